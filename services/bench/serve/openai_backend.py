"""`cbserve bench serve --backend openai --target URL`: any OpenAI-compatible HTTP server (smg in front
of cbserve, `cbserve up --http-port`; vLLM's own OpenAI server) driven with the same workloads as
cbserve's gRPC API, for a side-by-side comparison of whole stacks.

Each request is one streaming POST to `/v1/completions` (`stream_options.include_usage`, and vLLM's
`ignore_eos`, which smg forwards to its workers) on a pool of HTTP/1.1 connections of httpx2 (already
in the environment: huggingface_hub's and openai's client), with no limit on connections so that the
client never queues a request the schedule sends. Prompts go as text, since smg takes no token-id
prompts: token ids (drawn, or a dataset's `token_ids`) as `--tokenizer`'s word tokens (text.py,
exact lengths), a dataset's `prompt` text as it is. The model is the one `/v1/models` lists.

Timing is the gRPC backend's: a chunk's time is taken when its server-sent event is complete, and each
chunk with text is one token (servers stream a token at a time). A token that decodes to no text (a
special token, half a character) sends no chunk: its time is not seen, and the request's token count
comes from the final usage. A request fails (RequestFailed) on an HTTP status other than 200
(HTTP_<status>, with the server's message), a refused or lost connection before the answer
(CONNECTION_ERROR), a stream that ends before `data: [DONE]` (TRUNCATED), an answer that is not a
stream of JSON events (BAD_STREAM), an error event in the stream (STREAM_ERROR) or `--request-timeout`
(DEADLINE_EXCEEDED). At the phase's time limit a request in flight is cancelled by closing its
connection, which is how an HTTP client goes away: smg and vLLM then abort it.

The server's load (KV usage, running and waiting requests, prefix-cache hits, preemptions) comes from
`--metrics-url` (metrics.py: cbserve's or vLLM's names); without it the report says unknown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from services.bench.serve.backends import BackendError, RequestFailed, ServerInfo, request_seed
from services.bench.serve.metrics import parse_load, scrape
from services.bench.serve.report import RequestRecord
from services.bench.serve.text import PromptText
from services.bench.serve.workloads import BenchRequest

if TYPE_CHECKING:
    import httpx2

_MESSAGE_CHARS = 300  # of an error body kept in the report


def api_base(target: str) -> str:
    """`http://host:port` or `http://host:port/v1` -> the `/v1` base the API's paths hang from."""
    base = target.rstrip("/")
    return base if base.endswith("/v1") else f"{base}/v1"


class OpenAIBackend:
    def __init__(
        self, client: httpx2.AsyncClient, args: argparse.Namespace, model: dict[str, Any], prompts: PromptText
    ) -> None:
        self.client, self.args, self.model, self.prompts = client, args, model, prompts
        self.url = f"{api_base(args.target)}/completions"
        self.description = f"openai {self.url}"
        self.load_source: str | None = None
        # A server's metrics may be figures of its engine's last update (vLLM's API server gets them
        # with the engine's outputs), so they count as settled only once they hold still a while.
        self.load_settle_s = 1.0

    @classmethod
    @asynccontextmanager
    async def open(cls, args: argparse.Namespace) -> AsyncIterator[OpenAIBackend]:
        import logging

        import httpx2

        logging.getLogger("httpx2").setLevel(logging.WARNING)  # it logs every request at INFO
        try:
            prompts = PromptText(args.tokenizer, args.cache_salt)
        except (OSError, ValueError) as exc:
            raise BackendError(f"--tokenizer {args.tokenizer}: {exc}") from exc
        unlimited = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
        # trust_env off: a proxy from the environment must not stand between the client and the server.
        async with httpx2.AsyncClient(timeout=None, limits=unlimited, trust_env=False) as client:
            model = await _served_model(client, api_base(args.target), args.served_model_name)
            backend = cls(client, args, model, prompts)
            backend.load_source = await backend._probe_metrics()
            yield backend

    async def info(self) -> ServerInfo:
        facts = self.model | {
            "tokenizer": str(self.args.tokenizer),
            "vocab_size": self.prompts.vocab_size,
            "word_tokens": len(self.prompts.words),
        }
        max_len = self.model.get("max_model_len")
        return ServerInfo(self.prompts.vocab_size, max_len if isinstance(max_len, int) else None, facts)

    def body(self, req: BenchRequest) -> dict[str, Any]:
        prompt = req.text if req.token_ids is None else self.prompts.words_for(req.token_ids)
        body: dict[str, Any] = {
            "model": self.model["id"],
            "prompt": prompt,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.args.temperature,
            "ignore_eos": self.args.ignore_eos,
        }
        if req.max_tokens is not None:
            body["max_tokens"] = req.max_tokens
        if self.args.temperature > 0:
            body["seed"] = request_seed(self.args, req)
        return body

    async def stream(self, req: BenchRequest, record: RequestRecord, now: Callable[[], float]) -> None:
        import httpx2

        answered = False
        try:
            async with (
                asyncio.timeout(self.args.request_timeout),
                self.client.stream("POST", self.url, json=self.body(req)) as response,
            ):
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise RequestFailed(f"HTTP_{response.status_code}", error_message(text))
                answered = True
                if not await _read_events(httpx2.EventSource(response), record, now):
                    raise RequestFailed("TRUNCATED", "the stream ended before `data: [DONE]`")
        except TimeoutError as exc:
            raise RequestFailed(
                "DEADLINE_EXCEEDED", f"not done within --request-timeout {self.args.request_timeout} s"
            ) from exc
        except httpx2.SSEError as exc:
            raise RequestFailed("BAD_STREAM", str(exc)) from exc
        except httpx2.HTTPError as exc:
            code = "TRUNCATED" if answered else "CONNECTION_ERROR"
            raise RequestFailed(code, f"{type(exc).__name__}: {exc}") from exc

    async def load(self, timeout_s: float) -> dict[str, int] | None:
        if self.load_source is None:
            return None
        try:
            return parse_load(await asyncio.to_thread(scrape, self.args.metrics_url, timeout_s))
        except OSError:
            return None

    async def _probe_metrics(self) -> str | None:
        """`--metrics-url` when it gives the server's load, with a warning why not otherwise."""
        import sys

        url = self.args.metrics_url
        if url is None:
            return None
        try:
            found = parse_load(await asyncio.to_thread(scrape, url))
        except OSError as exc:
            print(f"warning: {url}: {exc}; the server's load is unknown", file=sys.stderr)
            return None
        if found is None:
            print(
                f"warning: {url} has neither cbserve's nor vLLM's load metrics; the server's load is unknown",
                file=sys.stderr,
            )
            return None
        return f"metrics {url}"


