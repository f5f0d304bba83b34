"""The wire protocol: every message survives a round trip through the codec of its link, tensors
travel exactly and without a copy, and whatever else arrives is refused with `ProtocolError`.

No sockets: the frames `Codec.encode` returns are handed straight to `Codec(...).decode`, as
bytes (what a copying recv gives), as bytearrays, or as zmq.Frame objects (copy=False recv).
"""

from __future__ import annotations

import ast
import ctypes
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq

from moemesh.protocol import (OutputBatch, AbortRequest, Activations, Assignment, ClientMessage, Codec, CoordinatorMessage,
                              CoordinatorReply, GenerateRequest, Heartbeat, PromptLogprobs, ProtocolError, Ready,
                              Register, RequestOutput, SampledToken, Schedule, SeqWork, Shutdown, Start,
                              StatusReply, StatusRequest, StepResult, StepSpan, TokenLogprobs, WorkerFailed,
                              WorkerMessage)
from moemesh.sampling import SamplingParams
from stage_worker.tensors import frames_of, from_frame

ROOT = Path(__file__).resolve().parents[1]

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=12, min_p=0.05, seed=1234,
                        ignore_eos=True, stop_token_ids=(3, 5), min_tokens=2, presence_penalty=0.5,
                        frequency_penalty=-0.25, repetition_penalty=1.5, logprobs=3, prompt_logprobs=2)
LP = TokenLogprobs(17, -0.125, [(17, -0.125), (4, -2.5), (9, -3.75)])
LP_NO_TOP = TokenLogprobs(8, -7.0, [])

def _filled(cls) -> dict:
    """A distinct non-default value for every field of a flat struct of bools, ints, floats, strings
    and lists of floats (so that a field lost or swapped on the way shows)."""
    values = {}
    for i, f in enumerate(msgspec.structs.fields(cls)):
        if f.type is bool:
            values[f.name] = True
        elif f.type is int:
            values[f.name] = 100 + i
        elif f.type is float:
            values[f.name] = i + 0.25
        elif f.type == list[float]:
            values[f.name] = [i + 0.5, i + 1.75]
        elif f.type == list[int]:
            values[f.name] = [i + 3, i + 4]
        elif f.type in (str, str | None):
            values[f.name] = f"text {i}"
        elif f.type == list[StepSpan]:
            values[f.name] = [StepSpan(i, 1.8e9 + i + 0.125, 0.0625, 64 + i, 16, 2), StepSpan(i + 1, 2.5, 1.5, 3, 3),
                              StepSpan(i + 2, 2.5, 1.5, 512, 16, 1, [4, 11])]
        elif f.type == list[list[StepSpan]]:
            values[f.name] = [[StepSpan(i, 1.8e9 + 0.5, 0.25, 512, 16)], [], [StepSpan(i + 2, 3.0, 0.5, 8, 8, 4)]]
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: add a value for {f.type}")
    return values


