"""`--partition-costs measured`: each layer's and the head's cost timed on this machine with the
stages' own kernels (stage_worker/costs.py, in a subprocess), kept per model, settings and machine
(moemesh/step_costs.py), and balanced by `--layer-partition auto`."""

from __future__ import annotations

import json
import logging
import subprocess

import pytest

from moemesh import step_costs
from moemesh.config import ModelConfig
from moemesh.layout import StepCosts
from moemesh.settings import EngineSettings, partition_arg


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

    return write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=3, vocab_size=384),
                            tmp_path_factory.mktemp("costs"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "moemesh" / "costs"


def test_measures_each_part_once_and_keeps_it(tiny, cache, monkeypatch):
    mc = ModelConfig.from_dir(tiny)
    costs = step_costs.measured_costs(tiny, mc, rows=8, context=16, prompt_len=4, chunk=32)
    assert costs is not None and costs.measured
    assert len(costs.decode) == len(costs.prompt) == mc.num_layers
    assert all(c > 0 for c in costs.decode + costs.prompt) and costs.head >= 0
    kept = list(cache.glob("*.json"))
    assert len(kept) == 1
    record = json.loads(kept[0].read_text())
    assert (record["rows"], record["context"], record["prompt_len"], record["chunk"]) == (8, 16, 4, 32)

    def no_subprocess(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert step_costs.measured_costs(tiny, mc, rows=8, context=16, prompt_len=4, chunk=32) == costs
    # another workload's shape is another measurement
    with pytest.raises(AssertionError, match="measured again"):
        step_costs.measured_costs(tiny, mc, rows=9, context=16, prompt_len=4, chunk=32)


def test_a_failed_measurement_falls_back_to_the_weights(tiny, cache, monkeypatch, caplog):
    mc = ModelConfig.from_dir(tiny)
    monkeypatch.setattr(subprocess, "run", lambda argv, **k: subprocess.CompletedProcess(argv, 1, "", "Boom: no\n"))
    with caplog.at_level(logging.WARNING, logger="moemesh"):
        assert step_costs.measured_costs(tiny, mc) is None
    [record] = [r for r in caplog.records if "could not be measured" in r.getMessage()]
    assert record.fields["error"] == "Boom: no"
    # kept as failed: not tried again at the next start with the same key
    assert [json.loads(p.read_text()) for p in cache.glob("*.json")] == [{"failed": "Boom: no"}]
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("measured again"))
    assert step_costs.measured_costs(tiny, mc) is None
    monkeypatch.setattr(subprocess, "run", lambda argv, **k: subprocess.CompletedProcess(argv, 0, "not json\n", ""))
    assert step_costs.measured_costs(tiny, mc, rows=3) is None
    # a cache that cannot be written costs the next start a measurement, not this one its answer
    good = json.dumps({"decode": {"sparse": 1.0}, "prompt": {"sparse": 1.0}, "head": 2.0})
    monkeypatch.setattr(subprocess, "run", lambda argv, **k: subprocess.CompletedProcess(argv, 0, good + "\n", ""))
    (cache.parent.parent.parent / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache.parent.parent.parent / "file"))
    assert step_costs.measured_costs(tiny, mc, rows=4).head == 2.0
    monkeypatch.setattr(step_costs, "MEASURE_LIMIT", 1)  # layers too large to load twice: not even tried
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("measured"))
    assert step_costs.measured_costs(tiny, mc) is None


def test_measured_only_for_auto_on_a_cpu_pipeline(tiny, monkeypatch):
    mc = ModelConfig.from_dir(tiny)
    calls = []
    monkeypatch.setattr(step_costs, "measured_costs", lambda *a, **k: calls.append(k) or StepCosts((1.0,) * 3,
                                                                                                    (1.0,) * 3, 9.0))
    auto = EngineSettings(model=str(tiny), layer_partition=partition_arg("auto:10:30"), max_seqs=100,
                          max_batched_tokens=64)
    assert step_costs.partition_costs(auto, tiny, mc, 1) is None
    assert step_costs.partition_costs(auto, tiny, mc, 2, device="cuda:0") is None
    assert step_costs.partition_costs(EngineSettings.derive(auto, partition_costs="weights"), tiny, mc, 2) is None
    assert step_costs.partition_costs(EngineSettings.derive(auto, layer_partition=(2, 1)), tiny, mc, 2) is None
    assert not calls
    assert step_costs.partition_costs(auto, tiny, mc, 4) is None  # (more stages than layers: refused later)
    assert not calls
    assert step_costs.partition_costs(auto, tiny, mc, 2, threads=2).head == 9.0
    # a decode microbatch: --max-seqs within --max-batched-tokens, among the stages; the mix's context
    assert calls == [dict(dtype="auto", quantization=None, moe_backend="auto", rows=32, context=25, prompt_len=10,
                          chunk=64, threads=2)]
    # a plain "auto" (a 1:1 mix) with lengths of a typical request, not of one token
    step_costs.partition_costs(EngineSettings.derive(auto, layer_partition="auto"), tiny, mc, 2)
    assert (calls[-1]["context"], calls[-1]["prompt_len"]) == (48, 32)


def test_the_engine_splits_by_the_measurement(tiny, monkeypatch):
    """The split follows what was measured: a first layer five times the others' takes a stage alone."""
    from moemesh.entrypoints.engine import LLMEngine

    monkeypatch.setattr(step_costs, "measured_costs", lambda *a, **k: StepCosts((5.0, 1.0, 1.0), (5.0, 1.0, 1.0),
                                                                                0.0, True))
    settings = EngineSettings(model=str(tiny), num_kv_blocks=16, pp=2, layer_partition=partition_arg("auto:0:1"))
    assert LLMEngine(settings, progress=False).layout.stage_layers == (1, 2)
    monkeypatch.setattr(step_costs, "measured_costs", lambda *a, **k: None)  # not measured: the weights'
    from moemesh.layout import balanced_partition

    assert LLMEngine(settings, progress=False).layout.stage_layers == balanced_partition(ModelConfig.from_dir(tiny), 2)


def test_the_cache_key_follows_the_kernel_sources_in_a_checkout_and_installed(tmp_path, monkeypatch):
    """kernels/ in a checkout, moemesh_kernels/ where a wheel is installed, beside HuggingFace's
    `kernels`: an edit to our kernel source prices the layers anew, one to theirs does not."""
    model = tmp_path / "model"
    model.mkdir()
    for layout, ours in (("checkout", "kernels"), ("site-packages", "moemesh_kernels")):
        root = tmp_path / layout
        (root / "stage_worker").mkdir(parents=True)
        (root / ours).mkdir()
        (root / ours / "cpu_gemm.c").write_text("int a;")
        if layout == "site-packages":
            (root / "kernels").mkdir()
            (root / "kernels" / "__init__.py").write_text("# HuggingFace's")
        monkeypatch.setattr(step_costs, "_ROOT", root)
        before = step_costs._key(model, {})
        (root / ours / "cpu_gemm.c").write_text("int b;")
        assert step_costs._key(model, {}) != before
        if layout == "site-packages":
            after = step_costs._key(model, {})
            (root / "kernels" / "__init__.py").write_text("# HuggingFace's, a newer one")
            assert step_costs._key(model, {}) == after
