"""Prometheus metrics, with vLLM's names where vLLM has one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0, 600.0,
            1800.0, 3600.0)  # (long answers on a CPU take minutes)
FINISHED_REASONS = ("stop", "length", "abort", "error")


class Metrics:
    def __init__(self, model: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model = model
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels, registry=r,
                              buckets=_LATENCY)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens of a request", labels,
                             registry=r, buckets=_LATENCY)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels, registry=r,
                             buckets=_LATENCY)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time a request waited to be scheduled", labels,
                               registry=r, buckets=_LATENCY)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels, registry=r)
        self.requests = Counter("vllm:request_success", "Requests finished", labels + ["finished_reason"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the pipeline", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted (their KV cache given up, to be "
                                   "recomputed)", labels, registry=r)
        self.stage_busy = Gauge("moemesh:stage_busy_fraction", "Share of the last interval each pipeline stage "
                                "spent computing", labels + ["stage"], registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                   registry=r)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Decodes that carried speculative draft tokens "
                                   "(--num-speculative-tokens)", labels, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens checked",
                                         labels, registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted",
                                     labels, registry=r)
        # (the coordinator's running totals, as counters: monotonic across a coordinator started afresh)
        self.recoveries = Counter("moemesh:recoveries", "Workers lost and the pipeline rebuilt without them", labels,
                                  registry=r)
        self.recovery_seconds = Counter("moemesh:recovery_seconds", "Seconds spent recovering, in all", labels,
                                        registry=r)
        self.requests_resumed = Counter("moemesh:requests_resumed", "Sequences recomputed after a recovery", labels,
                                        registry=r)
        self.worker_restarts = Counter("moemesh:worker_restarts", "Lost stage workers replaced by a restarted "
                                       "process", labels, registry=r)
        self.mesh_refused = Counter("moemesh:mesh_handshakes_refused", "Connections to mesh sockets refused for a "
                                    "missing or unknown CurveZMQ key", labels, registry=r)
        self.malformed = Counter("moemesh:malformed_messages", "Mesh messages that did not decode or could not be "
                                 "handled", labels, registry=r)
        self.slow_clients = Counter("moemesh:slow_clients_aborted", "Streaming requests aborted because their "
                                    "client stopped reading (--stream-timeout)", labels, registry=r)
        # every series there from the start (as vLLM's), so that rates and alerts see zeros, not "no data"
        for metric in (self.ttft, self.itl, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens,
                       self.slow_clients, self.recoveries, self.recovery_seconds, self.requests_resumed,
                       self.worker_restarts, self.mesh_refused, self.malformed):
            metric.labels(model)
        for reason in FINISHED_REASONS:
            self.requests.labels(model, reason)
        self._last_busy: tuple[float, list[float]] | None = None
        # the coordinator's running totals (StatusReply fields), each fed to its counter (update_from_status)
        self._totals = ((self.prefix_queries, "prefix_cache_queries"), (self.prefix_hits, "prefix_cache_hits"),
                        (self.preemptions, "num_preemptions"), (self.spec_drafts, "spec_drafts"),
                        (self.spec_draft_tokens, "spec_draft_tokens"), (self.spec_accepted, "spec_accepted_tokens"),
                        (self.recoveries, "recoveries"), (self.recovery_seconds, "recovery_seconds"),
                        (self.requests_resumed, "requests_resumed"), (self.worker_restarts, "workers_replaced"),
                        (self.mesh_refused, "mesh_refused"), (self.malformed, "malformed_messages"))
        self._last_totals = (0,) * len(self._totals)  # as the last status had them
        self._instance = None  # the coordinator that reported them

    def coordinator_silent(self, streams: int) -> None:
        """No status comes: the gauges say what this gateway knows (its requests still in flight), not
        the last status's figures, frozen."""
        m = self.model
        self.running.labels(m).set(streams)
        self.waiting.labels(m).set(0)
        self.kv_usage.labels(m).set(0)
        self.stage_busy.clear()
        self._last_busy = None

    def update_from_status(self, status, now: float) -> None:
        m = self.model
        self.running.labels(m).set(status.num_running)
        self.waiting.labels(m).set(status.num_waiting)
        self.kv_usage.labels(m).set(1 - status.num_free_blocks / status.num_blocks if status.num_blocks else 0)
        if self._last_busy is not None:
            then, busy = self._last_busy
            dt = max(now - then, 1e-9)
            for stage, (a, b) in enumerate(zip(busy, status.stage_busy_seconds)):
                self.stage_busy.labels(m, str(stage)).set(min(1.0, max(0.0, (b - a) / dt)))
        self._last_busy = (now, list(status.stage_busy_seconds))
        # the coordinator's running totals, as counters: what they rose by since the last status
        totals = tuple(getattr(status, field) for _, field in self._totals)
        if status.instance != self._instance or any(t < last for t, last in zip(totals, self._last_totals)):
            self._last_totals = (0,) * len(totals)  # a new coordinator counts from zero again
        self._instance = status.instance
        for (counter, _), total, last in zip(self._totals, totals, self._last_totals):
            counter.labels(m).inc(max(0, total - last))
        self._last_totals = totals
