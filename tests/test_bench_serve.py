"""`bench serve` against a server that is not moemesh: one that closes kept-alive connections after
each response and reports no usage (as llama-server can), and the shared-prefix workload."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from moemesh.entrypoints.cli import main


class FakeServer:
    """A minimal OpenAI-style streaming server on loopback: each completion streams `max_tokens`
    chunks of one token each (no usage), announces keep-alive and then closes the connection."""

    def __init__(self, mode: str = "stream"):
        # stream; json: a plain JSON answer (stream ignored); garbage: a non-JSON event; string-error: an error
        # event whose error is a bare string; finish: a last event with no text, only its finish_reason
        self.mode = mode
        self.prompts: list[list[int]] = []
        self.handlers: set[asyncio.Task] = set()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.handlers.add(asyncio.current_task())
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            body = json.loads(await reader.readexactly(length))
            self.prompts.append(body["prompt"])
            if self.mode == "bad-bytes":  # (an error whose body is not UTF-8)
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\n\xff\xfe\xfd\xfc")
                await writer.drain()
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            events = [json.dumps({"choices": [{"index": 0, "text": "x"}]}) for _ in range(body["max_tokens"])]
            if self.mode == "json":
                events = []
                payload = json.dumps({"choices": [{"index": 0, "text": "x" * body["max_tokens"]}]}).encode()
                writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            elif self.mode == "garbage":
                events = ["not json", *events]
            elif self.mode == "string-error":
                events = [*events[:1], json.dumps({"error": "model overloaded"})]
            elif self.mode == "finish":  # (the token's text incomplete, then whole, then the finish alone)
                events = [json.dumps({"choices": [{"index": 0, "text": ""}]}), *events[1:],
                          json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})]
            elif self.mode == "cut":  # (every other stream ends after one token, cleanly, without its end)
                events = events[:1] if len(self.prompts) % 2 == 0 else events
            done = [] if self.mode == "json" or (self.mode == "cut" and len(events) == 1) else ["[DONE]"]
            for data in [*events, *done]:
                # (SSE's space after "data:" is optional: a server may leave it out)
                payload = (f"data:{data}\n\n" if self.mode == "tight" else f"data: {data}\n\n").encode()
                writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)  # idle keep-alive connection closed by the server
        except (ConnectionResetError, BrokenPipeError):
            pass  # (the client closed the connection mid-answer: a server goes on; asyncio would log it)
        finally:
            writer.close()

    async def _close(self):
        self.server.close()
        await self.server.wait_closed()
        await asyncio.gather(*self.handlers, return_exceptions=True)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_bench_serve_against_a_server_that_closes_connections_and_sends_no_usage(capsys):
    server = FakeServer()
    try:
        assert main(["bench", "serve", "--url", f"http://127.0.0.1:{server.port}", "--concurrency", "4",
                     "--num-prompts", "24", "--prompt-len", "5", "--new", "6", "--shared-prefix", "10",
                     "--vocab", "500", "--json"]) == 0
    finally:
        server.stop()
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["failed"] == 0 and row["requests"] == 24 and row["shared_prefix"] == 10
    # tokens counted from the chunks: 24 x 6
    assert row["output_tokens"] == 24 * 6
    assert abs(row["output_tok_per_s"] * row["seconds"] - 24 * 6) < 0.05 * 24 * 6 + 1  # (both rounded)
    assert len(server.prompts) == 24 and all(len(p) == 15 for p in server.prompts)
    assert len({tuple(p[:10]) for p in server.prompts}) == 1  # one shared prefix
    assert len({tuple(p[10:]) for p in server.prompts}) == 24  # different suffixes


def test_bench_serve_says_why_requests_failed(capsys):
    """A server that answers 200 without an event stream of tokens, or streams an event that is not
    JSON: every request is a failure, and the command says why (no traceback, no figures)."""
    for mode, reason in (("json", "the reply streamed no tokens"), ("garbage", "not a JSON event in the stream"),
                         ("string-error", "model overloaded"), ("bad-bytes", "HTTP 503: \ufffd")):
        server = FakeServer(mode)
        try:
            with pytest.raises(SystemExit) as stop:
                main(["bench", "serve", "--url", f"http://127.0.0.1:{server.port}", "--concurrency", "2",
                      "--num-prompts", "4", "--prompt-len", "3", "--new", "3", "--vocab", "500"])
            assert stop.value.code == 2
        finally:
            server.stop()
        err = capsys.readouterr().err
        assert f"every request failed against http://127.0.0.1:{server.port} at concurrency 2: 4 x {reason}" in err, err
        assert "Traceback" not in err


def test_bench_serve_counts_tokens_not_events_and_plots_one_token_answers(capsys, tmp_path):
    """Without usage, a token is an event with choices, its text empty or not (a character not yet whole);
    a last event with only its finish_reason is none. With one token per answer there is no time per
    output token, and the plot leaves it out."""
    for new, want in ((1, 4), (3, 12)):
        server = FakeServer("finish")
        try:
            assert main(["bench", "serve", "--url", f"http://127.0.0.1:{server.port}", "--concurrency", "2",
                         "--num-prompts", "4", "--prompt-len", "3", "--new", str(new), "--vocab", "500", "--json",
                         "--plot", str(tmp_path / "p.png")]) == 0
        finally:
            server.stop()
        row = json.loads(capsys.readouterr().out.splitlines()[-1])
        # (4 x new tokens: not 4 x (new + 1) events, nor the events with text alone)
        assert row["failed"] == 0 and row["output_tokens"] == want and row["input_tokens"] == 4 * 3, row
        assert (row["tpot_p50_ms"] is None) == (new == 1) and (tmp_path / "p.png").stat().st_size > 0


def test_bench_serve_counts_a_stream_cut_short_as_failed_and_reads_tight_sse(capsys):
    """A stream that ends cleanly before its end (no finish_reason, no [DONE]) is a failed request, not
    a short answer in the figures; "data:" without its optional space is an event."""
    for mode, prompts in (("cut", 4), ("tight", 2)):
        server = FakeServer(mode)
        try:
            assert main(["bench", "serve", "--url", f"http://127.0.0.1:{server.port}", "--concurrency", "1",
                         "--num-prompts", str(prompts), "--prompt-len", "3", "--new", "5", "--vocab", "500",
                         "--json"]) == 0
        finally:
            server.stop()
        out = capsys.readouterr()
        row = json.loads(out.out.splitlines()[-1])
        if mode == "cut":  # (every other stream cut after its first token)
            assert (row["requests"], row["failed"], row["output_tokens"]) == (4, 2, 2 * 5), row  # (requests: sent)
            assert "the stream ended before its end" in out.err
        else:
            assert (row["failed"], row["output_tokens"]) == (0, 2 * 5), row
