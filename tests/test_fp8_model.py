"""FP8 end to end: a checkpoint written by `moemesh quantize` loads and runs, and so does
`--quantization fp8` on a 16/32-bit checkpoint; both stay within a stated bound of the original."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moemesh.entrypoints.cli import main
from moemesh.config import ConfigError, ModelConfig
from moemesh.entrypoints.engine import LLMEngine
from moemesh.settings import EngineSettings
from moemesh.sampling import SamplingParams
from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
from stage_worker.layers.fp8 import resolve_quantization
from stage_worker.layers.linear import UnquantizedLinearMethod
from test_model_parity import all_logits

# Random tiny models amplify weight error through every layer (weights of std 1/sqrt(fan_in), no
# training to make them robust): measured max |logit error| / max |logit| was 0.13-0.43 over the four
# architectures (docs/benchmarks.md). The bound checks that quantization is applied and sane.
MAX_REL_LOGIT_ERROR = 0.5
PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7, 300, 12], list(range(30, 52))]


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def checkpoints(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"fp8-{request.param}")
    write_tiny_model(TinyModelSpec(arch=request.param, num_layers=2, hidden_size=64, intermediate_size=96,
                                   moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=4,
                                   vocab_size=384), d / "m")
    assert main(["quantize", "--model", str(d / "m"), "--out", str(d / "q")]) == 0
    return d / "m", d / "q"


def engine(path, **kw):
    return LLMEngine(EngineSettings(model=str(path), num_kv_blocks=64, **kw), progress=False)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_quantized_checkpoint_loads_and_stays_close(checkpoints):
    original, quantized = checkpoints
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    # the base engine on torch's kernels: its float weights stay inspectable (native packs them)
    base, q, inplace = engine(original, moe_backend="torch"), engine(quantized), engine(original, quantization="fp8")
    layer = q.stages[0].runner.model.model.layers["0"]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    assert isinstance(layer.mlp.gate.quant_method, UnquantizedLinearMethod)  # the router is never quantized
    for prompt in PROMPTS:
        want = all_logits(base, prompt)
        assert rel(all_logits(q, prompt), want) < MAX_REL_LOGIT_ERROR
        assert rel(all_logits(inplace, prompt), want) < MAX_REL_LOGIT_ERROR
    # each weight within e4m3's bound of the original (half an ULP: 2^-4 relative, plus the subnormal floor)
    w = base.stages[0].runner.model.model.layers["0"].mlp.experts.w13_weight
    qe = inplace.stages[0].runner.model.model.layers["0"].mlp.experts
    deq = qe.w13_weight.float() * qe.w13_weight_scale[:, None, None]
    assert ((deq - w).abs() <= w.abs() / 16 + qe.w13_weight_scale[:, None, None] / 1024 + 1e-7).all()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in q.generate(PROMPTS, params)]
    assert all(len(t) == 8 for t in got)


def test_quantization_choices_are_checked(checkpoints, tmp_path):
    original, quantized = checkpoints
    assert resolve_quantization(ModelConfig.from_dir(original), None) is None
    assert resolve_quantization(ModelConfig.from_dir(original), "fp8").checkpoint_is_fp8 is False
    assert resolve_quantization(ModelConfig.from_dir(quantized), None).checkpoint_is_fp8 is True
    with pytest.raises(ConfigError, match="--quantization 'int4'"):
        resolve_quantization(ModelConfig.from_dir(original), "int4")
    raw = json.loads((quantized / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ConfigError, match="'gptq' is not supported"):
        resolve_quantization(ModelConfig.from_hf(raw), None)


def test_bench_fp8_reports_both_variants(checkpoints, capsys):
    original, quantized = checkpoints
    assert main(["bench", "fp8", "--model", str(original), "--fp8-model", str(quantized), "--num-prompts", "3",
                 "--new", "4", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in rows] == ["fp8 in place", "fp8 checkpoint"]
    for r in rows:
        assert 0 < r["max_rel_logit_error"] < MAX_REL_LOGIT_ERROR
        assert 0 <= r["position_agreement"] <= 1 and 0 <= r["mean_common_prefix"] <= 4


@pytest.mark.parametrize("swap", ["quantized model", "plain fp8 model", "missing fp8 model"])
def test_bench_fp8_refuses_checkpoints_that_would_compare_nothing(checkpoints, tmp_path, swap):
    original, quantized = checkpoints
    model, fp8 = {"quantized model": (quantized, None), "plain fp8 model": (original, original),
                  "missing fp8 model": (original, tmp_path / "nope")}[swap]
    argv = ["bench", "fp8", "--model", str(model), "--num-prompts", "1", "--new", "1"]
    with pytest.raises(SystemExit) as e:
        main(argv + (["--fp8-model", str(fp8)] if fp8 else []))
    assert e.value.code == 2


def test_quantize_refuses_an_out_directory_that_holds_weights(checkpoints, tmp_path, capsys):
    """A shard or index left there from another checkpoint would be loaded with this one's config."""
    original, quantized = checkpoints
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--model", str(original), "--out", str(quantized)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--out {quantized} already holds" in err and "Traceback" not in err


