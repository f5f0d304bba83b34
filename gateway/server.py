"""The OpenAI-compatible HTTP gateway (aiohttp on uvloop).

    POST /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages (Anthropic's)
         (streaming as server-sent events, or not); /v1/messages/count_tokens
    GET  /v1/models, /health (alive: serving or recovering), /ready (serving), /version, /metrics
    GET  /debug/timeline   (the pipeline's recent steps, stage by stage: a Perfetto / chrome://tracing file)
    POST /tokenize, /detokenize; GET /tokenizer_info   (the shapes lm-eval's local-completions uses)

The gateway owns the tokenizer and the chat template; the coordinator sees only token ids. Every
error is OpenAI's JSON shape with the right status. A client that goes away aborts its requests in
the coordinator, so their KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import hmac
import json
import math
import os
import re
import socket
import ssl
import time
import typing
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import tools as tool_calls
from gateway.beam import BeamSearch, BeamSettings
from gateway.chat import ChatTemplate, TemplateError
from gateway.detokenizer import IncrementalDetokenizer
from gateway.metrics import Metrics
from gateway.schemas import (CONSTRAINTS, VLLM_UNSUPPORTED, ChatCompletionRequest, CompletionRequest,
                             DetokenizeRequest, SamplingFields, TokenizeRequest, stop_list)
from gateway.reasoning import ReasoningMode, ReasoningStream
from gateway import reasoning as thoughts
from gateway import messages as messages_api
from gateway import responses as responses_api
from gateway.messages import MessageBuilder, MessagesRequest
from gateway.responses import ResponseBuilder, ResponsesRequest
from gateway.tools import ToolError, ToolMode, ToolStream
from moemesh import __version__, structured
from moemesh.client import CoordinatorClient
from moemesh.config import ModelConfig, generation_defaults
from moemesh.errors import ConfigError
from moemesh.log import get_logger
from moemesh.mesh_security import check_exposure, is_loopback
from moemesh.protocol import PROTOCOL_VERSION, TokenLogprobs
from moemesh.sampling import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from moemesh.settings import GatewaySettings
from moemesh.timeline import chrome_trace
from moemesh.tokenizer import TextTokenizer, whole_characters

log = get_logger("gateway")

MAX_N = 16  # choices per prompt
MAX_LENGTH_PENALTY = 10.0  # a beam search's (a 128k-token beam's length to the 10th power is still a float)
THOUGHT_TAIL_TOKENS = 8  # a chat prompt's last tokens, read for a `<think>` its template ends with
MAX_BAD_WORD_CHARS = 256  # a bad word's characters (tokenized twice on the event loop)
MAX_PROMPTS = 256  # prompts in one completions request
# seconds of the coordinator's silence after which the requests in flight end with an error: the
# longest stall tolerated (a coordinator that answers again still holds them; past the workers'
# --coordinator-timeout, 10 s, they register again and it recovers, once it answers)
COORDINATOR_LOST = 30.0
MAX_STOP, MAX_STOP_CHARS = 16, 1000  # stop strings, and the length of each
DRAIN_MARGIN = 2.0  # seconds past --drain-timeout for the requests it ended to say so (Gateway._drain)
STREAM_SEND_BUFFER = 256 << 10  # bytes of a streaming response the kernel holds for a client (thousands of events)
COORDINATOR_SILENT = "the coordinator does not answer"
HEADERS_AFTER = 1.0  # seconds a stream waits for its first event before its headers may go out without it
KEEPALIVE = 15.0  # seconds of silence before a stream that sent its headers early says it is still waiting
BODY_TIMEOUTS = 4  # a request body arrives whole within this many --stream-timeout (an 8 MiB one at 70 KB/s)


class SlowClient(Exception):
    """A streaming client did not take an event within --stream-timeout."""


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                 code: str | None = None):
        """code: OpenAI's name for the error where it has one (context_length_exceeded); else the status."""
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.code = status, message, param, headers or {}, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                429: "rate_limit_error",
                503: "service_unavailable"}.get(
            self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code or self.status}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


@dataclass(frozen=True)
class Delta:
    """What one coordinator output added to a choice, taken when it came (the choice goes on changing
    while the delta waits in the queue)."""
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    has_tokens: bool
    prompt_logprobs: list | None
    tokens: int = 0  # how many it added
    cached_tokens: int | None = None  # the first's: prompt tokens the prefix cache held


@dataclass(frozen=True)
class Plan:
    """How a request's jobs run where not as one sequence each: a beam search per prompt (gateway/beam.py),
    or the prompt alone (echo with max_tokens 0: one token is generated, and not shown)."""
    search: list[BeamSettings] | None = None
    prompt_only: bool = False


@dataclass
class Choice:
    """One generated sequence of a request, as it streams."""
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens the coordinator found in its prefix cache


