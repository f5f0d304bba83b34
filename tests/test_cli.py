"""The `moemesh` command line, in process through `cli.main` and once as a real subprocess.

User errors must end with exit status 2 and one `moemesh: error:` line naming the flag, never a
traceback: in process, a traceback shows up as an exception other than SystemExit.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from moemesh.entrypoints.cli import main
from moemesh.config import ModelConfig
from moemesh.entrypoints.default_model import DEMO_MODEL_DIR
from moemesh.entrypoints.tiny_model import ARCHS

REPO = Path(__file__).resolve().parent.parent
SIZES = ["--layers", "2", "--hidden", "64", "--intermediate", "64", "--heads", "4", "--kv-heads", "2",
         "--experts", "4", "--top-k", "2", "--vocab", "384"]
KV = ["--kv-memory", str(4 << 20)]  # the 1 GiB default costs seconds per engine; these prompts need little
GREEDY = ["--temperature", "0", "--ignore-eos"]
TEXT = "The quick brown fox"


def make_model(out: Path, arch: str = "mixtral", *extra: str) -> Path:
    assert main(["make-tiny-model", "--arch", arch, "--out", str(out), *SIZES, *extra]) == 0
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("cli") / "mixtral")


def generate(capsys, model: Path | None, *args: str) -> list[dict]:
    capsys.readouterr()
    argv = ["generate", *(["--model", str(model)] if model else []), *KV, "--json", *args]
    assert main(argv) == 0
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines()]


def user_error(capsys, argv: list[str], no_output: bool = False) -> str:
    """Runs a command that must fail cleanly; returns its stderr. no_output: it printed nothing (no
    result rows: it failed before any work)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert not (no_output and out), out
    assert "Traceback" not in err
    assert "error:" in err
    return err


# ----------------------------------------------------------------------------------------------
# make-tiny-model


@pytest.mark.parametrize("arch", ARCHS)
def test_make_tiny_model_writes_a_checkpoint_the_engine_runs(arch, tmp_path, capsys):
    out = make_model(tmp_path / arch, arch)
    assert capsys.readouterr().out.strip() == str(out)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["num_hidden_layers"] == 2 and config["vocab_size"] == 384
    mc = ModelConfig.from_dir(out)
    assert (mc.model_type, mc.num_layers, mc.hidden_size, mc.vocab_size) == (arch, 2, 64, 384)
    assert mc.num_experts == (0 if arch == "llama" else 4)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert tuple(f.get_tensor("model.embed_tokens.weight").shape) == (384, 64)
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() <= 384
    (result,) = generate(capsys, out, "--prompt", TEXT, "--max-tokens", "3", *GREEDY)
    assert len(result["token_ids"]) == 3 and all(0 <= t < 384 for t in result["token_ids"])


# ----------------------------------------------------------------------------------------------
# generate


def test_generate_prompt_gives_exactly_max_tokens_with_text(model, capsys):
    (result,) = generate(capsys, model, "--prompt", TEXT, "--max-tokens", "7", *GREEDY)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert result["index"] == 0
    assert result["prompt_ids"] == tok.encode(TEXT).ids
    assert len(result["token_ids"]) == 7 and result["finish_reason"] == "length"
    assert result["text"] == tok.decode(result["token_ids"], skip_special_tokens=True)


def test_generate_without_json_prints_the_text(model, capsys):
    (as_json,) = generate(capsys, model, "--prompt", TEXT, "--max-tokens", "5", *GREEDY)
    capsys.readouterr()
    assert main(["generate", "--model", str(model), *KV, "--prompt", TEXT, "--max-tokens", "5", *GREEDY]) == 0
    assert capsys.readouterr().out == as_json["text"] + "\n"


def test_greedy_is_repeatable_and_text_equals_its_token_ids(model, capsys):
    args = ["--max-tokens", "12", *GREEDY]
    first = generate(capsys, model, "--prompt", TEXT, *args)
    second = generate(capsys, model, "--prompt", TEXT, *args)
    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(TEXT).ids
    by_ids = generate(capsys, model, "--prompt-ids", ",".join(map(str, ids)), *args)
    assert first == second
    assert by_ids[0]["token_ids"] == first[0]["token_ids"] and len(first[0]["token_ids"]) == 12
    assert by_ids[0]["prompt_ids"] == ids


