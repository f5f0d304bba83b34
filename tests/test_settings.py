"""Settings: each flag declared once renders back into the flags, and the environment, that rebuild it."""

from __future__ import annotations

import argparse
import dataclasses
import socket
from dataclasses import dataclass

import pytest

from moemesh.entrypoints.cli import build_parser
from moemesh.entrypoints.launcher import LocalMesh
from moemesh.settings import (CoordinatorSettings, EngineSettings, GatewaySettings, LaunchSettings, LogSettings,
                              StageSettings, StandaloneSettings, WorkerResources, WorkerSettings, flag)

ODD = {  # a value unlike the default for every flag
    "model": "/m", "dtype": "bfloat16", "quantization": "int8", "moe_backend": "torch", "pp": 3, "tp": 2,
    "layer_partition": (1, 2, 5), "partition_costs": "weights", "expert_parallel": True, "no_mlp_handoff": True, "block_size": 8, "max_batched_tokens": 99,
    "max_seqs": 7, "max_in_flight": 4, "num_scheduler_steps": 6, "num_speculative_tokens": 3,
    "ngram_prompt_lookup_max": 6, "ngram_prompt_lookup_min": 3, "speculative_disable_by_batch_size": 12,
    "speculative_sampling": True, "speculative_config": '{"method":"ngram","num_speculative_tokens":2}', "kv_memory": 12345, "threads": 3, "host": "0.0.0.0", "port": 6000,
    "client_port": 6001, "worker_timeout": 2.5, "register_timeout": 9.0, "ready_timeout": 11.0, "recovery_timeout": 7.0,
    "coordinator": "tcp://c:1", "pp_rank": 1, "tp_rank": 1, "advertise_host": "h", "device": "cuda:1",
    "record": "/r", "record_steps": 3, "served_model_name": "n", "api_key": "k", "max_pending": 5, "max_stored_responses": 7,
    "num_kv_blocks": 77, "coordinator_timeout": 4.5, "no_huge_pages": True, "max_model_len": 300, "no_prefix_caching": True, "log_level": "debug", "log_format": "json", "launcher": "ray",
    "mesh_keys": "/keys", "insecure_mesh": True, "max_message_bytes": 4096, "max_activation_bytes": 2048, "api_key_file": "/ak",
    "ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem", "max_waiting": 9, "stream_timeout": 3.5, "keepalive_timeout": 8.5, "drain_timeout": 0.25, "step_timeout": 33.0,
    "ray_address": "ray://x:1", "generation_config": "vllm", "tool_call_parser": "hermes", "reasoning_parser": "qwen3", "standalone": True, "layers": "0:2", "replay": "/p", "tokens": 9, "seqs": 2,
}


@pytest.mark.parametrize("cls", [EngineSettings, CoordinatorSettings, WorkerSettings, StageSettings, GatewaySettings,
                                 LogSettings, LaunchSettings, StandaloneSettings])
def test_argv_and_environment_rebuild_the_settings(cls):
    s = cls(**{f.name: ODD[f.name] for f in cls.flags()})
    assert cls.from_argv(s.to_argv()) == s
    assert cls.from_argv([], environ=s.to_env()) == s


def test_a_command_line_flag_beats_the_environment_and_a_bad_variable_names_both(capsys):
    assert WorkerSettings.from_argv(["--tp-rank", "0"], environ={"MOEMESH_TP_RANK": "1"}).tp_rank == 0
    # a boolean a variable set is turned off by --flag=false (a bare --flag is true, as ever)
    on = {"MOEMESH_INSECURE_MESH": "1"}
    assert WorkerSettings.from_argv([], environ=on).insecure_mesh
    assert not WorkerSettings.from_argv(["--insecure-mesh=false"], environ=on).insecure_mesh
    assert WorkerSettings.from_argv(["--insecure-mesh"], environ={}).insecure_mesh
    with pytest.raises(SystemExit):
        WorkerSettings.from_argv([], environ={"MOEMESH_TP_RANK": "one"})
    err = capsys.readouterr().err
    assert "MOEMESH_TP_RANK='one'" in err and "--tp-rank" in err


def test_a_field_added_once_reaches_the_flags_the_environment_and_the_children():
    @dataclass(frozen=True)
    class Resources(WorkerResources):
        pin_memory: bool = flag(False, "page-lock the KV cache")

    @dataclass(frozen=True)
    class Worker(Resources, WorkerSettings):
        pass

    @dataclass(frozen=True)
    class Engine(Resources, EngineSettings):
        pass

    parser = argparse.ArgumentParser()
    Engine.add_arguments(parser, environ={})
    engine = Engine.from_args(parser.parse_args(["--pin-memory", "--pp", "2"]))
    child = Worker.derive(engine, coordinator="tcp://c:1", pp_rank=1)
    assert "--pin-memory" in child.to_argv() and Worker.from_argv(child.to_argv()).pin_memory
    assert Worker.from_argv([], environ={"MOEMESH_PIN_MEMORY": "1"}).pin_memory


