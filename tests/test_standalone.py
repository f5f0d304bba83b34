"""A stage alone: synthetic input, and a live worker's recording replayed and compared."""

from __future__ import annotations

import msgspec
import pytest

from hf_models import build_hf_model
from moemesh.entrypoints.cli import main
from moemesh.entrypoints.launcher import LocalMesh
from moemesh.settings import EngineSettings
from moemesh.netutil import run
from moemesh.protocol import Schedule
from moemesh.sampling import SamplingParams
from test_mesh import generate_all

PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7, 8, 9]]


def test_synthetic_input_reports_every_layer(tmp_path, capsys):
    build_hf_model("qwen2_moe", tmp_path)
    assert main(["stage-worker", "--standalone", "--model", str(tmp_path), "--layers", "1:3", "--tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert "layer 1:" in out and "layer 2:" in out and "layer 3:" not in out
    assert "residual stream: shape [20, 64]" in out
    # (in bfloat16 the stage takes its input in bfloat16, as a live stage's previous one sends it)
    assert main(["stage-worker", "--standalone", "--model", str(tmp_path), "--layers", "1:3", "--tokens", "20",
                 "--dtype", "bfloat16"]) == 0
    assert "residual stream: shape [20, 64]" in capsys.readouterr().out


def test_a_recording_made_before_stages_sent_one_tensor_is_read_as_their_sum():
    import torch

    from stage_worker.standalone import _stream

    hidden, residual = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(_stream({"hidden": hidden, "residual": residual}), hidden + residual)
    assert _stream({"stream": hidden}) is hidden


def test_a_recording_replays_to_the_same_outputs(tmp_path, capsys):
    """Recorded with int8 weights, and the first stage's third layer handing its (int8) MLP to the
    last stage for the prompt steps: the replay computes as the recorded stage did (its run.json)."""
    import json

    model = tmp_path / "m"
    build_hf_model("mixtral", model)
    rec = tmp_path / "rec"
    settings = EngineSettings(model=str(model), pp=2, kv_memory=8 << 20, quantization="int8", block_size=8,
                              layer_partition=(3, 1))
    with LocalMesh.of(settings, record=str(rec)) as mesh:
        results, _ = run(generate_all(mesh, PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    assert all(tokens for tokens, _ in results)
    assert sorted(p.name for p in rec.iterdir()) == ["pp0-tp0", "pp1-tp0"]
    from safetensors.torch import load_file

    sent = load_file(str(next((rec / "pp1-tp0").glob("*.inputs"))))
    assert list(sent) == ["stream"]  # one tensor crosses the boundary: hidden + residual
    run_file = json.loads((rec / "pp1-tp0" / "run.json").read_text())
    assert run_file["quantization"] == "int8" and run_file["block_size"] == 8 and run_file["layers"] == [3, 4]
    assert run_file["mlp_handoff"] is True
    handed = [msgspec.msgpack.decode(p.read_bytes(), type=Schedule).mlp_handoff
              for p in (rec / "pp1-tp0").glob("*.schedule")]
    assert [2] in handed and [] in handed
    assert main(["stage-worker", "--standalone", "--model", str(model), "--layers", "0:3",
                 "--replay", str(rec / "pp0-tp0")]) == 0
    first = capsys.readouterr().out
    assert "matches the recording" in first and "max abs difference from the recording: 0" in first
    assert main(["stage-worker", "--standalone", "--model", str(model), "--layers", "3:4",
                 "--replay", str(rec / "pp1-tp0")]) == 0
    last = capsys.readouterr().out
    assert "-> same" in last and "DIFFERENT" not in last and "matches the recording" in last
    assert "layer 2 (MLP):" in last and "layer 3:" in last  # (the MLP handed over, timed as the layers are)
    # a step whose result is missing is not counted as a match: the summary says what was compared
    results = sorted((rec / "pp1-tp0").glob("*.result"))
    results[0].unlink()
    assert main(["stage-worker", "--standalone", "--model", str(model), "--replay", str(rec / "pp1-tp0")]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert f"{len(results) - 1} of {len(results)} steps compared" in summary and "nothing recorded" in summary
    for result in results[1:]:
        result.unlink()
    assert main(["stage-worker", "--standalone", "--model", str(model), "--replay", str(rec / "pp1-tp0")]) == 1
    assert f"nothing to compare: none of the {len(results)} recorded steps" in capsys.readouterr().out


def test_the_standalone_stage_computes_on_the_device_asked_for(tmp_path, capsys):
    """--device reaches the standalone stage (it was ignored: a GPU host's timings were the CPU's);
    a device this host lacks is refused naming the flag."""
    import torch

    build_hf_model("llama", tmp_path)
    if torch.cuda.is_available():
        assert main(["stage-worker", "--standalone", "--model", str(tmp_path), "--layers", "0:1", "--device",
                     "cuda"]) == 0
        return
    with pytest.raises(SystemExit) as e:
        main(["stage-worker", "--standalone", "--model", str(tmp_path), "--layers", "0:1", "--device", "cuda"])
    assert e.value.code == 2 and "--device cuda" in capsys.readouterr().err


def test_a_replay_that_differs_is_reported(tmp_path, capsys):
    model = tmp_path / "m"
    build_hf_model("mixtral", model)
    other = tmp_path / "other"
    build_hf_model("mixtral", other, seed=1)  # different weights
    rec = tmp_path / "rec"
    with LocalMesh.of(EngineSettings(model=str(model), pp=2, kv_memory=8 << 20), record=str(rec)) as mesh:
        run(generate_all(mesh, PROMPTS, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)))
    assert main(["stage-worker", "--standalone", "--model", str(other), "--layers", "0:2",
                 "--replay", str(rec / "pp0-tp0")]) == 1
    assert "DIFFERS FROM the recording" in capsys.readouterr().out


def test_an_fp8_checkpoint_runs_as_one_alone_and_never_loads_as_plain_numbers(tmp_path, capsys):
    import pytest

    from moemesh.errors import LoadError
    from stage_worker.loader import load_model

    build_hf_model("mixtral", tmp_path / "m")
    assert main(["quantize", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    absmax = {}
    for name in ("m", "q"):
        assert main(["stage-worker", "--standalone", "--model", str(tmp_path / name), "--layers", "0:2"]) == 0
        out = capsys.readouterr().out
        absmax[name] = float(out.split("absmax ")[1].split()[0])
    assert "Fp8Config" in out
    assert 0.5 < absmax["q"] / absmax["m"] < 2  # (read as plain numbers, its fp8 codes made it 1e9)
    with pytest.raises(LoadError, match="quantized"):
        load_model(tmp_path / "q", progress=False)


def test_a_replay_takes_its_layers_from_the_recording_and_refuses_others(tmp_path, capsys):
    import pytest

    model = tmp_path / "m"
    build_hf_model("mixtral", model)
    rec = tmp_path / "rec"
    with LocalMesh.of(EngineSettings(model=str(model), pp=2, kv_memory=8 << 20), record=str(rec)) as mesh:
        run(generate_all(mesh, PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
    assert main(["stage-worker", "--standalone", "--model", str(model), "--replay", str(rec / "pp1-tp0")]) == 0
    out = capsys.readouterr().out
    from moemesh_kernels.cpu_gemm import native

    assert "loaded layers 2:4" in out and "matches the recording" in out
    assert ("a fused decode step" in out) == (native() is not None)  # (the native kernels' one call per layer)
    # a float32 recording replayed in bfloat16 (its numbers differ; it runs)
    assert main(["stage-worker", "--standalone", "--model", str(model), "--replay", str(rec / "pp1-tp0"),
                 "--dtype", "bfloat16"]) in (0, 1)
    assert "bfloat16" in capsys.readouterr().out
    wider = tmp_path / "wider"  # (another model: its residual stream is wider than the recording's)
    build_hf_model("mixtral", wider, hidden_size=96)
    for argv, said in ((["--model", str(wider), "--replay", str(rec / "pp1-tp0")], "a recording of another model?"),
                       (["--model", str(model), "--replay", str(tmp_path / "none")], "no such directory")):
        with pytest.raises(SystemExit) as e:
            main(["stage-worker", "--standalone", *argv])
        assert e.value.code == 2 and said in capsys.readouterr().err
    for argv in (["--layers", "0:2", "--replay", str(rec / "pp1-tp0")], ["--replay", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            main(["stage-worker", "--standalone", "--model", str(model), *argv])
        assert e.value.code == 2
    assert "recording is of layers 2:4" in capsys.readouterr().err
    next((rec / "pp0-tp0").glob("*.schedule")).write_bytes(b"\x92")  # (cut short)
    with pytest.raises(SystemExit):
        main(["stage-worker", "--standalone", "--model", str(model), "--replay", str(rec / "pp0-tp0")])
    assert "cannot be read" in capsys.readouterr().err
