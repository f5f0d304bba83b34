"""The benchmark commands run and print comparable rows (speed itself is not asserted): `bench
model` (roofline fraction, backend ratios), `bench throughput` (layers per stage, the
coordinator's cost per step)."""

import json

import pytest

from moemesh.entrypoints.bench.model import step_cost
from moemesh.entrypoints.cli import main
from moemesh.config import ModelConfig
from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
from moemesh_kernels.cpu_gemm import native


def test_bench_model_json_rows(tmp_path, capsys):
    model = write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=2, hidden_size=64, intermediate_size=64,
                                           num_experts=4, vocab_size=384), tmp_path / "m")
    assert main(["bench", "model", "--model", str(model), "--batch", "1,3", "--new", "4", "--prompt-len", "5",
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ours = [r for r in rows if r["impl"] == "moemesh"]
    theirs = [r for r in rows if r["impl"] == "transformers"]
    assert [r["batch"] for r in ours] == [1, 3] and [r["batch"] for r in theirs] == [1, 3]
    assert all(r["tok_per_s"] > 0 and 0 < r["fraction_of_roofline"] for r in ours)
    assert all(r["moemesh_speedup"] > 0 for r in theirs)
    machine = rows[-1]
    assert machine["impl"] == "machine" and machine["matmul_gflops"] > 0 and machine["copy_gb_per_s"] > 0


def test_roofline_counts_experts_hit_and_kv_reads(tmp_path):
    model = write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=1, hidden_size=64, intermediate_size=32,
                                           num_heads=4, num_kv_heads=2, num_experts=4, top_k=1, vocab_size=384),
                             tmp_path / "m")
    mc = ModelConfig.from_dir(model)
    b1, f1 = step_cost(mc, 1, [10], 4)
    expert = 3 * 64 * 32
    attn = 64 * (64 + 2 * 32) + 64 * 64
    kv = (10 + 1) * 2 * 32
    assert b1 == 4 * (attn + 4 * 64 + 1 * expert + 384 * 64 + kv)  # one token picks one expert
    assert f1 == 2 * (attn + 4 * 64 + expert + 384 * 64) + 4 * 10 * 64
    b_many, _ = step_cost(mc, 1000, [0] * 1000, 4)
    assert abs(b_many / 4 - (attn + 4 * 64 + 4 * expert + 384 * 64 + 1000 * 2 * 32)) < 1  # all experts read once
    b_int8, _ = step_cost(mc, 1, [10], 1, 4)  # int8 weights (1 byte), float32 KV cache (4)
    assert b_int8 == (attn + 4 * 64 + 1 * expert + 384 * 64) + 4 * kv
    # greedy rows through the screened head: its bfloat16 copy read, its products at twice the rate
    for product in ("native", "onednn"):
        b_s, f_s = step_cost(mc, 1, [10], 4, screened=product)
        assert b_s == b1 - 2 * 384 * 64 and f_s == f1 - 384 * 64
    b_i, f_i = step_cost(mc, 1, [10], 2, screened="int8")  # a bfloat16 head's int8 copy: 1 byte a weight
    assert b_i == step_cost(mc, 1, [10], 2)[0] - 384 * 64 and f_i == f1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-tiny")
    assert main(["make-tiny-model", "--arch", "mixtral", "--out", str(path), "--layers", "4", "--hidden", "64",
                 "--intermediate", "96", "--experts", "4"]) == 0
    return path


