"""Who is in the pipeline, and which phase each worker and the whole pipeline are in.

    pipeline:  REGISTERING --every rank registered--> LOADING --every worker Ready--> SERVING
                     \\________________ deadline passed, or a worker failed ___________\\--> DOWN
               SERVING --a worker lost--> RECOVERING --replacements registered and Ready--> SERVING
                                              \\--- --recovery-timeout passed ---> DOWN

    worker:    REGISTERING (registered, no assignment yet) -> LOADING (assigned) -> SERVING (Ready)
               -> DOWN (reported a failure, or stopped heartbeating)

Each waiting phase has a deadline (`--register-timeout`, `--ready-timeout`); the coordinator waits on
the events this registry sets, never by polling. No sockets and no asyncio tasks here: the coordinator
feeds it messages and the clock.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

from moemesh.log import get_logger
from moemesh.protocol import ProtocolError, Register

log = get_logger("coordinator")


class Phase(enum.Enum):
    REGISTERING = "registering"
    LOADING = "loading"
    SERVING = "serving"
    RECOVERING = "recovering"
    DOWN = "down"


@dataclass
class WorkerInfo:
    identity: bytes
    pp_rank: int
    tp_rank: int
    data_address: str
    rendezvous_address: str
    last_seen: float
    phase: Phase = Phase.REGISTERING
    busy_seconds: float = 0.0
    comm_seconds: float = 0.0
    sent_bytes: int = 0
    num_blocks: int = 0
    refused: int = 0  # handshakes its activation socket refused (its heartbeat says)
    malformed: int = 0  # messages it could not decode or use (its heartbeat says)
    last_step: int = -1  # the last step it finished (its heartbeat says)
    received_step: int = -1  # the last schedule it took (its heartbeat says)
    heard_at: float = 0.0  # when its last heartbeat came
    next_unreached: float = 0.0  # seconds its link to the next stage has been connecting, never connected
    relinks: int = 0  # times it made that link again after a refused handshake (its heartbeat says)
    relinked: bool = False  # made again since it last connected: what it held then was dropped
    pid: int = 0  # its process id on its host (as it registered)

    @property
    def rank(self) -> tuple[int, int]:
        return self.pp_rank, self.tp_rank


class WorkerRegistry:
    def __init__(self, pp: int, tp: int, clock=time.monotonic):
        self.pp, self.tp, self.clock = pp, tp, clock
        self.phase = Phase.REGISTERING
        self.epoch = 0  # bumped by every recovery
        self.first_step = 0  # the epoch's first step id (Reset, Ping and every Schedule carry it)
        self.refused_gone = self.malformed_gone = 0  # counted by workers no longer in the pipeline
        self.workers: dict[tuple[int, int], WorkerInfo] = {}
        self._by_identity: dict[bytes, WorkerInfo] = {}
        self.all_registered = asyncio.Event()
        self.all_ready = asyncio.Event()
        self.lost = asyncio.Event()  # a worker was lost (set by `lose`, cleared by whoever waits on it)
        self.went_down = asyncio.Event()

    @property
    def ranks(self) -> list[tuple[int, int]]:
        return [(p, t) for p in range(self.pp) for t in range(self.tp)]

    def enter(self, phase: Phase) -> None:
        """Moves the pipeline to `phase`; DOWN is final (until recovery is built, nothing leaves it)."""
        if self.phase is Phase.DOWN:
            return
        if phase is not self.phase:
            log.info("pipeline phase", extra={"fields": {"from": self.phase.value, "to": phase.value}})
            self.phase = phase
            if phase is Phase.DOWN:
                self.went_down.set()

    def register(self, identity: bytes, msg: Register) -> WorkerInfo:
        """A worker for a rank of the layout; ProtocolError for a rank outside it, or a rank that
        registers again once the pipeline has left REGISTERING (during a recovery, a replacement for
        a lost rank is welcome)."""
        key = (msg.pp_rank, msg.tp_rank)
        if not (0 <= msg.pp_rank < self.pp and 0 <= msg.tp_rank < self.tp):
            raise ProtocolError(f"registration for rank {key} outside pp={self.pp} tp={self.tp}")
        replacing = self.phase is Phase.RECOVERING and key not in self.workers
        if self.phase is not Phase.REGISTERING and not replacing:
            raise ProtocolError(f"rank {key} registered while the pipeline is {self.phase.value}")
        old = self.workers.get(key)
        if old is not None:
            self._by_identity.pop(old.identity, None)
        w = WorkerInfo(identity, msg.pp_rank, msg.tp_rank, msg.data_address, msg.rendezvous_address, self.clock(),
                       pid=msg.pid)
        self.workers[key] = self._by_identity[identity] = w
        if len(self.workers) == self.pp * self.tp:
            self.all_registered.set()
        return w

    def get(self, identity: bytes) -> WorkerInfo | None:
        return self._by_identity.get(identity)

    def missing(self) -> list[tuple[int, int]]:
        return sorted(set(self.ranks) - set(self.workers))

    def assigned(self, w: WorkerInfo) -> None:
        w.phase = Phase.LOADING

    def ready(self, w: WorkerInfo, num_blocks: int) -> None:
        w.num_blocks, w.phase = num_blocks, Phase.SERVING
        if all(x.phase is Phase.SERVING for x in self.workers.values()) and len(self.workers) == self.pp * self.tp:
            self.all_ready.set()

    def not_ready(self) -> list[tuple[int, int]]:
        return sorted(k for k, w in self.workers.items() if w.phase is not Phase.SERVING)

    def num_blocks(self) -> int:
        """The smallest pool of any worker: block ids are shared across stages."""
        return min(w.num_blocks for w in self.workers.values())

    def seen(self, w: WorkerInfo) -> None:
        w.last_seen = self.clock()

    def silent(self, timeout: float) -> WorkerInfo | None:
        """A worker not heard from for `timeout` seconds, if any."""
        now = self.clock()
        return next((w for w in self.workers.values() if now - w.last_seen > timeout), None)

    def next_silence(self, timeout: float) -> float:
        """Seconds until the earliest worker would count as silent."""
        if not self.workers:
            return timeout
        return max(0.0, min(w.last_seen for w in self.workers.values()) + timeout - self.clock())

    def lose(self, w: WorkerInfo) -> None:
        """A worker is gone (dead, silent or failed): its rank is missing until a replacement
        registers; the pipeline recovers (a new epoch)."""
        self.workers.pop(w.rank, None)
        self._by_identity.pop(w.identity, None)
        self.refused_gone += w.refused  # (what it counted still counts)
        self.malformed_gone += w.malformed
        w.phase = Phase.DOWN
        self.all_registered.clear()
        self.all_ready.clear()
        self.lost.set()
        if self.phase is not Phase.RECOVERING:
            self.epoch += 1
        self.enter(Phase.RECOVERING)

    def down(self, w: WorkerInfo | None = None) -> None:
        if w is not None:
            w.phase = Phase.DOWN
        self.enter(Phase.DOWN)

    def unreached(self, grace: float) -> tuple[tuple[int, int] | None, str]:
        """(rank, description) of the first link between stages that has been connecting for `grace`
        seconds or more without ever connecting (heartbeats say), or (None, "")."""
        stuck = sorted(w.rank for w in self.workers.values() if w.next_unreached >= grace)
        if not stuck:
            return None, ""
        w = self.workers[stuck[0]]
        nxt = self.workers.get((w.pp_rank + 1, w.tp_rank))
        where = f" at {nxt.data_address}" if nxt is not None else ""
        more = f" ({len(stuck) - 1} more such links)" if len(stuck) > 1 else ""
        return w.rank, (f"stage {w.pp_rank} (tp rank {w.tp_rank}) has not reached stage {w.pp_rank + 1}{where} "
                        f"in {w.next_unreached:.0f} s{more}: that stage's --advertise-host must be the address the "
                        f"other hosts reach it at (and, with --mesh-keys, its host must allow this worker's key)")

    def stage_rank0(self, field: str) -> list:
        """`field` of each stage's tensor rank 0 (what /status reports per stage)."""
        out = [0.0 if field.endswith("seconds") else 0] * self.pp
        for (p, t), w in self.workers.items():
            if t == 0:
                out[p] = getattr(w, field)
        return out
