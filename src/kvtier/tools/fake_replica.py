"""A fake vLLM replica: enough of vLLM's OpenAI server to route to, answering at once.

The router benchmark measures the hop against it (`python -m kvtier.tools.fake_replica PORT`),
and the router's tests run it in-process to misbehave on demand (`mode`):

    ok              answer: JSON, or SSE when the request asks to stream
    error500        answer 500
    reset           read the request, then reset the connection
    hang            read the request, never answer
    die_mid_stream  stream the first SSE event, then reset the connection
    slow_stream     stream the first SSE event, the rest once `release` is set
    slow_end        stream every SSE event, `[DONE]` included; end the body once `release` is set
    slow_answer     send the first half of a whole (non-streamed) answer, the rest once
                    `release` is set
    die_mid_answer  send the first half of a whole answer, then reset the connection
    abort           answer cut short as vLLM does when it stops: `finish_reason` "abort"
    refuse          answer as a draining vLLM refuses a request: a text prompt or a chat, 500
                    "cannot schedule new futures after shutdown"; a token prompt, `finish_reason`
                    "abort" at once, or streamed, `[DONE]` alone, after a usage event with no
                    choice if the request asks for usage

`vanish()` drops it off the network as a node whose link is cut: nothing is answered any more,
open connections stay open and silent, and new ones time out rather than being refused.

It speaks HTTP/1.1 with keep-alive on a raw asyncio server (httptools parses requests), so it
controls its sockets down to the reset, and serves TLS when given an `ssl.SSLContext`.
Endpoints: GET /health (503 while `healthy` is False), /v1/models (the model, then any
`adapters`), /metrics (the `vllm:cache_config_info` line with `block_tokens`); POST
/v1/completions, /v1/chat/completions, /tokenize. Every POSTed JSON body is kept in `received`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any, Self

import httptools

from kvtier.core.parent_watch import stop_with_parent

__all__ = ["SSE_CHUNKS", "FakeReplica", "adapter_path"]

DIE_AFTER_S = 0.2
"""`die_mid_answer`: the pause between the first half and the reset, which makes the kernel
drop what the peer has not read yet (under load, the whole half: an answer that never began)."""

SSE_CHUNKS = [
    b'data: {"choices": [{"text": "a"}]}\n\n',
    b'data: {"choices": [{"text": "b"}]}\n\n',
    b"data: [DONE]\n\n",
]
_SHUT_DOWN_ERROR = {
    "error": {
        "message": "cannot schedule new futures after shutdown",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
"""vLLM 0.32's answer to a request it must tokenize once it is stopping."""
_STATUS = {
    200: b"OK",
    404: b"Not Found",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
}


