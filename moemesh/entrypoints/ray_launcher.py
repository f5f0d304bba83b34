"""`moemesh serve --launcher ray`: the stage workers as Ray actors.

One actor per (stage, tensor rank); the actors of a stage are packed on one node by a placement
group (one bundle per rank, STRICT_PACK), so a stage's tensor parallelism stays inside a host and
the pipeline crosses hosts, the layout vLLM's TPU backend adopted for Ray. Everything else is the
same as the local launcher: the coordinator is a child process of this one, the actors register
with it like any worker, and activations travel over ZeroMQ, not through Ray. Beyond one node the
mesh faces the network, so it needs --mesh-keys (or --insecure-mesh): then the coordinator listens
on every interface of this (the driver's) node and the actors reach it at the node's IP; without
them everything stays on loopback, on the driver's node. `--device cuda` gives each actor one GPU.
An actor whose worker exits (or that dies) is replaced in its bundle, within the local launcher's
restart budget, and the coordinator's recovery takes the replacement in.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from moemesh.entrypoints.launcher import LaunchError, LocalMesh
from moemesh.log import current_format, get_logger

log = get_logger("ray")

# seconds Ray may take to place a stage's bundles, and to start an actor in its bundle (a bundle
# whose node is gone waits for another: a restart that waits longer fails, as one that cannot start)
PLACEMENT_TIMEOUT = 120.0


def _worker_actor():
    import ray

    @ray.remote
    class StageWorkerActor:
        """Runs one stage worker in the actor's process until the coordinator shuts it down."""

        def where(self) -> tuple[str, int]:
            """(its node's address, its process id: the worker's, which the coordinator names when it
            counts the worker lost)"""
            return ray.util.get_node_ip_address(), os.getpid()

        def run(self, argv: list[str], log_level: str = "warning", log_format: str = "text") -> int:
            """`argv`: the worker's settings as flags (WorkerSettings.to_argv), as a process would get them;
            it logs as a process would (on stderr, which Ray hands to the driver)."""
            import torch

            from moemesh.log import setup_logging
            from moemesh.netutil import run
            from moemesh.settings import WorkerSettings
            from stage_worker.worker import StageWorker

            setup_logging(log_level, log_format)

            settings = WorkerSettings.from_argv(argv)
            torch.set_num_threads(settings.threads or 1)
            return run(StageWorker(settings).run())

    return StageWorkerActor


