"""The wire protocol: typed messages per link, one codec, tensors as raw frames beside a header.

Links (socket pattern, direction):
- client link (DEALER -> coordinator ROUTER): `ClientMessage` in, `CoordinatorReply` out. Clients
  are gateways and the local `generate` driver.
- worker link (stage worker DEALER -> coordinator ROUTER): `WorkerMessage` up, `CoordinatorMessage`
  down (assignment, schedules, shutdown).
- activation link (stage s PUSH -> stage s+1 PULL, same tensor rank): `Activations` + tensor frames.

A multipart message is [msgpack header, tensor frame, tensor frame, ...]; the header names each
tensor's dtype and shape. Decoding takes the frames as they arrived (no copy for tensors) and checks
each frame's size against its declared dtype and shape; turning a frame into a tensor is the worker's
business (`stage_worker.tensors`), so this module, and everything that only routes messages, needs
no torch. Nothing here can execute code on decode: msgspec builds only the Structs below (no pickle
anywhere).
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from moemesh.sampling import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_GRAMMAR_CHARS,
                              MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingParams)


class ProtocolError(ValueError):
    """A message that does not decode to what the link expects."""


# What a stage worker and the coordinator must agree on beyond the messages' shapes: a field one side
# does not know is dropped silently on decode, so a worker of another version could compute the
# wrong tokens without an error. Workers say theirs in `Register`; the coordinator refuses another.
# Raise it with any change to what a worker must do with a schedule, an activation or a result.
# 2: heartbeats say the last schedule taken (the coordinator takes a worker that says nothing for one
# that lost every schedule). 4: schedules may hand a stage's last MLP to the next stage
# (`Schedule.mlp_handoff`). 5: prompt logprobs carry each token's rank (`TokenLogprobs.rank`). 6: sampling
# parameters may carry a structured output's grammar (`SamplingParams.grammar`: an older last stage would
# sample without it). 7: and logit_bias, allowed_token_ids and bad_words (`SamplingParams`). 8: a decode may
# carry draft tokens for the last stage to check (`SeqWork.draft`; an older one would sample after the last).
# 9: a request may carry a prefix cache salt (`SamplingParams.cache_salt`: an older coordinator would share
# its prefix with every other request's).
PROTOCOL_VERSION = 9
MAX_KV_BLOCKS = 1 << 24  # KV blocks a worker may report (and a pool hold): far past any host's memory in blocks
TIMELINE_SPANS = 4096  # the newest steps of each stage (and of the coordinator) kept for the timeline
# (an environment variable) the secret part of a stage worker's identity on the coordinator's link, where
# its launcher chose it, to report the worker's death in its name; else the worker draws its own
WORKER_TOKEN = "MOEMESH_WORKER_TOKEN"


def worker_identity(pp_rank: int, tp_rank: int, pid: int, token: str) -> bytes:
    """A stage worker's identity on the coordinator's link (its own, and its launcher's death report)."""
    return f"w{pp_rank}.{tp_rank}.{pid}.{token}".encode()


# -- tensors ------------------------------------------------------------------------------------

TENSOR_ITEM_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4}  # dtype name -> bytes


MAX_TENSOR_DIMS = 8  # (a stage's tensors have 1 to 3)
# characters of a client's request id (the gateway's are under 64): ended requests keep theirs for a while
MAX_REQUEST_ID = 256
RequestId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID)]


class TensorMeta(msgspec.Struct, array_like=True, frozen=True):
    dtype: str
    shape: Annotated[list[int], msgspec.Meta(max_length=MAX_TENSOR_DIMS)]


# -- client link --------------------------------------------------------------------------------

class GenerateRequest(msgspec.Struct, tag="generate", frozen=True):
    request_id: RequestId
    prompt_ids: list[int]
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    request_id: RequestId


class StatusRequest(msgspec.Struct, tag="status", frozen=True):
    timeline: bool = False  # also the recent steps' spans (StatusReply.stage_spans, coordinator_spans)
    nonce: int = 0  # the reply carries it back: a client matches replies to its questions by it


