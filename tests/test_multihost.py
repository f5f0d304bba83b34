"""The mesh across simulated hosts: network namespaces joined by a bridge, the coordinator on one,
each stage on its own, everything over TCP between them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_models import build_hf_model
from moemesh.entrypoints.engine import LLMEngine
from moemesh.settings import EngineSettings
from moemesh.entrypoints.netns import Hosts, NetnsUnavailable, leftover_namespaces
from moemesh.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7], list(range(30, 52)), [299, 1, 298, 2]]

CLIENT = r"""
import asyncio, json, sys
from moemesh.client import CoordinatorClient
from moemesh.netutil import run
from moemesh.sampling import SamplingParams

async def main(address, prompts, keys):
    client = CoordinatorClient(address, mesh_keys=keys)
    await client.wait_serving(timeout=120)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    async def one(p):
        tokens = []
        async for out in client.generate(p, params):
            assert out.error is None, out.error
            tokens += out.token_ids
        return tokens
    print(json.dumps(await asyncio.gather(*(one(p) for p in prompts))), flush=True)
    await client.close()

run(main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]))
"""


STRANGER = r"""
import sys, zmq
s = zmq.Context().socket(zmq.DEALER)
s.linger = 0
s.connect(sys.argv[1])
s.send_multipart([b'\x81\xa4type\xa6status'])
print("answered" if s.poll(1500) else "silent")
"""


def test_greedy_across_namespaces_with_keys_equals_one_process(tmp_path):
    """Every mesh link between the simulated hosts with CurveZMQ (the deployment default): the same
    tokens; a keyless peer on another host gets no answer from the coordinator."""
    from moemesh.mesh_security import make_keys

    build_hf_model("mixtral", tmp_path)
    keys = str(make_keys(tmp_path / "keys"))
    want = [o.token_ids for o in LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=64), progress=False)
            .generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]
    py = [sys.executable, "-m", "moemesh"]
    try:
        with Hosts(["front", "s0", "s1"]) as hosts:
            front = hosts.address("front")
            hosts.popen("front", [*py, "coordinator", "--model", str(tmp_path), "--pp", "2", "--host", "0.0.0.0",
                                  "--port", "5555", "--client-port", "5556", "--mesh-keys", keys], cwd=REPO,
                        stdout=subprocess.DEVNULL)
            for rank, name in enumerate(["s0", "s1"]):
                hosts.popen(name, [*py, "stage-worker", "--coordinator", f"tcp://{front}:5555", "--pp-rank", str(rank),
                                   "--host", "0.0.0.0", "--advertise-host", hosts.address(name),
                                   "--kv-memory", str(8 << 20), "--mesh-keys", keys], cwd=REPO)
            client = hosts.popen("front", [sys.executable, "-c", CLIENT, "tcp://127.0.0.1:5556", json.dumps(PROMPTS), keys],
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = client.communicate(timeout=180)
            assert client.returncode == 0, err.decode()[-2000:]
            assert json.loads(out) == want
            # the stages really are apart: stage 1 cannot reach stage 0 over loopback
            probe = subprocess.run(["ip", "netns", "exec", hosts.ns("s1"), "python3", "-c",
                                    "import socket; socket.create_connection(('127.0.0.1', 5555), 1)"],
                                   capture_output=True)
            assert probe.returncode != 0
            stranger = subprocess.run(["ip", "netns", "exec", hosts.ns("s1"), sys.executable, "-c", STRANGER,
                                       f"tcp://{front}:5556"], capture_output=True, text=True, timeout=30)
            assert stranger.stdout.strip() == "silent", stranger.stderr
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces cannot be made here: {e}")
    assert not [ns for ns in leftover_namespaces() if ns.startswith(f"mm{os.getpid() % 100000}")]


STREAMER = r"""
import asyncio, json, sys
from moemesh.client import CoordinatorClient
from moemesh.netutil import run
from moemesh.sampling import SamplingParams

async def main(address, prompts, keys, n):
    client = CoordinatorClient(address, mesh_keys=keys)
    await client.wait_serving(timeout=120)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    started = asyncio.Event()
    async def one(p):
        tokens = []
        async for out in client.generate(p, params):
            assert out.error is None, out.error
            tokens += out.token_ids
            if len(tokens) >= 4 and not started.is_set():
                started.set()
                print("STREAMING", flush=True)
        return tokens
    tokens = await asyncio.gather(*(one(p) for p in prompts))
    status = await client.status()
    print(json.dumps({"tokens": tokens, "recoveries": status.recoveries, "step_resets": status.step_resets}),
          flush=True)
    await client.close()

