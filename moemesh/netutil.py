"""Small helpers shared by the mesh processes: sockets, event loops, counters of bad messages."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from moemesh.protocol import ProtocolError


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when it is installed (it is a dependency), the default loop otherwise."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


def run(coro, stop_on_sigterm: bool = False) -> object:
    """asyncio.run on uvloop: on Ctrl-C the main task is cancelled and every task cleaned up. With
    `stop_on_sigterm`, SIGTERM (a service manager's stop: `docker stop`, systemd, a pod's deletion)
    does the same and run returns None: the HTTP gateway stops listening and gives the requests in
    flight --drain-timeout to finish (5 s; then those still open end with a 503, given up to 2 s more
    to say so: gateway/server.py `Gateway._drain`). A second SIGTERM ends the process at once."""
    # (a loop's signal handlers exist on the main thread only: elsewhere SIGTERM keeps its default)
    stop_on_sigterm = stop_on_sigterm and threading.current_thread() is threading.main_thread()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(_until_sigterm(coro) if stop_on_sigterm else coro)


async def _until_sigterm(coro):
    loop, main = asyncio.get_running_loop(), asyncio.current_task()
    stopping = False

    def stop() -> None:
        nonlocal stopping
        if stopping:
            os._exit(128 + signal.SIGTERM)
        stopping = True
        logging.getLogger("moemesh").info("stopping on SIGTERM")
        main.cancel()

    before = signal.getsignal(signal.SIGTERM)
    loop.add_signal_handler(signal.SIGTERM, stop)
    try:
        return await coro
    except asyncio.CancelledError:
        if not stopping:
            raise
        return None
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        if before is not None:  # (the handler of a container's first process, `cli.main`)
            signal.signal(signal.SIGTERM, before)


def url_host(host: str) -> str:
    """A host as a tcp:// address holds it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _ipv6_for(sock: zmq.Socket, host: str) -> None:
    """libzmq takes IPv6 addresses only on a socket told so (else "No such device")."""
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)


def bind(sock: zmq.Socket, host: str, port: int, flags: str = "--host/--port") -> int:
    """Binds tcp://host:port (port 0: a free one; host an IPv6 address too, bracketed or not); returns
    the port. OSError naming the address and the `flags` that set it when it cannot (taken, or not
    this host's): the CLI prints it as one line."""
    host = url_host(host)
    _ipv6_for(sock, host)
    try:
        if port == 0:
            return sock.bind_to_random_port(f"tcp://{host}")
        sock.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as e:
        raise OSError(e.errno, f"cannot listen on tcp://{host}:{port or '(any port)'} ({flags}): "
                               f"{zmq.strerror(e.errno)}") from None
    return port


def connect(sock: zmq.Socket, address: str) -> None:
    """sock.connect(tcp://HOST:PORT), an IPv6 HOST in brackets."""
    _ipv6_for(sock, address.removeprefix("tcp://").rpartition(":")[0])
    sock.connect(address)


async def receive(sock: zmq.asyncio.Socket) -> list:
    """The next multipart message (frames uncopied). pyzmq's asyncio receive can fail with EAGAIN when
    libzmq reported a message ready that is gone by the time it is read (the connection it came on
    dropped meanwhile, or a CURVE handshake stirred the socket): that is no error, the wait goes on."""
    while True:
        try:
            return await sock.recv_multipart(copy=False)
        except zmq.Again:
            await asyncio.sleep(0)


def set_heartbeats(sock: zmq.Socket, interval_ms: int = 1000) -> None:
    """ZMTP heartbeats: a dead peer's connection is noticed (and reconnected) in seconds."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * interval_ms)
    sock.setsockopt(zmq.LINGER, 0)


class LinkState:
    """Whether a socket that connects to one address has ever connected, and whether its peer refused
    the handshake: its monitor's events, read without waiting when asked (`poll`, at each heartbeat;
    an asyncio monitor's first event may not wake the loop). An address nobody listens at, or one
    that does not route, never connects (ZeroMQ goes on trying); a peer that refuses the handshake
    (its allowed keys lack this one) is not tried again on the same socket. A link that was up and
    dropped is not counted: that is a lost peer, which recovery handles."""

    # (libzmq gives up on a handshake failed by the peer's ZAP or by the protocol; one cut by a
    # connection error, HANDSHAKE_FAILED_NO_DETAIL, it tries again by itself)
    EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH

    def __init__(self, sock: zmq.Socket, since: float | None = None):
        """`since`: when the link (an earlier socket to the same address) began connecting."""
        self.sock = sock
        self.since: float | None = since or time.monotonic()  # None once connected
        self.refused_at: float | None = None  # the last refused handshake, until one succeeds
        self._monitor = sock.get_monitor_socket(self.EVENTS)
        self._events = zmq.Socket.shadow(self._monitor.underlying)

    def poll(self) -> None:
        while self.since is not None:
            try:
                event = parse_monitor_message(self._events.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.since = self.refused_at = None
                self.close()  # (nothing more to watch)
            else:
                self.refused_at = time.monotonic()

    def unreached_for(self) -> float:
        """Seconds the socket has been connecting without ever connecting; 0.0 once it has."""
        self.poll()
        return 0.0 if self.since is None else time.monotonic() - self.since

    def refused_for(self) -> float:
        """Seconds since its peer last refused the handshake (0.0: none refused, or it connected)."""
        self.poll()
        return 0.0 if self.refused_at is None else time.monotonic() - self.refused_at

    def close(self) -> None:
        """Before the socket closes (once connected, the monitor is closed already)."""
        if self._monitor.closed:
            return
        self.sock.disable_monitor()
        self._monitor.close(linger=0)


class BadMessages:
    """Counts (and logs, rate-limited) messages that did not decode; never raises."""

    def __init__(self, log: logging.Logger, link: str):
        self.log, self.link, self.count = log, link, 0

    def __call__(self, error: Exception, peer: str = "") -> None:
        self.count += 1
        if self.count <= 10 or self.count % 1000 == 0:
            self.log.warning("malformed message", extra={"fields": {
                "link": self.link, "peer": peer, "error": str(error)[:200], "count": self.count}})


__all__ = ["BadMessages", "ProtocolError", "bind", "new_event_loop", "receive", "run", "set_heartbeats"]
