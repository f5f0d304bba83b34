"""CurveZMQ on every mesh link, with pyzmq's own `zmq.auth`: keys, who may connect where, refusals.

The key directory (`moemesh keys --out DIR`) holds one key pair per role, in the layout zmq.auth
reads (`NAME.key` public, `NAME.key_secret` public + secret):

    DIR/server.key, server.key_secret   what every listening mesh socket serves with: the coordinator's
                                        worker and client sockets, each stage worker's activation socket
    DIR/worker.key_secret               a stage worker's key when it connects (registration, activations)
    DIR/client.key_secret               a gateway's (or driver's) key when it connects to the client socket
    DIR/workers/*.key                   public keys allowed on the worker-facing sockets
    DIR/clients/*.key                   public keys allowed on the client socket

So a gateway's host needs only `server.key` and `client.key_secret`: its key submits requests but
cannot register as a stage or send activations. The allowed sets are read at each handshake (a key
file added or removed takes effect for the next connection: rotation needs no restart of the
listening side). A peer without a key, or with one not in the allowed set, fails the handshake in
libzmq: nothing it sends reaches a decoder. Each refusal is counted (`MeshGuard.refused`).

Without keys, a mesh socket may only listen on or connect to loopback, unless --insecure-mesh says
the operator has made the network safe some other way (`check_exposure`).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import threading
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth import create_certificates, load_certificate, load_certificates
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from moemesh.errors import ConfigError
from moemesh.log import get_logger

log = get_logger("mesh_security")

ROLES = ("server", "worker", "client")
DOMAINS = {"workers": "worker", "clients": "client"}  # ZAP domain (a listening socket's) -> the role let in
# a peer without CURVE (mechanism mismatch), with a key not allowed, or a connection that ended before
# completing a handshake (libzmq reports some refusals that way; a bare TCP port probe counts too)
REFUSALS = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def make_keys(directory: str | os.PathLike) -> Path:
    """Writes a fresh key pair per role and the allowed sets; refuses to overwrite keys."""
    directory = Path(directory)
    if (directory / "server.key_secret").exists():
        raise ConfigError(f"{directory} already holds mesh keys (server.key_secret); pick another directory, or "
                          f"delete it to start over (every process then needs the new keys)")
    for sub in ("", *DOMAINS):
        (directory / sub).mkdir(parents=True, exist_ok=True)
        (directory / sub).chmod(0o755)  # whatever the umask: only the owner adds keys to the allowed sets
    old_umask = os.umask(0o077)  # secret files readable by their owner only
    try:
        for role in ROLES:
            create_certificates(directory, role)
    finally:
        os.umask(old_umask)
    for role in ROLES:
        (directory / f"{role}.key").chmod(0o644)  # public
    for domain, role in DOMAINS.items():
        shutil.copyfile(directory / f"{role}.key", directory / domain / f"{role}.key")
        (directory / domain / f"{role}.key").chmod(0o644)
    return directory


# what each kind of host holds (`moemesh keys --gateway-out/--stage-out`): a gateway connects as a client; a
# stage host's workers connect as workers and serve their activation sockets to the other workers
HOST_KEYS = {"gateway": ("server.key", "client.key_secret"),
             "stage": ("server.key", "server.key_secret", "worker.key_secret", "workers")}


def copy_keys(source: str | os.PathLike, out: str | os.PathLike, host: str) -> Path:
    """Writes into `out` the keys of `source` (a directory `make_keys` made) that a `host` ("gateway",
    "stage") needs, and nothing else: a gateway's host that is broken into holds no key that registers a
    stage or serves the mesh. Run again, it brings `out` up to date (an allowed key removed is removed)."""
    source, out = Path(source), Path(out)
    if not out.is_dir():
        out.mkdir(parents=True)
        out.chmod(0o755)  # (one that exists keeps its mode: 0700 is fine, and the owner's choice)
    for name in HOST_KEYS[host]:
        if (source / name).is_dir():
            if not (out / name).is_dir():
                (out / name).mkdir()
            (out / name).chmod(0o755)  # (the allowed set: writable by its owner alone, as a listener demands)
            kept = {p.name for p in (source / name).glob("*.key")}
            for old in (out / name).glob("*.key"):
                if old.name not in kept:
                    old.unlink()
            files = [(source / name / k, out / name / k) for k in sorted(kept)]
        else:
            files = [(source / name, out / name)]
        for src, dst in files:  # (each written whole under a temporary name, born with its mode, then renamed)
            tmp, mode = dst.with_name(dst.name + ".tmp"), 0o600 if dst.name.endswith("_secret") else 0o644
            tmp.unlink(missing_ok=True)  # (left by a run that was cut short)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
                f.write(src.read_bytes())
            os.chmod(tmp, mode)  # (whatever the umask took away)
            tmp.replace(dst)
    return out


class MeshKeys:
    """The key directory, read lazily: each process reads only the files its role needs."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConfigError(f"--mesh-keys {directory}: no such directory (make one with `moemesh keys --out DIR`)")
        if not zmq.has("curve"):  # pragma: no cover - pyzmq's wheels always have it
            raise ConfigError("--mesh-keys: this libzmq was built without CURVE")
        self._warned: set[Path] = set()

    def _pair(self, role: str, secret: bool) -> tuple[bytes, bytes | None]:
        wanted = f"{role}.key_secret" if secret else f"{role}.key"
        path = self.directory / wanted
        if not path.is_file() and not secret:
            path = self.directory / f"{role}.key_secret"  # (holds the public key too)
        if not path.exists():  # (a key left out when the directory was copied to this host; named as wanted,
            # not as a secret this host need not hold)
            raise ConfigError(f"--mesh-keys {self.directory}: no {wanted} there; copy it from the directory "
                              f"`moemesh keys` made (every host of a mesh uses the same keys: deploy/README.md)")
        try:
            public, secret_key = load_certificate(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--mesh-keys {self.directory}: cannot read {path.name}: {e}") from None
        if secret and not secret_key:
            raise ConfigError(f"--mesh-keys {self.directory}: {path.name} holds no secret key")
        if secret and path.stat().st_mode & 0o077 and path not in self._warned:
            self._warned.add(path)
            log.warning("secret mesh key readable by others", extra={"fields": {
                "file": str(path), "mode": oct(path.stat().st_mode & 0o777), "hint": f"chmod 600 {path}"}})
        return public, secret_key

    def check_allowed_sets(self) -> None:
        """A listening side lets in the keys in DIR/workers and DIR/clients: refuses to start when anyone
        but the owner may write there (or to the key directory, or to a key file in them), since whoever
        can would let their own key in (as ssh refuses a group-writable authorized_keys). On a read-only
        mount (a Kubernetes secret's, a compose `:ro` volume) nobody writes here, but the mount's source
        may be writable where it lives: a warning says so."""
        for path in (self.directory, *(self.directory / d for d in DOMAINS),
                     *(p for d in DOMAINS for p in sorted((self.directory / d).glob("*.key")))):
            try:
                mode = path.stat().st_mode
                read_only = os.statvfs(path).f_flag & os.ST_RDONLY  # (a read-only mount: nobody can write there)
            except FileNotFoundError:  # (a host holds only what its role needs)
                continue
            if mode & 0o022 and read_only:  # (a bind mount's source may still be writable on the host)
                log.warning("allowed keys writable by others where they come from", extra={"fields": {
                    "path": str(path), "mode": oct(mode & 0o777), "hint": "read-only here; check the mount's source"}})
            elif mode & 0o022:
                raise ConfigError(f"--mesh-keys {self.directory}: {path} is writable by group or others, who could "
                                  f"add a key of their own to the allowed set (chmod go-w {path})")

    def serve(self, sock: zmq.Socket, domain: str) -> None:
        """Makes `sock` (before it binds) a CURVE server that lets in the keys allowed in `domain`."""
        public, secret = self._pair("server", secret=True)
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_server = True
        sock.zap_domain = domain.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no authenticator: no connection (not "allow all")

    def connect(self, sock: zmq.Socket, role: str) -> None:
        """Makes `sock` (before it connects) a CURVE client with `role`'s key, trusting the mesh's server key."""
        sock.curve_serverkey = self._pair("server", secret=False)[0]
        public, secret = self._pair(role, secret=True)
        sock.curve_secretkey, sock.curve_publickey = secret, public


class _AllowedKeys:
    """zmq.auth's credentials provider: the public keys in DOMAIN's directory, re-read when it changes."""

    def __init__(self, directory: Path):
        self.directory, self.stamp, self.keys = directory, None, {}

    def callback(self, domain: str, z85_key: bytes) -> bool:
        try:
            stamp = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in self.directory.glob("*.key")))
            if stamp != self.stamp:
                self.keys, self.stamp = load_certificates(self.directory), stamp
        except (OSError, ValueError) as e:
            log.error("cannot read the allowed keys", extra={"fields": {"dir": str(self.directory), "error": str(e)}})
            return False
        return bool(self.keys.get(z85_key))