def test_prompts_file_mixes_text_and_ids_in_input_order(model, tmp_path, capsys):
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    # (a record's other keys, an id or metadata, are left alone)
    prompts = [{"prompt": TEXT, "id": "a"}, {"prompt_ids": [5, 6, 7, 8, 9]}, {"prompt": "Hello", "meta": {"k": 1}},
               {"prompt_ids": [42]}]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in prompts[:2]) + "\n\n" +
                 "\n".join(json.dumps(p) for p in prompts[2:]) + "\n")
    results = generate(capsys, model, "--prompts-file", str(f), "--max-tokens", "6", *GREEDY)
    expected_ids = [p["prompt_ids"] if "prompt_ids" in p else tok.encode(p["prompt"]).ids for p in prompts]
    assert [r["index"] for r in results] == [0, 1, 2, 3]
    assert [r["prompt_ids"] for r in results] == expected_ids
    assert all(len(r["token_ids"]) == 6 and isinstance(r["text"], str) for r in results)
    # batched together, each prompt gets what it gets alone
    for ids, r in zip(expected_ids, results):
        (alone,) = generate(capsys, model, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "6", *GREEDY)
        assert alone["token_ids"] == r["token_ids"]


def test_seed_makes_sampling_reproducible(model, capsys):
    args = ["--prompt", TEXT, "--max-tokens", "16", "--temperature", "1.5", "--ignore-eos"]
    a = generate(capsys, model, *args, "--seed", "11")
    b = generate(capsys, model, *args, "--seed", "11")
    c = generate(capsys, model, *args, "--seed", "12")
    greedy = generate(capsys, model, "--prompt", TEXT, "--max-tokens", "16", *GREEDY)
    assert a == b
    assert a[0]["token_ids"] != c[0]["token_ids"]
    assert a[0]["token_ids"] != greedy[0]["token_ids"]  # it really sampled


def test_layer_partition_gives_the_same_greedy_tokens(model, capsys):
    args = ["--prompt", TEXT, "--max-tokens", "10", *GREEDY]
    whole = generate(capsys, model, *args)
    split = generate(capsys, model, *args, "--layer-partition", "1,1")
    assert split[0]["token_ids"] == whole[0]["token_ids"] and len(whole[0]["token_ids"]) == 10


def test_without_model_generate_uses_the_shipped_demo_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOEMESH_HOME", str(tmp_path / "home"))
    (first,) = generate(capsys, None, "--prompt-ids", "4000,5,6", "--max-tokens", "4", *GREEDY)
    (named,) = generate(capsys, DEMO_MODEL_DIR, "--prompt-ids", "4000,5,6", "--max-tokens", "4", *GREEDY)
    assert first == named and len(first["token_ids"]) == 4  # id 4000 is inside the demo model's 4096-token vocab
    assert not (tmp_path / "home").exists()  # shipped, not written on first use