# (message, the union its link decodes); each message type at least once, the nested ones filled in
MESSAGES = [
    (GenerateRequest("req-1", [1, 2, 3, 319], PARAMS), ClientMessage),
    (GenerateRequest("req-2", [5], SamplingParams()), ClientMessage),
    (AbortRequest("req-1"), ClientMessage),
    (StatusRequest(), ClientMessage),
    (StatusRequest(timeline=True), ClientMessage),
    (RequestOutput("req-1", [17, 8], [LP, LP_NO_TOP], [None, LP, LP_NO_TOP], finish_reason="stop",
                   num_prompt_tokens=3), CoordinatorReply),
    (RequestOutput("req-3", [], finish_reason="error", error="stage 1 died"), CoordinatorReply),
    (RequestOutput("req-4", [42]), CoordinatorReply),
    (OutputBatch([RequestOutput("req-5", [1], queue_seconds=0.5), RequestOutput("req-6", [], finish_reason="error",
                                                                             error="bad", error_status=400)]),
     CoordinatorReply),
    (StatusReply(**_filled(StatusReply)), CoordinatorReply),
    (Register(1, 0, "tcp://10.0.0.2:5555", "cuda:0", 4242), WorkerMessage),
    (Ready(1, 1, 512), WorkerMessage),
    (Heartbeat(**_filled(Heartbeat)), WorkerMessage),
    (StepResult(7, [SampledToken(0, 17, LP), SampledToken(3, 99)],
                [PromptLogprobs(0, 1, [LP, LP_NO_TOP]), PromptLogprobs(3, 4, [LP])], busy_seconds=0.75),
     WorkerMessage),
    (StepResult(8, []), WorkerMessage),
    (WorkerFailed(1, 0, "CUDA out of memory"), WorkerMessage),
    (Assignment("/models/mixtral", 0, 16, 2, 2, "tcp://10.0.0.3:5556", "bfloat16", 16), CoordinatorMessage),
    (Assignment("/models/mixtral", 16, 32, 2, 2, None, "float32", 16), CoordinatorMessage),
    (Assignment("/models/mixtral", 16, 32, 2, 2, None, "float32", 16, mlp_handoff=True), CoordinatorMessage),
    (Start(100), CoordinatorMessage),
    (Schedule(5, [SeqWork(0, [1, 2, 3], 0, [4, 5], True, PARAMS, 3, [1, 2, 3]),
                  SeqWork(2, [7], 40, [0, 1, 2], True),
                  SeqWork(3, [8, 9], 16, [6, 7], False, SamplingParams(max_tokens=3), 30),
                  SeqWork(4, [9], 8, [1, 2], True, PARAMS, 9, None, [1, 2, 3, 4, 5, 6, 7, 8])],
              forget=[1, 4]), CoordinatorMessage),
    (Schedule(7, [SeqWork(5, [1, 2, 3], 0, [4], True, PARAMS, 3)], mlp_handoff=[15, 31]), CoordinatorMessage),
    (Schedule(6, []), CoordinatorMessage),
    (Shutdown(), CoordinatorMessage),
    (Activations(3, []), Activations),
]
ALL_TYPES = {GenerateRequest, AbortRequest, StatusRequest, RequestOutput, OutputBatch, StatusReply, Register, Ready,
             Heartbeat, StepResult, WorkerFailed, Assignment, Start, Schedule, Shutdown, Activations}


def _bytes(frames) -> list[bytes]:
    return [bytes(f) for f in frames]


def test_every_message_type_is_covered():
    assert {type(m) for m, _ in MESSAGES} == ALL_TYPES


@pytest.mark.parametrize("msg,link", MESSAGES, ids=lambda x: type(x).__name__ if isinstance(x, msgspec.Struct) else "")
def test_round_trip(msg, link):
    frames = Codec.encode(msg)
    assert len(frames) == 1
    got, tensors = Codec(link).decode(_bytes(frames))
    assert tensors == []
    assert type(got) is type(msg)
    assert got == msg