def test_the_local_launcher_starts_children_with_what_their_commands_parse_back(tmp_path):
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

    model = str(write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=8), tmp_path / "m"))
    engine = EngineSettings(model=model, pp=2, tp=2, layer_partition=(3, 5), kv_memory=1 << 20, quantization="int8",
                            max_in_flight=3, threads=2)
    mesh = LocalMesh.of(engine, worker_timeout=2.0, record="/rec")
    parser = build_parser()
    coord = CoordinatorSettings.from_args(parser.parse_args(["coordinator", *mesh.coordinator.to_argv()]))
    assert coord == dataclasses.replace(CoordinatorSettings.derive(engine), port=0, client_port=0, worker_timeout=2.0,
                                        drain_timeout=0.05)  # (a launcher's coordinator: `serve`'s gateway drains)
    w = mesh.worker_settings("tcp://c:1", 1, 0)
    worker = WorkerSettings.from_args(parser.parse_args(["stage-worker", *w.to_argv()]))
    assert worker == w and (worker.record, worker.kv_memory, worker.threads) == ("/rec/pp1-tp0", 1 << 20, 2)
    with pytest.raises(TypeError, match="no_such"):
        LocalMesh.of(engine, no_such=1)


def test_a_worker_on_a_wildcard_host_advertises_an_address_the_other_stages_can_reach():
    """--host 0.0.0.0 without --advertise-host: not tcp://0.0.0.0 (each stage would connect to its own
    machine) but this host's address on the route to the coordinator; a given host is kept."""
    from stage_worker.worker import advertised_host

    assert advertised_host("0.0.0.0", "tcp://127.0.0.1:5555") == "127.0.0.1"
    assert advertised_host("10.1.2.3", "tcp://127.0.0.1:5555") == "10.1.2.3"
    assert advertised_host("::", "tcp://[::1]:5555") == "[::1]"
    # (an IPv4 wildcard listens on IPv4 only: never an IPv6 address, whatever the coordinator's)
    assert advertised_host("0.0.0.0", "tcp://[::1]:5555") == advertised_host("*", "tcp://[::1]:5555") == "127.0.0.1"
    assert advertised_host("*", "tcp://nohost.invalid:5555") == "127.0.0.1"  # (no route: loopback)
    # a coordinator at one of this host's own non-loopback addresses: that address, the route's source
    own = [a for a in map(_ipv4_of, (name for _, name in socket.if_nameindex())) if a and not a.startswith("127.")]
    if not own:
        pytest.skip("this host has no non-loopback IPv4 address")
    assert advertised_host("0.0.0.0", f"tcp://{own[0]}:5555") == own[0]


def _ipv4_of(interface: str) -> str | None:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR
            answer = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
            return socket.inet_ntoa(answer[20:24])
        except OSError:
            return None


def test_byte_and_seed_flags_take_more_than_the_count_cap():
    """Counts stop at 2^40 (past that ZeroMQ's and torch's C integers overflow before anything names the
    flag); a KV cache in bytes may be larger, and a seed is any 63-bit integer."""
    from moemesh.settings import byte_count, positive_int, seed_int, threads_int

    assert byte_count(str(1 << 41)) == 1 << 41 and seed_int(str((1 << 63) - 1)) == (1 << 63) - 1
    for parse, bad in ((positive_int, 1 << 41), (byte_count, 1 << 61), (seed_int, 1 << 63), (threads_int, 1025)):
        with pytest.raises(ValueError):
            parse(str(bad))