def test_python_dash_m_moemesh_runs_as_a_program(model, tmp_path, capsys):
    args = ["generate", "--model", str(model), *KV, "--json", "--prompt-ids", "5,6,7", "--max-tokens", "5", *GREEDY]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOEMESH_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "moemesh", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (result,) = [json.loads(line) for line in proc.stdout.splitlines()]
    (in_process,) = generate(capsys, model, *args[3 + len(KV):])
    assert result == in_process and len(result["token_ids"]) == 5
    bad = subprocess.run([sys.executable, "-m", "moemesh", "generate", "--prompt-ids", "1", "--max-tokens", "0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--max-tokens" in bad.stderr and "Traceback" not in bad.stderr


def test_a_control_plane_install_names_the_extra_a_compute_command_needs(tmp_path):
    """`pip install moemesh` (no [worker]: the coordinator and gateway's image) lists every command;
    those that need torch or safetensors say which extra to install, not an ImportError's traceback."""
    for name in ("torch", "safetensors", "numpy", "triton"):  # (a path where these fail to import)
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ModuleNotFoundError('no {name}', name='{name}')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MOEMESH_HOME": str(tmp_path / "home")}
    for argv in (["generate", "--prompt-ids", "1"], ["make-tiny-model", "--arch", "llama", "--out", str(tmp_path / "m")],
                 ["stage-worker", "--coordinator", "tcp://127.0.0.1:9", "--pp-rank", "0"]):
        r = subprocess.run([sys.executable, "-m", "moemesh", *argv], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"moemesh {argv[0]} needs " in r.stderr and "pip install 'moemesh[worker]'" in r.stderr, r.stderr


# ----------------------------------------------------------------------------------------------
# User errors


@pytest.mark.parametrize("flags,flag", [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-k", "-2"], "--top-k"),
    (["--min-p", "1.5"], "--min-p"),
    (["--block-size", "0"], "--block-size"),
    (["--layer-partition", "1,x"], "--layer-partition"),
    (["--num-scheduler-steps", "0"], "--num-scheduler-steps"),
    (["--num-scheduler-steps", "4", "--pp", "2"], "--num-scheduler-steps"),  # (refused before any process starts)
])
def test_bad_sampling_and_engine_flags_are_named(model, capsys, flags, flag):
    err = user_error(capsys, ["generate", "--model", str(model), *KV, "--prompt-ids", "1,2", *flags])
    assert flag in err


def test_missing_model_directory_is_named(capsys):
    err = user_error(capsys, ["generate", "--model", "/nonexistent/model", "--prompt-ids", "1"])
    assert "--model /nonexistent/model" in err


def test_prompt_ids_outside_the_vocabulary_fail_cleanly(model, capsys):
    err = user_error(capsys, ["generate", "--model", str(model), *KV, "--prompt-ids", "1,99999"])
    assert "99999" in err and "vocabulary" in err


def test_prompt_ids_outside_the_vocabulary_name_the_flag(model, capsys):
    err = user_error(capsys, ["generate", "--model", str(model), *KV, "--prompt-ids", "1,99999"])
    assert "--prompt-ids" in err


def test_empty_prompt_ids_are_named(model, capsys):
    err = user_error(capsys, ["generate", "--model", str(model), *KV, "--prompt-ids", ","])
    assert "--prompt-ids" in err


@pytest.mark.parametrize("content,expect", [
    (None, "no such file"),
    ('{"prompt_ids": [1, 2]}\n{"prompt": "unterminated\n', "line 2: invalid JSON"),
    ('{"prompt_ids": [1, 2]}\n[1, 2, 3]\n', "line 2: expected"),
    ('{"prompt": 5}\n', "line 1: expected"),
    ('{"prompt_ids": [1, "a"]}\n', "line 1: expected"),
    ('{"text": "hi"}\n', "line 1: expected"),
    ('{"prompt_ids": [1, 2], "prompt": "x"}\n', "got prompt, prompt_ids"),  # (one would be dropped)
    ('{"prompt": "a", "max_tokens": 3, "id": 7}\n', "got max_tokens"),  # (a sampling field would be ignored)
    ("\n\n", "no prompts"),
], ids=["missing", "bad-json", "list", "prompt-not-str", "ids-not-ints", "wrong-key", "both", "extra-key", "empty"])
def test_prompts_file_errors_name_the_flag_and_line(model, tmp_path, capsys, content, expect):
    f = tmp_path / "prompts.jsonl"
    if content is not None:
        f.write_text(content)
    err = user_error(capsys, ["generate", "--model", str(model), *KV, "--prompts-file", str(f)])
    assert "--prompts-file" in err and expect in err


def test_prompt_and_prompt_ids_are_mutually_exclusive(model, capsys):
    err = user_error(capsys, ["generate", "--model", str(model), "--prompt", "hi", "--prompt-ids", "1"])
    assert "--prompt-ids" in err and "not allowed" in err


def test_a_request_too_long_for_the_model_fails_cleanly(model, capsys):
    err = user_error(capsys, ["generate", "--model", str(model), *KV, "--prompt-ids", "1,2,3", "--max-tokens", "5000"])
    assert "5000" in err and "2048" in err


@pytest.mark.parametrize("partition", ["1,5", "2,0", "1"])
def test_layer_partition_that_does_not_sum_to_the_layers_is_named(model, capsys, partition):
    err = user_error(capsys, ["generate", "--model", str(model), *KV, "--prompt-ids", "1,2",
                              "--layer-partition", partition])
    assert "--layer-partition" in err and partition in err


def test_checkpoint_without_weights_fails_cleanly(model, tmp_path, capsys):
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        (broken / name).write_bytes((model / name).read_bytes())
    err = user_error(capsys, ["generate", "--model", str(broken), *KV, "--prompt-ids", "1,2"])
    assert str(broken) in err


def test_make_tiny_model_small_vocab_is_named(tmp_path, capsys):
    err = user_error(capsys, ["make-tiny-model", "--arch", "mixtral", "--out", str(tmp_path / "m"), "--vocab", "10"])
    assert "--vocab" in err and "300" in err and "10" in err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("flags", [["--heads", "0"], ["--kv-heads", "0"]], ids=["heads", "kv-heads"])
def test_make_tiny_model_zero_heads_are_named(tmp_path, capsys, flags):
    err = user_error(capsys, ["make-tiny-model", "--arch", "mixtral", "--out", str(tmp_path / "m"), *flags])
    assert flags[0] in err


def test_make_tiny_model_refuses_what_no_loader_takes_and_names_what_it_ignores(tmp_path, capsys):
    """An odd head size (rotary embeddings need an even one) was written and then refused by every
    loader; a moe-intermediate size larger than a size can be was named as "moe_--intermediate"; an
    MoE size given for a dense model is ignored, and it says so."""
    err = user_error(capsys, ["make-tiny-model", "--arch", "mixtral", "--out", str(tmp_path / "m"), "--head-dim", "3"])
    assert "--head-dim" in err and "even" in err and not (tmp_path / "m").exists()
    err = user_error(capsys, ["make-tiny-model", "--arch", "qwen2_moe", "--out", str(tmp_path / "m"),
                              "--moe-intermediate", str(1 << 40)])
    assert "--moe-intermediate must be at most" in err
    assert main(["make-tiny-model", "--arch", "llama", "--out", str(tmp_path / "l"), *SIZES]) == 0
    assert "--experts applies to mixtral, qwen2_moe, qwen3_moe only" in capsys.readouterr().err


def _copy(model: Path, to: Path) -> Path:
    to.mkdir()
    for f in model.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


@pytest.mark.parametrize("file,content,expect", [
    ("config.json", b"[1, 2]", "not a JSON object"),
    ("config.json", b'{"model_type": "mixtral", "num_hidden_layers": "4"}', "num_hidden_layers"),
    ("config.json", b"\xff\xfe{", "not valid JSON"),
    ("generation_config.json", b"{oops", "generation_config.json is not valid JSON"),
    ("tokenizer.json", b"{}", "tokenizer.json"),
    ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": ", "not a safetensors file"),
], ids=["config-array", "config-string-layers", "config-not-utf8", "generation-config", "tokenizer", "weights"])
def test_a_broken_checkpoint_file_is_named_without_a_traceback(model, tmp_path, capsys, file, content, expect):
    broken = _copy(model, tmp_path / "broken")
    if file == "config.json" and b"model_type" in content:  # the real config with one field of the wrong type
        raw = json.loads((model / "config.json").read_text())
        content = json.dumps({**raw, "num_hidden_layers": "4"}).encode()
    (broken / file).write_bytes(content)
    err = user_error(capsys, ["generate", "--model", str(broken), *KV, "--prompt", "hi"])
    assert expect in err


def test_bad_prompts_and_paths_are_named(model, tmp_path, capsys):
    err = user_error(capsys, ["generate", "--model", str(model), *KV, "--prompt", "a\udcffb"])  # argv not UTF-8
    assert "--prompt" in err and "UTF-8" in err
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "x"}\n\xff\n')
    assert "not UTF-8" in user_error(capsys, ["generate", "--model", str(model), *KV, "--prompts-file",
                                              str(tmp_path / "p.jsonl")])
    (tmp_path / "b.jsonl").write_text('{"prompt_ids": [1, true]}\n')
    assert "line 1" in user_error(capsys, ["generate", "--model", str(model), *KV, "--prompts-file",
                                           str(tmp_path / "b.jsonl")])
    for argv in (["make-tiny-model", "--arch", "mixtral", "--out", ""], ["keys", "--out", ""]):
        assert "--out" in user_error(capsys, argv)
    assert "--out /proc/nope/keys" in user_error(capsys, ["keys", "--out", "/proc/nope/keys"])
    err = user_error(capsys, ["quantize", "--model", str(model), "--out", str(model)])
    assert "--out" in err and "--model" in err
    # a parent of --out that cannot be made is --out's fault, not the checkpoint's
    assert "--out /proc/nope/q:" in user_error(capsys, ["quantize", "--model", str(model), "--out", "/proc/nope/q"])
    assert not (tmp_path / "q").exists()
    err = user_error(capsys, ["quantize", "--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "q")])
    assert "config.json" in err and not (tmp_path / "q").exists()


@pytest.mark.parametrize("argv,flag", [
    (["coordinator", "--port", "99999"], "--port"),
    (["stage-worker", "--coordinator", "tcp://127.0.0.1:1", "--pp-rank", "-1"], "--pp-rank"),
    (["stage-worker", "--coordinator", "tcp://127.0.0.1:1", "--pp-rank", "0", "--device", "banana"], "--device"),
    (["coordinator", "--worker-timeout", "-1"], "--worker-timeout"),
    (["bench", "serve", "--url", "http://127.0.0.1:1", "--concurrency", "0"], "--concurrency"),
    (["bench", "throughput", "--model", "m", "--pp", ","], "--pp"),
])
def test_out_of_range_numbers_are_refused_when_parsed(capsys, argv, flag):
    assert flag in user_error(capsys, argv)


def test_a_bad_environment_variable_stops_only_the_command_that_uses_it(model, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MOEMESH_PP", "x")
    monkeypatch.setenv("MOEMESH_DTYPE", "banana")
    assert main(["keys", "--out", str(tmp_path / "keys")]) == 0  # (no --pp, no --dtype)
    err = user_error(capsys, ["coordinator", "--model", str(model)])
    assert "MOEMESH_PP='x'" in err or "MOEMESH_DTYPE='banana'" in err
    monkeypatch.delenv("MOEMESH_PP")
    assert "MOEMESH_DTYPE='banana'" in user_error(capsys, ["coordinator", "--model", str(model)])
    monkeypatch.delenv("MOEMESH_DTYPE")
    monkeypatch.setenv("MOEMESH_INSECURE_MESH", "banana")
    assert main(["keys", "--out", str(tmp_path / "keys2")]) == 0
    assert "MOEMESH_INSECURE_MESH='banana'" in user_error(capsys, ["coordinator", "--model", str(model)])
    monkeypatch.setenv("MOEMESH_INSECURE_MESH", "off")
    from moemesh.settings import CoordinatorSettings

    assert CoordinatorSettings.from_argv([], environ={"MOEMESH_INSECURE_MESH": "off"}).insecure_mesh is False
    assert CoordinatorSettings.from_argv([], environ={"MOEMESH_INSECURE_MESH": "yes"}).insecure_mesh is True


def test_make_tiny_model_into_an_old_checkpoint_leaves_none_of_its_shards(tmp_path, capsys):
    out = tmp_path / "m"
    make_model(out, "mixtral", "--seed", "1", "--max-shard-bytes", "200000")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    make_model(out, "mixtral", "--seed", "2")
    assert sorted(p.name for p in out.glob("model*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("argv,expect", [
    (["bench", "throughput", "--pp", "9"], "--pp 9"),
    (["bench", "recovery", "--pp", "9"], "--pp 9"),
    (["bench", "model", "--prompt-len", "5000", "--batch", "1", "--no-transformers"], "--prompt-len 5000"),
    (["bench", "fp8", "--prompt-len", "5000"], "--prompt-len 5000"),
    (["bench", "throughput", "--prompt-len", "5000"], "--prompt-len 5000"),
    (["stage-worker", "--standalone", "--layers", "0:1", "--replay", "/nonexistent"], "--replay /nonexistent"),
    (["bench", "recovery", "--new", "1"], "--new 1"),
    (["bench", "throughput", "--pp", "2", "--kv-memory", "1", "--new", "16",
      "--prompt-len", "8", "--concurrency", "2"], "the in-process baseline"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--vocab", "3"], "--vocab 3"),
    (["bench", "throughput", "--netns", "--timeline", "/tmp/x"], "--timeline"),
    (["bench", "throughput", "--timeline", "/proc/nope"], "--timeline /proc/nope"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--plot", "/proc/nope/x.png"], "--plot /proc/nope/x.png"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--plot", "/tmp/curve.txt"], "cannot write .txt files"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--plot", "/tmp"], "--plot /tmp: is a directory"),
], ids=["throughput-pp", "recovery-pp", "model-prompt-len", "fp8-prompt-len", "throughput-prompt-len", "replay",
        "recovery-new", "throughput-baseline", "serve-vocab", "throughput-timeline-netns", "throughput-timeline-dir",
        "serve-plot-file", "serve-plot-format", "serve-plot-dir"])
def test_benchmarks_refuse_what_cannot_run_before_any_work(model, capsys, argv, expect):
    assert expect in user_error(capsys, [*argv, "--model", str(model)], no_output=True)


def test_train_demo_refuses_a_missing_stdlib_and_an_unwritable_out(tmp_path, capsys):
    assert "--stdlib" in user_error(capsys, ["train-demo", "--out", str(tmp_path / "d"), "--stdlib", str(tmp_path)])
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    assert "--out /proc/nope" in user_error(capsys, ["train-demo", "--out", "/proc/nope/d", "--stdlib",
                                                     str(tmp_path / "src")])


def test_log_level_goes_before_or_after_the_command():
    from moemesh.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "info"]).log_level == "info"
    assert parser.parse_args(["--log-level", "debug", "serve"]).log_level == "debug"
    assert parser.parse_args(["bench", "serve", "--url", "http://x", "--log-level", "error"]).log_level == "error"
    assert parser.parse_args(["generate", "--prompt-ids", "1"]).log_level == os.environ.get("MOEMESH_LOG_LEVEL",
                                                                                            "warning")


def test_a_taken_port_a_bad_coordinator_address_and_a_missing_gpu_are_one_line_each(model, capsys):
    import torch

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for argv in (["coordinator", "--model", str(model), "--port", port, "--client-port", "0"],
                     ["stage-worker", "--coordinator", "tcp://127.0.0.1:9", "--pp-rank", "0", "--port", port]):
            r = subprocess.run([sys.executable, "-m", "moemesh", *argv], capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
            assert f"cannot listen on tcp://127.0.0.1:{port} (--host/--port): Address already in use" in r.stderr, \
                r.stderr
    for bad in ("foo", "tcp://127.0.0.1:99999", "tcp://:5", "tcp://[::1:5555", "tcp://a b:5"):
        assert "--coordinator" in user_error(capsys, ["stage-worker", "--coordinator", bad, "--pp-rank", "0"])
        assert "--coordinator" in user_error(capsys, ["gateway", "--coordinator", bad])
    if not torch.cuda.is_available():
        assert "--device cuda" in user_error(capsys, ["generate", "--model", str(model), "--device", "cuda",
                                                      "--prompt-ids", "1,2"])
        assert "--device cuda:0" in user_error(capsys, ["generate", "--model", str(model), "--device", "cuda:0",
                                                        "--pp", "2", "--prompt-ids", "1,2"])


def test_a_broken_checkpoint_is_named_before_a_mesh_starts_its_workers(model, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:4096])  # (a download cut short)
    err = user_error(capsys, ["generate", "--model", str(broken), "--pp", "2", "--prompt-ids", "1,2"])
    assert f"{weights} is not a" in err and "safetensors file" in err and err.count("\n") == 1


def test_more_flags_named_in_their_errors(model, tmp_path, capsys):
    """--max-model-len beyond the model's positions (vLLM refuses it too), a rope_theta that would make
    every logit nan, eval-demo's --rows / --pp / --model, a --record path that is a file."""
    err = user_error(capsys, ["generate", "--model", str(model), "--max-model-len", "99999", "--prompt-ids", "1"])
    assert "--max-model-len 99999 is more than the model's" in err
    assert "--rope-theta" in user_error(capsys, ["make-tiny-model", "--arch", "mixtral", "--out", str(tmp_path / "r"),
                                                 "--rope-theta", "nan"])
    assert "--mlp-only-layers" in user_error(capsys, ["make-tiny-model", "--arch", "mixtral", "--out",
                                                      str(tmp_path / "r"), "--mlp-only-layers", "1"])
    bad_theta = tmp_path / "theta"
    make_model(bad_theta)
    config = json.loads((bad_theta / "config.json").read_text())
    (bad_theta / "config.json").write_text(json.dumps({**config, "rope_theta": -1}))
    assert "rope_theta=-1" in user_error(capsys, ["generate", "--model", str(bad_theta), "--prompt-ids", "1"])
    for flags, named in ((["--rows", "float32,bogus"], "--rows"), (["--pp", "a"], "--pp"),
                         (["--model", str(tmp_path / "none")], "--model")):
        assert named in user_error(capsys, ["eval-demo", *flags])
    assert "--model" in user_error(capsys, ["quantize", "--model", str(tmp_path / "none"),
                                            "--out", str(tmp_path / "q")])


def test_bench_model_runs_the_triton_kernels_in_the_interpreter_on_cpu(model):
    """`bench model` takes a list of backends: triton among them turns the interpreter on, as for
    `generate` (it ended in a traceback)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "moemesh", "bench", "model", "--model", str(model), "--batch", "1",
                        "--new", "2", "--no-transformers", "--moe-backend", "triton", "--json"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert any(row.get("backend") == "triton" and row["tok_per_s"] > 0 for row in rows), r.stdout


@pytest.mark.parametrize("override,expect", [
    ({"num_attention_heads": 0}, "num_attention_heads is 0"),
    ({"eos_token_id": "abc"}, "eos_token_id"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps"),
    ({"intermediate_size": -4}, "intermediate_size is -4"),
    ({"model_type": ["mixtral"]}, "unsupported architecture"),
    ({"model_type": "gpt9", "architectures": 5}, "unsupported architecture"),
    ({"hidden_size": "x"}, "hidden_size is 'x'"),
    ({"num_local_experts": -4}, "num_local_experts is -4"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings is 'false', not true or false"),
    ({"rope_scaling": 5}, "rope_scaling is 5, not an object"),
    ({"max_position_embeddings": None, "rope_scaling": {"rope_type": "linear", "factor": "x"}},
     "rope_scaling.factor is 'x'"),
    ({"sliding_window": "x"}, "sliding_window is 'x'"),
    ({"vocab_size": 2**40}, "vocab_size is 1099511627776, more than"),
    ({"num_hidden_layers": 10**12}, "num_hidden_layers is 1000000000000, more than"),
    ({"num_hidden_layers": 6}, "num_hidden_layers is 6, but the checkpoint"),
    ({"vocab_size": 2**31 - 1}, "GiB of weights as config.json sizes them (vocab_size 2147483647"),
], ids=["zero-heads", "eos-string", "eps-string", "negative-intermediate", "model-type-list", "architectures-int",
        "hidden-string", "negative-experts", "bool-string", "rope-scaling-int", "rope-factor-string",
        "sliding-string", "vocab-past-int32", "layers-huge", "layers-past-checkpoint", "weights-past-memory"])
def test_a_config_field_out_of_range_is_named_without_a_traceback(model, tmp_path, capsys, override, expect):
    broken = _copy(model, tmp_path / "broken")
    raw = json.loads((model / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**raw, **override}))
    err = user_error(capsys, ["generate", "--model", str(broken), *KV, "--prompt", "hi"])
    assert expect in err and str(broken) in err


def test_sizes_no_host_can_run_are_named_before_any_work(model, tmp_path, capsys):
    """Threads OpenMP cannot start, integers past a C long, an empty partition, a KV cache larger than the
    host, a truncated weights file, a synthetic standalone step that cannot run, a gateway port that is
    taken: each an error naming its flag (or file), not a crash, a traceback or a wait."""
    ids = ["--prompt-ids", "1,2", "--max-tokens", "1"]
    assert "--threads" in user_error(capsys, ["generate", "--model", str(model), *KV, *ids, "--threads", "100000"])
    assert "--max-batched-tokens" in user_error(capsys, ["coordinator", "--model", str(model),
                                                         "--max-batched-tokens", str(10 ** 20)])
    assert "--layer-partition" in user_error(capsys, ["generate", "--model", str(model), *KV, *ids,
                                                      "--layer-partition="])
    from moemesh.settings import host_memory

    err = user_error(capsys, ["generate", "--model", str(model), *ids, "--kv-memory", str(2 * host_memory())])
    assert "--kv-memory" in err and "GiB" in err
    truncated = _copy(model, tmp_path / "truncated")
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    err = user_error(capsys, ["generate", "--model", str(truncated), *KV, *ids])
    assert "model.safetensors" in err and "safetensors file" in err
    standalone = ["stage-worker", "--standalone", "--model", str(model), "--layers", "0:1"]
    assert "--seqs 4" in user_error(capsys, [*standalone, "--tokens", "1", "--seqs", "4"])
    assert "positions" in user_error(capsys, [*standalone, "--tokens", "100000", "--seqs", "1"])
    assert "KV blocks" in user_error(capsys, [*standalone, "--tokens", "70000", "--seqs", "700"])
    err = user_error(capsys, ["bench", "model", "--model", str(model), "--batch", str(10 ** 8), "--no-transformers"])
    assert "--batch 100000000" in err and "GiB" in err
    err = user_error(capsys, ["make-tiny-model", "--arch", "mixtral", "--hidden", "1000000", "--out",
                              str(tmp_path / "huge")])
    assert "more than this host's" in err and "--hidden" in err and not (tmp_path / "huge").exists()
    assert "--hidden must be at most" in user_error(capsys, ["make-tiny-model", "--arch", "mixtral", "--hidden",
                                                             str(2 ** 40), "--out", str(tmp_path / "huge")])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        err = user_error(capsys, ["gateway", "--coordinator", "tcp://127.0.0.1:9", "--port", port])
        assert f"--port {port}" in err and "in use" in err


def test_a_prompts_file_is_json_lines_whatever_its_strings_hold(model, tmp_path, capsys):
    """Lines end at newlines only (U+2028 inside a JSON string is text, not a line break), a byte-order
    mark is skipped, and a token id no model could have is named with its line."""
    (tmp_path / "p.jsonl").write_bytes('\ufeff{"prompt": "a\u2028b"}\n{"prompt_ids": [5, 6]}\n'.encode())
    rows = generate(capsys, model, "--prompts-file", str(tmp_path / "p.jsonl"), "--max-tokens", "2")
    assert len(rows) == 2 and rows[1]["prompt_ids"] == [5, 6]
    (tmp_path / "big.jsonl").write_text('{"prompt_ids": [5, 99999999999999999999999]}\n')
    err = user_error(capsys, ["generate", "--model", str(model), *KV, "--prompts-file", str(tmp_path / "big.jsonl")])
    assert "line 1" in err and "2^31" in err


def test_an_api_key_is_stripped_and_an_empty_one_is_none_said_aloud(caplog):
    """A key given with spaces round it is taken stripped, as the key file's lines and the request's
    header are (else no request could match it); an empty one is no key (the compose files pass
    MOEMESH_API_KEY empty where none is set), and the gateway warns that /v1/ is open."""
    import logging

    from gateway.server import Gateway, key_matches, load_api_keys
    from moemesh.settings import GatewaySettings

    assert key_matches("Bearer secret", load_api_keys(" secret ", None))
    assert load_api_keys("", None) == load_api_keys("  ", None) == []
    import moemesh

    with caplog.at_level(logging.WARNING):
        gateway = Gateway(GatewaySettings(model=str(Path(moemesh.__file__).parent / "demo_model"), api_key=" "))
    assert gateway.api_keys == [] and "served without an API key" in caplog.text
    # no key at all: said where the gateway listens beyond this host, not on loopback
    for host, warned in (("127.0.0.1", False), ("::1,127.0.0.1", False), ("0.0.0.0", True), ("", True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            Gateway(GatewaySettings(model=str(Path(moemesh.__file__).parent / "demo_model"), host=host))
        assert ("without an API key" in caplog.text) == warned, host


def test_a_bad_context_length_and_an_empty_layer_range_are_named(tmp_path, capsys):
    """config.json's max_position_embeddings 0 is named as such (not as rope scaling's derived length);
    a standalone worker's --layers that hold no layer say so (not "outside the model")."""
    import shutil

    import moemesh

    demo = Path(moemesh.__file__).parent / "demo_model"
    bad = tmp_path / "m"
    shutil.copytree(demo, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 0}))
    err = user_error(capsys, ["generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "2"], no_output=True)
    assert "max_position_embeddings is 0" in err
    err = user_error(capsys, ["stage-worker", "--standalone", "--model", str(demo), "--layers", "2:1"], no_output=True)
    assert "--layers 2:1 holds no layer" in err


def test_an_error_about_a_flag_set_by_its_variable_names_the_variable(model, capsys, monkeypatch):
    """The user never typed --layer-partition: the error says it came from MOEMESH_LAYER_PARTITION;
    given on the command line, it does not."""
    monkeypatch.setenv("MOEMESH_LAYER_PARTITION", "1,1")
    err = user_error(capsys, ["serve", "--model", str(model), "--pp", "1"], no_output=True)
    assert "(--layer-partition from MOEMESH_LAYER_PARTITION='1,1')" in err
    err = user_error(capsys, ["serve", "--model", str(model), "--layer-partition", "1,1", "--pp", "1"], no_output=True)
    assert "--layer-partition" in err and "MOEMESH_" not in err


def test_every_commands_help_prints(capsys):
    """`--help` of every command and bench mode prints (argparse formats help with %: a bare one is a
    traceback, as `serve --help` once was)."""
    import argparse

    from moemesh.entrypoints.cli import build_parser

    def commands(parser, path):
        yield path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from commands(sub, [*path, name])

    paths = list(commands(build_parser(), []))
    assert ["serve"] in paths and ["bench", "throughput"] in paths
    for path in paths:
        with pytest.raises(SystemExit) as e:
            main([*path, "--help"])
        assert e.value.code == 0, path
        assert "usage:" in capsys.readouterr().out, path


def test_launcher_addresses_keys_and_the_gateways_model_are_refused_before_any_process(model, tmp_path, capsys):
    """Refused at once, naming the flag (each once waited or crashed after processes had started): a
    --ray-address that is malformed, answers nothing (ray.init waited for ever, deaf to SIGTERM) or is
    given without --launcher ray; --mesh-keys naming a file; the gateway's --model without a tokenizer
    (found only once the pipeline served); config.json's decoder_sparse_step and mlp_only_layers of
    the wrong type (a TypeError deep in the layout)."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    serve = ["serve", "--model", str(model), *KV, "--port", "0"]
    assert "not host:port" in user_error(capsys, [*serve, "--launcher", "ray", "--ray-address", "garbage"])
    assert f"--ray-address 127.0.0.1:{free}: no Ray cluster answers" in user_error(
        capsys, [*serve, "--launcher", "ray", "--ray-address", f"127.0.0.1:{free}"])
    assert "--ray-address is for --launcher ray" in user_error(capsys, [*serve, "--ray-address", "auto"])
    (tmp_path / "afile").write_text("")
    assert f"--mesh-keys {tmp_path / 'afile'}: not a directory" in user_error(
        capsys, [*serve, "--mesh-keys", str(tmp_path / "afile")])
    assert f"--model {tmp_path}: no tokenizer.json" in user_error(
        capsys, ["gateway", "--coordinator", "tcp://127.0.0.1:9", "--model", str(tmp_path), "--port", "0"])
    for field, value in (("decoder_sparse_step", "2"), ("decoder_sparse_step", -1), ("mlp_only_layers", "0")):
        bad = tmp_path / f"{field}-{value}"
        make_model(bad, "qwen2_moe")
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, field: value}))
        assert field in user_error(capsys, ["generate", "--model", str(bad), *KV, "--prompt-ids", "1,2,3"])