def test_round_trip_keeps_nested_types():
    """The nested structs come back as structs (not dicts), tuples as tuples, None as None."""
    req, out = MESSAGES[0][0], next(m for m, _ in MESSAGES if isinstance(m, RequestOutput))
    got, _ = Codec(ClientMessage).decode(_bytes(Codec.encode(req)))
    assert isinstance(got.params, SamplingParams)
    assert got.params.stop_token_ids == (3, 5) and got.params.seed == 1234 and got.params.greedy is False
    got, _ = Codec(CoordinatorReply).decode(_bytes(Codec.encode(out)))
    assert got.prompt_logprobs[0] is None
    assert isinstance(got.prompt_logprobs[1], TokenLogprobs)
    assert got.logprobs[0].top[1] == (4, -2.5)
    sched = next(m for m, _ in MESSAGES if isinstance(m, Schedule))
    got, _ = Codec(CoordinatorMessage).decode(_bytes(Codec.encode(sched)))
    assert [type(w) for w in got.seqs] == [SeqWork] * 4
    assert got.seqs[3].cached_ids == [1, 2, 3, 4, 5, 6, 7, 8] and got.seqs[1].cached_ids is None
    assert got.seqs[0].params == PARAMS and got.seqs[0].prompt_ids == [1, 2, 3]
    assert got.seqs[1].params is None and got.seqs[1].prompt_len == 0 and got.seqs[1].prompt_ids is None
    assert got.forget == [1, 4]
    beat = next(m for m, _ in MESSAGES if isinstance(m, Heartbeat))
    got, _ = Codec(WorkerMessage).decode(_bytes(Codec.encode(beat)))
    assert [type(s) for s in got.spans] == [StepSpan] * 3 and got.spans[0].num_steps == 2
    assert got.spans[2].mlp_handoff == [4, 11] and got.spans[0].mlp_handoff == []
    status = next(m for m, _ in MESSAGES if isinstance(m, StatusReply))
    got, _ = Codec(CoordinatorReply).decode(_bytes(Codec.encode(status)))
    assert [len(s) for s in got.stage_spans] == [1, 0, 1] and type(got.stage_spans[2][0]) is StepSpan


def test_zmq_frames_decode_like_bytes():
    """copy=False receives zmq.Frame objects; the codec reads their buffers."""
    msg = next(m for m, _ in MESSAGES if isinstance(m, StepResult))
    got, _ = Codec(WorkerMessage).decode([zmq.Frame(f) for f in _bytes(Codec.encode(msg))])
    assert got == msg


# -- tensors ------------------------------------------------------------------------------------

TENSORS = [
    torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
    torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(2)).to(torch.float16),
    torch.tensor([[0, -1, 2**62], [-(2**63), 5, 2**63 - 1]], dtype=torch.int64),
    torch.arange(-6, 6, dtype=torch.int32).reshape(3, 4),
    torch.empty(0, 64),
    torch.empty(5, 0, dtype=torch.bfloat16),
    torch.empty(0, dtype=torch.int64),
    torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0]),
]


def _activations(tensors) -> list:
    metas, buffers = frames_of(tensors)
    return Codec.encode(Activations(9, metas), buffers)


def _decode(frames):
    """The activation link as a worker reads it: the codec checks the frames, the worker makes tensors."""
    msg, buffers = Codec(Activations).decode(frames)
    return msg, [from_frame(m, b) for m, b in zip(msg.tensors, buffers)]


@pytest.mark.parametrize("as_type", [bytes, bytearray, zmq.Frame])
def test_tensors_survive_exactly(as_type):
    frames = _activations(TENSORS)
    assert len(frames) == 1 + len(TENSORS)
    msg, got = _decode([as_type(bytes(f)) for f in frames])
    assert msg.step_id == 9
    assert len(got) == len(TENSORS)
    for sent, recv in zip(TENSORS, got):
        assert recv.dtype == sent.dtype
        assert recv.shape == sent.shape
        # bitwise: NaN, -0.0 and the int64 extremes included
        assert torch.equal(recv.contiguous().view(-1).view(torch.uint8) if recv.numel() else recv,
                           sent.contiguous().view(-1).view(torch.uint8) if sent.numel() else sent)


def test_non_contiguous_tensor_is_sent_in_logical_order():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # a transposed view
    _, (got,) = _decode(_bytes(_activations([t])))
    assert got.shape == (4, 3)
    assert torch.equal(got, t)


def test_scalar_tensor_round_trip():
    t = torch.tensor(3.5)
    _, (got,) = _decode(_bytes(_activations([t])))
    assert got.shape == () and got.item() == 3.5


def _address_range(buf) -> tuple[int, int]:
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.ctypes.data + arr.nbytes


def test_encode_does_not_copy_tensors():
    t = torch.randn(8, 16)
    frames = _activations([t])
    start, end = _address_range(frames[1])
    assert start == t.data_ptr() and end == t.data_ptr() + t.numel() * 4


