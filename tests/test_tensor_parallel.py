"""Tensor and expert parallelism inside a stage: real worker processes, gloo process groups."""

from __future__ import annotations

import pytest

from hf_models import build_hf_model, hf_greedy
from moemesh.config import ConfigError, ModelConfig
from moemesh.layout import check_layout
from moemesh.entrypoints.launcher import LocalMesh
from moemesh.settings import EngineSettings
from moemesh.netutil import run
from moemesh.sampling import SamplingParams
from stage_worker.layers.parallel import TPGroup
from stage_worker.loader import load_model
from test_mesh import generate_all, keys_for

PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7], list(range(30, 52)), [299, 1, 298, 2]]
NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
# llama with a single kv head: two ranks each hold a copy of it
OVERRIDES = {"llama": dict(num_key_value_heads=1)}


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe", "llama"])
def checkpoint(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(f"tp-{arch}")
    hf = build_hf_model(arch, path, **OVERRIDES.get(arch, {}))
    return arch, path, [hf_greedy(hf, p, NEW) for p in PROMPTS]


def run_layout(path, **layout):
    with LocalMesh.of(EngineSettings(model=str(path), kv_memory=8 << 20, mesh_keys=keys_for(path), **layout)) as mesh:
        results, _ = run(generate_all(mesh, PROMPTS, GREEDY))
        again, status = run(generate_all(mesh, PROMPTS, GREEDY))  # the 22-token prompt's first block is cached
    assert status.num_free_blocks == status.num_blocks
    assert (status.mlp_handoff_steps > 0) == (layout.get("layer_partition") == (3, 1))
    assert [t for t, _ in again] == [t for t, _ in results] and status.prefix_cache_hits >= 16
    assert (status.spec_draft_tokens > 0) == bool(layout.get("num_speculative_tokens"))
    return [t for t, _ in results]


# (3, 1): the prompt step hands the third layer's MLP, sliced over the ranks as the first stage slices it,
# to the last stage (the MLP hand-off)
# speculative: every rank of the last stage checks the drafts (greedy: all of them alike)
@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, pp=2), dict(tp=2, pp=2, layer_partition=(3, 1)),
                                    dict(tp=2, pp=2, num_speculative_tokens=3, ngram_prompt_lookup_min=1)],
                         ids=["tp2", "tp2-pp2", "tp2-pp2-handoff", "tp2-pp2-speculative"])
def test_greedy_parity_with_transformers(checkpoint, layout):
    arch, path, reference = checkpoint
    assert run_layout(path, **layout) == reference


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_expert_parallel_parity_with_transformers(tmp_path, arch):
    hf = build_hf_model(arch, tmp_path)
    assert run_layout(tmp_path, tp=2, expert_parallel=True) == [hf_greedy(hf, p, NEW) for p in PROMPTS]


def test_expert_parallel_stages_hand_whole_experts_over(tmp_path):
    """The last stage's copy of the first stage's last MoE, split by experts over its ranks as the
    first stage splits it: the tokens stay transformers'."""
    hf = build_hf_model("qwen2_moe", tmp_path)
    assert run_layout(tmp_path, tp=2, pp=2, expert_parallel=True, layer_partition=(3, 1)) == \
        [hf_greedy(hf, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "expert-parallel"])