class StepSpan(msgspec.Struct, array_like=True, frozen=True):
    """One step as one process saw it: a stage's forward pass (its tensor rank 0), or on the
    coordinator the step from its schedule going out to its result coming back."""
    step_id: int
    start: float  # wall clock (time.time()) when it began: spans of processes on one host line up
    seconds: float
    tokens: int  # tokens of the step (of each decode step, in a schedule of several)
    seqs: int
    num_steps: int = 1
    # the MLP hand-off: the layers whose MLP the schedule handed over (the coordinator's span), or
    # that this stage stopped before or ran for the stage before it (a stage's)
    mlp_handoff: list[int] = []

    @classmethod
    def of(cls, sched: Schedule, start: float, seconds: float = 0.0, mlp_handoff: list[int] | None = None) -> StepSpan:
        """The span of a schedule's step, begun at `start` (wall clock); mlp_handoff: the schedule's."""
        return cls(sched.step_id, start, seconds, sum(len(w.token_ids) for w in sched.seqs), len(sched.seqs),
                   sched.num_steps, sched.mlp_handoff if mlp_handoff is None else mlp_handoff)


UNKNOWN_REQUEST = 404  # a RequestOutput's error_status for a resend of a request the coordinator does not know


class ResendRequest(msgspec.Struct, tag="resend", frozen=True):
    """A client missed outputs of a request (its link to the coordinator dropped): its tokens from
    `start` on again, and its end if it has ended."""
    request_id: RequestId
    start: int


class TokenLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """Logprob of one token, and the top-N alternatives at its position (N may be 0)."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int = 0  # the tokens at least as likely, itself included (vLLM's rank); 0: not computed (sampled tokens)


class RequestOutput(msgspec.Struct, tag="output", frozen=True):
    """New tokens of one request since its last output; `finish_reason` set on the last one."""
    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first prompt token has none
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    error_status: int = 0  # with an error: 400 the request was invalid, 503 the pipeline is down
    num_prompt_tokens: int = 0
    queue_seconds: float | None = None  # on the first output: from arrival to first scheduled
    num_cached_tokens: int = 0  # on the first output: prompt tokens found in the prefix cache
    start: int = -1  # the index of its first token among the request's outputs (-1: not counted)


class OutputBatch(msgspec.Struct, tag="outputs", frozen=True):
    """Every output one step produced for one client, in one message."""
    outputs: list[RequestOutput]


class StatusReply(msgspec.Struct, tag="status_reply", frozen=True):
    serving: bool
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    stage_busy_seconds: list[float]  # per stage (its tensor rank 0)
    stage_comm_seconds: list[float]
    uptime_seconds: float
    malformed_messages: int
    stage_sent_bytes: list[int] = []  # activation bytes each stage (tp rank 0) sent to the next
    model: str = ""  # the checkpoint directory the workers load
    max_model_len: int = 0
    failure: str | None = None  # why the pipeline is down, when it is
    steps: int = 0  # microbatches scheduled so far
    coordinator_step_seconds: float = 0.0  # the coordinator's CPU time scheduling them and taking results
    schedule_bytes: int = 0  # encoded size of those schedules (each sent once to every worker)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found there
    phase: str = ""  # the pipeline's: registering | loading | serving | recovering | down; stopping (SIGTERM)
    recoveries: int = 0  # workers lost and the pipeline rebuilt without them
    recovery_seconds: float = 0.0  # spent recovering, in all
    requests_resumed: int = 0  # sequences put back to be recomputed by recoveries
    tokens_recomputed: int = 0  # tokens those sequences had in the KV cache when it was lost
    mesh_refused: int = 0  # handshakes the mesh's sockets refused (--mesh-keys: no key, or one not allowed)
    max_waiting: int = 0  # the coordinator's --max-waiting (0: not said)
    mlp_handoff_steps: int = 0  # steps scheduled with an MLP handed to the next stage (Schedule.mlp_handoff)
    instance: str = ""  # random per coordinator process: a new value means a restarted coordinator
    workers_replaced: int = 0  # lost workers whose rank a restarted (or new) process took over
    spec_drafts: int = 0  # speculative decoding (--num-speculative-tokens): decodes that carried draft tokens
    spec_draft_tokens: int = 0  # the draft tokens they carried
    spec_accepted_tokens: int = 0  # of which the last stage kept
    step_resets: int = 0  # pipeline resets because a step was overdue (--step-timeout)
    unreached: str = ""  # a link between stages that never connected (a wrong --advertise-host), named
    protocol: int = 0  # the coordinator's PROTOCOL_VERSION (0: older than the field): a gateway sends what it knows
    # with StatusRequest(timeline=True): the most recent steps (TIMELINE_SPANS at most) of each stage,
    # and the coordinator's own
    stage_spans: list[list[StepSpan]] = []
    coordinator_spans: list[StepSpan] = []
    nonce: int = 0  # the request's


ClientMessage = Union[GenerateRequest, AbortRequest, StatusRequest, ResendRequest]
CoordinatorReply = Union[RequestOutput, OutputBatch, StatusReply]


# -- worker link --------------------------------------------------------------------------------

class Register(msgspec.Struct, tag="register", frozen=True):
    pp_rank: int
    tp_rank: int
    data_address: str  # where this worker's activation PULL socket can be reached
    device: str
    pid: int
    rendezvous_address: str = ""  # a free tcp://host:port for its stage's process group (used from tp rank 0)
    max_message_bytes: int = 0  # the largest message its sockets take (--max-message-bytes; 0: not said)
    protocol: int = 0  # PROTOCOL_VERSION of the worker's code (0: a worker from before there was one)
    max_activation_bytes: int = 0  # the largest activations its data socket takes (0: max_message_bytes)


class Assignment(msgspec.Struct, tag="assignment", frozen=True):
    model: str
    layer_start: int
    layer_end: int
    pp_size: int
    tp_size: int
    next_address: str | None  # the next stage's worker of the same tensor rank; None on the last stage
    dtype: str
    block_size: int
    tp_rendezvous: str | None = None  # init_method of the stage's torch.distributed group (tp > 1)
    expert_parallel: bool = False
    quantization: str | None = None  # "fp8": quantize at load (an FP8 checkpoint says so itself)
    moe_backend: str = "auto"
    mlp_handoff: bool = False  # a stage after the first also holds the MLP of the layer before its own


class Ready(msgspec.Struct, tag="ready", frozen=True):
    pp_rank: int
    tp_rank: int
    num_blocks: int
    model_config: str = ""  # the loaded checkpoint's config as JSON (ModelConfig's fields; "": not said)


class Start(msgspec.Struct, tag="start", frozen=True):
    num_blocks: int  # the smallest pool of any worker: block ids are shared across stages
    epoch: int = 0  # the pipeline's epoch the worker joins (a replacement joins a later one)


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    pp_rank: int
    tp_rank: int
    busy_seconds: float  # in forward passes, since start
    comm_seconds: float = 0.0  # of which in tensor-parallel collectives
    sent_bytes: int = 0  # activation bytes sent to the next stage, since start
    refused: int = 0  # handshakes its activation socket refused (no key, or one not allowed), since start
    malformed: int = 0  # messages it received that did not decode or did not fit, since start
    last_step: int = -1  # the last step it finished computing
    received_step: int = -1  # the last schedule it took (in order: after a gap it takes none until a Reset)
    # (tensor rank 0) the steps it finished since its last heartbeat, oldest first: TIMELINE_SPANS at most
    # (4096 spans are about 120 KB), the newest of them if it ran more
    spans: list[StepSpan] = []
    # seconds its link to the next stage has been connecting without ever connecting (a wrong address,
    # a peer refusing its keys; 0: it connected, or there is no next stage)
    next_unreached: float = 0.0
    relinks: int = 0  # times it made that link again after a refused handshake (what it held was dropped)


class WorkerFailed(msgspec.Struct, tag="worker_failed", frozen=True):
    pp_rank: int
    tp_rank: int
    error: str


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    refused: str = ""  # a registration the coordinator refused: why (the worker exits non-zero saying so)
    reason: str = ""  # why else the worker is told to stop (it logs it as it exits)


class Reset(msgspec.Struct, tag="reset", frozen=True):
    """A new epoch (a worker was lost, or a step overdue): drop every step below `first_step` not yet
    run, the activations waiting for them, and the block table and sampling state of every sequence
    admitted before `first_step`; the epoch's steps are numbered from `first_step` on."""
    epoch: int
    first_step: int = 0


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """The coordinator is alive (sent to every registered worker twice a second). A worker that
    hears nothing for --coordinator-timeout exits, so that its launcher starts it again and it
    registers with whichever coordinator answers at that address. It carries the current epoch: a
    worker that missed the epoch's Reset (its connection was down) resets on seeing it."""
    epoch: int
    first_step: int = 0