@pytest.mark.parametrize("as_type", [bytes, zmq.Frame])
def test_decoded_tensors_share_the_received_frame(as_type):
    sent = [torch.randn(4, 8), torch.randn(6, 2).to(torch.bfloat16)]
    frames = [as_type(bytes(f)) for f in _activations(sent)]
    _, got = _decode(frames)
    for frame, t in zip(frames[1:], got):
        start, end = _address_range(frame.buffer if isinstance(frame, zmq.Frame) else frame)
        ptr = t.untyped_storage().data_ptr()
        assert start <= ptr and ptr + t.numel() * t.element_size() <= end


def test_decoded_tensor_sees_writes_to_its_frame():
    frames = [bytearray(f) for f in _activations([torch.zeros(2, 3)])]
    _, (t,) = _decode(frames)
    assert t.sum().item() == 0
    ctypes.memmove((ctypes.c_char * 4).from_buffer(frames[1], 4 * 4), np.float32(2.5).tobytes(), 4)
    assert t[1, 1].item() == 2.5


# -- refusals -----------------------------------------------------------------------------------

LINKS = {"client": ClientMessage, "reply": CoordinatorReply, "worker": WorkerMessage,
         "coordinator": CoordinatorMessage, "activations": Activations}
WRONG_LINK = [
    (Schedule(1, []), "client"),
    (StepResult(1, []), "client"),
    (GenerateRequest("r", [1], SamplingParams()), "worker"),
    (Schedule(1, []), "worker"),
    (StepResult(1, []), "coordinator"),
    (Register(0, 0, "tcp://x:1", "cpu", 1), "coordinator"),
    (RequestOutput("r", [1]), "client"),
    (GenerateRequest("r", [1], SamplingParams()), "reply"),
    (Shutdown(), "activations"),
    (Activations(1, []), "worker"),
]


@pytest.mark.parametrize("msg,link", WRONG_LINK, ids=lambda x: type(x).__name__ if isinstance(x, msgspec.Struct) else x)
def test_link_refuses_another_links_message(msg, link):
    with pytest.raises(ProtocolError):
        Codec(LINKS[link]).decode(_bytes(Codec.encode(msg)))