def test_each_rank_loads_about_a_tp_th_of_the_expert_weights(tmp_path, expert_parallel):
    build_hf_model("qwen3_moe", tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    layers = range(1, 2)  # a sparse layer (decoder_sparse_step 2)
    _, whole = load_model(tmp_path, config, layers, progress=False)
    expert_bytes = sum(n for name, n in whole.bytes_by_tensor.items() if ".experts." in name)
    for tp in (2, 4):
        for rank in range(tp):
            _, stats = load_model(tmp_path, config, layers, TPGroup(rank, tp, expert_parallel=expert_parallel),
                                  progress=False)
            mine = sum(n for name, n in stats.bytes_by_tensor.items() if ".experts." in name)
            assert mine == expert_bytes // tp


def test_layouts_the_model_cannot_take_are_refused():
    cfg = ModelConfig.from_hf(dict(model_type="qwen2_moe", vocab_size=10, hidden_size=48, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, intermediate_size=40,
                                   moe_intermediate_size=20, shared_expert_intermediate_size=30, num_experts=6,
                                   num_experts_per_tok=2, mlp_only_layers=[0]))
    check_layout(cfg, 2)
    with pytest.raises(ConfigError, match=r"--tp 4 does not divide the model's 6 attention heads, shared expert "
                                          r"intermediate size 30$"):
        check_layout(cfg, 4)
    with pytest.raises(ConfigError, match="--tp 3 does not divide .*2 key/value heads.*intermediate_size 40.*"
                                          "expert intermediate size 20"):
        check_layout(cfg, 3)
    with pytest.raises(ConfigError, match="--tp 4 .*6 experts \\(with --expert-parallel\\)"):
        check_layout(cfg, 4, expert_parallel=True)
    check_layout(cfg, 2, expert_parallel=True)
    dense = ModelConfig.from_hf(dict(model_type="llama", vocab_size=10, hidden_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=8))
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        check_layout(dense, 2, expert_parallel=True)


def test_a_vocabulary_smaller_than_the_ranks_rows_leaves_the_last_ranks_padding_only():
    """5 tokens over 4 ranks (2 rows each): rank 3 starts past the vocabulary (its load had failed
    with a negative row count); the ranks' rows still add up to the table, padding zero."""
    import torch

    from stage_worker.layers.vocab import VocabParallelEmbedding

    table = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    rows = []
    for rank in range(4):
        shard = VocabParallelEmbedding(5, 3, TPGroup(rank, 4))
        shard.weight_loader(shard.weight, table)
        rows.append(shard.weight.data[:shard.end - shard.start])
        assert not shard.weight.data[shard.end - shard.start:].any()
    assert torch.equal(torch.cat(rows), table) and [len(r) for r in rows] == [2, 2, 1, 0]


def test_cuda_meshes_need_a_gpu_for_every_worker_before_any_starts(tmp_path, monkeypatch):
    import torch

    from moemesh_kernels.backend import BackendError

    build_hf_model("mixtral", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    LocalMesh.of(EngineSettings(model=str(tmp_path), pp=3, device="cuda"))._check_workers_can_run()
    with pytest.raises(BackendError, match=r"--device cuda, one GPU for each of the 4 \(--pp x --tp\) workers, "
                                           r"needs cuda:3: this host has 3 CUDA devices"):
        LocalMesh.of(EngineSettings(model=str(tmp_path), pp=2, tp=2, device="cuda"))._check_workers_can_run()


def test_the_coordinator_refuses_a_bad_layout_before_any_worker_starts(tmp_path, capsys):
    from moemesh.entrypoints.cli import main

    build_hf_model("mixtral", tmp_path)  # 4 heads, 2 kv heads, 4 experts
    with pytest.raises(SystemExit) as exit_info:
        main(["coordinator", "--model", str(tmp_path), "--tp", "3", "--port", "0", "--client-port", "0"])
    assert exit_info.value.code == 2
    assert "--tp 3 does not divide the model's 4 attention heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--tp", "8", "--expert-parallel"])
    assert "4 experts (with --expert-parallel)" in capsys.readouterr().err


def test_a_killed_rank_of_a_tensor_parallel_stage_is_replaced_with_every_worker(tmp_path):
    """tp rank 1 of the last stage dies: every other worker is told to exit too (a process group
    cannot take a new member; a reset could leave ranks a step apart), the launcher starts them all
    again, each stage meets at a fresh rendezvous, and every stream completes with the tokens of an
    undisturbed run."""
    import asyncio
    import time

    from moemesh.client import CoordinatorClient
    from test_mesh import collect, stream_all

    build_hf_model("mixtral", tmp_path)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, **(dict(temperature=0) if i % 2 else
                                                                dict(temperature=0.8, seed=700 + i)))
              for i in range(16)]

    async def scenario():
        mesh = LocalMesh.of(EngineSettings(model=str(tmp_path), pp=2, tp=2, kv_memory=8 << 20,
                                           mesh_keys=keys_for(tmp_path)), worker_timeout=3.0)
        mesh.start()
        client = CoordinatorClient(mesh.client_address, mesh_keys=mesh.coordinator.mesh_keys)
        try:
            await client.wait_serving(timeout=120)
            want = await asyncio.gather(*(collect(client, p, sp) for p, sp in zip(prompts, params)))
            tasks, got = stream_all(client, prompts, params)
            while sum(map(len, got)) < 16 * 3:
                await asyncio.sleep(0.005)
            mesh.kill("stage-worker pp=1 tp=1")
            killed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            return [t for t, _ in want], got, await client.status(), time.monotonic() - killed, mesh.died
        finally:
            await client.close()
            mesh.stop()

    want, got, status, seconds, died = run(scenario())
    assert got == want and all(len(t) == 30 for t in got)
    assert status.recoveries == 1 and status.phase == "serving" and died is None