class RayMesh(LocalMesh):
    def __init__(self, coordinator, worker, extra_env=None, ray_address: str | None = None,
                 startup_timeout: float = 300.0):
        super().__init__(coordinator, worker, extra_env, startup_timeout)
        self.ray_address = ray_address
        self.gpu = worker.device.startswith("cuda")
        self.actors, self.runs, self.groups = [], {}, []
        self.placement: dict[str, tuple] = {}  # actor name -> (coordinator address, pp rank, tp rank, group)
        self.by_name: dict = {}
        self.pids: dict[str, int] = {}  # actor name -> its process id
        self._started_ray = False  # this process called ray.init (and so ray.shutdown at stop)
        self._own_cluster = False  # ... and that started a Ray of its own (no --ray-address)

    @classmethod
    def of(cls, engine, extra_env=None, ray_address: str | None = None, **changes) -> "RayMesh":
        mesh = super().of(engine, extra_env, **changes)
        mesh.ray_address = ray_address
        if mesh.exposed:  # actors on other nodes must reach the coordinator
            mesh.coordinator = dataclasses.replace(mesh.coordinator, host="0.0.0.0")
        return mesh

    @property
    def exposed(self) -> bool:
        """Whether the mesh may face the network (keys, or --insecure-mesh): else all on loopback."""
        return bool(self.worker.mesh_keys or self.worker.insecure_mesh)

    def _check_workers_can_run(self) -> None:
        """Nothing to check here: the actors run on other nodes (GPUs, weights) than the driver's."""

    def _start_workers(self, coordinator: str) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError:
            raise LaunchError("--launcher ray needs Ray: pip install 'ray>=2.40'") from None
        if not ray.is_initialized():
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            # (the actors' stderr, their workers' log lines, forwarded here; Ray's own at our --log-level)
            ray.init(address=self.ray_address, include_dashboard=False, log_to_driver=True,
                     logging_level=logging.getLogger("moemesh").getEffectiveLevel(),
                     **({} if self.ray_address else {"num_cpus": max(2, os.cpu_count() or 2)}))
            self._started_ray, self._own_cluster = True, not self.ray_address
        self._actor_cls = _worker_actor()
        if self.exposed:  # (it listens on every interface: the actors reach it at this node's address)
            coordinator = f"tcp://{ray.util.get_node_ip_address()}:{coordinator.rsplit(':', 1)[1]}"
        pp, tp = self.coordinator.pp, self.coordinator.tp
        gpu = 1 if self.gpu else 0
        for p in range(pp):
            group = placement_group([{"CPU": 0.01, **({"GPU": 1} if gpu else {})}] * tp, strategy="STRICT_PACK")
            if not group.wait(timeout_seconds=PLACEMENT_TIMEOUT):
                raise LaunchError(f"Ray could not place stage {p}'s {tp} workers on one node")
            self.groups.append(group)
            for t in range(tp):
                self.placement[f"ray actor pp={p} tp={t}"] = (coordinator, p, t, group)
                self._start_actor(f"ray actor pp={p} tp={t}")
        log.info("ray actors started", extra={"fields": {"actors": len(self.actors), "stages": pp}})

    def _start_actor(self, name: str) -> None:
        """The actor of one (stage, tensor rank), in its bundle of the stage's placement group."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        coordinator, p, t, group = self.placement[name]
        gpu = 1 if self.gpu else 0
        actor = self._actor_cls.options(
            num_cpus=0.01, num_gpus=gpu,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=t),
        ).remote()
        try:
            host, self.pids[name] = ray.get(actor.where.remote(), timeout=PLACEMENT_TIMEOUT)
        except TimeoutError:  # (ray.exceptions.GetTimeoutError)
            ray.kill(actor)
            raise LaunchError(f"Ray did not start {name} within {PLACEMENT_TIMEOUT:.0f} s "
                              f"(is the node of its placement group gone?)") from None
        # beyond loopback only with keys (or --insecure-mesh): the activation socket faces the network
        worker = self.worker_settings(coordinator, p, t, host="0.0.0.0" if self.exposed else "127.0.0.1",
                                      advertise_host=host if self.exposed else "127.0.0.1",
                                      device="cuda:0" if gpu else "cpu")  # (Ray shows the actor its one GPU)
        self.actors.append(actor)
        self.by_name[name] = actor
        level = logging.getLevelName(logging.getLogger("moemesh").getEffectiveLevel()).lower()  # (as ray.init's)
        self.runs[name] = actor.run.remote(worker.to_argv(), level, current_format())

    def _restartable(self, name: str) -> bool:
        return name in self.placement or super()._restartable(name)

    def _respawn(self, name: str) -> bool:
        """An actor that ended (its worker exited, or the actor died) is replaced by a new one in the
        same bundle, which registers for its rank like a restarted process."""
        if name not in self.placement:
            return super()._respawn(name)
        import ray

        old = self.by_name.pop(name, None)
        if old is not None:
            ray.kill(old)
            self.actors.remove(old)
        try:
            self._start_actor(name)
        except Exception as e:  # (Ray could not place or start it)
            log.error("actor restart failed", extra={"fields": {"actor": name, "error": f"{type(e).__name__}: {e}"}})
            return False
        return True

    def _kill_lost(self, pp: int, tp: int, pid: int, reason: str) -> None:
        """Kills the actor of rank (pp, tp) if its process is `pid` and its worker still runs (the watch
        then replaces it; a pid alone could be another node's)."""
        super()._kill_lost(pp, tp, pid, reason)
        import ray

        name = f"ray actor pp={pp} tp={tp}"
        if self.pids.get(name) == pid and name in self.runs and name in self.by_name:
            log.warning("killing a worker the coordinator counted lost", extra={"fields": {
                "actor": name, "pid": pid, "reason": reason}})
            ray.kill(self.by_name[name])

    def _check_children(self) -> tuple[str | None, str] | None:
        """(name, description) of a process or actor that ended (the watcher restarts it)."""
        ended = super()._check_children()
        if ended or not self.runs:
            return ended
        import ray

        ready, _ = ray.wait(list(self.runs.values()), timeout=0)
        for name, ref in list(self.runs.items()):
            if ref in ready:
                del self.runs[name]
                try:
                    return name, f"{name} exited with status {ray.get(ref)}"
                except Exception as e:  # the actor died
                    return name, f"{name} failed: {type(e).__name__}"
        return None

    def stop(self) -> None:
        self._stop_watching()  # (no actor replaced while they are killed)
        if self.actors and not self._own_cluster:  # (a Ray of this process's own goes whole, below)
            import ray

            for actor in self.actors:
                ray.kill(actor)
            for group in self.groups:
                ray.util.remove_placement_group(group)
        self.actors.clear()
        super().stop()
        if self._started_ray:
            # (a Ray of its own ends whole, the actors' processes among them; one by one, a GCS that a
            # SIGTERM to the whole process group has ended, as `timeout` and systemd's default send, would
            # make each Ray call wait a minute)
            import ray

            ray.shutdown()