def json_rows(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


@pytest.mark.skipif(native() is None, reason="no C compiler: the native kernels cannot be built here")
def test_bench_model_compares_backends_and_reports_the_roofline(tiny, capsys):
    capsys.readouterr()
    assert main(["bench", "model", "--model", str(tiny), "--batch", "1,4", "--new", "4", "--prompt-len", "4",
                 "--moe-backend", "native,torch", "--quantization", "int8", "--no-transformers", "--json"]) == 0
    out = json_rows(capsys)
    ours = [r for r in out if r["impl"] == "moemesh"]
    assert [(r["backend"], r["batch"]) for r in ours] == [("native", 1), ("native", 4), ("torch", 1), ("torch", 4)]
    assert all(r["quantization"] == "int8" and r["tok_per_s"] > 0 and r["fraction_of_roofline"] > 0 for r in ours)
    ratios = [r for r in out if r["impl"] == "ratio"]
    assert [r["batch"] for r in ratios] == [1, 4] and all(r["native_over_torch"] > 0 for r in ratios)
    machine = next(r for r in out if r["impl"] == "machine")
    assert machine["read_gb_per_s"] > 0 and machine["matmul_gflops"] > 0


def test_bench_throughput_prints_layers_and_the_coordinators_cost(tiny, capsys, tmp_path):
    """... and with --timeline, writes each layout's steps as a trace file and splits each stage's idle
    time by what it waited for."""
    capsys.readouterr()
    assert main(["bench", "throughput", "--model", str(tiny), "--pp", "1,2", "--concurrency", "4", "--prompt-len", "4",
                 "--new", "3", "--layer-partition", "auto:4:3", "--partition-costs", "weights", "--no-baseline",
                 "--json",
                 "--timeline", str(tmp_path / "tl")]) == 0
    out = json_rows(capsys)
    from moemesh.layout import balanced_partition

    want = list(balanced_partition(ModelConfig.from_dir(tiny), 2, 3 / 7))
    assert [(r["pp"], r["layers"]) for r in out] == [(1, [4]), (2, want)]
    for r in out:
        assert r["tok_per_s"] > 0 and r["steps"] > 0
        assert r["coordinator_ms_per_step"] > 0 and r["schedule_bytes_per_step"] > 0
        assert len(r["stage_busy_fraction"]) == r["pp"]
        assert len(r["stage_idle_before_prompt_steps_s"]) == len(r["stage_idle_before_decode_steps_s"]) == r["pp"]
        events = json.loads(open(r["timeline"]).read())["traceEvents"]
        for stage in range(r["pp"] + 1):  # every stage and the coordinator ran every step
            assert len([e for e in events if e["ph"] == "X" and e["tid"] == stage]) >= r["steps"]
    # (the first prompt steps, 4 tokens each, and decodes of one token per sequence)
    assert {e["cat"] for e in events if e["ph"] == "X"} == {"prompt", "decode"}


def test_bench_throughput_runs_a_layout_with_and_without_the_mlp_handoff(tiny, capsys):
    capsys.readouterr()
    assert main(["bench", "throughput", "--model", str(tiny), "--pp", "1,2", "--concurrency", "4", "--prompt-len", "6",
                 "--new", "3", "--layer-partition", "3,1", "--no-baseline", "--mlp-handoff", "off,on", "--json"]) == 0
    out = json_rows(capsys)
    assert [(r["pp"], r["mlp_handoff"]) for r in out] == [(1, None), (2, "off"), (2, "on")]
    assert out[1]["mlp_handoff_steps"] == 0 < out[2]["mlp_handoff_steps"] < out[2]["steps"]
    assert out[2]["mlp_handoff_on_vs_off"] == pytest.approx(out[2]["tok_per_s"] / out[1]["tok_per_s"], abs=0.002)


def test_bench_throughput_rounds_print_every_round_then_the_medians(tiny, capsys):
    """--rounds 2: both layouts twice, each row tagged with its round, then one median row per row of
    a round, whose ratio is the median of the rounds' own ratios."""
    capsys.readouterr()
    assert main(["bench", "throughput", "--model", str(tiny), "--pp", "1,2", "--concurrency", "3", "--prompt-len", "4",
                 "--new", "2", "--no-baseline", "--rounds", "2", "--json"]) == 0
    out = json_rows(capsys)
    assert [(r["impl"], r.get("round"), r["pp"]) for r in out] == [
        ("mesh", 1, 1), ("mesh", 1, 2), ("mesh", 2, 1), ("mesh", 2, 2),
        ("median-mesh", None, 1), ("median-mesh", None, 2)]
    two = [r for r in out if r["impl"] == "mesh" and r["pp"] == 2]
    med = out[-1]
    assert med["rounds"] == 2 and len(med["stage_busy_fraction"]) == 2
    assert med["tok_per_s"] == pytest.approx((two[0]["tok_per_s"] + two[1]["tok_per_s"]) / 2, abs=0.01)
    assert med["vs_pp1_tp1"] == pytest.approx((two[0]["vs_pp1_tp1"] + two[1]["vs_pp1_tp1"]) / 2, abs=1e-3)


def test_medians_take_each_rounds_ratio_not_the_ratio_of_medians():
    from moemesh.entrypoints.bench.throughput import medians

    def round_(single, double, busy):
        return [{"impl": "mesh", "pp": 1, "tp": 1, "tok_per_s": single},
                {"impl": "mesh", "pp": 2, "tp": 1, "tok_per_s": double, "vs_pp1_tp1": round(double / single, 2),
                 "stage_busy_fraction": busy}]

    rows = medians([round_(100, 150, [0.8, 0.9]), round_(200, 360, [0.9, 0.7]), round_(120, 240, [0.7, 0.8])])
    assert [r["impl"] for r in rows] == ["median-mesh", "median-mesh"]
    assert rows[0]["tok_per_s"] == 120 and rows[1]["tok_per_s"] == 240
    # the rounds' ratios are 1.5, 1.8 and 2.0: their median 1.8, where the medians' ratio is 2.0
    assert rows[1]["vs_pp1_tp1"] == 1.8
    assert rows[1]["stage_busy_fraction"] == [0.8, 0.8] and rows[1]["rounds"] == 3
    # rounds whose rows differ are never paired
    with pytest.raises(ValueError, match="different rows"):
        medians([round_(100, 150, [0.8, 0.9]), list(reversed(round_(200, 360, [0.9, 0.7])))])
    with pytest.raises(ValueError):
        medians([round_(100, 150, [0.8, 0.9]), round_(200, 360, [0.9, 0.7])[:1]])


def test_bench_throughput_ceiling_runs_independent_engines_beside_the_layouts(tiny, capsys):
    """--ceiling: two engines in their own processes share the prompts and generate every token
    between them; the pp=2 layout is read against them."""
    capsys.readouterr()
    assert main(["bench", "throughput", "--model", str(tiny), "--pp", "1,2", "--concurrency", "5", "--prompt-len", "4",
                 "--new", "3", "--ceiling", "--json"]) == 0
    out = json_rows(capsys)
    assert [r["impl"] for r in out] == ["in-process", "ceiling", "mesh", "mesh"]
    ceiling = out[1]
    assert ceiling["engines"] == 2 and len(ceiling["engine_seconds"]) == 2
    assert ceiling["seconds"] >= max(ceiling["engine_seconds"])
    # every generated token counted: 5 prompts x 3 tokens, split 3 + 2 between the engines
    assert ceiling["tokens"] == 15
    assert "vs_ceiling" not in out[2] and out[3]["vs_ceiling"] > 0 and ceiling["vs_in_process"] > 0


def test_ceiling_engines_that_fail_are_errors_not_hangs(tiny, tmp_path, monkeypatch):
    """An engine that cannot load, one that fails while generating, one that never loads in time:
    each a RuntimeError naming what it did not do. Lines a library prints on the children's stdout
    (a sitecustomize here) do not confuse the handshake."""
    from moemesh.entrypoints.bench.ceiling import bench_ceiling
    from moemesh.sampling import SamplingParams
    from moemesh.settings import EngineSettings

    (tmp_path / "sitecustomize.py").write_text("print('a library says hello on stdout')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    params = SamplingParams(max_tokens=2)
    r = bench_ceiling(EngineSettings(model=str(tiny)), [[5, 6]] * 3, params, 2)
    assert r["tokens"] == 6 and len(r["engine_seconds"]) == 2
    with pytest.raises(RuntimeError, match="engine 0 ended before it could load"):
        bench_ceiling(EngineSettings(model=str(tmp_path / "missing")), [[5, 6]] * 2, params, 2)
    with pytest.raises(RuntimeError, match="ended before it could report"):
        bench_ceiling(EngineSettings(model=str(tiny)), [[5, 10 ** 9]] * 2, params, 2)  # a token past the vocabulary
    with pytest.raises(RuntimeError, match="did not load in time"):
        bench_ceiling(EngineSettings(model=str(tiny)), [[5, 6]] * 2, params, 2, load_timeout=0.01)



def test_bench_scheduler_schedule_bytes_stay_flat_as_contexts_grow(capsys):
    """A decode step's schedule is the same size at 300 and at 4,000 tokens of context (both
    lengths take 3 bytes in msgpack); whole block tables would have grown ~13x."""
    assert main(["bench", "scheduler", "--seqs", "16", "--context", "300,4000", "--steps", "10", "--json"]) == 0
    short, long = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert short["seqs"] == long["seqs"] == 16 and short["steps"] == long["steps"] == 10
    assert long["schedule_bytes_per_step"] <= short["schedule_bytes_per_step"] * 1.05
    assert long["whole_table_bytes_per_step"] > 3 * short["whole_table_bytes_per_step"]
    assert long["coordinator_ms_per_step"] > 0 and "ms_vs_first" in long
    # sizes past what the process could hold: the flags named before anything is allocated
    with pytest.raises(SystemExit) as e:
        main(["bench", "scheduler", "--seqs", "100000", "--context", "100000", "--steps", "1"])
    assert e.value.code == 2 and "--seqs 100000 --context 100000" in capsys.readouterr().err


def test_bench_throughput_takes_the_quantization_and_measures_the_partition_for_it(tiny, monkeypatch):
    """--quantization reaches every engine and the measured costs `auto` balances (--partition-costs
    measured: for a microbatch of --concurrency shared among the stages)."""
    from moemesh.entrypoints.bench import throughput

    asked = []

    def measured(model_dir, model, **kw):
        asked.append(kw)
        return None  # (the weights' then)

    class Seen(Exception):
        pass

    def in_process(settings, prompts, params):
        raise Seen(settings)

    monkeypatch.setattr("moemesh.step_costs.measured_costs", measured)
    monkeypatch.setattr(throughput, "bench_in_process", in_process)
    with pytest.raises(Seen) as seen:
        main(["bench", "throughput", "--model", str(tiny), "--pp", "1,2", "--concurrency", "6", "--prompt-len", "4",
              "--new", "3", "--layer-partition", "auto:4:3", "--quantization", "int8"])
    assert seen.value.args[0].quantization == "int8"
    assert [(k["quantization"], k["rows"], k["context"], k["prompt_len"]) for k in asked] == [("int8", 3, 5, 4)]
    # the baseline and each ceiling engine run at most --concurrency (its share) sequences at once, as the
    # meshes are driven, whatever --num-prompts
    assert seen.value.args[0].max_seqs == 6
    ceilings = []

    def ceiling(settings, prompts, params, engines):
        ceilings.append((engines, settings.max_seqs))
        raise Seen(settings)

    monkeypatch.setattr(throughput, "bench_in_process", lambda *a: {"tokens": 1, "seconds": 1.0})
    monkeypatch.setattr(throughput, "bench_ceiling", ceiling)
    with pytest.raises(Seen):
        main(["bench", "throughput", "--model", str(tiny), "--pp", "1,2", "--concurrency", "5", "--num-prompts",
              "20", "--prompt-len", "4", "--new", "3", "--ceiling"])
    assert ceilings == [(2, 3)]


def test_bench_speculative_compares_drafts_with_none_on_the_same_prompts(capsys, tmp_path):
    demo = "moemesh/demo_model"
    assert main(["bench", "speculative", "--model", demo, "--batch", "1,2", "--prompt-len", "48", "--new", "12",
                 "--num-speculative-tokens", "2", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["batch"], r["num_speculative_tokens"]) for r in rows] == [(1, 0), (2, 0), (1, 2), (2, 2)]
    assert all(r["tok_per_s"] > 0 and r["vs_baseline"] > 0 for r in rows)
    assert rows[0]["vs_baseline"] == 1.0 and rows[0]["acceptance"] is None
    assert any(r["acceptance"] is not None and r["tokens_per_step"] > 1 for r in rows[2:])  # (source repeats itself)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"words": "no text"}\n')
    with pytest.raises(SystemExit):
        main(["bench", "speculative", "--model", demo, "--prompts", str(bad)])
    assert "line 1: not a JSON object with a \"text\" or a \"prompt\"" in capsys.readouterr().err


def test_bench_recovery_times_the_gap_to_the_rebuilt_pipelines_first_token(tiny, capsys):
    """The last stage is killed mid-stream: no request is lost, and each stream's gap runs to the first
    token the rebuilt pipeline made, not to a token made before the kill and read just after it (that
    read as a gap of 0)."""
    assert main(["bench", "recovery", "--model", str(tiny), "--pp", "2", "--concurrency", "4", "--new", "256",
                 "--prompt-len", "8", "--worker-timeout", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["requests_lost"] == 0 and row["recoveries"] == 1
    assert row["kill_to_next_token_s"]["min"] >= 0.5 * row["serving_again_after_s"] > 0, row


def test_bench_scheduler_divides_what_it_sent_by_the_schedules_that_carried_it():
    """With several steps in flight, the schedules issued but not yet answered at the end carried bytes
    too: per-step figures divide by the schedules issued, so a short run and a long one agree."""
    from moemesh.entrypoints.bench.scheduler import measure

    short, long = measure(8, 32, 5, 16, 4), measure(8, 32, 50, 16, 4)
    per_step = long["schedule_bytes_per_step"]
    assert abs(short["schedule_bytes_per_step"] - per_step) <= 0.1 * per_step


def test_bench_throughput_prices_the_prefix_cache_from_its_rates(tiny, capsys):
    """caching_on_time_speedup is the ratio of the two runs' rates (the same tokens either way), not of
    seconds rounded to 0.01 (which read 0.02 / 0.06 as 0.33 where the rates said 0.36)."""
    assert main(["bench", "throughput", "--model", str(tiny), "--pp", "1", "--concurrency", "4", "--new", "8",
                 "--prompt-len", "8", "--shared-prefix", "32", "--prefix-caching", "on,off", "--no-baseline",
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    on = next(r for r in rows if r.get("prefix_caching") == "on")
    off = next(r for r in rows if r.get("prefix_caching") == "off")
    priced = on.get("caching_on_time_speedup") or off.get("caching_on_time_speedup")
    assert priced == round(on["tok_per_s"] / off["tok_per_s"], 2)
