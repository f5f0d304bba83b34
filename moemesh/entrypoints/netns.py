"""Simulated hosts for tests and benchmarks: Linux network namespaces joined by a bridge.

Each host is a namespace with one veth interface on a private /24, the other end of which sits on
a bridge in a "switch" namespace; traffic between hosts crosses real TCP stacks and a link, not
loopback. Needs root and iproute2. Everything made is removed on exit, also when the body fails.
"""

from __future__ import annotations

import os
import subprocess


class NetnsUnavailable(RuntimeError):
    pass


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise NetnsUnavailable(f"{' '.join(cmd)}: {out.stderr.strip()}")


class Hosts:
    """with Hosts(["a", "s0", "s1"]) as hosts: hosts.address("s0"); hosts.popen("s0", [...])"""

    def __init__(self, names: list[str], subnet: str = "192.168.213", mtu: int = 65535):
        self.tag = f"mm{os.getpid() % 100000}"
        self.names, self.subnet, self.mtu = names, subnet, mtu
        self.switch = f"{self.tag}-sw"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 10}"

    def __enter__(self) -> "Hosts":
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self.namespaces.append(self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, name in enumerate(self.names):
            ns = self.ns(name)
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            host_end, switch_end = f"{self.tag}h{i}", f"{self.tag}s{i}"
            _ip("link", "add", host_end, "netns", ns, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", switch_end, "netns", self.switch, "mtu", str(self.mtu))
            _ip("link", "set", switch_end, "master", "br0", ns=self.switch)
            _ip("link", "set", switch_end, "up", ns=self.switch)
            _ip("addr", "add", f"{self.address(name)}/24", "dev", host_end, ns=ns)
            _ip("link", "set", host_end, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)

    def link(self, name: str, up: bool) -> None:
        """Cuts (or restores) host `name`'s link at the switch, as a pulled cable would."""
        _ip("link", "set", f"{self.tag}s{self.names.index(name)}", "up" if up else "down", ns=self.switch)

    def popen(self, name: str, cmd: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(name), *cmd], **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()


def leftover_namespaces(tag_prefix: str = "mm") -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag_prefix)]