def _raw(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


GOOD_GENERATE = {"type": "generate", "request_id": "r", "prompt_ids": [1, 2], "params": {"max_tokens": 4}}
META_F32_2x2 = ["float32", [2, 2]]
BAD_CLIENT = {
    "garbage": [b"\xc1\xff\x00garbage"],
    "empty message": [],
    "empty header": [b""],
    "truncated msgpack": [_bytes(Codec.encode(GenerateRequest("r", [1, 2, 3], PARAMS)))[0][:-5]],
    "not a map": [_raw(5)],
    "no tag": [_raw({"request_id": "r"})],
    "unknown tag": [_raw({"type": "launch_missiles"})],
    "missing field": [_raw({"type": "generate", "request_id": "r", "params": {}})],
    "request id not a string": [_raw({**GOOD_GENERATE, "request_id": 5})],
    "prompt ids not ints": [_raw({**GOOD_GENERATE, "prompt_ids": ["a", "b"]})],
    "prompt ids not a list": [_raw({**GOOD_GENERATE, "prompt_ids": 7})],
    "params not a map": [_raw({**GOOD_GENERATE, "params": [1, 2]})],
    "max_tokens a float": [_raw({**GOOD_GENERATE, "params": {"max_tokens": 2.5}})],
    "top_p a string": [_raw({**GOOD_GENERATE, "params": {"top_p": "high"}})],
    "top_p 5": [_raw({**GOOD_GENERATE, "params": {"top_p": 5.0}})],
    "negative max_tokens": [_raw({**GOOD_GENERATE, "params": {"max_tokens": -1}})],
    "logprobs 1000": [_raw({**GOOD_GENERATE, "params": {"logprobs": 1000}})],
    "min_tokens over max_tokens": [_raw({**GOOD_GENERATE, "params": {"max_tokens": 2, "min_tokens": 3}})],
    "extra frame on a tensorless message": [_raw(GOOD_GENERATE), b"\x00" * 4],
}


def test_good_generate_is_accepted():
    """The base of the malformed client messages below decodes, so each refusal is its own fault's."""
    msg, _ = Codec(ClientMessage).decode([_raw(GOOD_GENERATE)])
    assert msg == GenerateRequest("r", [1, 2], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("name", list(BAD_CLIENT))
def test_malformed_client_message_is_a_protocol_error(name):
    with pytest.raises(ProtocolError):
        Codec(ClientMessage).decode(BAD_CLIENT[name])


def _act_header(*metas) -> bytes:
    return _raw({"type": "activations", "step_id": 1, "tensors": [list(m) for m in metas]})


BAD_ACTIVATIONS = {
    "2 tensors declared, 1 frame": [_act_header(META_F32_2x2, META_F32_2x2), b"\x00" * 16],
    "1 tensor declared, 2 frames": [_act_header(META_F32_2x2), b"\x00" * 16, b"\x00" * 16],
    "1 tensor declared, no frame": [_act_header(META_F32_2x2)],
    "frame too short": [_act_header(META_F32_2x2), b"\x00" * 15],
    "frame too long": [_act_header(META_F32_2x2), b"\x00" * 17],
    "frame of the other dtype's size": [_act_header(["bfloat16", [2, 2]]), b"\x00" * 16],
    "bytes for an empty shape": [_act_header(["float32", [0, 4]]), b"\x00" * 4],
    "unknown dtype": [_act_header(["float128", [2, 2]]), b"\x00" * 32],
    "dtype not a string": [_act_header([4, [2, 2]]), b"\x00" * 16],
    "negative dimension": [_act_header(["float32", [-2, -2]]), b"\x00" * 16],
    "one negative dimension": [_act_header(["float32", [4, -1]]), b"\x00" * 16],
    "shape not ints": [_act_header(["float32", [2.0, 2.0]]), b"\x00" * 16],
    "shape overflowing int64": [_act_header(["float32", [2**63, 2]]), b"\x00" * 16],
    "meta missing its shape": [_act_header(["float32"]), b"\x00" * 16],
}


def test_good_activations_header_is_accepted():
    msg, (t,) = _decode([_act_header(META_F32_2x2), b"\x00" * 16])
    assert msg.step_id == 1 and t.shape == (2, 2) and t.dtype == torch.float32


@pytest.mark.parametrize("name", list(BAD_ACTIVATIONS))
def test_malformed_activations_are_a_protocol_error(name):
    with pytest.raises(ProtocolError):
        Codec(Activations).decode(BAD_ACTIVATIONS[name])


@pytest.mark.parametrize("count", [0, 1, 2])
def test_a_stage_takes_exactly_one_tensor_the_residual_stream(count):
    """Two tensors (hidden and residual apart, as stages sent before) or none are refused; one is
    a view of its frame."""
    from stage_worker.worker import received_stream

    tensors = [torch.arange(6.0).view(3, 2) + i for i in range(count)]
    frames = _activations(tensors)
    if count != 1:
        with pytest.raises(ProtocolError, match=f"activations carry {count} tensors, expected 1"):
            received_stream(Codec(Activations), frames)
        return
    step_id, stream = received_stream(Codec(Activations), frames)
    assert step_id == 9 and torch.equal(stream, tensors[0])


@pytest.mark.parametrize("shape", [[2**63, 0], [2**40, 2**40, 0], [0, 2**39, 2**39, 2**39]])
def test_empty_tensor_with_huge_dimension_is_a_protocol_error(shape):
    with pytest.raises(ProtocolError):
        _decode([_act_header(["float32", shape]), b""])


@pytest.mark.parametrize("shape", [[2**40 - 1] * 8, [2**40 - 1] * 400, [1] * 9, [3, 2, 1]])
def test_a_shape_of_many_or_huge_dimensions_is_a_protocol_error_and_cheap(shape):
    """Eight dimensions at most (a stage's tensors have 1-3), and a frame the shape does not fit is
    refused without printing its product: 400 dimensions of 2^40 once made a number too long to print
    (a ValueError, not a ProtocolError, that ended the worker's receive loop)."""
    from stage_worker.worker import received_stream

    frames = [_act_header(["float32", shape]), b"\x00" * 24]
    with pytest.raises(ProtocolError) as e:
        received_stream(Codec(Activations), frames)
    assert len(str(e.value)) < 300


@pytest.mark.parametrize("link", list(LINKS.values()), ids=list(LINKS))
def test_random_bytes_never_raise_anything_but_protocol_error(link):
    """Fuzz each link's decoder: mutated valid messages and random bytes."""
    rng = np.random.default_rng(0)
    seeds = [_bytes(Codec.encode(m))[0] for m, _ in MESSAGES] + [_act_header(META_F32_2x2)]
    refused = 0
    for i in range(400):
        header = bytearray(seeds[i % len(seeds)])
        if i % 4 == 0:
            header = bytearray(rng.integers(0, 256, size=int(rng.integers(1, 64)), dtype=np.uint8).tobytes())
        else:
            for _ in range(int(rng.integers(1, 4))):
                header[int(rng.integers(0, len(header)))] = int(rng.integers(0, 256))
        frames = [bytes(header)] + [b"\x00" * 16] * int(rng.integers(0, 2))
        try:
            Codec(link).decode(frames)
        except ProtocolError:
            refused += 1
    assert refused > 100  # the fuzz does reach the refusals


# -- no pickle ----------------------------------------------------------------------------------

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib", "jsonpickle"}
UNSAFE_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}  # pyzmq's pickle paths


def unsafe_uses(source: str) -> list[str]:
    """What in this source could turn received bytes into code: an import of a pickle-like module
    (statement, __import__ or importlib), pyzmq's pickling calls, torch/numpy loads that unpickle."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            first = node.args[0] if node.args else None
            if name in UNSAFE_CALLS:
                found.append(name)
            elif name in ("__import__", "import_module") and isinstance(first, ast.Constant) \
                    and str(first.value).split(".")[0] in UNSAFE_MODULES:
                found.append(f"{name}({first.value!r})")
            elif name == "load" and isinstance(f, ast.Attribute) and ast.unparse(f.value) in ("torch", "np", "numpy") \
                    and not any(k.arg in ("weights_only", "allow_pickle") and isinstance(k.value, ast.Constant)
                                and k.value.value is (k.arg == "weights_only") for k in node.keywords):
                found.append(ast.unparse(f))
    return found


def test_the_checker_finds_every_way_in():
    assert unsafe_uses("import os\nimport pickle\n") == ["pickle"]
    assert unsafe_uses("from pickle import loads\n") == ["pickle"]
    assert unsafe_uses("import cloudpickle as cp\n") == ["cloudpickle"]
    assert unsafe_uses("msg = sock.recv_" "pyobj()\n") == ["recv_pyobj"]
    assert unsafe_uses("m = __import__('pickle')\n") and unsafe_uses("importlib.import_module('dill')\n")
    assert unsafe_uses("x = torch.load(f)\n") == ["torch.load"]
    assert unsafe_uses("x = np.load(f, allow_pickle=True)\n") == ["np.load"]
    assert unsafe_uses("x = torch.load(f, weights_only=True)\ny = np.load(f, allow_pickle=False)\n") == []
    assert unsafe_uses('"""no pickle anywhere: import pickle"""\nmsgspec.msgpack.decode(b)\n') == []


def test_no_pickle_in_the_serving_code():
    files = [p for d in ("moemesh", "coordinator", "stage_worker", "kernels", "gateway") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20 and ROOT / "moemesh" / "protocol.py" in files
    offenders = {str(p.relative_to(ROOT)): unsafe_uses(p.read_text()) for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}