run(main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])))
"""


def _cut_link_mid_stream(tmp_path, seconds: float, coordinator_flags: list[str], worker_flags: list[str]):
    """Streams greedy requests through a mesh across namespaces (keys on, each worker under a restart
    loop as compose's restart policy would run it), pulls stage 1's cable for `seconds` mid-stream;
    -> (what the client printed: tokens and the coordinator's counters, the undisturbed tokens)."""
    from moemesh.mesh_security import make_keys

    build_hf_model("mixtral", tmp_path)
    keys = str(make_keys(tmp_path / "keys"))
    new = 160
    want = [o.token_ids for o in LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=64), progress=False)
            .generate(PROMPTS, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))]
    py = [sys.executable, "-m", "moemesh"]
    loops = []
    try:
        with Hosts(["front", "s0", "s1"]) as hosts:
            front = hosts.address("front")
            hosts.popen("front", [*py, "coordinator", "--model", str(tmp_path), "--pp", "2", "--host", "0.0.0.0",
                                  "--port", "5555", "--client-port", "5556", "--mesh-keys", keys,
                                  *coordinator_flags], cwd=REPO, stdout=subprocess.DEVNULL)
            for rank, name in enumerate(["s0", "s1"]):
                worker = " ".join([*py, "stage-worker", "--coordinator", f"tcp://{front}:5555", "--pp-rank", str(rank),
                                   "--host", "0.0.0.0", "--advertise-host", hosts.address(name), "--kv-memory",
                                   str(8 << 20), "--mesh-keys", keys, *worker_flags])
                loops.append(hosts.popen(name, ["sh", "-c", f"while true; do {worker}; sleep 0.5; done"], cwd=REPO,
                                         start_new_session=True))
            client = hosts.popen("front", [sys.executable, "-c", STREAMER, "tcp://127.0.0.1:5556", json.dumps(PROMPTS),
                                           keys, str(new)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
            assert client.stdout.readline().strip() == "STREAMING", client.communicate()[1][-2000:]
            hosts.link("s1", up=False)
            time.sleep(seconds)
            hosts.link("s1", up=True)
            try:
                out, err = client.communicate(timeout=90)
            finally:
                for loop in loops:  # the loop and the worker in it (its own process group)
                    os.killpg(loop.pid, signal.SIGKILL)
            assert client.returncode == 0, err[-2000:]
            return json.loads(out), want
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces cannot be made here: {e}")


def test_a_stage_whose_link_is_cut_for_8_s_is_recovered_and_nothing_is_lost(tmp_path):
    """Stage 1's link down for 8 s mid-stream: the coordinator loses it (2 s heartbeat timeout), its
    worker hears nothing and exits, its restart loop starts it again, and when the link comes back it
    registers, the pipeline recovers, and every stream completes with the undisturbed tokens."""
    got, want = _cut_link_mid_stream(tmp_path, 8, ["--worker-timeout", "2", "--recovery-timeout", "60"],
                                     ["--coordinator-timeout", "3"])
    assert got == {"tokens": want, "recoveries": 1, "step_resets": 0}


def test_a_link_down_for_less_than_the_timeouts_costs_a_pause_and_nothing_else(tmp_path):
    """Stage 1's link down for 5 s, longer than ZeroMQ's connection heartbeats (3 s) but shorter than
    the workers' and the coordinator's timeouts. The connections drop and come back; a message that
    was in one may be lost with it (a schedule, activations, a result: it happens in some runs), and
    then the step stays in flight until --step-timeout resets the pipeline. Either way no worker is
    replaced and every stream completes with the undisturbed tokens."""
    got, want = _cut_link_mid_stream(tmp_path, 5, ["--worker-timeout", "30", "--step-timeout", "6"],
                                     ["--coordinator-timeout", "30"])
    assert got["tokens"] == want and got["recoveries"] == 0 and got["step_resets"] <= 2


def test_namespaces_are_removed_when_the_body_fails():
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with Hosts(["x"]) as hosts:
                made = hosts.ns("x")
                raise RuntimeError("boom")
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces cannot be made here: {e}")
    assert made not in leftover_namespaces()
