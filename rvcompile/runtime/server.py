"""`rvrun serve`: an OpenAI-compatible HTTP server (FastAPI) over one Model's engine.

Routes: POST /v1/chat/completions and /v1/completions (JSON, or SSE token by token with
`stream: true`), GET /v1/models, /health and /metrics (Prometheus). The engine runs in one
background thread (EngineThread); each request hands it a sink that moves outputs onto the event
loop. Bad requests get OpenAI-style error JSON: 400 for malformed bodies, unknown fields, wrong
types (the schemas below check types only), values out of range and prompts that do not fit
(the engine's one request check, runtime/request_limits), 404 for an unknown model, 503 when the
waiting queue is full or the engine is lost (a device error; /health then says why). A request
the engine fails to run gets a 500 (or an error event in its stream); the others go on. A client
that disconnects, streaming or not, aborts its request, which frees its sequence at the next
step.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from rvcompile.runtime.engine import EngineThread, QueueFull, RequestOutput
from rvcompile.runtime.engine import Request as EngineRequest
from rvcompile.runtime.executor_api import Sampling
from rvcompile.runtime.model import Model
from rvcompile.runtime.request_limits import RequestError

# ---------------------------------------------------------------------------------- schemas


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share, by type; the engine checks their values
    (request_limits). Accepted OpenAI fields we do not implement must keep their neutral value
    (checked in `unsupported`)."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # an extension (as in vLLM); 0 or -1: no cut
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # an extension (as in vLLM), for benchmarks

    def unsupported(self) -> str | None:
        if self.n != 1:
            return "n: only n=1 is supported"
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            return "presence_penalty, frequency_penalty and logit_bias are not supported"
        return None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False

    def unsupported(self) -> str | None:
        return "logprobs is not supported" if self.logprobs else super().unsupported()


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.echo or self.logprobs is not None or self.suffix is not None:
            return "echo, logprobs and suffix are not supported"
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) \
                and len(self.prompt) != 1:
            return "prompt: one prompt per request"
        return super().unsupported()


# ---------------------------------------------------------------------------------- errors


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type_,
                                                                       param, code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status, headers=headers)


def _validation_error(exc: RequestValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument: {param}", param=param)
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON")
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param)


# ---------------------------------------------------------------------------------- metrics


class Metrics:
    """The server's Prometheus metrics; engine gauges are read from the engine at scrape time."""

    def __init__(self, thread: EngineThread):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rvrun_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("rvrun_request_finish", "Finished requests by finish reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("rvrun_prompt_tokens", "Prompt tokens admitted",
                                     registry=r)
        self.generation_tokens = Counter("rvrun_generation_tokens", "Tokens generated",
                                         registry=r)
        latency = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("rvrun_time_to_first_token_seconds",
                              "Request received -> first token out", buckets=latency,
                              registry=r)
        self.itl = Histogram("rvrun_inter_token_latency_seconds",
                             "Time between a request's consecutive tokens", buckets=latency,
                             registry=r)
        r.register(_EngineCollector(thread))


class _EngineCollector:
    def __init__(self, thread: EngineThread):
        self.thread = thread

    def collect(self):
        s = self.thread.engine.stats()
        yield GaugeMetricFamily("rvrun_running_sequences", "Sequences admitted to the batch",
                                value=s.running)
        yield GaugeMetricFamily("rvrun_waiting_sequences", "Sequences waiting for admission",
                                value=s.waiting)
        used = GaugeMetricFamily("rvrun_kv_blocks_used", "KV blocks held by sequences",
                                 labels=["kind"])
        total = GaugeMetricFamily("rvrun_kv_blocks_total", "KV blocks in the pool",
                                  labels=["kind"])
        for kind in s.kv_total:
            used.add_metric([kind], s.kv_used[kind])
            total.add_metric([kind], s.kv_total[kind])
        yield used
        yield total
        yield CounterMetricFamily("rvrun_prefix_cache_queried_tokens",
                                  "Prompt tokens looked up in the prefix cache",
                                  value=s.prefix_queried)
        yield CounterMetricFamily("rvrun_prefix_cache_hit_tokens",
                                  "Prompt tokens served by the prefix cache", value=s.prefix_hit)
        yield GaugeMetricFamily("rvrun_prefix_cache_hit_rate",
                                "Prefix-cache hit tokens / queried tokens, since start",
                                value=s.prefix_hit / s.prefix_queried if s.prefix_queried else 0)
        yield CounterMetricFamily("rvrun_preemptions", "Sequences preempted for KV blocks",
                                  value=s.preemptions)


