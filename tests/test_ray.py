"""The Ray launcher: stage workers as Ray actors, one placement group per stage, on a local Ray
instance; the same coordinator and ZeroMQ data path (with mesh keys, as across nodes)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hf_models import build_hf_model, hf_greedy
from moemesh.netutil import run
from moemesh.sampling import SamplingParams
from test_launcher import alive
from test_mesh import generate_all

ray = pytest.importorskip("ray", reason="ray is not installed")

PROMPTS = [[5, 17, 33, 2, 9], [7, 8], list(range(30, 45))]


def test_ray_actors_serve_like_processes(tmp_path, monkeypatch):
    for key, value in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                       "RAY_USAGE_STATS_ENABLED": "0"}.items():
        monkeypatch.setenv(key, value)
    from moemesh.settings import EngineSettings
    from moemesh.entrypoints.ray_launcher import RayMesh

    hf = build_hf_model("mixtral", tmp_path)
    want = [hf_greedy(hf, p, 6) for p in PROMPTS]
    from moemesh.mesh_security import make_keys

    # with keys the mesh may face the network, as across nodes: the coordinator listens on every
    # interface and the actors reach it at this node's address
    keys = make_keys(tmp_path / "keys")
    mesh = RayMesh.of(EngineSettings(model=str(tmp_path), pp=2, tp=2, kv_memory=8 << 20, mesh_keys=str(keys)))
    assert mesh.coordinator.host == "0.0.0.0"
    try:
        mesh.start()
        assert all(not coordinator.startswith("tcp://0.0.0.0") for coordinator, *_ in mesh.placement.values())
        results, status = run(generate_all(mesh, PROMPTS, SamplingParams(max_tokens=6, temperature=0,
                                                                        ignore_eos=True)))
        assert [t for t, _ in results] == want
        assert len(mesh.actors) == 4 and len(mesh.groups) == 2
        table = ray.util.placement_group_table()
        ours = [table[g.id.hex()] for g in mesh.groups]
        assert all(t["strategy"] == "STRICT_PACK" and len(t["bundles"]) == 2 for t in ours)
        assert mesh.died is None
        # an actor dies: it is replaced in its bundle (with tp=2 the coordinator has every worker
        # replaced), the pipeline recovers and serves the same tokens
        ray.kill(mesh.by_name["ray actor pp=1 tp=1"])
        results, status = run(generate_all(mesh, PROMPTS, SamplingParams(max_tokens=6, temperature=0,
                                                                        ignore_eos=True)))
        assert [t for t, _ in results] == want and status.recoveries >= 1
        assert mesh.died is None and len(mesh.actors) == 4
        # an actor's process stops (alive, silent): the coordinator counts it lost and says so, the
        # launcher kills the actor, and it is replaced as a dead one is
        stopped = mesh.pids["ray actor pp=0 tp=1"]
        os.kill(stopped, signal.SIGSTOP)
        recoveries = status.recoveries
        results, status = run(generate_all(mesh, PROMPTS, SamplingParams(max_tokens=6, temperature=0,
                                                                        ignore_eos=True)))
        assert [t for t, _ in results] == want and status.recoveries > recoveries
        assert mesh.died is None and mesh.pids["ray actor pp=0 tp=1"] != stopped
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and alive(stopped):
            time.sleep(0.2)
        assert not alive(stopped)
    finally:
        mesh.stop()
    assert not ray.is_initialized()
    assert os.environ.get("RAY_USAGE_STATS_ENABLED") == "0"


def test_a_mesh_started_here_gives_each_worker_its_gpu_and_keeps_loopback_without_keys(tmp_path):
    """--device cuda: worker i (stage by stage, tensor rank by tensor rank) on cuda:i, by both launchers'
    settings (nothing is started); without keys the Ray launcher's coordinator stays on loopback."""
    from moemesh.entrypoints.launcher import LocalMesh
    from moemesh.entrypoints.ray_launcher import RayMesh
    from moemesh.settings import EngineSettings

    build_hf_model("mixtral", tmp_path)
    mesh = LocalMesh.of(EngineSettings(model=str(tmp_path), pp=2, tp=2, device="cuda"))
    assert [mesh.worker_device(p, t) for p in range(2) for t in range(2)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert LocalMesh.of(EngineSettings(model=str(tmp_path), pp=2)).worker_device(1, 0) == "cpu"
    ray_mesh = RayMesh.of(EngineSettings(model=str(tmp_path), pp=2, device="cuda"))
    assert ray_mesh.gpu and ray_mesh.coordinator.host == "127.0.0.1"
    # the local launcher checks this host can run its workers; Ray's actors run on other nodes
    ray_mesh._check_workers_can_run()  # (a CPU-only driver of GPU actors: no refusal)
    import torch

    if not torch.cuda.is_available():
        from moemesh_kernels.backend import BackendError

        with pytest.raises(BackendError, match="--device cuda"):
            mesh._check_workers_can_run()


def test_an_actor_ray_cannot_start_fails_its_restart_instead_of_holding_the_watch(tmp_path, monkeypatch):
    """A replacement actor whose bundle's node is gone: Ray waits for another node without end, so the
    launcher waits PLACEMENT_TIMEOUT for it, kills it and fails the restart (the watch then reports
    the mesh down) rather than holding its one watch thread for ever. Ray is a stand-in here: it
    never starts the actor."""
    import sys
    import types

    from moemesh.entrypoints import ray_launcher
    from moemesh.entrypoints.launcher import LaunchError
    from moemesh.settings import EngineSettings

    killed, waited = [], []

    def get(ref, timeout=None):
        if timeout is None:
            raise AssertionError("ray.get of an actor that never starts, without a timeout: waits for ever")
        waited.append(timeout)
        raise TimeoutError("GetTimeoutError")

    class Actor:
        where = types.SimpleNamespace(remote=lambda: "ref")

    class ActorClass:
        def options(self, **_):
            return types.SimpleNamespace(remote=Actor)

    fake = types.ModuleType("ray")
    fake.get, fake.kill = get, killed.append
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.PlacementGroupSchedulingStrategy = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.util", types.ModuleType("ray.util"))
    monkeypatch.setitem(sys.modules, "ray.util.scheduling_strategies", strategies)
    build_hf_model("mixtral", tmp_path)
    mesh = ray_launcher.RayMesh.of(EngineSettings(model=str(tmp_path), pp=2))
    mesh._actor_cls = ActorClass()
    name = "ray actor pp=1 tp=0"
    mesh.placement[name] = ("tcp://127.0.0.1:1", 1, 0, object())
    with pytest.raises(LaunchError, match=f"did not start {name} within 120 s"):
        mesh._start_actor(name)
    assert waited == [ray_launcher.PLACEMENT_TIMEOUT] and len(killed) == 1
    assert mesh._respawn(name) is False and len(killed) == 2  # (logged; the watch reports the mesh down)
    assert name not in mesh.runs and not mesh.actors