class Repoint(msgspec.Struct, tag="repoint", frozen=True):
    """The next stage's worker of the same tensor rank is a replacement at this address."""
    next_address: str


class SeqWork(msgspec.Struct, array_like=True, frozen=True):
    """One sequence's share of a step. `params` and `prompt_len` come with its first chunk after
    admission (a new or recomputed sequence); `prompt_ids` too when prompt logprobs are wanted, and
    `cached_ids` when that chunk starts after a prefix found in the cache (the tokens before it).

    Only what changed travels: the first chunk after admission carries the sequence's whole block
    table, every later one only the blocks appended since (usually none: a decode takes a new
    block once every block_size tokens). Workers keep the tables (`StageExecutor`), so a step's
    schedule grows with the tokens it computes, not with its sequences' context lengths."""
    seq_id: int
    token_ids: list[int]  # new tokens, at positions context_len ..
    context_len: int
    new_blocks: list[int]  # the whole table on admission (params set), else the blocks added since
    sample: bool
    params: SamplingParams | None = None
    prompt_len: int = 0
    prompt_ids: list[int] | None = None
    cached_ids: list[int] | None = None
    draft: int = 0  # speculative decoding: the last `draft` of token_ids are guesses for the last stage to
    # check (its result holds the tokens it keeps: 1 to draft + 1 for the sequence, in order)


class Schedule(msgspec.Struct, tag="schedule", frozen=True):
    step_id: int
    seqs: list[SeqWork]
    forget: list[int] = []  # sequences that ended: drop their block table and sampling state
    epoch: int = 0  # the pipeline's epoch it belongs to: a worker that missed the epoch's Reset (and
    # perhaps the schedules that admitted its sequences afresh) resets before running it, so that
    # no block-table delta is ever applied to a table of an earlier epoch
    first_step: int = 0  # that epoch's first step id: with it a worker tells a lost schedule (a gap)
    num_steps: int = 1  # > 1: decodes only, on a stage that holds the whole model (--num-scheduler-steps):
    # each sequence decodes its token, then feeds back what it sampled, num_steps decode steps in all;
    # the result carries num_steps x len(seqs) tokens, step by step, each step's in the schedule's order

    # the MLP hand-off (stage_worker/models/base.py): the layers, each the last of its stage, whose MLP
    # the next stage runs for this step (the stage stops that layer after its attention). Empty: every
    # stage runs all of its own layers.
    mlp_handoff: list[int] = []