# ---------------------------------------------------------------------------------- app


@dataclass(frozen=True)
class ServeOptions:
    model_name: str  # the only model id requests may name
    max_waiting: int = 256  # requests queued beyond this get 503


def create_app(model: Model, options: ServeOptions) -> FastAPI:
    """The ASGI app; its lifespan starts the engine thread and stops it."""
    state: dict[str, object] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state["thread"] = thread = EngineThread(model.engine)
        state["metrics"] = Metrics(thread)
        try:
            yield
        finally:
            thread.stop()

    app = FastAPI(title="rvrun serve", lifespan=lifespan)
    app.state.rvrun = state

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(ApiError)
    async def _on_api_error(_: Request, exc: ApiError):
        return exc.response()

    app.add_middleware(_CountRequests, state=state)

    @app.get("/health")
    async def health():
        error = state["thread"].error
        if error:
            return JSONResponse({"status": "error", "error": error}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_route():
        return Response(generate_latest(state["metrics"].registry),
                        media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": options.model_name, "object": "model", "created": 0, "owned_by": "rvcompile",
            "max_model_len": model.max_context}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _check_common(body, options)
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} for m in body.messages]
        try:
            text = model.apply_chat_template(messages)
        except Exception as e:  # a template that rejects these messages (roles, order)
            raise ApiError(400, f"messages: {str(e).splitlines()[0]}", param="messages") from e
        ids = model.encode(text, add_bos=False)
        max_tokens = body.max_tokens if body.max_completion_tokens is None \
            else body.max_completion_tokens
        return await _serve(model, state, options, body, ids, max_tokens, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_common(body, options)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = model.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return await _serve(model, state, options, body, ids, body.max_tokens, request,
                            chat=False)

    return app


class _CountRequests:
    """ASGI middleware counting /v1/ requests by path and status (a plain ASGI wrapper: it
    leaves streaming and client disconnects alone)."""

    def __init__(self, app, state: dict):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.state["metrics"].requests.labels(scope["path"],
                                                      str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _check_common(body: _Sampling, options: ServeOptions) -> None:
    if body.model != options.model_name:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{options.model_name!r}", param="model", code="model_not_found")
    problem = body.unsupported()
    if problem:
        raise ApiError(400, problem)


async def _serve(model: Model, state: dict, options: ServeOptions, body: _Sampling,
                 ids: list[int], max_tokens: int | None, request: Request, *, chat: bool):
    received = time.perf_counter()
    thread: EngineThread = state["thread"]
    metrics: Metrics = state["metrics"]
    if max_tokens is None:  # what the context leaves (at least 1: a full prompt is refused)
        max_tokens = max(model.max_context - len(ids), 1)
    stop = body.stop if body.stop is not None else ()
    seed = random.getrandbits(31) if body.seed is None else body.seed
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine_request = EngineRequest(rid, ids, max_tokens,
                                   Sampling(body.temperature, body.top_k, body.top_p, seed), stop,
                                   body.ignore_eos)

    def sink(out: RequestOutput) -> None:  # on the engine thread
        if out.finished:
            metrics.finished.labels(out.finish_reason).inc()
            metrics.generation_tokens.inc(out.completion_tokens)
        loop.call_soon_threadsafe(queue.put_nowait, out)

    try:
        thread.submit(engine_request, sink, options.max_waiting)
    except RequestError as e:
        raise ApiError(400, f"{_param(e.param, body, chat)}: {e.problem}",
                       param=_param(e.param, body, chat), code=e.code) from e
    except QueueFull as e:
        raise ApiError(503, f"the server's queue is full ({options.max_waiting} waiting "
                            "requests); retry later", type_="server_overloaded",
                       code="queue_full") from e
    except RuntimeError as e:
        raise ApiError(503, str(e), type_="server_error") from e
    metrics.prompt_tokens.inc(len(ids))
    stream = _Stream(rid, queue, thread, metrics, received)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _chat_events if chat else _completion_events
        return StreamingResponse(events(stream, options.model_name, include_usage),
                                 media_type="text/event-stream")
    return await _complete(stream, options.model_name, request, chat)


def _param(param: str, body: _Sampling, chat: bool) -> str:
    """A request_limits field as this request spelled it."""
    if param == "prompt" and chat:
        return "messages"
    if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return param


class _Stream:
    """One request's outputs on the event loop, with its latency metrics. `close` aborts the
    request if it is still running (a client gone, a server shutting down)."""

    def __init__(self, rid: str, queue: asyncio.Queue, thread: EngineThread, metrics: Metrics,
                 received: float):
        self.rid, self.queue, self.thread, self.metrics = rid, queue, thread, metrics
        self.received, self.last = received, None
        self.created = int(time.time())
        self.done = False

    async def next(self) -> RequestOutput:
        out = await self.queue.get()
        now = time.perf_counter()
        if out.token_ids:
            if self.last is None:
                self.metrics.ttft.observe(now - self.received)
            else:  # a device-side decode loop hands over several tokens at once: per token
                gap = (now - self.last) / len(out.token_ids)
                for _ in out.token_ids:
                    self.metrics.itl.observe(gap)
            self.last = now
        if out.finished:
            self.done = True
        return out

    def close(self) -> None:
        if not self.done:
            self.thread.abort(self.rid)
            self.done = True


def _usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _check_finished(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise ApiError(500, out.error, type_="server_error")


async def _complete(stream: _Stream, model_name: str, request: Request, chat: bool):
    """Collect the whole answer; a client that goes away meanwhile aborts the request at once
    (its disconnect is the next message on the request's ASGI channel, its body being read)."""

    async def collect() -> tuple[list[str], RequestOutput]:
        text = []
        while True:
            out = await stream.next()
            text.append(out.text)
            if out.finished:
                return text, out

    async def disconnected() -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a channel that fails is a client gone too
            return

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        collector.cancel()
        stream.close()
    if not collector.done() or collector.cancelled():
        return Response(status_code=499)
    text, out = collector.result()
    _check_finished(out)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                  "finish_reason": out.finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": "".join(text), "finish_reason": out.finish_reason,
                  "logprobs": None}
    return {"id": stream.rid, "object": "chat.completion" if chat else "text_completion",
            "created": stream.created, "model": model_name, "choices": [choice],
            "usage": _usage(out)}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _events(stream: _Stream, include_usage: bool, head: dict, first: dict | None,
                  piece) -> AsyncIterator[str]:
    """SSE of one request: `first` (if any), then a chunk per new text, a final chunk with the
    finish reason, the usage chunk if asked for, and [DONE]."""
    try:
        if first is not None:
            yield _sse({**head, "choices": [first]})
        while True:
            out = await stream.next()
            if out.finish_reason == "error":
                yield _sse({"error": {"message": out.error, "type": "server_error",
                                      "param": None, "code": None}})
                return
            if out.text:
                yield _sse({**head, "choices": [piece(out.text, None)]})
            if out.finished:
                yield _sse({**head, "choices": [piece("", out.finish_reason)]})
                break
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(out)})
        yield _sse("[DONE]")
    finally:
        stream.close()


def _chat_events(stream: _Stream, model_name: str, include_usage: bool) -> AsyncIterator[str]:
    head = {"id": stream.rid, "object": "chat.completion.chunk", "created": stream.created,
            "model": model_name}

    def piece(text: str, reason: str | None) -> dict:
        return {"index": 0, "delta": {"content": text} if text else {},
                "finish_reason": reason, "logprobs": None}

    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
             "logprobs": None}
    return _events(stream, include_usage, head, first, piece)


def _completion_events(stream: _Stream, model_name: str,
                       include_usage: bool) -> AsyncIterator[str]:
    head = {"id": stream.rid, "object": "text_completion", "created": stream.created,
            "model": model_name}

    def piece(text: str, reason: str | None) -> dict:
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

    return _events(stream, include_usage, head, None, piece)