class MeshGuard:
    """One per process and zmq context: CURVE on the mesh sockets when there are keys, the ZAP
    authenticator (its own thread), and a count of refused handshakes on each listening socket.
    Without keys every method leaves the socket as it is (plain TCP)."""

    def __init__(self, ctx: zmq.asyncio.Context, keys_dir: str | None):
        self.ctx = ctx
        self.keys = MeshKeys(keys_dir) if keys_dir else None
        self.refused = 0
        self._auth: ThreadAuthenticator | None = None
        self._monitors: list[tuple[zmq.Socket, str]] = []
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def serve(self, sock: zmq.asyncio.Socket, domain: str) -> None:
        """Before `sock` binds: CURVE server for `domain`, the authenticator running, refusals counted.
        Call from the running event loop."""
        if self.keys is None:
            return
        allowed = self.keys.directory / domain
        if not allowed.is_dir():  # (every handshake on the socket would be refused: a stall, not an error)
            raise ConfigError(f"--mesh-keys {self.keys.directory}: no {domain}/ directory of the public keys allowed "
                              f"to connect to this process's {domain} socket (copy it from the key directory "
                              f"`moemesh keys` made)")
        if self._auth is None:
            self.keys.check_allowed_sets()
            # the thread form: pyzmq's asyncio one (27.3) polls its ZAP socket on the event loop in a way
            # that makes other sockets' receives on that loop fail with EAGAIN under CURVE
            self._auth = ThreadAuthenticator(self.ctx, log=get_logger("zap"))
            self._auth.start()
            for d in DOMAINS:
                self._auth.configure_curve_callback(d, _AllowedKeys(self.keys.directory / d))
        self.keys.serve(sock, domain)
        # read on a thread of its own, blocking: on the event loop the first event could wait for the next
        monitor = sock.get_monitor_socket(REFUSALS)
        self._monitors.append((zmq.Socket.shadow(monitor.underlying), domain, monitor))
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._count, name="mesh-refusals", daemon=True)
            self._watcher.start()

    def connect(self, sock: zmq.Socket, role: str) -> None:
        if self.keys is not None:
            self.keys.connect(sock, role)

    def _count(self) -> None:
        poller = zmq.Poller()
        watched = 0
        while not self._stop.is_set():
            new = self._monitors[watched:]  # (sockets served after the thread started)
            watched += len(new)
            for monitor, _, _ in new:
                poller.register(monitor, zmq.POLLIN)
            try:
                for monitor, _ in poller.poll(200):
                    event = parse_monitor_message(monitor.recv_multipart())
                    domain = next(d for m, d, _ in self._monitors if m is monitor)
                    self.refused += 1
                    if self.refused <= 10 or self.refused % 1000 == 0:
                        log.warning("mesh handshake refused", extra={"fields": {
                            # (the refusing socket's own endpoint: libzmq's events do not name the peer)
                            "socket": domain, "endpoint": event.get("endpoint", b"").decode(errors="replace"),
                            "event": zmq.Event(event["event"]).name, "count": self.refused}})
            except zmq.ContextTerminated:
                return
            except Exception as e:  # an odd event must not end the count
                log.warning("mesh monitor", extra={"fields": {"error": str(e)}})

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=2)
        if self._watcher is None or not self._watcher.is_alive():  # (never close what another thread polls)
            for shadow, _, monitor in self._monitors:
                monitor.close(linger=0)
        if self._auth is not None:
            self._auth.stop()