class BlockTables:
    """A worker's copy of every running sequence's block table, kept up to date from schedules
    (the receiving side of `SeqWork.new_blocks`), with the step that admitted each: a Reset drops
    those admitted before the new epoch's first step (every sequence of the epoch is admitted
    afresh, at or after it)."""

    def __init__(self):
        self.tables: dict[int, list[int]] = {}
        self.admitted: dict[int, int] = {}  # seq id -> the step whose schedule carried its whole table

    def apply(self, sched: Schedule) -> list[list[int]]:
        """Forgets the sequences `sched` ends, applies its blocks; the tables of its sequences, in its
        order. Raises ValueError for a sequence never admitted here."""
        tables = self.tables
        for seq_id in sched.forget:
            tables.pop(seq_id, None)
            self.admitted.pop(seq_id, None)
        out = []
        for w in sched.seqs:
            if w.params is not None:  # admitted: the whole table
                table = tables[w.seq_id] = list(w.new_blocks)
                self.admitted[w.seq_id] = sched.step_id
            else:
                table = tables.get(w.seq_id)
                if table is None:
                    raise ValueError(f"step {sched.step_id}: sequence {w.seq_id} has no block table here "
                                     f"(its first chunk did not carry params)")
                table += w.new_blocks
            out.append(table)
        return out

    def drop_admitted_before(self, step_id: int) -> list[int]:
        """Forgets the sequences admitted by a step below `step_id`; -> their ids."""
        stale = [seq_id for seq_id, step in self.admitted.items() if step < step_id]
        for seq_id in stale:
            del self.tables[seq_id], self.admitted[seq_id]
        return stale


class SampledToken(msgspec.Struct, array_like=True, frozen=True):
    seq_id: int
    token_id: int
    logprobs: TokenLogprobs | None = None
    # a structured output's constraint failed here (why): the token is the end of sequence it forced, and
    # the request ends with an error rather than as a finished answer
    error: str | None = None


class PromptLogprobs(msgspec.Struct, array_like=True, frozen=True):
    seq_id: int
    start: int  # position of the first prompt token these cover
    logprobs: list[TokenLogprobs]


class StepResult(msgspec.Struct, tag="result", frozen=True):
    step_id: int
    sampled: list[SampledToken]
    prompt_logprobs: list[PromptLogprobs] = []
    busy_seconds: float = 0.0


class Activations(msgspec.Struct, tag="activations", frozen=True):
    step_id: int
    tensors: list[TensorMeta]


WorkerMessage = Union[Register, Ready, Heartbeat, StepResult, WorkerFailed]
CoordinatorMessage = Union[Assignment, Start, Schedule, Shutdown, Reset, Repoint, Ping]


# -- codec --------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()


class Codec:
    """Encodes any message above; decodes only the union a link expects."""

    def __init__(self, expected):
        self._decoder = msgspec.msgpack.Decoder(expected)

    @staticmethod
    def encode(msg, buffers=()) -> list:
        """-> [header, *buffers]; each buffer holds one tensor's bytes as `msg.tensors` describes it
        (pyzmq's copy=False sends them without a copy and holds them until sent)."""
        return [_encoder.encode(msg), *buffers]

    def decode(self, frames: list) -> tuple[object, list]:
        """-> (message, its tensor frames as buffers), each frame checked against its TensorMeta."""
        if not frames:
            raise ProtocolError("empty message")
        try:
            msg = self._decoder.decode(_buffer(frames[0]))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            raise ProtocolError(f"undecodable message: {e}") from None
        except RecursionError:  # (msgspec skipping a deeply nested unknown field)
            raise ProtocolError("undecodable message: nested too deeply") from None
        metas = getattr(msg, "tensors", [])
        if len(frames) - 1 != len(metas):
            raise ProtocolError(f"message declares {len(metas)} tensors but carries {len(frames) - 1} frames")
        buffers = [_buffer(f) for f in frames[1:]]
        try:
            for meta, buf in zip(metas, buffers):
                check_frame(meta, buf)
        except ProtocolError:
            raise
        except Exception as e:  # (whatever a hostile frame finds: still one malformed message, never a crash)
            raise ProtocolError(f"undecodable tensor frame: {type(e).__name__}") from None
        return msg, buffers


