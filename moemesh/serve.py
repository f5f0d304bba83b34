"""`moemesh serve`: the whole system on this machine. A coordinator and pp x tp stage workers as
child processes (the local launcher), and the HTTP gateway in this process; the URL is printed
when the pipeline serves, and Ctrl-C stops everything."""

from __future__ import annotations

import asyncio

from gateway.server import GatewayConfig, run_gateway
from moemesh.cli import CLIError
from moemesh.generate import engine_config_from_args, mesh_spec_from_args
from moemesh.launcher import LaunchError, LocalMesh
from moemesh.log import get_logger
from moemesh.netutil import run

log = get_logger("serve")


def run_serve(args) -> int:
    cfg = engine_config_from_args(args)
    spec = mesh_spec_from_args(args, cfg, args.pp)
    if args.launcher == "ray":
        from moemesh.ray_launcher import RayMesh

        make_mesh = lambda: RayMesh(spec, ray_address=args.ray_address)  # noqa: E731
    else:
        make_mesh = lambda: LocalMesh(spec)  # noqa: E731
    try:
        with make_mesh() as mesh:
            gw = GatewayConfig(coordinator=mesh.client_address, host=args.host, port=args.port, model=cfg.model,
                               served_model_name=args.served_model_name, api_key=args.api_key,
                               max_pending=args.max_pending)
            run(_serve(mesh, gw))
    except (LaunchError, RuntimeError, TimeoutError) as e:
        raise CLIError(str(e)) from None
    except OSError as e:  # e.g. the port is taken
        raise CLIError(f"--host {args.host} --port {args.port}: {e.strerror or e}") from None
    return 0


async def _serve(mesh: LocalMesh, cfg: GatewayConfig) -> None:
    ready = asyncio.Event()
    server = asyncio.ensure_future(run_gateway(cfg, ready))

    async def watch():
        # before the URL is printed a dead child is fatal; after it, the pipeline is down but the
        # gateway stays up answering 503 with the reason (so health checks see it) until Ctrl-C
        while mesh.died is None:
            await asyncio.sleep(0.2)
        if not ready.is_set():
            raise LaunchError(f"the mesh failed to start: {mesh.died}")
        log.error("a mesh process died; serving 503 until stopped", extra={"fields": {"reason": mesh.died}})
        await asyncio.Event().wait()

    watcher = asyncio.ensure_future(watch())
    try:
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait([waiter, server, watcher], return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():
            print(f"moemesh is serving {cfg.model} at http://{cfg.host}:{cfg.port}  (Ctrl-C to stop)", flush=True)
            await asyncio.wait([server, watcher], return_when=asyncio.FIRST_COMPLETED)
        for t in (server, watcher):
            if t.done():
                t.result()
    finally:
        for t in (server, watcher):
            t.cancel()
        await asyncio.gather(server, watcher, return_exceptions=True)
