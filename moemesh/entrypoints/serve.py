"""`moemesh serve`: the whole system on this machine. A coordinator and pp x tp stage workers as
child processes (the local launcher), and the HTTP gateway in this process; the URL is printed
when the pipeline serves, and Ctrl-C stops everything."""

from __future__ import annotations

import asyncio
import os
import socket

from gateway.server import listen_sockets, load_api_keys, run_gateway, ssl_context
from moemesh.entrypoints.generate import engine_settings_from_args
from moemesh.entrypoints.launcher import LaunchError, LocalMesh
from moemesh.errors import CLIError
from moemesh.log import get_logger
from moemesh.netutil import run
from moemesh.settings import GatewaySettings

log = get_logger("serve")


def check_ray_address(address: str) -> None:
    """--ray-address names a cluster that answers: host:port (or ray://host:port) reached within a few
    seconds, before any process starts (ray.init waits on one that does not for ever, deaf to signals)."""
    if address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CLIError(f"--ray-address {address}: not host:port, ray://host:port or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise CLIError(f"--ray-address {address}: no Ray cluster answers there ({e.strerror or e})") from None


def run_serve(args) -> int:
    cfg = engine_settings_from_args(args)
    if args.ray_address and args.launcher != "ray":
        raise CLIError("--ray-address is for --launcher ray")
    if args.launcher == "ray" and args.ray_address:
        check_ray_address(args.ray_address)
    if cfg.mesh_keys and os.path.exists(cfg.mesh_keys) and not os.path.isdir(cfg.mesh_keys):
        raise CLIError(f"--mesh-keys {cfg.mesh_keys}: not a directory (make one with `moemesh keys --out DIR`)")
    if cfg.mesh_keys and not os.path.exists(cfg.mesh_keys):  # a new directory: the keys are made there first
        from moemesh.mesh_security import make_keys

        make_keys(cfg.mesh_keys)
        log.warning("made mesh keys", extra={"fields": {"dir": cfg.mesh_keys}})
    gateway = GatewaySettings.from_args(args, model=cfg.model)
    load_api_keys(gateway.api_key, gateway.api_key_file)  # a bad key or certificate file: before any process starts
    ssl_context(gateway)
    socks = listen_sockets(gateway)  # (and a port that is taken)
    if args.launcher == "ray":
        from moemesh.entrypoints.ray_launcher import RayMesh

        make_mesh = lambda: RayMesh.of(cfg, ray_address=args.ray_address)  # noqa: E731
    else:
        make_mesh = lambda: LocalMesh.of(cfg)  # noqa: E731
    try:
        mesh = make_mesh()
        # the gateway reconnects to the same address and serves again (Ray actors are not restarted, so
        # a restarted coordinator would find no workers: there it stays fatal)
        mesh.restart_coordinator = args.launcher == "local"
        with mesh:
            run(_serve(mesh, GatewaySettings.derive(gateway, coordinator=mesh.client_address), socks),
                stop_on_sigterm=True)
    except (LaunchError, RuntimeError, TimeoutError) as e:
        raise CLIError(str(e)) from None
    finally:
        for sock in socks:
            sock.close()
    return 0


async def _serve(mesh: LocalMesh, cfg: GatewaySettings, socks) -> None:
    ready, urls = asyncio.Event(), []
    down = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(run_gateway(cfg, ready, urls, down, socks))

    async def watch():
        # before the URL is printed a dead child is fatal; after it, the pipeline is down but the
        # gateway stays up answering 503 with the reason (so health checks see it) until Ctrl-C
        while mesh.died is None:
            await asyncio.sleep(0.2)
        if not ready.is_set():
            raise LaunchError(f"the mesh failed to start: {mesh.died}")
        log.error("a mesh process died; serving 503 until stopped", extra={"fields": {"reason": mesh.died}})
        down.set_result(f"the mesh is down: {mesh.died} (restart `moemesh serve`)")
        await asyncio.Event().wait()

    watcher = asyncio.ensure_future(watch())
    try:
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait([waiter, server, watcher], return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():
            print(f"moemesh is serving {cfg.model} at {urls[0]}  (Ctrl-C to stop)", flush=True)
            await asyncio.wait([server, watcher], return_when=asyncio.FIRST_COMPLETED)
        for t in (server, watcher):
            if t.done():
                t.result()
    finally:
        for t in (server, watcher):
            t.cancel()
        await asyncio.gather(server, watcher, return_exceptions=True)