async def _read_events(events: Any, record: RequestRecord, now: Callable[[], float]) -> bool:
    """Records the stream's chunks and usage; True when it ended with `data: [DONE]`."""
    async for event in events:
        t = now()
        if event.data == "[DONE]":
            return True
        try:
            chunk = json.loads(event.data)
        except ValueError as exc:
            raise RequestFailed(
                "BAD_STREAM", f"an event that is not JSON: {event.data[:_MESSAGE_CHARS]!r}"
            ) from exc
        if not isinstance(chunk, dict):
            raise RequestFailed(
                "BAD_STREAM", f"an event that is not a JSON object: {event.data[:_MESSAGE_CHARS]!r}"
            )
        # vLLM reports an error after the stream started as {"error": {...}}, smg as {"type": "error", ...}.
        if isinstance(chunk.get("error"), dict) or chunk.get("type") == "error":
            raise RequestFailed("STREAM_ERROR", error_message(json.dumps(chunk)))
        for choice in chunk.get("choices") or ():
            if choice.get("text"):
                record.chunk_times.append(t)
                record.chunk_tokens.append(1)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        if usage := chunk.get("usage"):
            record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
            record.completion_tokens = usage.get("completion_tokens")
            # smg always says; vLLM only with --enable-prompt-tokens-details (else unknown, None).
            record.cached_prompt_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return False


def error_message(body: str) -> str:
    """The message of an OpenAI error body ({"error": {"message": ...}}, or {"message": ...}), else
    the body's start."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:_MESSAGE_CHARS]
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        source = inner if isinstance(inner, dict) else parsed
        if isinstance(source.get("message"), str):
            return source["message"][:_MESSAGE_CHARS]
    return body[:_MESSAGE_CHARS]


async def _served_model(client: httpx2.AsyncClient, base: str, wanted: str | None) -> dict[str, Any]:
    """The model entry of `/v1/models` to send requests to: `wanted`, or the one the server lists."""
    import httpx2

    url = f"{base}/models"
    try:
        reply = await client.get(url, timeout=30)
    except httpx2.HTTPError as exc:
        raise BackendError(f"{url}: {type(exc).__name__}: {exc}") from exc
    if reply.status_code != 200:
        raise BackendError(f"{url}: HTTP {reply.status_code}: {error_message(reply.text)}")
    try:
        models = [m for m in reply.json()["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (ValueError, KeyError, TypeError) as exc:
        raise BackendError(f"{url}: not an OpenAI model list: {reply.text[:_MESSAGE_CHARS]!r}") from exc
    ids = [m["id"] for m in models]
    if wanted is not None:
        if wanted not in ids:
            raise BackendError(f"{url}: no model {wanted!r}; the server lists {ids}")
        return next(m for m in models if m["id"] == wanted)
    if len(models) != 1:
        raise BackendError(f"{url}: the server lists {ids}: choose one with --served-model-name")
    return models[0]