@dataclass
class FakeReplica:
    mode: str = "ok"
    """How completions are answered (see the module docstring)."""
    model: str = "fake"
    max_model_len: int = 8192
    adapters: tuple[str, ...] = ()
    """LoRA adapters /v1/models lists after the model, as vLLM lists `--lora-modules`: cards
    with the base model as `parent`."""
    answer_bytes: int = 2
    """Length of a whole answer's text (a large one stands for long logprobs)."""
    answer_headers: bytes = b""
    """Header lines added to a whole answer's head (each ending with CRLF)."""
    block_tokens: int = 128
    """Engine block size reported on /metrics (vLLM's on CPU by default)."""
    healthy: bool = True
    health_delay_s: float = 0.0
    """Seconds /health takes to answer (a busy replica)."""
    tls: ssl.SSLContext | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    """Set it to let a `slow_stream` or `slow_end` replica finish its answer."""
    url: str = ""
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _gone: list[socket.socket] = field(default_factory=list)
    """After `vanish()`: the listener that takes nothing, and the connection filling it."""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> Self:
        self._server = await asyncio.start_server(self._serve, host, port, ssl=self.tls)
        bound = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://{host}:{bound}"
        return self

    async def serve_forever(self) -> None:
        assert self._server is not None, "start() first"
        await self._server.serve_forever()

    async def vanish(self) -> None:
        """Answer nothing from now on, and hold the port with a listener whose one-slot backlog
        is kept full, so that a new connection gets no answer at all (see the module docstring)."""
        assert self._server is not None, "start() first"
        host, port = self._server.sockets[0].getsockname()[:2]
        self._server.close()  # stops accepting; the open connections stay as they are
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(0)
        self._gone = [listener, socket.create_connection((host, port))]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            await self._server.wait_closed()
        for sock in self._gone:
            sock.close()

    # ----- one connection -----

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while (request := await _read_request(reader)) is not None:
                method, path, body = request
                if not await self._answer(writer, method, path, body):
                    break
        except (ConnectionError, httptools.HttpParserError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _answer(
        self, writer: asyncio.StreamWriter, method: str, path: str, body: bytes
    ) -> bool:
        """Answer one request; False when the connection must end."""
        while self._gone:  # dropped off the network: no answer, ever
            await asyncio.sleep(0.05)
        if method == "GET" and path == "/health":
            await asyncio.sleep(self.health_delay_s)
            await _respond(writer, 200 if self.healthy else 503, b"ok", b"text/plain")
        elif method == "GET" and path == "/v1/models":
            await _respond_json(
                writer,
                200,
                {"object": "list", "data": self._model_cards()},
            )
        elif method == "GET" and path == "/metrics":
            text = f'vllm:cache_config_info{{block_size="{self.block_tokens}",engine="0"}} 1.0\n'
            await _respond(writer, 200, text.encode(), b"text/plain")
        elif method == "POST" and path == "/tokenize":
            words = str(json.loads(body).get("prompt", "")).split()
            await _respond_json(
                writer,
                200,
                {
                    "tokens": [hash(w) % 50000 for w in words],
                    "count": len(words),
                    "max_model_len": self.max_model_len,
                },
            )
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            return await self._generate(writer, json.loads(body))
        else:
            await _respond_json(writer, 404, {"error": {"message": f"no route {path}"}})
        return True

    def _model_cards(self) -> list[dict[str, Any]]:
        base = {"id": self.model, "object": "model", "root": self.model, "parent": None}
        adapters = [
            {"id": name, "object": "model", "root": adapter_path(name), "parent": self.model}
            for name in self.adapters
        ]
        return [{**base, "max_model_len": self.max_model_len}, *adapters]

    async def _generate(self, writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        self.received.append(body)
        if self.mode == "error500":
            await _respond_json(writer, 500, {"error": "boom"})
            return True
        if self.mode == "refuse" and not isinstance(body.get("prompt"), list):
            await _respond_json(writer, 500, _SHUT_DOWN_ERROR)
            return True
        if self.mode == "reset":
            return False
        if self.mode == "hang":
            await asyncio.sleep(3600)
        finish = "abort" if self.mode in ("abort", "refuse") else "length"
        if not body.get("stream"):
            return await self._answer_whole(writer, finish)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        if self.mode == "refuse":
            if body.get("stream_options", {}).get("include_usage"):
                await _chunk(
                    writer, b'data: {"choices": [], "usage": {"completion_tokens": 0}}\n\n'
                )
            await _chunk(writer, SSE_CHUNKS[-1])
            await _chunk(writer, b"")
            return True
        await _chunk(writer, SSE_CHUNKS[0])
        if self.mode == "die_mid_stream":
            await asyncio.sleep(0.05)
            return False
        if self.mode == "slow_stream":
            await self.release.wait()
        if self.mode == "abort":
            await _chunk(writer, b'data: {"choices": [{"text": "", "finish_reason": "abort"}]}\n\n')
        for event in SSE_CHUNKS[1:]:
            await _chunk(writer, event)
        if self.mode == "slow_end":
            await self.release.wait()
        await _chunk(writer, b"")
        return True

    async def _answer_whole(self, writer: asyncio.StreamWriter, finish: str) -> bool:
        doc = {
            "id": "x",
            "object": "text_completion",
            "model": self.model,
            "choices": [
                {"text": "ok".ljust(self.answer_bytes, "."), "index": 0, "finish_reason": finish}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "served_by": self.url,
        }
        data = json.dumps(doc).encode()
        cut = self.mode in ("slow_answer", "die_mid_answer")
        sent = len(data) // 2 if cut else len(data)
        await _respond(writer, 200, data, b"application/json", self.answer_headers, sent)
        if not cut:
            return True
        if self.mode == "die_mid_answer":
            # the reset discards what the peer has not read yet: give it time to read the half
            await asyncio.sleep(DIE_AFTER_S)
            return False
        await self.release.wait()
        writer.write(data[sent:])
        await writer.drain()
        return True


def adapter_path(name: str) -> str:
    """The path /v1/models gives for the adapter `name` (its card's `root`)."""
    return f"/adapters/{name}"


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    """The next request on a keep-alive connection: (method, path, body); None at EOF."""
    done = asyncio.get_running_loop().create_future()
    parts: dict[str, Any] = {"url": b"", "body": []}

    class Callbacks:
        def on_url(self, url: bytes) -> None:
            parts["url"] += url

        def on_body(self, body: bytes) -> None:
            parts["body"].append(body)

        def on_message_complete(self) -> None:
            done.set_result(None)

    parser = httptools.HttpRequestParser(Callbacks())
    while not done.done():
        data = await reader.read(65536)
        if not data:
            return None
        parser.feed_data(data)
    path = httptools.parse_url(parts["url"]).path.decode()
    return parser.get_method().decode(), path, b"".join(parts["body"])


async def _respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: bytes,
    extra_headers: bytes = b"",
    send_bytes: int | None = None,
) -> None:
    """The answer's head for the whole `body`, then its first `send_bytes` (default: all)."""
    writer.write(
        b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s"
        % (
            status,
            _STATUS.get(status, b"Status"),
            content_type,
            len(body),
            extra_headers,
            body[:send_bytes],
        )
    )
    await writer.drain()


async def _respond_json(writer: asyncio.StreamWriter, status: int, doc: object) -> None:
    await _respond(writer, status, json.dumps(doc).encode(), b"application/json")


async def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
    await writer.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve a fake vLLM replica on loopback.")
    parser.add_argument("port", type=int)
    parser.add_argument("--mode", default="ok")
    args = parser.parse_args()
    stop_with_parent()  # a fake a benchmark started stops should the benchmark die first

    async def serve() -> None:
        replica = await FakeReplica(mode=args.mode).start(port=args.port)
        await replica.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