def test_a_positive_number_flag_refuses_infinity_and_nan():
    """--lr inf trained a NaN model, and a timeout of inf waits forever: both are refused, naming the flag."""
    from moemesh.entrypoints.cli import main
    from moemesh.settings import positive_float

    assert positive_float("2e-3") == 2e-3
    for bad in ("inf", "-inf", "nan", "0", "-1"):
        with pytest.raises(ValueError):
            positive_float(bad)
    for argv in (["train-demo", "--out", "x", "--lr", "inf"], ["train-demo", "--out", "x", "--seed", str(1 << 64)]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_values_that_start_with_a_dash_and_padded_or_upper_case_variables_reach_the_children():
    """A path like "-demo" is a value, not a flag, in a child's argv (--model=-demo); a variable a
    compose file quoted with its spaces, or a log level in capitals, reads as meant."""
    from moemesh.settings import GatewaySettings

    s = GatewaySettings(model="-demo", api_key="-abc")
    assert GatewaySettings.from_argv(s.to_argv()) == s
    env = {"MOEMESH_INSECURE_MESH": " 1", "MOEMESH_PORT": " 8100 "}
    parsed = GatewaySettings.from_argv([], environ=env)
    assert (parsed.insecure_mesh, parsed.port) == (True, 8100)
    assert LogSettings.from_argv([], environ={"MOEMESH_LOG_LEVEL": "INFO"}).log_level == "info"
    assert LogSettings.from_argv(["--log-level", "DEBUG"]).log_level == "debug"


def test_library_records_are_one_structured_line_and_a_clients_malformed_request_is_not_logged(capsys):
    """aiohttp's, asyncio's and Python's warnings come out as moemesh's key=value lines, a traceback on
    the same line; the error aiohttp logs for each malformed request a client sends stays out of the
    log below --log-level debug (any client could fill it)."""
    import logging
    import warnings

    from aiohttp.http_exceptions import BadHttpMessage

    from moemesh.log import setup_logging

    logging.captureWarnings(False)  # (an earlier test's command left it on, under another test's warnings)
    setup_logging("warning")
    try:
        server = logging.getLogger("aiohttp.server")
        for exc in (BadHttpMessage("bad framing"), RuntimeError("a handler's bug")):
            try:
                raise exc
            except Exception:
                server.exception("Error handling request")
        warnings.warn("a library warning")
        logging.getLogger("asyncio").info("not at warning")
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 2, lines
        assert lines[0].startswith("ts=") and "logger=aiohttp.server" in lines[0]
        assert "exception=\"RuntimeError: a handler's bug\"" in lines[0] and "traceback='Traceback" in lines[0]
        assert "logger=py.warnings" in lines[1] and "UserWarning: a library warning" in lines[1]
        setup_logging("debug")
        try:
            raise BadHttpMessage("bad framing")
        except Exception:
            server.exception("Error handling request")
        assert "BadHttpMessage" in capsys.readouterr().err
    finally:
        setup_logging("warning")
        logging.captureWarnings(False)


def test_json_log_lines_hold_the_event_its_fields_and_its_traceback(capsys):
    """--log-format json: one JSON object a line, for moemesh's records and the libraries' alike; a
    field cannot replace the event's own keys; a value JSON cannot hold is its str()."""
    import json
    import logging
    from pathlib import Path

    from moemesh.log import current_format, get_logger, setup_logging

    logging.captureWarnings(False)
    setup_logging("info", "json")
    try:
        assert current_format() == "json"
        log = get_logger("test")
        log.info("stage ready", extra={"fields": {"pp": 1, "path": Path("/m"), "msg": "not the message"}})
        try:
            raise RuntimeError("a worker's bug")
        except RuntimeError:
            logging.getLogger("aiohttp.server").exception("Error handling request")
        log.debug("below the level")
        log.warning("odd values", extra={"fields": {"loss": float("nan"), "pairs": {(1, 2): 3}}})
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 3, lines
        def strict(text):  # (no NaN or Infinity: what a strict parser takes)
            return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text}"))
        first, second, third = map(strict, lines)
        assert (third["msg"], third["loss"], third["pairs"]) == ("odd values", "nan", "{(1, 2): 3}")
        assert (first["level"], first["logger"], first["msg"], first["pp"], first["path"]) == \
            ("info", "moemesh.test", "stage ready", 1, "/m")
        assert first["ts"].endswith("Z") and "exception" not in first
        assert second["exception"] == "RuntimeError: a worker's bug"
        assert second["traceback"].startswith("Traceback") and second["logger"] == "aiohttp.server"
        with pytest.raises(ValueError, match="yaml"):
            setup_logging("info", "yaml")
    finally:
        setup_logging("warning")
        logging.captureWarnings(False)
    assert current_format() == "text"


def test_the_log_format_goes_before_or_after_the_command_and_to_the_processes_it_starts(monkeypatch):
    import os

    from moemesh.entrypoints.launcher import child_environment

    parser = build_parser()
    assert parser.parse_args(["serve", "--log-format", "JSON"]).log_format == "json"
    assert parser.parse_args(["--log-format", "json", "serve"]).log_format == "json"
    monkeypatch.setenv("MOEMESH_LOG_FORMAT", "json")
    assert build_parser().parse_args(["serve"]).log_format == "json"
    assert child_environment()["MOEMESH_LOG_FORMAT"] == "json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-format", "xml"])
    assert os.environ["MOEMESH_LOG_FORMAT"] == "json"


def test_a_token_budget_whose_messages_a_worker_could_not_take_is_refused_naming_the_flags(tmp_path):
    """--max-batched-tokens 1e10: the workers' derived --max-message-bytes is past what their flags take;
    refused here, not by every worker in a restart loop that never names the user's flag."""
    from hf_models import build_hf_model
    from moemesh.errors import ConfigError

    build_hf_model("mixtral", tmp_path)
    with pytest.raises(ConfigError, match="--max-batched-tokens 10000000000 with --max-seqs"):
        LocalMesh.of(EngineSettings(model=str(tmp_path), max_batched_tokens=10_000_000_000))