class Gateway:
    def __init__(self, cfg: GatewaySettings):
        check_exposure(cfg.mesh_keys, cfg.insecure_mesh, coordinator=cfg.coordinator)
        self.cfg = cfg
        self.client: CoordinatorClient | None = None
        self.status = None
        self.pending = 0
        self.down: str | None = None  # set by whoever runs the gateway when the mesh is gone for good
        self._askers: list[asyncio.Future] = []  # streams waiting for the next shared status round trip
        self._asking: asyncio.Future | None = None  # the task asking it
        # (an empty --api-key, "$KEY" of a KEY left unset, falls back on the variable as it always did)
        key = cfg.api_key if (cfg.api_key or "").strip() else os.environ.get("MOEMESH_API_KEY", cfg.api_key)
        self.api_keys = load_api_keys(key, cfg.api_key_file)
        if key is not None and not key.strip() and not self.api_keys:  # (a variable left unset, say: not silently)
            log.warning("--api-key (or MOEMESH_API_KEY) is empty: /v1/ is served without an API key",
                        extra={"fields": {"host": cfg.host, "port": cfg.port}})
        elif not self.api_keys and not all(is_loopback(h.strip()) for h in cfg.host.split(",")):
            log.warning("no --api-key: /v1/ is served without an API key on an address beyond this host",
                        extra={"fields": {"host": cfg.host, "port": cfg.port}})

    # -- setup ---------------------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        self.client = CoordinatorClient(self.cfg.coordinator, mesh_keys=self.cfg.mesh_keys)
        self.status = None
        for waited in range(0, 600, 30):  # (the HTTP port opens once the pipeline serves)
            try:
                self.status = await self.client.wait_serving(timeout=30)
                break
            except TimeoutError:
                log.warning("waiting for the pipeline to serve", extra={"fields": {
                    "coordinator": self.cfg.coordinator, "seconds": waited + 30}})
        if self.status is None:
            raise TimeoutError(f"the coordinator at {self.cfg.coordinator} did not serve within 600 s")
        model_dir = self.cfg.model or self.status.model
        self.tokenizer = TextTokenizer(model_dir)
        config = ModelConfig.from_dir(model_dir)
        self.vocab_size = config.vocab_size  # the model's, may exceed the tokenizer's
        try:  # structured outputs' reading of it (the last stage's, which masks the logits)
            self.grammar_tokenizer, self.grammar_unavailable = (
                structured.tokenizer(model_dir, config.vocab_size, config.eos_token_ids), None)
        except ValueError as e:
            self.grammar_tokenizer, self.grammar_unavailable = None, str(e)
        self.chat_template = ChatTemplate.from_dir(model_dir)
        # a --reasoning-parser reads the thought's tags in the text, which keeps them where they are special
        # tokens; a constraint after the thought matches them as tokens then
        tags = [self.tokenizer.encode(tag, add_special_tokens=False) for tag in (thoughts.THINK_OPEN,
                                                                                 thoughts.THINK_CLOSE)]
        self.thought_tags = (tags[0][0], tags[1][0]) if all(
            len(t) == 1 and t[0] in self.tokenizer.special_ids for t in tags) else None
        self.eos_token_ids = tuple(config.eos_token_ids)
        self.model_name = self.cfg.served_model_name or os.path.basename(os.path.normpath(model_dir))
        self._set_max_model_len(self.status.max_model_len)
        # the model's recommended sampling, for requests that do not say (vLLM's --generation-config auto)
        self.defaults = generation_defaults(model_dir) if self.cfg.generation_config == "auto" else {}
        if self.defaults:
            log.info("request defaults from the model's generation_config.json", extra={"fields": self.defaults})
        self.metrics = Metrics(self.model_name)
        self.responses_store = responses_api.ResponseStore(self.cfg.max_stored_responses)
        self.created = int(time.time())
        self._stopping = False
        self._drain_timer: asyncio.TimerHandle | None = None
        self._poller = asyncio.ensure_future(self._poll_status())

    def _set_max_model_len(self, n: int) -> None:
        self.max_model_len = n
        # the longest text any prompt could be (every token the longest): longer is refused untokenized
        self.max_prompt_chars = n * max(1, self.tokenizer.longest_token_chars()) + 1024

    async def stop(self, app: web.Application) -> None:
        self._stopping = True  # (asyncio.wait_for of Python 3.11 can swallow a cancel that meets its result)
        if getattr(self, "_drain_timer", None) is not None:
            self._drain_timer.cancel()
        for task in (self._poller, self._asking):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._poller, self._asking) if t is not None), return_exceptions=True)
        await self.client.close()

    async def _drain(self, app: web.Application) -> None:
        """Stopping (SIGTERM): the gateway listens no more, and aiohttp waits for the requests under way.
        Those still open --drain-timeout seconds from now end then, each with an error (an error event and
        [DONE] in a stream; a 503), and their sequences are aborted. (aiohttp's own timeout would let a
        stream go on for a second --drain-timeout, then cut it mid-chunk with no word.)"""
        def cut() -> None:
            if self.client is not None and self.client.streams:
                log.warning("requests still open at the drain timeout end now", extra={"fields": {
                    "requests": len(self.client.streams), "seconds": self.cfg.drain_timeout}})
                self.client.fail_all(f"the gateway is stopping: requests still open after --drain-timeout "
                                     f"{self.cfg.drain_timeout:g} s were ended")

        self._drain_timer = asyncio.get_running_loop().call_later(self.cfg.drain_timeout, cut)

    async def _poll_status(self) -> None:
        """The coordinator's status twice a second. Silent, it is down (/health says so) but its
        requests go on: a coordinator that was only stalled still holds them and streams on (its
        workers, silent too, register again and it recovers). They end when a new coordinator answers
        (its instance id: the old one and its requests are gone), or after COORDINATOR_LOST seconds
        of silence (dead, and nothing restarts it)."""
        silent_since = None
        while not self._stopping:
            try:
                status = await self.client.status(timeout=2.0)
                if status.instance != self.status.instance:  # a new coordinator: ours are gone
                    log.error("coordinator restarted", extra={"fields": {"requests": len(self.client.streams)}})
                    self.client.fail_all("the coordinator restarted")
                if self.down:  # (the coordinator may still answer: its launcher has given up on the mesh)
                    status = msgspec.structs.replace(status, serving=False, failure=self.down, phase="down")
                elif silent_since is not None:
                    log.info("coordinator answers again", extra={"fields": {
                        "silent_seconds": round(time.monotonic() - silent_since, 1)}})
                self.status = status
                if status.max_model_len and status.max_model_len != self.max_model_len:
                    self._set_max_model_len(status.max_model_len)  # (a recovery rebuilt the KV pool)
                self.metrics.update_from_status(self.status, time.monotonic())
                silent_since = None
            except asyncio.TimeoutError:
                now = time.monotonic()
                if silent_since is None:
                    silent_since = now
                    if not self.down:
                        log.warning("coordinator silent", extra={"fields": {"requests": len(self.client.streams)}})
                # (a mesh its launcher gave up on keeps that reason: it says what to do)
                reason = self.down or COORDINATOR_SILENT
                self.status = msgspec.structs.replace(self.status, serving=False, failure=reason, phase="down")
                if now - silent_since >= COORDINATOR_LOST and self.client.streams:
                    log.error("coordinator lost", extra={"fields": {"requests": len(self.client.streams),
                                                                    "silent_seconds": round(now - silent_since, 1)}})
                    self.client.fail_all(reason)
                self.metrics.coordinator_silent(len(self.client.streams))
            await asyncio.sleep(0.5)

    def fail(self, reason: str) -> None:
        """The mesh is gone for good (its launcher gave up on it): 503 with the reason from now on, and
        the requests in flight end with it."""
        self.down = reason
        if self.status is not None:
            self.status = msgspec.structs.replace(self.status, serving=False, failure=reason, phase="down")
        if self.client is not None:
            self.client.fail_all(reason)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        app.on_startup.append(self.start)
        app.on_shutdown.append(self._drain)
        app.on_cleanup.append(self.stop)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.response_input_items)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)  # (a served name may hold a slash)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/debug/timeline", self.timeline)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if request.path.startswith(("/v1/", "/debug/")) and self.api_keys:
                # (Anthropic's clients send the key as x-api-key)
                given = request.headers.get("Authorization") or \
                    ("Bearer " + request.headers["x-api-key"] if "x-api-key" in request.headers else "")
                if not key_matches(given, self.api_keys):
                    raise HTTPError(401, "missing or wrong API key (Authorization: Bearer ..., or x-api-key)")
            return await handler(request)
        except HTTPError as e:
            return _refusal(request.path, e)
        except web.HTTPRequestEntityTooLarge:
            return _refusal(request.path, HTTPError(413, f"request body larger than {self.cfg.max_body_bytes} bytes"))
        except web.HTTPNotFound:
            return _refusal(request.path, HTTPError(404, f"no route {request.method} {request.path}"))
        except web.HTTPMethodNotAllowed:
            return _refusal(request.path, HTTPError(405, f"{request.method} is not allowed on {request.path}"))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # a bug: say so in OpenAI's shape, and log it
            log.error("request failed", exc_info=True, extra={"fields": {"path": request.path}})
            return _refusal(request.path, HTTPError(500, f"internal error: {type(e).__name__}"))

    # -- plain endpoints -----------------------------------------------------------------------

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        self._check_model(request.match_info["model"])
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moemesh",
                "max_model_len": self.max_model_len}

    def _accepting(self) -> bool:
        """Requests are taken while the pipeline serves or recovers (they wait for it), but not while a
        link between its stages has never connected (every step would wait for it)."""
        return (self.status.serving or self.status.phase == "recovering") and not self.status.unreached

    def _not_serving(self) -> HTTPError:
        starting = "the coordinator is stopping" if self.status.phase == "stopping" else "starting"
        reason = self.status.failure or self.status.unreached
        # soon, unless it is down; a silent coordinator (stalled, or being restarted) in a few seconds
        retry = "1" if not reason else "5" if reason == COORDINATOR_SILENT and not self.down else None
        return HTTPError(503, f"the pipeline is not serving: {reason or starting}",
                         headers={"Retry-After": retry} if retry else None)

    async def health(self, request):
        """Whether this gateway and its pipeline are alive: 200 while serving or recovering (but not
        while a link between stages has never connected)."""
        if not self._accepting():
            raise self._not_serving()
        return web.json_response({"status": "ok", "pipeline": self.status.phase or "serving"})

    async def ready(self, request):
        """For load balancers: 200 only while the pipeline serves (not while it recovers)."""
        phase = self.status.phase or ("serving" if self.status.serving else "down")
        ready = self.status.serving and not self.status.unreached
        body = {"ready": ready, "pipeline": phase}
        if self.status.failure or self.status.unreached:
            body["reason"] = self.status.failure or self.status.unreached
        return web.json_response(body, status=200 if ready else 503)

    async def version(self, request):
        return web.json_response({"version": __version__})

    async def metrics_endpoint(self, request):
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def timeline(self, request):
        """The last steps of every stage and of the coordinator (moemesh.timeline), as a trace file to
        open in ui.perfetto.dev or chrome://tracing. (A stage's spans come with its heartbeats: its
        last half second may not be there yet.)"""
        try:
            status = await self.client.status(timeout=5.0, timeline=True)
        except asyncio.TimeoutError:
            raise HTTPError(503, "the coordinator does not answer") from None
        # (several MB for a long pipeline: built beside the event loop, which keeps streaming)
        body = await asyncio.to_thread(lambda: json.dumps(chrome_trace(status)))
        return web.Response(text=body, content_type="application/json")

    async def tokenize(self, request):
        body = await self._parse(request, TokenizeRequest)
        self._check_model(body.model)
        if body.chat_template is not None:  # (as chat refuses it: the tokens would not be the template's)
            raise HTTPError(400, "chat_template is not supported by this server", "chat_template")
        if body.messages is not None:
            ids = self._chat_prompt(body.messages, body.add_generation_prompt, body.chat_template_kwargs or {},
                                    body.continue_final_message, bool(body.add_special_tokens),
                                    self._tools(body.tools))
        elif body.prompt is not None:
            ids = self._encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            raise HTTPError(400, "give `prompt` or `messages`", "prompt")
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def detokenize(self, request):
        body = await self._parse(request, DetokenizeRequest)
        self._check_model(body.model)
        # (no API key guards this route, as in vLLM: more ids than a context holds are refused before
        # the work, which runs on the event loop, as _encode bounds a text)
        if len(body.tokens) > self.max_model_len:
            raise HTTPError(400, f"{len(body.tokens)} token ids, more than this model's context holds "
                                 f"({self.max_model_len})", "tokens")
        self._check_ids(body.tokens, "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)})

    async def tokenizer_info(self, request):
        tok = self.tokenizer
        return web.json_response({
            "tokenizer_class": tok.config.get("tokenizer_class", "PreTrainedTokenizerFast"),
            "eos_token": tok.special_token("eos_token"), "bos_token": tok.special_token("bos_token"),
            "pad_token": tok.special_token("pad_token"), "unk_token": tok.special_token("unk_token"),
            "model_max_length": self.max_model_len, "vocab_size": tok.vocab_size,
            "chat_template": self.chat_template.source if self.chat_template else None})

    # -- generation ----------------------------------------------------------------------------

    async def completions(self, request):
        body = await self._parse(request, CompletionRequest)
        self._check_model(body.model)
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise HTTPError(400, f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
        given = self._prompts(body.prompt)
        prompts = [self._truncated(body, p) for p in given]
        # echo shows a text prompt as it was sent (the ids may decode otherwise: a BOS, normalization), and
        # token ids, or a prompt cut by truncate_prompt_tokens, as they decode: up to a character they end
        # inside of, which the generated text starts with, whole (IncrementalDetokenizer)
        texts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        echoes = [t if isinstance(t, str) and len(p) == len(g) else self._echo(p)
                  for t, p, g in zip(texts, prompts, given)] if body.echo else None
        # echo with max_tokens 0: the prompt and its logprobs alone (OpenAI's legacy scoring, and vLLM's)
        prompt_only = body.echo and body.max_tokens == 0

        def max_tokens(prompt):  # (left out: OpenAI's 16; null: the rest of the context, as vLLM)
            if prompt_only:
                return 1
            if body.max_tokens is msgspec.UNSET:
                return 16
            return max(1, self.max_model_len - len(prompt)) if body.max_tokens is None else body.max_tokens

        self._check_prompt_logprobs(body)
        # the echo's logprobs and vLLM's prompt_logprobs come from one computation, with the larger top-N
        asked = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
        bad_words = self._bad_words(body.bad_words)  # (tokenized once for all the prompts)
        params = [self._params(body, len(p), max_tokens(p), body.logprobs, max(asked, default=None),
                               bad_words=bad_words) for p in prompts]
        return await self._serve(request, body, "cmpl", prompts, params, chat=False, echoes=echoes,
                                 prompt_only=prompt_only)

    async def chat_completions(self, request):
        body = await self._parse(request, ChatCompletionRequest)
        ids, params, mode, thinking = self._chat_job(body)
        return await self._serve(request, body, "chatcmpl", [ids], params, chat=True, tools=mode,
                                 thinking=thinking)

    async def responses(self, request):
        """OpenAI's Responses API: the request as a chat completion's (gateway/responses.py), its answer as
        output items."""
        body = await self._parse(request, ResponsesRequest)
        previous = None
        if body.previous_response_id is not None:
            previous = self.responses_store.get(body.previous_response_id)
            if previous is None:
                kept = "" if self.cfg.max_stored_responses else " (this gateway keeps none: --max-stored-responses 0)"
                raise HTTPError(400, f"previous response with id {body.previous_response_id!r} not found{kept}",
                                "previous_response_id", code="previous_response_not_found")
        chat, ids, params, mode, thinking = self._as_chat(responses_api, body, previous=previous)
        return await self._serve(request, chat, "resp", [ids], params, chat=True, tools=mode, thinking=thinking,
                                 builder=ResponseBuilder(body, self.model_name, self.responses_store, previous))

    def _stored(self, request) -> responses_api.Stored:
        rid = request.match_info["response_id"]
        stored = self.responses_store.get(rid)
        if stored is None:
            raise HTTPError(404, f"response with id {rid!r} not found (this gateway keeps the last "
                                 f"{self.cfg.max_stored_responses} it answered with store true)")
        return stored

    async def stored_response(self, request):
        """GET /v1/responses/{id}: a response this gateway kept (whole: only a background response, which this
        server does not run, streams again)."""
        stored = self._stored(request)
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise HTTPError(400, "only background responses can be streamed again; this server runs none", "stream")
        if any(k.startswith("include") for k in request.query):
            raise HTTPError(400, "include is not supported by this server", "include")
        return web.json_response(stored.response)

    async def delete_response(self, request):
        """DELETE /v1/responses/{id}: forgets a kept response (a later previous_response_id naming it is a 400)."""
        rid = self._stored(request).response["id"]
        self.responses_store.delete(rid)
        return web.json_response({"id": rid, "object": "response", "deleted": True})

    async def response_input_items(self, request):
        """GET /v1/responses/{id}/input_items: the kept response's input items, a page at a time (limit 1-100,
        20 by default; order desc, the default, or asc; after an item id)."""
        stored = self._stored(request)
        q = request.query
        if any(k.startswith("include") for k in q):
            raise HTTPError(400, "include is not supported by this server", "include")
        try:
            limit = int(q.get("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise HTTPError(400, "limit must be an integer from 1 to 100", "limit")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise HTTPError(400, "order must be asc or desc", "order")
        try:
            return web.json_response(responses_api.input_items_page(stored, limit, order, q.get("after")))
        except ValueError as e:
            raise HTTPError(400, str(e), "after") from None

    async def messages(self, request):
        """Anthropic's Messages API: the request as a chat completion's (gateway/messages.py), its answer as
        content blocks; errors in Anthropic's shape (the middleware's `_refusal`). Its max_tokens, which
        Anthropic's clients always send and often large, is lowered to what the context leaves."""
        body = await self._parse(request, MessagesRequest)
        if body.max_tokens < 1:
            raise HTTPError(400, "max_tokens must be at least 1", "max_tokens")
        chat, ids, params, mode, thinking = self._as_chat(messages_api, msgspec.structs.replace(body, max_tokens=None))
        # (without max_tokens, the chat path gives the context's rest, or less: generation_config's cap)
        params = [msgspec.structs.replace(params[0], max_tokens=min(params[0].max_tokens, body.max_tokens))]
        # (the context's end cut the answer, not a max_tokens: the client's, or generation_config's below it)
        limit = params[0].max_tokens
        capped = limit < body.max_tokens and limit >= self.max_model_len - len(ids)
        return await self._serve(request, chat, "msg", [ids], params, chat=True, tools=mode, thinking=thinking,
                                 builder=MessageBuilder(self.model_name, len(ids), capped=capped))

    async def count_tokens(self, request):
        """Anthropic's token count of a message request: its prompt's tokens, as /v1/messages renders it
        (Anthropic's clients ask before they send a long conversation)."""
        body = await self._parse(request, messages_api.CountTokensRequest)
        self._check_model(body.model)
        try:
            chat = msgspec.convert(messages_api.chat_request(body), type=ChatCompletionRequest)
        except messages_api.MessagesError as e:
            raise HTTPError(400, str(e), e.param) from None
        except msgspec.ValidationError as e:
            raise HTTPError(400, f"invalid request: {e}") from None
        ids = self._chat_prompt(chat.messages, chat.add_generation_prompt, chat.chat_template_kwargs or {},
                                chat.continue_final_message, chat.add_special_tokens, self._tools(chat.tools))
        return web.json_response({"input_tokens": len(ids)})

    def _as_chat(self, api, body, **context):
        """Another API's request (gateway/responses.py's, gateway/messages.py's) as the chat request that
        answers it, checked: (the chat request, prompt, sampling parameters, tool calling, reasoning); a
        400 names the field as that API does."""
        try:
            chat = msgspec.convert(api.chat_request(body, **context), type=ChatCompletionRequest)
            return (chat, *self._chat_job(chat))
        except (responses_api.ResponsesError, messages_api.MessagesError) as e:
            raise HTTPError(400, str(e), e.param) from None
        except msgspec.ValidationError as e:
            raise HTTPError(400, f"invalid request: {e}") from None
        except HTTPError as e:
            if e.param in api.FIELDS:  # (the chat field's name in the message too, where the message opens with it)
                named = api.FIELDS[e.param]
                e.message = re.sub(rf"^{re.escape(e.param)}(?![\w])", api.NAMES.get(e.param, named), e.message)
                e.param = named
            raise

    def _chat_job(self, body: ChatCompletionRequest) -> tuple[list[int], list[SamplingParams], ToolMode | None,
                                                               ReasoningMode | None]:
        """A chat request's prompt, sampling parameters, tool calling and reasoning, checked (400s)."""
        self._check_model(body.model)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise HTTPError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        for name, given in (("echo", body.echo), ("chat_template", body.chat_template is not None)):
            if given:
                raise HTTPError(400, f"{name} is not supported by this server", name)
        for name in ("functions", "function_call"):  # (answered without them, they would be ignored)
            if getattr(body, name) is not None:
                raise HTTPError(400, f"{name} (the legacy form of tools and tool_choice) is not supported by this "
                                     f"server: give tools and tool_choice", name)
        template_kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:  # (the template reads it, as the responses' reasoning.effort)
            if not body.reasoning_effort:
                raise HTTPError(400, "reasoning_effort must be a string, e.g. low, medium or high", "reasoning_effort")
            template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        tools = self._tools(body.tools)
        try:
            mode, constraint = tool_calls.tool_mode(tools, body.tool_choice, body.parallel_tool_calls,
                                                    self.cfg.tool_call_parser)
        except ToolError as e:
            raise HTTPError(400, str(e), e.param) from None
        ids = self._truncated(body, self._chat_prompt(body.messages, body.add_generation_prompt,
                                                      template_kwargs, body.continue_final_message,
                                                      body.add_special_tokens, tools))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self._check_prompt_logprobs(body)
        thinking = None
        if self.cfg.reasoning_parser:
            thinking = ReasoningMode.of(self.cfg.reasoning_parser, self._opens_thought(body, ids),
                                        body.include_reasoning)
        params = [self._params(body, len(ids), max_tokens, logprobs, body.prompt_logprobs, param, "messages",
                               constraint, thinking=thinking)]
        return ids, params, mode, thinking

    def _opens_thought(self, body: ChatCompletionRequest, ids: list[int]) -> bool:
        """Whether the chat prompt leaves the answer inside a thought: its template ends it with `<think>`
        (Qwen3's thinking-2507 models, DeepSeek-R1-0528), or the final message it continues has one open."""
        if (body.chat_template_kwargs or {}).get("continue_final_message", body.continue_final_message):
            return thoughts.opens_thought(_text_content(body.messages[-1].get("content")))
        tail = self.tokenizer.decode(ids[-THOUGHT_TAIL_TOKENS:], skip_special_tokens=False)
        return tail.rstrip().endswith(thoughts.THINK_OPEN)

    @staticmethod
    def _tools(tools) -> list[dict] | None:
        if not tools:
            return None
        try:
            return tool_calls.functions(tools)
        except ToolError as e:
            raise HTTPError(400, str(e), e.param) from None

    @staticmethod
    def _check_prompt_logprobs(body: SamplingFields) -> None:
        """vLLM's prompt_logprobs: 0 to MAX_LOGPROBS alternatives, and not in a stream (as vLLM)."""
        if body.prompt_logprobs is None:
            return
        if not 0 <= body.prompt_logprobs <= MAX_LOGPROBS:
            raise HTTPError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
        if body.stream:
            raise HTTPError(400, "prompt_logprobs is not available when streaming (stream: true)", "prompt_logprobs")

    def _truncated(self, body: SamplingFields, prompt: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as the context takes)."""
        k = body.truncate_prompt_tokens
        if k is None:
            return prompt
        if k == -1:
            k = self.max_model_len
        if k < 1:
            raise HTTPError(400, "truncate_prompt_tokens must be at least 1, or -1", "truncate_prompt_tokens")
        return prompt[-k:]

    def _params(self, body: SamplingFields, prompt_len: int, max_tokens: int, logprobs, prompt_logprobs,
                max_tokens_param: str = "max_tokens", prompt_param: str = "prompt", tool_constraint: dict | None = None,
                bad_words: tuple[tuple[int, ...], ...] | None = None, thinking: ReasoningMode | None = None):
        """tool_constraint: the structured output a tool_choice asks for (gateway/tools.py), as fields;
        bad_words: the request's, tokenized (`_bad_words`), or None to tokenize them here; thinking: a chat
        answer's reasoning (gateway/reasoning.py), which a constraint follows."""
        unsupported = ["suffix"] if getattr(body, "suffix", None) else []
        unsupported += [name for name in VLLM_UNSUPPORTED if _given(getattr(body, name), getattr(_DEFAULTS, name))]
        if unsupported:
            raise HTTPError(400, f"{unsupported[0]} is not supported by this server", unsupported[0])
        if body.stream_options is not None and body.stream_options.include_usage and not body.stream:
            raise HTTPError(400, "stream_options is only for a streamed request (stream: true)", "stream_options")
        if body.stream_options is not None and body.stream_options.continuous_usage_stats:
            raise HTTPError(400, "stream_options.continuous_usage_stats (usage on every chunk) is not supported by "
                                 "this server: include_usage gives it once, in the last chunk", "stream_options")
        if max_tokens < 1:
            raise HTTPError(400, f"{max_tokens_param} must be at least 1", max_tokens_param)
        max_tokens = min(max_tokens, self.defaults.get("max_tokens", max_tokens))  # (vLLM caps it there too)
        if prompt_len >= self.max_model_len:  # (whatever max_tokens asks, or the context's rest it defaults to)
            raise HTTPError(400, f"this model's maximum context length is {self.max_model_len} tokens; the "
                                 f"prompt has {prompt_len}, which leaves no room for a completion",
                            prompt_param, code="context_length_exceeded")
        if prompt_len + max_tokens > self.max_model_len:
            raise HTTPError(400, f"this model's maximum context length is {self.max_model_len} tokens; the "
                                 f"prompt has {prompt_len} tokens and {max_tokens_param} asks for {max_tokens}, "
                                 f"{prompt_len + max_tokens} in all", max_tokens_param, code="context_length_exceeded")
        if not 1 <= body.n <= MAX_N:
            raise HTTPError(400, f"n must be in [1, {MAX_N}]", "n")
        if body.best_of is not None and body.best_of != body.n and not body.use_beam_search:
            raise HTTPError(400, "best_of other than n is only for beam search (use_beam_search); give n alone",
                            "best_of")
        stop = stop_list(body.stop)
        if len(stop) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
            raise HTTPError(400, f"stop takes at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters", "stop")
        fields = {k: getattr(body, k) if getattr(body, k) is not None else self.defaults.get(k)
                  for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                            "repetition_penalty")}
        fields = {k: v for k, v in fields.items() if v is not None}
        if fields.get("top_k") == -1:
            fields["top_k"] = 0  # (-1: off, as vLLM spells it)
        seed = None if body.seed == -1 else body.seed  # (-1: no seed, as vLLM reads it)
        if seed is not None:  # any 64-bit integer, signed or not (vLLM takes the signed; the sampler's are 63-bit)
            if not -(1 << 63) <= seed < 1 << 64:
                raise HTTPError(400, "seed must be a 64-bit integer", "seed")
            seed %= 1 << 63
        grammar = self._grammar(body, tool_constraint, thinking)
        bias, allowed = self._logit_bias(body.logit_bias), body.allowed_token_ids
        if allowed is not None:
            if not allowed:
                raise HTTPError(400, "allowed_token_ids must name at least one token", "allowed_token_ids")
            self._check_ids(allowed, "allowed_token_ids")
            allowed = sorted(set(allowed))  # (so at most the vocabulary: SamplingParams' bound holds)
        bad_words = self._bad_words(body.bad_words) if bad_words is None else bad_words
        for param, given in (("logit_bias", bias), ("allowed_token_ids", allowed is not None),
                             ("bad_words", bad_words)):
            if given:
                self._require_protocol(param, 7)
        salt = getattr(body, "cache_salt", None)  # (its length: SamplingParams' check, a 400 naming it)
        if salt is not None:
            self._require_protocol("cache_salt", 9)
        try:
            return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=body.ignore_eos,
                                  min_tokens=body.min_tokens, stop_token_ids=tuple(body.stop_token_ids or ()),
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs, grammar=grammar,
                                  logit_bias=bias, allowed_token_ids=None if allowed is None else tuple(allowed),
                                  bad_words=bad_words, cache_salt=salt, **fields)
        except ValueError as e:
            raise HTTPError(400, str(e), str(e).split()[0]) from None

    def _grammar(self, body: SamplingFields, tool_constraint: dict | None,
                 thinking: ReasoningMode | None = None) -> str | None:
        """The request's structured output as an llguidance grammar (moemesh/structured.py), checked
        against the model's tokenizer, or None. With `thinking` (a --reasoning-parser), it applies after
        the answer's thought, which it leaves free (as vLLM's)."""
        given = {name: getattr(body, name) for name in CONSTRAINTS}
        param = next((k for k, v in given.items() if v is not None), None)
        whitespace = body.guided_whitespace_pattern  # (for the JSON constraint given, or the tool choice's)
        try:
            grammar = structured.grammar_of(given, self.grammar_tokenizer,
                                            whitespace if tool_constraint is None else None)
        except structured.ConstraintError as e:
            raise HTTPError(400, str(e), e.param) from None
        if tool_constraint is not None:
            if grammar is not None:
                raise HTTPError(400, "tool_choice required or of a function constrains the answer already: give "
                                     "no response_format or structured_outputs with it", "tool_choice")
            param = "tool_choice"
            try:
                grammar = structured.grammar_of(tool_constraint, self.grammar_tokenizer, whitespace)
            except structured.ConstraintError as e:  # (a function's parameters: not a schema llguidance takes)
                raise HTTPError(400, f"a tool's parameters: {str(e).removeprefix('guided_json: ')}", "tools") from None
        if grammar is None:
            return None
        if self.grammar_tokenizer is None:
            raise HTTPError(400, f"structured outputs are not available with this model: {self.grammar_unavailable}",
                            param)
        self._require_protocol(param, 6)
        if thinking is not None:
            try:
                grammar = structured.after_thought(grammar, thinking.thinking, self.thought_tags, self.eos_token_ids,
                                                   self.grammar_tokenizer, param)
            except structured.ConstraintError as e:
                raise HTTPError(400, str(e), e.param) from None
        return grammar

    def _require_protocol(self, param: str, version: int) -> None:
        """A 503 where the coordinator is older than the protocol `version` that brought the sampling field
        (a grammar: 6, logit_bias and allowed_token_ids: 7, cache_salt: 9): it would drop the field it does
        not know of and answer as if it were not given."""
        if self.status.protocol < version:
            raise HTTPError(503, f"the coordinator speaks protocol {self.status.protocol}, older than this gateway's "
                                 f"{PROTOCOL_VERSION}, and would ignore {param}: run the same moemesh version on "
                                 f"every host")

    def _logit_bias(self, given: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's logit_bias ({"token id": bias in [-100, 100]}) as SamplingParams takes it."""
        if not given:
            return ()
        if len(given) > MAX_LOGIT_BIAS:
            raise HTTPError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
        out: dict[int, float] = {}  # ("5" and "05" name one token: the last given wins, as vLLM's dict)
        for key, bias in given.items():
            digits = key.strip()  # (ASCII digits: "²" is a digit to str.isdigit, not to int)
            if not (digits.isascii() and digits.isdigit() and len(digits) <= 10) or not -100 <= bias <= 100:
                raise HTTPError(400, f"logit_bias maps token ids to biases in [-100, 100]; got {key[:20]!r}: "
                                     f"{bias!r}", "logit_bias")  # (JSON has no NaN)
            out[int(digits)] = float(bias)
        self._check_ids(list(out), "logit_bias")
        return tuple(out.items())

    def _bad_words(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences: each word (leading spaces stripped, as vLLM) as the model
        writes it at the text's start and after a space, both where they differ (vLLM keeps the second
        only where it is as long as the first: this bans a few more)."""
        if not words:
            return ()
        if len(words) > MAX_BAD_WORDS:
            raise HTTPError(400, f"bad_words takes at most {MAX_BAD_WORDS} words", "bad_words")
        out: dict[tuple[int, ...], None] = {}
        for word in words:
            word = word.lstrip()
            if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                raise HTTPError(400, f"each of bad_words must have 1 to {MAX_BAD_WORD_CHARS} characters besides "
                                     f"spaces", "bad_words")
            for text in (word, " " + word):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if not 0 < len(ids) <= MAX_BAD_WORD_TOKENS:
                    raise HTTPError(400, f"{word[:40]!r} of bad_words is {len(ids)} tokens; at most "
                                         f"{MAX_BAD_WORD_TOKENS} are taken", "bad_words")
                out[ids] = None
        return tuple(out)

    async def _serve(self, request, body, kind: str, prompts: list[list[int]], params: list[SamplingParams],
                     chat: bool, echoes: list[str] | None = None, tools: ToolMode | None = None,
                     thinking: ReasoningMode | None = None, builder: ResponseBuilder | MessageBuilder | None = None,
                     prompt_only: bool = False):
        """tools: how a chat answer's tool calls are read (gateway/tools.py), or None for text; thinking: how
        its thought is told from its answer (gateway/reasoning.py), or None; builder: the answer's shape
        where a chat request answers another API's (Responses' output items, gateway/responses.py;
        Anthropic's content blocks, gateway/messages.py)."""
        if not self._accepting():
            raise self._not_serving()
        search = None
        if body.use_beam_search and builder is None and not prompt_only:
            search = [self._beam_settings(body, sp) for sp in params]
        plan = Plan(search, prompt_only)
        n_seqs = len(prompts) * (search[0].width if search else body.n)  # (a beam search runs its width)
        # never admitted, however long it waits: not a 429 to retry (the coordinator queues at most
        # --max-waiting sequences, and a request's all arrive at once)
        limit, flag = min((self.cfg.max_pending, "--max-pending"),
                          (self.status.max_waiting or math.inf, "--max-waiting"))
        if n_seqs > limit:
            per = f"best_of={search[0].width} beams" if search else f"n={body.n}"
            raise HTTPError(400, f"{len(prompts)} prompts x {per} is {n_seqs} sequences, more than this "
                                 f"server takes at once ({limit}, {flag})",
                            ("best_of" if body.best_of is not None else "n") if search else
                            ("n" if body.n > 1 else "prompt"))
        if self.pending + n_seqs > self.cfg.max_pending:
            raise HTTPError(429, f"too many requests in flight ({self.pending}); retry shortly",
                            headers={"Retry-After": "1"})
        self.pending += n_seqs
        rid = f"{kind}-{uuid.uuid4().hex}"
        try:
            jobs = [(i * body.n + j, p, _seeded(sp, j)) for i, (p, sp) in enumerate(zip(prompts, params))
                    for j in range(body.n)]
            # (a parser that looks for a special token sees it in the text, as vLLM's mistral parser)
            keep_special = (tools and tools.keeps_special_tokens) or (thinking and self.thought_tags)
            shown = {"stop": stop_list(body.stop), "include_stop": body.include_stop_str_in_output,
                     "skip_special_tokens": body.skip_special_tokens and not keep_special}
            if builder is not None:
                if body.stream:
                    return await self._build_stream(request, builder, rid, jobs, shown, tools, thinking)
                return await self._build(builder, rid, jobs, shown, tools, thinking)
            if body.stream:
                return await self._stream(request, body, rid, jobs, shown, chat, echoes, tools, thinking, plan)
            return await self._complete(body, rid, jobs, shown, chat, echoes, tools, thinking, plan)
        finally:
            self.pending -= n_seqs

    async def _run(self, rid: str, index: int, prompt: list[int], params: SamplingParams, shown: dict,
                   queue: asyncio.Queue, refused: set[int] | None = None) -> None:
        """One sequence: its outputs (text pieces) into `queue` as (index, kind, payload). `shown`: the
        IncrementalDetokenizer's options (stop strings, and how they and special tokens show). `refused`
        gets its index at once where the coordinator answers it with an error before any token."""
        choice = Choice(index, IncrementalDetokenizer(self.tokenizer, min_tokens=params.min_tokens, context=prompt,
                                                      **shown))
        start = last = time.monotonic()
        stream = self.client.generate(prompt, params, request_id=f"{rid}-{index}")
        ended = "abort"  # (a client that went away cancels this task)
        try:
            async for out in stream:
                if out.error:
                    if out.error_status in (400, 429) and not choice.token_ids:
                        ended = None  # refused, never run: not a finished request (vLLM counts none)
                    if refused is not None and not choice.token_ids:
                        refused.add(index)
                    raise _output_error(out)
                now = time.monotonic()
                if out.token_ids:
                    (self.metrics.ttft if not choice.token_ids else self.metrics.itl).labels(self.model_name).observe(
                        now - (start if not choice.token_ids else last))
                    last = now
                if out.queue_seconds is not None:
                    self.metrics.queue.labels(self.model_name).observe(out.queue_seconds)
                    choice.cached_tokens = out.num_cached_tokens
                ids, lps = list(out.token_ids), list(out.logprobs or [])
                shown_ids = ids
                if out.finish_reason == "stop" and shown_ids and not choice.detok.include_stop:
                    shown_ids = shown_ids[:-1]  # the EOS or stop token that ended it is no text (as vLLM)
                if choice.detok.stop and len(ids) > 1:  # (several tokens at once: --num-scheduler-steps, drafts)
                    text = ""
                    for k, t in enumerate(shown_ids):  # a stop string ends the answer at the token that
                        text += choice.detok.add([t])  # completes it: the ones after it are not counted
                        if choice.detok.stopped:
                            ids, lps = ids[:k + 1], lps[:k + 1]
                            break
                else:
                    text = choice.detok.add(shown_ids)
                choice.token_ids += ids
                choice.logprobs += lps
                if out.finish_reason is not None:
                    text += choice.detok.finish()
                    choice.finish_reason = out.finish_reason
                if choice.detok.stopped:  # a stop string: cut here and end the request
                    choice.finish_reason = "stop"
                await queue.put((index, "delta", Delta(text, lps, choice.finish_reason, bool(ids),
                                                       out.prompt_logprobs, len(ids),
                                                       out.num_cached_tokens if out.queue_seconds is not None else None)))
                if choice.finish_reason is not None:
                    break
            ended = choice.finish_reason
        except Exception:
            ended = ended and "error"
            raise
        finally:
            await stream.aclose()  # an unfinished stream aborts its request in the coordinator
            if ended is not None:  # every request that ran counted once, however it ended (vLLM's
                # finished_reason: stop, length, abort, error)
                self._count_ended(ended, time.monotonic() - start, len(prompt), len(choice.token_ids))
        await queue.put((index, "done", choice))

    def _count_ended(self, reason: str, seconds: float, prompt_tokens: int, generated: int) -> None:
        """One request (or choice) that ran, in /metrics, however it ended."""
        self.metrics.e2e.labels(self.model_name).observe(seconds)
        self.metrics.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.metrics.generation_tokens.labels(self.model_name).inc(generated)
        self.metrics.requests.labels(self.model_name, reason).inc()

    async def _gather(self, rid, jobs, shown, plan: Plan | None = None):
        """Yields (index, kind, payload) from every job until all are done; errors propagate. With a
        plan's `search` (one per prompt), each prompt's choices are its best beams, yielded when found;
        with `prompt_only`, choices without the token each generated."""
        if plan is not None and plan.search is not None:
            async for item in self._beam_gather(rid, jobs, shown, plan.search):
                yield item
            return
        if plan is not None and plan.prompt_only:
            async for index, kind, payload in self._gather(rid, jobs, shown):
                if kind == "delta":
                    payload = Delta("", [], payload.finish_reason and "length", False, payload.prompt_logprobs, 0,
                                    payload.cached_tokens)
                else:
                    payload = Choice(index, IncrementalDetokenizer(self.tokenizer), finish_reason="length",
                                     cached_tokens=payload.cached_tokens)
                yield index, kind, payload
            return
        queue: asyncio.Queue = asyncio.Queue()
        refused: set[int] = set()
        tasks = [asyncio.ensure_future(self._run(rid, i, p, sp, shown, queue, refused)) for i, p, sp in jobs]
        remaining = len(tasks)
        getter = None
        # several sequences (n > 1, a list of prompts): nothing goes out until the coordinator has taken
        # every one (or each has begun), so that one it refuses (429: its queue is full) refuses the whole
        # request, as its first event (a stream's HTTP status), not after the others' first tokens were
        # sent (vLLM admits them at once). The coordinator answers its client's messages in order, and
        # refuses a request as it reads it: a status asked after every request went out (this task runs
        # after theirs, which send at their first step; shared with streams asking meanwhile) is answered
        # after any refusal of theirs.
        held: list | None = [] if len(tasks) > 1 else None
        begun: set[int] = set()
        taken = asyncio.ensure_future(self._answered_after()) if held is not None else None
        try:
            while remaining:
                failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
                if failed is not None:  # a sequence's error ends the request
                    raise failed.exception()
                if getter is None:
                    getter = asyncio.ensure_future(queue.get())
                # wake on the next item, when a sequence ends (perhaps failing), or when all were taken
                await asyncio.wait([getter, *[t for t in tasks if not t.done()],
                                    *([taken] if held is not None and not taken.done() else [])],
                                   return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    item, getter = getter.result(), None
                    if item[1] == "done":
                        remaining -= 1
                    if held is None:
                        yield item
                        continue
                    held.append(item)
                    begun.add(item[0])
                if held is not None and not refused and (len(begun) == len(tasks) or taken.done()):
                    items, held = held, None
                    for item in items:
                        yield item
        finally:
            if getter is not None:
                getter.cancel()
            if taken is not None:
                taken.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, *([taken] if taken is not None else []), return_exceptions=True)

    async def _answered(self) -> bool:
        """A round trip to the coordinator (its answer to a status request: True), or 5 seconds without one."""
        try:
            await self.client.status(timeout=5.0)
        except Exception:  # (no answer: the sequences' own outputs say the rest)
            return False
        return True

    async def _answered_after(self) -> bool:
        """`_answered` for a status asked after this call: one round trip at a time, shared by every
        stream that asks while it is on its way (the next one is theirs), so a thousand streams queued
        at once cost the coordinator a few status answers, not a thousand."""
        fut = asyncio.get_running_loop().create_future()
        self._askers.append(fut)
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._ask())
        return await fut

    async def _ask(self) -> None:
        while self._askers:
            askers, self._askers = self._askers, []  # (their requests went out before this status does)
            answered = await self._answered()
            for fut in askers:
                if not fut.done():  # (a stream that stopped waiting cancelled its own)
                    fut.set_result(answered)

    def _beam_settings(self, body: SamplingFields, params: SamplingParams) -> BeamSettings:
        """use_beam_search's settings (gateway/beam.py), checked: what a search cannot honour is a 400
        naming it. Sampling fields that only shape a draw (temperature, seed) have no effect."""
        width = body.best_of if body.best_of is not None else body.n
        param = "best_of" if body.best_of is not None else "n"
        if not body.n <= width <= MAX_N:
            raise HTTPError(400, f"best_of is the beams searched, of which n are returned: it must be in "
                                 f"[n, {MAX_N}]", "best_of")
        refused = (("stop", bool(stop_list(body.stop))), ("top_p", body.top_p not in (None, 1)),
                   ("top_k", body.top_k not in (None, 0, -1)), ("min_p", body.min_p not in (None, 0)),
                   ("presence_penalty", body.presence_penalty not in (None, 0)),
                   ("frequency_penalty", body.frequency_penalty not in (None, 0)),
                   ("repetition_penalty", body.repetition_penalty not in (None, 1)),
                   ("logit_bias", bool(params.logit_bias)),
                   ("allowed_token_ids", params.allowed_token_ids is not None), ("bad_words", bool(params.bad_words)),
                   ("prompt_logprobs" if body.prompt_logprobs is not None else "echo",
                    params.prompt_logprobs is not None),
                   (next((k for k in CONSTRAINTS if getattr(body, k) is not None), "tool_choice"),
                    params.grammar is not None))
        for name, given in refused:
            if given:
                raise HTTPError(400, f"{name} is not supported with use_beam_search", name)
        if body.early_stopping not in (True, False, "never"):
            raise HTTPError(400, 'early_stopping must be true, false or "never"', "early_stopping")
        if not -MAX_LENGTH_PENALTY <= body.length_penalty <= MAX_LENGTH_PENALTY:  # (a length to its power: finite)
            raise HTTPError(400, f"length_penalty must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]",
                            "length_penalty")
        stops = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.eos_token_ids)
        settings = BeamSettings(width, params.max_tokens, stops, body.length_penalty, body.early_stopping,
                                params.min_tokens, params.logprobs)
        if settings.top_n > MAX_LOGPROBS:
            raise HTTPError(400, f"a beam search of {width} beams, with {len(stops)} stop tokens, takes the "
                                 f"{settings.top_n} likeliest tokens of each beam at each step, more than the "
                                 f"{MAX_LOGPROBS} the engine reports: search fewer beams", param)
        return settings

    async def _beam_gather(self, rid, jobs, shown, search: list[BeamSettings]):
        """`_gather` for beam searches: every prompt's search at once; its n best beams as choices (one
        delta each, and done) when it ends."""
        n = len(jobs) // len(search)
        tasks = {asyncio.ensure_future(self._beam_search(f"{rid}-{i}", jobs[i * n][1], s, n,
                                                         jobs[i * n][2].cache_salt)): i
                 for i, s in enumerate(search)}
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=tasks.get):
                    i = tasks[task]
                    beams, cached = task.result()  # (a failed search's error ends the request)
                    for j, beam in enumerate(beams):
                        index, prompt = i * n + j, jobs[i * n + j][1]
                        detok = IncrementalDetokenizer(self.tokenizer, min_tokens=search[i].min_tokens,
                                                       context=prompt, **shown)
                        reason = "stop" if beam.stopped else "length"
                        shown_ids = beam.tokens[:-1] if beam.stopped and not detok.include_stop else beam.tokens
                        text = detok.add(shown_ids) + detok.finish()
                        choice = Choice(index, detok, list(beam.tokens), list(beam.logprobs), reason, cached)
                        yield index, "delta", Delta(text, choice.logprobs, reason, True, None, len(beam.tokens),
                                                    cached)
                        yield index, "done", choice
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _beam_search(self, rid: str, prompt: list[int], settings: BeamSettings, n: int,
                           cache_salt: str | None = None):
        """One prompt's beam search: (its n best beams, the prompt tokens the prefix cache held). Each step
        asks the coordinator for one token of every running beam with its likeliest alternatives (under
        the request's cache salt: its beams share blocks with each other and its salt's requests alone)."""
        search = BeamSearch(settings)
        step = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=settings.top_n,
                              cache_salt=cache_salt)
        start, cached, ended = time.monotonic(), 0, "abort"
        try:
            k = 0
            while not search.done:
                outs = [asyncio.ensure_future(self._one_token(prompt + beam.tokens, step, f"{rid}-{k}-{b}"))
                        for b, beam in enumerate(search.running)]
                try:
                    results = await asyncio.gather(*outs)
                finally:
                    for t in outs:
                        t.cancel()
                    await asyncio.gather(*outs, return_exceptions=True)
                if k == 0:
                    cached = results[0][1]
                search.advance([lp for lp, _ in results])
                k += 1
            beams = search.best(n)
            ended = None
        except Exception:
            ended = "error"
            raise
        finally:  # (each returned beam counted as one request, as n choices are: vLLM's finished_reason)
            seconds = time.monotonic() - start
            if ended is None:
                for beam in beams:  # (its first tokens reach the client with the search's end)
                    self.metrics.ttft.labels(self.model_name).observe(seconds)
                    self._count_ended("stop" if beam.stopped else "length", seconds, len(prompt), len(beam.tokens))
            else:
                for _ in range(n):
                    self._count_ended(ended, seconds, len(prompt), 0)
        return beams, cached

    async def _one_token(self, prompt: list[int], params: SamplingParams, rid: str) -> tuple[TokenLogprobs, int]:
        """One engine step of a beam: (the next token's logprobs, the prompt tokens found cached)."""
        stream = self.client.generate(prompt, params, request_id=rid)
        logprobs, cached = None, 0
        try:
            async for out in stream:
                if out.error:
                    raise _output_error(out)
                if out.queue_seconds is not None:
                    cached = out.num_cached_tokens
                if out.logprobs:
                    logprobs = out.logprobs[0]
                if out.finish_reason is not None:
                    break
        finally:
            await stream.aclose()
        if logprobs is None:
            raise HTTPError(500, "the coordinator ended a beam's step without its token")
        return logprobs, cached

    async def _complete(self, body, rid, jobs, shown, chat, echoes=None, tools: ToolMode | None = None,
                        thinking: ReasoningMode | None = None, plan: Plan | None = None):
        choices: dict[int, Choice] = {}
        prompt_lps: dict[int, list] = {}
        async for index, kind, payload in self._gather(rid, jobs, shown, plan):
            if kind == "done":
                choices[index] = payload
            elif payload.prompt_logprobs is not None:
                prompt_lps[index] = payload.prompt_logprobs
        out = []
        for index in sorted(choices):
            c = choices[index]
            prompt = jobs[index][1]
            if chat:
                lp = {"content": [self._chat_logprob(x) for x in c.logprobs]} if body.logprobs else None
                message, reason = {"role": "assistant", "content": c.detok.text}, _reason(c.finish_reason)
                if thinking is not None:
                    thought, message["content"] = thoughts.split(thinking, c.detok.text)
                    message.update(_thought(thinking, thought))
                if tools is not None and tools.kind != "auto" and not message["content"]:
                    message["content"] = None  # (no text to read a call from: none, as the stream sends)
                elif tools is not None and message["content"] is not None:
                    message["content"], calls = tool_calls.read_calls(tools, message["content"])
                    if calls:
                        message["tool_calls"] = calls
                        reason = _tool_reason(tools, reason)
                out.append({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                text = c.detok.text
                lp = None
                if body.logprobs is not None:
                    lp = self._completion_logprobs(c.logprobs, prompt if body.echo else None,
                                                   prompt_lps.get(index), None, body.skip_special_tokens,
                                                   echoes[index // body.n] if body.echo else None, body.logprobs)[0]
                if body.echo:
                    text = echoes[index // body.n] + text
                out.append({"index": index, "text": text, "logprobs": lp, "finish_reason": _reason(c.finish_reason)})
                if body.prompt_logprobs is not None:  # (vLLM's: on each choice, of its prompt)
                    out[-1]["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_lps.get(index),
                                                                            body.prompt_logprobs)
        response = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()), "model": self.model_name, "choices": out,
                    "usage": _usage(jobs, choices, body.n)}
        if chat and body.prompt_logprobs is not None:  # (vLLM's: beside the choices, which share the prompt)
            response["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_lps.get(0), body.prompt_logprobs)
        return web.json_response(response)

    async def _stream(self, request, body, rid, jobs, shown, chat, echoes=None, tools: ToolMode | None = None,
                      thinking: ReasoningMode | None = None, plan: Plan | None = None):
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        with_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices, usage=None):
            c = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if with_usage:  # (OpenAI: null on every chunk but the last)
                c["usage"] = usage
            return c

        choices: dict[int, Choice] = {}
        offsets: dict[int, TextAt] = {}  # completions: where each choice's next token starts
        streams: dict[int, ToolStream] = {}  # chat with tools: each choice's text, as calls are read from it
        splits: dict[int, ReasoningStream] = {}  # chat with a reasoning parser: each choice's thought and answer

        async def write(send_raw, events) -> None:
            async def send(payload) -> None:
                await send_raw(b"data: " + json.dumps(payload).encode() + b"\n\n")

            try:
                roles = chat  # (with the first event, not with headers sent early: clients time a first token by it)
                async for index, kind, payload in events:
                    if roles:
                        roles = False
                        for i, _, _ in jobs:
                            await send(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]))
                    if kind == "done":
                        choices[index] = payload
                        continue
                    d: Delta = payload
                    # one event per step that produced tokens (its text may be empty while a character is
                    # incomplete), so clients and benchmarks see every token's arrival
                    if chat:
                        if d.text or d.finish_reason or d.logprobs or d.has_tokens:
                            lp = {"content": [self._chat_logprob(x) for x in d.logprobs]} if body.logprobs else None
                            delta, reason, _ = self._chat_delta(index, d, tools, thinking, streams, splits)
                            await send(chunk([{"index": index, "delta": delta, "logprobs": lp,
                                               "finish_reason": reason}]))
                    else:
                        prefix, echo = "", None
                        if body.echo and index not in offsets:  # the first chunk carries the prompt
                            echo = jobs[index][1]
                            prefix = echoes[index // body.n]
                        start = offsets.setdefault(index, TextAt())
                        if d.text or prefix or d.finish_reason or d.has_tokens:
                            lp = None
                            if body.logprobs is not None:  # (offsets by tokens, as the non-streamed answer's)
                                lp, offsets[index] = self._completion_logprobs(
                                    d.logprobs, echo, d.prompt_logprobs, start, body.skip_special_tokens,
                                    prefix if echo is not None else None)
                            await send(chunk([{"index": index, "text": prefix + d.text, "logprobs": lp,
                                               "finish_reason": _reason(d.finish_reason)}]))
                if with_usage:
                    await send(chunk([], usage=_usage(jobs, choices, body.n)))
            except HTTPError as e:  # mid-stream: an error event, as the openai SDK expects
                await send(e.body())
            await send_raw(b"data: [DONE]\n\n")

        return await self._sse(request, rid, jobs, shown, write, plan)

    async def _sse(self, request, rid: str, jobs, shown: dict, write, plan: Plan | None = None) -> web.StreamResponse:
        """A streamed answer as server-sent events: `write(send_raw, events)` sends them for the jobs'
        events (`_gather`). An error the coordinator answers at once (before the first event) keeps its
        status; a client that leaves or stops reading aborts every sequence of the request."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

        async def send_raw(data: bytes) -> None:
            # a client that stops reading fills its connection's buffers and the write waits: past
            # --stream-timeout it is cut off, and its sequences aborted (their KV blocks freed)
            try:
                await asyncio.wait_for(resp.write(data), self.cfg.stream_timeout)
            except asyncio.TimeoutError:
                raise SlowClient from None

        events = self._gather(rid, jobs, shown, plan)
        # the first event before the 200: an error the coordinator answers at once keeps its status. A
        # request that waits longer (queued behind others, a long prompt) gets its headers once the
        # coordinator has answered a status asked after it went out (it answers in order and refuses as
        # it reads: no refusal can come after) and had said nothing of its sequences before that answer
        # (a refusal already read, its first event hops behind, keeps its status), so that a proxy's or
        # client's wait for headers does not run out; until its first event, a comment line every
        # KEEPALIVE seconds keeps idle timeouts away. Not for a beam search, whose later steps are new
        # requests that may yet be refused: its headers wait for its answer.
        first = asyncio.ensure_future(events.__anext__())
        taken = None
        try:
            searching = plan is not None and plan.search is not None
            await asyncio.wait([first], timeout=None if searching else HEADERS_AFTER)
            while not first.done():
                taken = asyncio.ensure_future(self._answered_after())
                await asyncio.wait([first, taken], return_when=asyncio.FIRST_COMPLETED)
                if first.done():
                    break
                if taken.result():  # (no answer in 5 s: asked again)
                    if any(self.client.heard(f"{rid}-{i}") for i, _, _ in jobs):
                        await asyncio.wait([first])  # (what it heard is on its way)
                    break
            if first.done():
                first.result()
        except HTTPError as e:
            await events.aclose()
            return _refusal(request.path, e)
        except BaseException:
            first.cancel()  # (its cancellation runs the generator's cleanup: every sequence aborted)
            raise
        finally:
            if taken is not None:
                taken.cancel()

        async def close() -> None:
            """Every sequence of the request aborted."""
            first.cancel()  # (the generator is busy in it: cancelling it is what closes it; done, this retrieves it)
            await asyncio.wait([first])
            await events.aclose()

        async def all_events():
            while not first.done():  # (headers sent early: nothing to say yet)
                if not (await asyncio.wait([first], timeout=KEEPALIVE))[0]:
                    await send_raw(b": waiting\n\n")
            try:
                yield first.result()
                async for event in events:
                    yield event
            except HTTPError:
                raise
            except Exception as e:  # a bug behind the stream: the client hears an error event, the log the trace
                log.error("request failed mid-stream", exc_info=True, extra={"fields": {"request_id": rid}})
                raise HTTPError(500, f"internal error: {type(e).__name__}") from None

        try:
            sock = request.transport.get_extra_info("socket") if request.transport is not None else None
            if sock is not None:  # a fixed send buffer (no autotuning to megabytes): a reader that stops is seen soon
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
            await resp.prepare(request)
            await write(send_raw, all_events())
            await asyncio.wait_for(resp.write_eof(), self.cfg.stream_timeout)
        except ConnectionError:  # the client left (reset, or closed while a write waited on it, which
            # aiohttp says as "Connection lost"): every sequence of the request is aborted
            await close()
        except asyncio.CancelledError:
            first.cancel()  # (aiohttp cancels the handler of a client that left: _gather's cleanup aborts)
            raise
        except (SlowClient, asyncio.TimeoutError):
            await close()  # aborts every sequence of the request
            self.metrics.slow_clients.labels(self.model_name).inc()
            log.warning("client stopped reading, request aborted", extra={"fields": {
                "request_id": rid, "seconds": self.cfg.stream_timeout}})
            if request.transport is not None:
                request.transport.abort()
        except Exception:  # a bug while writing: the 200 and some events are out, so the stream is cut, not
            # followed by an error response of its own (the middleware's 500)
            if not resp.prepared:
                first.cancel()
                raise
            log.error("request failed mid-stream", exc_info=True, extra={"fields": {"request_id": rid}})
            await close()
            if request.transport is not None:
                request.transport.abort()
        return resp

    async def _build(self, builder: ResponseBuilder | MessageBuilder, rid, jobs, shown, tools: ToolMode | None,
                     thinking: ReasoningMode | None):
        """Another API's whole answer (a response, a message): fed to `builder` as a stream's would be."""
        streams: dict[int, ToolStream] = {}
        splits: dict[int, ReasoningStream] = {}
        response = None
        async for index, kind, payload in self._gather(rid, jobs, shown):
            if kind == "done":
                response = _finish(builder, jobs, payload)
            else:
                delta, _, inside = self._chat_delta(index, payload, tools, thinking, streams, splits)
                builder.add(delta, payload.tokens, inside, payload.cached_tokens)
                builder.take()  # (a stream's events, which a whole answer does not send)
        return web.json_response(response)

    async def _build_stream(self, request, builder: ResponseBuilder | MessageBuilder, rid, jobs, shown,
                            tools: ToolMode | None, thinking: ReasoningMode | None):
        """Another API's answer streamed: its events (`event:` and `data:`, no [DONE]), as `builder` makes them."""
        streams: dict[int, ToolStream] = {}
        splits: dict[int, ReasoningStream] = {}

        async def write(send_raw, events) -> None:
            async def flush() -> None:
                for event in builder.take():
                    await send_raw(f"event: {event['type']}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n")

            try:  # (the answer's start goes with its first tokens)
                async for index, kind, payload in events:
                    if kind == "done":
                        _finish(builder, jobs, payload)
                    else:
                        delta, _, inside = self._chat_delta(index, payload, tools, thinking, streams, splits)
                        builder.add(delta, payload.tokens, inside, payload.cached_tokens)
                    await flush()
            except HTTPError as e:  # mid-stream: the API's error event
                builder.error(e.status, e.message, e.param, e.code)
                await flush()

        return await self._sse(request, rid, jobs, shown, write)

    # -- helpers -------------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> bytes:
        """The request's body as sent (the runner leaves Content-Encoding to decoded_body), read as
        request.read() does, but answered 408 where it stops arriving for --stream-timeout seconds, or
        has not all arrived in BODY_TIMEOUTS times that (a client sending a byte now and then would
        hold its handler and connection for as long as it liked)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BODY_TIMEOUTS * self.cfg.stream_timeout
        chunks, size = [], 0
        while True:
            try:
                chunk = await asyncio.wait_for(request.content.readany(),
                                               min(self.cfg.stream_timeout, max(0.0, deadline - loop.time())))
            except asyncio.TimeoutError:
                raise HTTPError(408, f"the request body did not arrive in time: it stopped for "
                                     f"{self.cfg.stream_timeout:g} s or took {BODY_TIMEOUTS:g} times that "
                                     f"(--stream-timeout)") from None
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self.cfg.max_body_bytes:
                raise web.HTTPRequestEntityTooLarge(max_size=self.cfg.max_body_bytes, actual_size=size)
            chunks.append(chunk)

    async def _parse(self, request: web.Request, kind):
        try:
            raw = await self._body(request)
        except web.RequestPayloadError as e:  # (a body that ends early)
            raise HTTPError(400, f"could not read the request body: {e}") from None
        except ConnectionResetError:  # (the client left while sending it: its refusal goes nowhere, and is
            # no error of the gateway's to log, which aiohttp would, with a traceback, for the exception)
            raise HTTPError(400, "the connection closed before the request body arrived") from None
        encodings = request.headers.getall("Content-Encoding", [])
        if encodings:  # (decoding takes a pass over the body: off the event loop)
            raw = await asyncio.to_thread(decoded_body, raw, encodings, self.cfg.max_body_bytes)
        try:
            try:
                value = msgspec.json.decode(raw)
            except msgspec.DecodeError:  # (decoded against the type, the error names where it is)
                return msgspec.json.decode(raw, type=kind)
            if isinstance(value, dict):  # null where OpenAI allows it for a field with a default: the default
                value = {k: v for k, v in value.items() if v is not None or k not in _defaulted_on_null(kind)}
            return msgspec.convert(value, type=kind)
        except msgspec.ValidationError as e:
            text = str(e)
            param = (text.rsplit("`$.", 1)[-1].rstrip("`") if "`$." in text else
                     text.split("`")[1] if text.startswith("Object missing required field `") else None)
            raise HTTPError(400, f"invalid request: {e}", param) from None
        except msgspec.DecodeError as e:
            raise HTTPError(400, f"invalid JSON body: {_decode_error(raw, e)}") from None
        except RecursionError:
            raise HTTPError(400, "invalid JSON body: nested too deeply") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise HTTPError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                            "model")

    def _check_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise HTTPError(400, f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param)

    def _encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Text -> ids. Text longer than any prompt the model takes could be (max_model_len times the
        longest token) is refused before the work, which bounds how long one request tokenizes on the
        event loop (the tokenizers library holds the GIL while it encodes: a thread would not help)."""
        if len(text) > self.max_prompt_chars:
            raise HTTPError(400, f"the text is {len(text)} characters, more than {self.max_model_len} tokens "
                                 f"(this model's context) can hold", param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = [self._encode(p) for p in prompt]
        elif prompt and all(_is_int(p) for p in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise HTTPError(400, "prompt must be a string, a list of strings, token ids or lists of token ids",
                            "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise HTTPError(400, f"at most {MAX_PROMPTS} prompts in one request", "prompt")
        for p in prompts:
            if not p:
                raise HTTPError(400, "a prompt is empty", "prompt")
            self._check_ids(p, "prompt")
        return prompts

    def _chat_prompt(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict,
                     continue_final: bool = False, add_special_tokens: bool = False,
                     tools: list[dict] | None = None) -> list[int]:
        """tools: the request's function tools, for the template's `tools` (its earlier calls' arguments as
        objects, gateway/tools.py)."""
        if self.chat_template is None:
            raise HTTPError(400, "this model has no chat template; use /v1/completions", "messages")
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise HTTPError(400, "messages must be a non-empty list of {role, content} objects", "messages")
        # a chat that cannot fit the context is refused before the template runs, on the event loop (a
        # message renders to a token at least; the text's length is _encode's to bound)
        if len(messages) > self.max_model_len:
            raise HTTPError(400, f"{len(messages)} messages, more than this model's context holds "
                                 f"({self.max_model_len} tokens)", "messages")
        # as transformers does: keys with null values are dropped; content parts become text
        try:
            messages = tool_calls.template_messages(
                [{**{k: v for k, v in m.items() if v is not None}, "content": _text_content(m.get("content"))}
                 for m in messages])
        except ToolError as e:
            raise HTTPError(400, str(e), e.param) from None
        kwargs = dict(kwargs)  # chat_template_kwargs: may set add_generation_prompt (as vLLM's), not the messages
        if tools is not None:
            kwargs["tools"] = tools
        if "messages" in kwargs:
            raise HTTPError(400, "chat_template_kwargs cannot set `messages`", "chat_template_kwargs")
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final = kwargs.pop("continue_final_message", continue_final)
        if continue_final and add_generation_prompt:
            raise HTTPError(400, "continue_final_message and add_generation_prompt cannot both be true (give "
                                 "add_generation_prompt: false to continue the last message)", "continue_final_message")
        try:
            text = self.chat_template.render(messages, add_generation_prompt, **kwargs)
            if continue_final:  # the same chat with a stand-in for the last content: what follows it is the template's
                stand_in = [*messages[:-1], {**messages[-1], "content": _STAND_IN}]
                after = _common_suffix(text, self.chat_template.render(stand_in, add_generation_prompt, **kwargs))
                text = _up_to_final_message(text[:len(text) - len(after)], messages[-1]["content"])
        except TemplateError as e:
            raise HTTPError(400, str(e), "messages") from None
        return self._encode(text, add_special_tokens=add_special_tokens, param="messages")

    def _echo(self, ids: list[int]) -> str:
        """Token ids' echo: as they decode, up to a character they end inside of (told by the bytes),
        which the generated text starts with, whole (IncrementalDetokenizer)."""
        return self.tokenizer.whole_text(ids, skip_special_tokens=False)

    def _chat_delta(self, index: int, d: Delta, tools: ToolMode | None, thinking: ReasoningMode | None,
                    streams: dict[int, ToolStream], splits: dict[int, ReasoningStream]) -> tuple[dict, str | None, bool]:
        """A streamed chat choice's delta for the text `d` adds (its thought, its content, its tool calls) ->
        (delta, finish_reason, whether the choice was inside its thought during it). streams, splits: each
        choice's tool calls and thought so far."""
        text, thought, inside = d.text, "", False
        if thinking is not None:
            split = splits.setdefault(index, ReasoningStream(thinking))
            inside = split.state == "thought"
            thought, text = split.add(text)
            if d.finish_reason is not None:
                thought, text = (a + b for a, b in zip((thought, text), split.finish()))
            inside = inside or bool(thought) or split.state == "thought"
        delta, reason = {"content": text} if text else {}, _reason(d.finish_reason)
        if tools is not None:
            delta, reason = self._tool_delta(streams.setdefault(index, ToolStream(tools)), text, reason)
        if thought and thinking.shown:
            delta = {**_thought(thinking, thought), **delta}
        return delta, reason, inside

    @staticmethod
    def _tool_delta(stream: ToolStream, text: str, reason: str | None) -> tuple[dict, str | None]:
        """A streamed chat choice's delta where tools may be called: a named function's arguments as they
        come, content as it may be sent (gateway/tools.py), and at the end the calls read from the text."""
        delta: dict = {}
        if stream.mode.kind == "named":
            entry = stream.arguments(text)
            if entry is not None:
                delta["tool_calls"] = [entry]
            return delta, reason
        content = stream.content(text)
        calls: list[dict] = []
        if reason is not None:
            rest, calls = stream.finish()
            content += rest
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            reason = _tool_reason(stream.mode, reason)
        return delta, reason

    def _chat_logprob(self, lp: TokenLogprobs) -> dict:
        def entry(token_id, logprob):  # (a piece of a character: "bytes:\\xNN" and its own bytes)
            return {"token": self.tokenizer.token_label(token_id), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token_id))}
        return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}

    def _vllm_prompt_logprobs(self, lps: list[TokenLogprobs | None] | None, top_n: int) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: for each prompt position, None (the first) or {token id: {logprob,
        rank, decoded_token}} of the prompt's token (first, with its rank in the vocabulary) and its
        top-N alternatives (ranked 1 to N); None where none came (as vLLM's null)."""
        if lps is None:
            return None

        def entry(token_id: int, logprob: float, rank: int) -> dict:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.tokenizer.token_label(token_id)}

        out: list[dict | None] = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            at = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
            for rank, (t, v) in enumerate(lp.top[:top_n], 1):
                at.setdefault(str(t), entry(t, v, rank))
            out.append(at)
        return out

    def _completion_logprobs(self, lps: list[TokenLogprobs], echo_prompt, prompt_lps, at: TextAt | None = None,
                             skip_special_tokens: bool = True, echo_text: str | None = None,
                             top_n: int | None = None) -> tuple[dict, TextAt]:
        """-> (the logprobs object, where the text after these tokens starts). `at`: where the first
        token starts (a stream's later chunk: where the one before ended). Each position's top_logprobs
        holds its own token too (OpenAI: "up to logprobs+1 elements", as vLLM gives). A token is named
        by its text, or by its bytes where it holds a piece of a character (`token_label`); its
        text_offset counts the whole characters before it, so a character's pieces share its offset.
        `echo_text`: the echoed prompt as returned: the generated tokens' offsets count from its end (a
        prompt sent as text is echoed as sent, which its tokens may not spell out: a BOS the tokenizer
        added, a SentencePiece leading space). `top_n`: the alternatives shown at each position (the
        prompt's may have been computed with more, for vLLM's prompt_logprobs)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        at = at or TextAt()
        entries = []  # (token, its logprobs, whether the returned text shows it)
        if echo_prompt is not None:  # (the echo keeps special tokens, the generated text drops them)
            entries = [(t, prompt_lps[i] if prompt_lps else None, True) for i, t in enumerate(echo_prompt)]
        special = self.tokenizer.special_ids if skip_special_tokens else frozenset()
        entries += [(lp.token_id, lp, lp.token_id not in special) for lp in lps]
        for i, (token_id, lp, shown) in enumerate(entries):
            if echo_text is not None and i == len(echo_prompt):  # (the generated tokens from here)
                at = TextAt(len(echo_text), at.tail)
            label = self.tokenizer.token_label(token_id)
            tokens.append(label)
            token_lps.append(lp.logprob if lp is not None else None)
            top = None
            if lp is not None:
                top = {self.tokenizer.token_label(t): v for t, v in lp.top[:top_n]}
                top.setdefault(label, lp.logprob)
            tops.append(top)
            offsets.append(at.offset)
            if shown:
                at = at.after(token_id, self.tokenizer)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, at


@dataclass(frozen=True)
class TextAt:
    """Where a completion's text stands after some of its tokens: `offset`, its characters so far;
    `tail`, the bytes after them that begin a character not yet whole (a character split across
    tokens). Bytes that cannot begin or continue one count as a U+FFFD each run, as in the text."""
    offset: int = 0
    tail: bytes = b""

    def after(self, token_id: int, tokenizer) -> TextAt:
        chars, tail = whole_characters(self.tail + tokenizer.token_bytes(token_id))
        return TextAt(self.offset + chars, tail)


_DEFAULTS = SamplingFields()


def _given(value, default) -> bool:
    """A field set to something other than its default (an empty list or object counts as not given)."""
    return value != default and value not in ([], {}, "")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@functools.cache
def _defaulted_on_null(kind) -> frozenset[str]:
    """The fields of a request body that take no null but have a default: OpenAI's API allows null for
    them (n, stream, echo, chat's logprobs ...), and vLLM reads it as the default."""
    return frozenset(f.encode_name for f in msgspec.structs.fields(kind)
                     if f.required is False and not _takes_none(f.type))


def _takes_none(t) -> bool:
    return t is None or t is type(None) or t is Any or any(_takes_none(a) for a in typing.get_args(t))


def _seeded(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n choices: its own seed, so the choices differ but stay reproducible."""
    if j == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + j) % (1 << 63))


# a \uD800-\uDBFF escape (not itself escaped) with no low surrogate's escape after it
_LONE_HIGH_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2})(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")


def _decode_error(raw: bytes, e: msgspec.DecodeError) -> str:
    """msgspec's message, but where it says "truncated" for a lone high surrogate's escape (it reads on
    for the low one), what is wrong."""
    if "truncated" in str(e) and (lone := _LONE_HIGH_SURROGATE.search(raw)):
        return (f"JSON is malformed: invalid utf-16 surrogate pair ({lone.group(1).decode()} with no low "
                f"surrogate after it, byte {lone.start(1)})")
    return str(e)


def _output_error(out) -> HTTPError:
    """A coordinator output's error as the HTTP error it answers (a 429 or 503 says when to retry)."""
    return HTTPError(out.error_status or 500, out.error,
                     headers={"Retry-After": "1"} if out.error_status in (429, 503) else None)


def _reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def _finish(builder: ResponseBuilder | MessageBuilder, jobs, choice: Choice) -> dict:
    """Another API's whole answer, once its one choice has ended."""
    return builder.finish(choice.finish_reason, len(jobs[0][1]), len(choice.token_ids), choice.cached_tokens,
                          choice.detok.matched)


def _refusal(path: str, e: HTTPError) -> web.Response:
    """An error as the API at `path` shapes it: Anthropic's for /v1/messages, OpenAI's elsewhere."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return web.json_response(messages_api.error_body(e.status, e.message), status=e.status, headers=e.headers)
    return e.response()


def _thought(mode: ReasoningMode, text: str | None) -> dict:
    """A message's or delta's reasoning, under vLLM's name and DeepSeek's (vLLM's before 0.11); None where
    the request asked for none (include_reasoning: false)."""
    text = text if mode.shown else None
    return {"reasoning": text, "reasoning_content": text}


def _tool_reason(mode: ToolMode, reason: str | None) -> str | None:
    """A choice that called tools ends with "tool_calls" (as vLLM's), but one that named its function
    with "stop" (as OpenAI's); one cut short by max_tokens stays "length"."""
    if reason == "length" or mode.kind == "named":
        return reason
    return "tool_calls"


def _usage(jobs, choices: dict[int, Choice], n: int) -> dict:
    """Each prompt counts once, whatever n (its choices are jobs i * n .. i * n + n - 1), as OpenAI's do."""
    prompt = sum(len(p) for _, p, _ in jobs[::n])
    completion = sum(len(c.token_ids) for c in choices.values())
    cached = sum(c.cached_tokens for i, c in choices.items() if i % n == 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _text_content(content) -> str:
    """OpenAI content: a string, or a list of text parts, joined by newlines (as vLLM joins them); an
    assistant's refusal part ({type: refusal, refusal}) reads as its text, as vLLM reads it. A part of
    another kind (an image, audio) is refused: this server's models read text only."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        kinds = {p.get("type") if isinstance(p, dict) and isinstance(p.get("type"), str) else
                 type(p.get("type") if isinstance(p, dict) else p).__name__ for p in content} - {"text", "refusal"}
        if kinds:
            raise HTTPError(400, f"content parts of type {sorted(map(str, kinds))[0]!r} are not supported by "
                                 f"this server (text only)", "messages")
        texts = [p.get(p["type"]) for p in content]
        if not all(isinstance(t, str) for t in texts):
            raise HTTPError(400, "a text part of a message's content needs a string `text` (a refusal part, "
                                 "a string `refusal`)", "messages")
        return "\n".join(texts)
    raise HTTPError(400, "message content must be a string or a list of text parts", "messages")


_STAND_IN = "\ue000"  # (a private-use character: no template writes one after a message's content)


def _common_suffix(a: str, b: str) -> str:
    return os.path.commonprefix([a[::-1], b[::-1]])[::-1]


def _up_to_final_message(text: str, final: str) -> str:
    """The rendered chat, without what the template writes after the last message (an end-of-turn
    token), cut right after that message's content, so that the answer continues it, as transformers
    does for continue_final_message: the content is found from the end, and its trailing whitespace is
    kept when the template kept it. (Searching only before the template's suffix, a content that also
    ends a special token, `d` before `<|im_end|>`, is never found inside it.)"""
    core = final.strip()
    if not core:
        raise HTTPError(400, "continue_final_message needs a last message with content", "continue_final_message")
    at = text.rfind(core)
    if at < 0:
        raise HTTPError(400, "continue_final_message: the chat template does not write the last message's "
                             "content as given", "continue_final_message")
    kept = final.lstrip()
    return text[:at + (len(kept) if text.startswith(kept, at) else len(core))]


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def load_api_keys(key: str | None, key_file: str | None) -> list[bytes]:
    """--api-key and the keys of --api-key-file (one a line; blank lines and # comments skipped). The
    key is stripped as the file's lines are (and a request's header): one given with a space round it
    would match no request. An empty one is no key (as vLLM takes it: the compose files pass
    MOEMESH_API_KEY empty where none is set); the gateway says so when it starts."""
    keys = [key.strip()] if key and key.strip() else []
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"--api-key-file {key_file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--api-key-file {key_file}: not UTF-8 text") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ConfigError(f"--api-key-file {key_file} holds no key")
    return [_digest(k) for k in keys]  # (kept as digests: equal lengths, nothing to learn from timing)


def key_matches(header: str, keys: list[bytes]) -> bool:
    """Whether an Authorization header (`Bearer KEY`, the scheme in any case) carries one of the keys.
    SHA-256 digests are compared, each in constant time, and every key is compared: the time tells
    neither how close a guess was, nor which key it nearly matched, nor the keys' lengths."""
    scheme, _, token = header.strip().partition(" ")
    given = _digest(token.strip() if scheme.lower() == "bearer" else "\0" + header)
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key)
    return matched


def ssl_context(cfg: GatewaySettings) -> ssl.SSLContext | None:
    """TLS for the HTTP port with --ssl-certfile (and --ssl-keyfile, unless the key is in the cert file)."""
    if cfg.ssl_keyfile and not cfg.ssl_certfile:
        raise ConfigError("--ssl-keyfile needs --ssl-certfile")
    if not cfg.ssl_certfile:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"--ssl-certfile {cfg.ssl_certfile}: {getattr(e, 'strerror', None) or e}") from None
    return context


def listen_sockets(cfg: GatewaySettings) -> list[socket.socket]:
    """The gateway's sockets, one per address --host names (localhost: 127.0.0.1 and ::1; "" or 0.0.0.0:
    every interface), bound now but listening only once the pipeline serves (until then a client is
    refused at once, as by a server that is not up): a port that is taken, or a host that is not this
    machine's, is an error naming the flags before anything waits for the pipeline (or starts it)."""
    socks: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(cfg.host or None, cfg.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        port = cfg.port
        for family, _, _, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:  # (a family this kernel does not have, IPv6 turned off: as asyncio skips it)
                continue
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (not past a listener: Linux refuses)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address[0], port, *address[2:]))
            except OSError as e:  # (a name's address this host does not have, e.g. ::1 without IPv6: skipped)
                if e.errno != errno.EADDRNOTAVAIL:
                    raise
                socks.remove(sock)
                sock.close()
                continue
            port = port or sock.getsockname()[1]  # (--port 0: every address on the one port the first got)
            sock.setblocking(False)
        if not socks:
            raise OSError(errno.EADDRNOTAVAIL, "none of its addresses is this host's")
    except (OSError, UnicodeError) as e:  # (socket.gaierror is an OSError)
        for sock in socks:
            sock.close()
        raise ConfigError(f"--host {cfg.host} --port {cfg.port}: {getattr(e, 'strerror', None) or e}") from None
    return socks


LISTEN_BACKLOG = 128  # (aiohttp's)


def start_listening(socks: list[socket.socket], cfg: GatewaySettings) -> None:
    """listen() on `listen_sockets`' sockets, here, where a failure is an error naming the flags:
    another process may have bound the port while this one waited for the pipeline (two processes
    with SO_REUSEADDR may both bind a port no one listens on yet; the first to listen takes it), and
    aiohttp's own listen() under uvloop does not say so (its site then has no address)."""
    for sock in socks:
        try:
            sock.listen(LISTEN_BACKLOG)
        except OSError as e:
            raise ConfigError(f"--host {cfg.host} --port {cfg.port}: {e.strerror or e} (another process began "
                              f"listening on it while this gateway waited for the pipeline)") from None


CONTENT_CODINGS = ("gzip", "deflate")  # (and identity, and x-gzip for gzip)
MAX_CODINGS, MAX_GZIP_MEMBERS = 2, 16  # (more is no client's doing: each costs a pass over the body)


def decoded_body(raw: bytes, encodings: list[str], limit: int) -> bytes:
    """A request body under its Content-Encoding headers (RFC 9110 8.4: codings in the order they were
    applied, so undone last to first), at most `limit` bytes decoded. HTTPError: 415 for a coding
    this gateway does not decode (naming the ones it does), 400 for a body that does not decode as
    its coding says (or ends early, or has bytes after a deflate stream, or more than MAX_CODINGS
    codings or MAX_GZIP_MEMBERS gzip members), 413 past the limit. The gateway decodes bodies itself
    (its runner does not): aiohttp answers a coding it lacks a library for in plain text, and passes
    one it does not know on as if it were not encoded."""
    codings = [c.strip().lower() for value in encodings for c in value.split(",") if c.strip()]
    codings = ["gzip" if c == "x-gzip" else c for c in codings if c != "identity"]
    unknown = [c for c in codings if c not in CONTENT_CODINGS]
    if unknown:
        raise HTTPError(415, f"Content-Encoding {', '.join(unknown)} is not supported: send the body as it is, or "
                             f"{' or '.join(CONTENT_CODINGS)}", headers={"Accept-Encoding": ", ".join(CONTENT_CODINGS)})
    if len(codings) > MAX_CODINGS:
        raise HTTPError(400, f"could not read the request body: {len(codings)} content codings, at most {MAX_CODINGS}")
    for coding in reversed(codings):
        if coding == "gzip":
            wbits = 16 + zlib.MAX_WBITS
        else:  # deflate: the zlib format (RFC 9110), or the raw deflate stream some clients send
            wbits = zlib.MAX_WBITS if len(raw) >= 2 and raw[0] & 0x0F == 8 and (raw[0] << 8 | raw[1]) % 31 == 0 \
                else -zlib.MAX_WBITS
        out, rest = [], memoryview(raw)
        size = 0
        for member in range(MAX_GZIP_MEMBERS + 1):  # (gzip: one member after another, RFC 1952)
            if member == MAX_GZIP_MEMBERS:
                raise HTTPError(400, f"could not read the request body: more than {MAX_GZIP_MEMBERS} gzip members")
            inflate = zlib.decompressobj(wbits)
            try:
                out.append(inflate.decompress(rest, limit + 1 - size))
            except zlib.error as e:
                raise HTTPError(400, f"could not read the request body: it does not decode as {coding}: {e}") from None
            size += len(out[-1])
            if size > limit:
                raise HTTPError(413, f"request body larger than {limit} bytes (decoded from {coding})")
            if not inflate.eof:
                raise HTTPError(400, f"could not read the request body: its {coding} stream ends early")
            rest = rest[len(rest) - len(inflate.unused_data):]
            if not rest:
                break
            if coding != "gzip":
                raise HTTPError(400, f"could not read the request body: {len(rest)} bytes after its {coding} stream")
        raw = b"".join(out)
    return raw


async def run_gateway(cfg: GatewaySettings, ready: asyncio.Event | None = None, urls: list | None = None,
                      down: asyncio.Future | None = None, socks: list[socket.socket] | None = None) -> None:
    """Serves until cancelled; once listening sets `ready` and appends its URL (the port it bound,
    which --port 0 leaves to the system) to `urls`. `down`: its result, a reason, turns the gateway to
    503 for good (the mesh's launcher gave up on it). `socks`: `listen_sockets` bound already."""
    socks = socks or listen_sockets(cfg)
    gw = Gateway(cfg)
    if down is not None:
        down.add_done_callback(lambda f: f.cancelled() or gw.fail(f.result()))
    # (the drain ends what is still open at --drain-timeout itself: `Gateway._drain`; the margin lets those
    # requests write their error and end before aiohttp cancels them)
    # (aiohttp closes a connection idle at keepalive_timeout, and one whose request's headers are still
    # arriving then: it is waiting for a whole message; aiohttp's own default is an hour)
    runner = web.AppRunner(gw.app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=cfg.keepalive_timeout,
                           shutdown_timeout=cfg.drain_timeout + DRAIN_MARGIN,
                           auto_decompress=False)  # (bodies are decoded by decoded_body)
    try:
        await runner.setup()  # (waits for the pipeline to serve)
        start_listening(socks, cfg)
        for sock in socks:
            await web.SockSite(runner, sock, ssl_context=ssl_context(cfg), backlog=LISTEN_BACKLOG).start()
    except BaseException:
        for sock in socks:
            sock.close()
        await runner.cleanup()
        raise
    scheme = "https" if cfg.ssl_certfile else "http"
    port = runner.addresses[0][1] if runner.addresses else cfg.port
    host = cfg.host or "0.0.0.0"
    url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
    log.info("gateway listening", extra={"fields": {"url": url}})
    if urls is not None:
        urls.append(url)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