def test_a_quantize_that_fails_part_way_leaves_no_checkpoint_behind(checkpoints, tmp_path, monkeypatch, capsys):
    """A failure while writing (here the disk, at the first shard) takes back what this run wrote: a new
    --out is removed, and an existing one keeps only what it held before."""
    import moemesh.entrypoints.quantize as quantize

    original, _ = checkpoints

    def full_disk(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a shard")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(quantize, "save_file", full_disk)
    fresh = tmp_path / "fresh" / "fp8"
    with pytest.raises(SystemExit):
        main(["quantize", "--model", str(original), "--out", str(fresh)])
    assert not fresh.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "README.md").write_text("mine")
    with pytest.raises(SystemExit):
        main(["quantize", "--model", str(original), "--out", str(kept)])
    assert [p.name for p in kept.iterdir()] == ["README.md"]
    assert "Traceback" not in capsys.readouterr().err


def test_a_quantize_ended_by_sigterm_or_a_failed_write_takes_its_shards_back(checkpoints, tmp_path, monkeypatch,
                                                                             capsys):
    """SIGTERM (or SIGHUP) mid-write ends the command as ^C does, the shards written taken back (the
    default action had left them, and a rerun refused the --out they were in); a write that safetensors
    fails is --out's fault, not --model's."""
    import os
    import signal

    from safetensors import SafetensorError

    import moemesh.entrypoints.quantize as quantize

    original, _ = checkpoints
    real_save = quantize.save_file

    def terminated(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        os.kill(os.getpid(), signal.SIGTERM)

    real_rmtree = quantize.shutil.rmtree

    def terminated_again(path, ignore_errors=False):  # (a second SIGTERM, to the whole group: waits)
        os.kill(os.getpid(), signal.SIGTERM)
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(quantize, "save_file", terminated)
    monkeypatch.setattr(quantize.shutil, "rmtree", terminated_again)
    out = tmp_path / "terminated"
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--model", str(original), "--out", str(out)])
    assert exc.value.code == 128 + signal.SIGTERM and not out.exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # (put back)
    monkeypatch.setattr(quantize.shutil, "rmtree", real_rmtree)

    def too_large(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: File too large")

    monkeypatch.setattr(quantize, "save_file", too_large)
    with pytest.raises(SystemExit):
        main(["quantize", "--model", str(original), "--out", str(tmp_path / "large")])
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'large'}: Error while serializing" in err and "--model" not in err


def test_fp8_weights_stored_in_another_format_are_refused(checkpoints, tmp_path):
    """An FP8 parameter takes F8_E4M3 codes only: e5m2 codes (or a 16-bit weight beside a weight_scale)
    were cast by value, saturated at 448."""
    import shutil

    from safetensors.torch import load_file, save_file

    from stage_worker.loader import LoadError

    _, quantized = checkpoints
    shutil.copytree(quantized, tmp_path / "q")
    path = next((tmp_path / "q").glob("*.safetensors"))
    tensors = load_file(str(path))
    name = next(k for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn and "o_proj" in k)
    for wrong in (torch.float8_e5m2, torch.bfloat16):
        save_file({**tensors, name: tensors[name].to(wrong)}, str(path))
        with pytest.raises(LoadError, match=f"{name}.*an FP8 weight.*F8_E4M3"):
            engine(tmp_path / "q")


def test_quantize_reads_the_files_the_loader_reads(checkpoints, tmp_path):
    """Without an index, model.safetensors alone (a stray file beside it had been quantized and written
    into --out too, where the loader would not read it)."""
    import shutil

    original, _ = checkpoints
    shutil.copytree(original, tmp_path / "m")
    shutil.copy(tmp_path / "m" / "model.safetensors", tmp_path / "m" / "consolidated.safetensors")
    assert main(["quantize", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "q")]) == 0
    assert sorted(p.name for p in (tmp_path / "q").glob("*.safetensors")) == ["model.safetensors"]