# -- exposure ---------------------------------------------------------------------------------

_TCP = re.compile(r"^tcp://(\[[^\]]+\]|[^:/]+)(?::\d+|:\*)?$")


def address_host(address: str) -> str:
    """The host of tcp://HOST:PORT (IPv6 in brackets)."""
    m = _TCP.match(address or "")
    return m.group(1).strip("[]") if m else address


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name (resolved elsewhere), or *


def check_exposure(keys_dir: str | None, insecure: bool, warn: bool = True, **endpoints: str | None) -> None:
    """Refuses (ConfigError) a mesh socket beyond loopback with no keys, unless --insecure-mesh, which
    a process says at its start (warn; not for a check that repeats, as the coordinator's of each
    worker's address). `endpoints` maps a flag's name to the host or tcp:// address it gives."""
    if keys_dir:
        return
    for name, value in endpoints.items():
        if value is None:
            continue
        host = address_host(value) if value.startswith("tcp://") else value.strip("[]")
        if not is_loopback(host):
            flag = "--" + name.replace("_", "-")
            if insecure:  # (said at start, as the gateway says it has no API key)
                if warn:
                    log.warning("the mesh has no keys beyond loopback (--insecure-mesh): whoever reaches it can "
                                "use the model or inject activations", extra={"fields": {"flag": flag,
                                                                                      "address": value}})
                continue
            raise ConfigError(f"{flag} {value} is not loopback and the mesh has no keys: anyone who reaches it could "
                              f"use the model or inject activations. Give --mesh-keys DIR (make them with `moemesh "
                              f"keys --out DIR`), or --insecure-mesh if the network is protected another way")