def check_frame(meta: TensorMeta, buf) -> None:
    """Refuses a frame whose dtype is unknown or whose size is not what its shape needs."""
    size = TENSOR_ITEM_SIZES.get(meta.dtype)
    if size is None:
        raise ProtocolError(f"unknown tensor dtype {meta.dtype!r}")
    if len(meta.shape) > MAX_TENSOR_DIMS:  # (a TensorMeta made here, not decoded, may hold more)
        raise ProtocolError(f"tensor of {len(meta.shape)} dimensions, more than {MAX_TENSOR_DIMS}")
    numel = 1
    for d in meta.shape:
        if not 0 <= d < 1 << 40:
            raise ProtocolError("tensor shape has a dimension outside [0, 2^40)")
        numel *= d
    if len(buf) != numel * size:  # (the numbers said only where small: a hostile shape's are not printed)
        need = f"needs {numel * size}" if numel * size < 1 << 63 else "needs more"
        raise ProtocolError(f"tensor frame holds {len(buf)} bytes, its {meta.dtype} shape of {len(meta.shape)} "
                            f"dimensions {need}")


def _buffer(frame):
    return frame.buffer if hasattr(frame, "buffer") else frame


# -- limits -------------------------------------------------------------------------------------
# The largest legitimate frame of each link, set as ZMQ_MAXMSGSIZE on the receiving socket: a peer
# that sends more is disconnected by libzmq before the message is buffered. Generous on purpose
# (msgpack's worst case per value, slack for headers): a limit that refuses a real message is a bug.

HEADER_SLACK = 1 << 20
# a request's allowed_token_ids (5 bytes an id), logit_bias (an array of an id and a float64: 16 bytes) and
# bad_words' token sequences (an array header and 5 bytes an id)
TOKEN_EDIT_BYTES = (5 * MAX_ALLOWED_TOKEN_IDS + 16 * MAX_LOGIT_BIAS
                    + 2 * MAX_BAD_WORDS * (5 + 5 * MAX_BAD_WORD_TOKENS))


def max_client_message_bytes(max_model_len: int) -> int:
    """A generate request: its prompt ids (9 bytes each at most in msgpack) and its parameters (with a
    structured output's grammar, UTF-8; allowed_token_ids and logit_bias pairs)."""
    return HEADER_SLACK + 9 * max_model_len + 9 * MAX_STOP_TOKEN_IDS + 4 * MAX_GRAMMAR_CHARS + TOKEN_EDIT_BYTES


def max_result_bytes(max_batched_tokens: int, max_seqs: int, num_steps: int = 1) -> int:
    """A step result: a token per sequence (num_steps of them in a schedule of several decode steps),
    and logprobs with MAX_LOGPROBS alternatives for every token of the step at worst (prompt
    logprobs); each (id, logprob) pair is at most 18 bytes."""
    per_token = 32 + (MAX_LOGPROBS + 1) * 18
    return HEADER_SLACK + (max_batched_tokens + max_seqs * num_steps) * per_token


def max_activation_bytes(hidden_size: int, max_batched_tokens: int) -> int:
    """A tensor frame between stages: a step's residual stream in 32-bit floats at most."""
    return HEADER_SLACK + 4 * hidden_size * max_batched_tokens


def worker_message_bytes(hidden_size: int, max_batched_tokens: int, max_seqs: int, max_model_len: int,
                         block_size: int) -> int:
    """The largest message a stage worker can be sent: a schedule, or a step's activations."""
    return max(max_activation_bytes(hidden_size, max_batched_tokens),
               max_schedule_bytes(max_batched_tokens, max_seqs, max_model_len, block_size))


def max_schedule_bytes(max_batched_tokens: int, max_seqs: int, max_model_len: int, block_size: int) -> int:
    """A schedule to a worker: per sequence its block table (on admission) and parameters, the step's token ids
    (a first chunk may also carry its prompt ids and cached ids: up to max_model_len each)."""
    per_seq = (512 + 9 * (-(-max_model_len // block_size)) + 9 * MAX_STOP_TOKEN_IDS + 18 * max_model_len
               + 4 * MAX_GRAMMAR_CHARS + TOKEN_EDIT_BYTES)  # (a structured output's grammar, UTF-8)
    return HEADER_SLACK + max_seqs * per_seq + 9 * max_batched_tokens
