"""`rvrun serve`: an OpenAI-compatible HTTP server (FastAPI) over one Model's engine.

Routes: POST /v1/chat/completions and /v1/completions (JSON, or SSE token by token with
`stream: true`), GET /v1/models, /health and /metrics (Prometheus). Chat requests may declare
tools; the model's calls come back as `tool_calls` (serve/tools.py checks the fields,
serve/tool_calls.py reads the calls out of the answer, streamed or whole). The engine runs in one
background thread (EngineThread); each request hands it a sink that moves outputs onto the event
loop. Bad requests get OpenAI-style error JSON: 400 for malformed bodies, unknown fields, wrong
types (the schemas below check types only), values out of range and prompts that do not fit
(the engine's one request check, runtime/request_limits), 404 for an unknown model, 503 when the
waiting queue is full or the engine is lost (a device error; /health then says why). A request
the engine fails to run gets a 500 (or an error event in its stream); the others go on. A client
that disconnects, streaming or not, aborts its request, which frees its sequence at the next
step. With `ServeOptions.speculation` (`rvrun serve --speculative`), every request runs with
speculative decoding (the same tokens); /metrics counts the drafts verified and accepted.

The HTTP layer (`HttpOptions`, the guards at the end of this module): every error, unknown routes
(404), wrong methods (405) and failures in a route (500, traceback in the server log only)
included, is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`; a body must
be UTF-8 JSON of valid Unicode, at most `max_body_bytes` long (413) and all there within
`body_timeout_s` of its headers (408, connection closed); with an `api_key`, every route but
/health and /metrics needs `Authorization: Bearer <key>` (401). `run` serves until SIGTERM or
SIGINT, then drains: new requests get 503 while in-flight ones finish, up to a timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import random
import re
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from rvcompile.runtime.constraints import Constraint
from rvcompile.runtime.engine import EngineThread, QueueFull, RequestOutput
from rvcompile.runtime.engine import Request as EngineRequest
from rvcompile.runtime.executor_api import Penalties, Sampled, Sampling
from rvcompile.runtime.model import Model
from rvcompile.runtime.request_limits import RequestError
from rvcompile.runtime.serve import tool_calls
from rvcompile.runtime.serve import tools as chat_tools
from rvcompile.runtime.serve.access_log import AccessLog, AccessRecord, record
from rvcompile.runtime.speculative import Speculation

# ---------------------------------------------------------------------------------- schemas


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        """The grammar this format asks for (the engine compiles it: a 400 naming why when
        llguidance cannot)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint.json_object()
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ApiError(400, "response_format: type json_schema needs json_schema.schema",
                           param="response_format")
        return Constraint.json_schema(self.json_schema.schema_)


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
    repetition_penalty: float = 1.0  # an extension (as in vLLM)
    stop_token_ids: list[int] | None = None  # an extension (as in vLLM)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # an extension (as in vLLM), for benchmarks
    response_format: ResponseFormat | None = None  # structured outputs (on completions too,
    # as in vLLM)

    def unsupported(self) -> str | None:
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def want_logprobs(self) -> int | None:
        """Top log-probabilities per token wanted; None: no log-probabilities."""
        return None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant message of tool_calls
    name: str | None = None
    tool_calls: list[chat_tools.AssistantToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call answered


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    tools: list[chat_tools.Tool] | None = None
    tool_choice: chat_tools.ToolChoice | None = None
    parallel_tool_calls: bool = True
    top_logprobs: int | None = None

    def want_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: logprobs must be true to use top_logprobs",
                           param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def want_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> str | None:
        if self.echo or self.suffix is not None:
            return "echo and suffix are not supported"
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
    errors = exc.errors()
    first = errors[0]
    loc = _loc(first)
    member = next((i for i, x in enumerate(loc) if _union_member(x)), None)
    if member is not None:
        return _union_error(errors, loc[:member])
    param = ".".join(map(str, loc)) or None
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument: {param}", param=param)
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON")
    if param is None and first.get("type") == "missing":
        return ApiError(400, "the request body is empty")
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _loc(error: dict) -> list:
    return [x for x in error.get("loc", ()) if x != "body"]


def _union_member(x: object) -> bool:
    """Whether an error location's element names the member of a union that pydantic tried (a
    type such as 'str' or 'list[int]', a literal, a model class), not a field (ours are
    snake_case) or a list index: it is no part of the request's own path."""
    return isinstance(x, str) and (x in _TYPE_NAMES or "[" in x or x[:1].isupper())


def _union_error(errors: list[dict], field: list) -> ApiError:
    """One 400 for a value at `field` that no member of its union accepts (pydantic reports
    each member's failure, its name in the location): the member whose failure lies deepest
    inside the value names the part that is wrong; where none got inside it, what each wanted."""
    n = len(field)
    members = [(loc, e) for e in errors
               if (loc := _loc(e))[:n] == field and len(loc) > n and _union_member(loc[n])]
    loc, deepest = max(members, key=lambda m: len(m[0]))
    if len(loc) > n + 1:
        param = ".".join(str(x) for x in loc if not _union_member(x))
        return ApiError(400, f"{param}: {deepest.get('msg', 'invalid')}", param=param)
    param = ".".join(map(str, field))
    wants = list(dict.fromkeys(e.get("msg", "invalid") for _, e in members))
    prefix = "Input should be "
    if all(w.startswith(prefix) for w in wants):
        wants = [w.removeprefix(prefix) for w in wants]
        return ApiError(400, f"{param}: {prefix}{', or '.join(wants)}", param=param)
    return ApiError(400, f"{param}: {'; or '.join(wants)}", param=param)


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
        yield CounterMetricFamily("rvrun_spec_draft_tokens",
                                  "Speculative decoding: draft tokens verified", value=s.drafted)
        yield CounterMetricFamily("rvrun_spec_accepted_tokens",
                                  "Speculative decoding: draft tokens accepted", value=s.accepted)
        yield CounterMetricFamily("rvrun_spec_verify_calls",
                                  "Speculative decoding: verify calls run", value=s.verify_calls)
        yield GaugeMetricFamily("rvrun_spec_acceptance_rate",
                                "Accepted / drafted tokens, since start",
                                value=s.accepted / s.drafted if s.drafted else 0)
        yield CounterMetricFamily("rvrun_grammar_mask_seconds",
                                  "Host time computing grammar token masks", value=s.mask_s)
        yield CounterMetricFamily("rvrun_grammar_masks",
                                  "Grammar token masks computed (one per constrained sequence "
                                  "per sampling step)", value=s.mask_rows)
        yield CounterMetricFamily("rvrun_grammar_mask_wait_seconds",
                                  "Engine time spent waiting for grammar token masks (the mask "
                                  "time not hidden behind other work)", value=s.mask_wait_s)
        yield CounterMetricFamily("rvrun_grammar_mask_late_wait_seconds",
                                  "Engine time spent waiting for grammar token masks inside "
                                  "decode calls, while their forward pass ran on the device "
                                  "(hidden as far as it lasted)", value=s.mask_late_wait_s)
        yield CounterMetricFamily("rvrun_engine_steps", "Engine steps run", value=s.steps)
        yield CounterMetricFamily("rvrun_engine_packed_prefills",
                                  "Prefill calls that ran several sequences' prompt chunks",
                                  value=s.packed_prefills)
        yield CounterMetricFamily("rvrun_engine_mixed_calls",
                                  "Calls that ran prompt chunks and decode lanes together",
                                  value=s.mixed_calls)
        yield CounterMetricFamily("rvrun_engine_step_seconds", "Wall time inside engine steps",
                                  value=s.step_s)
        yield CounterMetricFamily("rvrun_engine_executor_seconds",
                                  "Of the engine steps' time, time inside executor calls "
                                  "(the rest is the engine's own host work)",
                                  value=s.executor_s)


# ---------------------------------------------------------------------------------- app


@dataclass(frozen=True)
class ServeOptions:
    model_name: str  # the only model id requests may name
    max_waiting: int = 256  # requests queued beyond this get 503
    speculation: Speculation | None = None  # every request's speculative decoding (checked)


def create_app(model: Model, options: ServeOptions, http: HttpOptions | None = None,
               access_log: Callable[[str], None] | None = None) -> FastAPI:
    """The ASGI app; its lifespan starts the engine thread and stops it. `http`: the HTTP
    layer's limits (default: HttpOptions()); `access_log`: where each request's access-log
    line goes (access_log.py; default: nowhere)."""
    state: dict[str, object] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state["delivery"] = delivery = _Delivery(asyncio.get_running_loop())
        state["thread"] = thread = EngineThread(model.engine, delivery.flush)
        state["metrics"] = Metrics(thread)
        try:
            yield
        finally:
            thread.stop()

    # No /docs, /redoc or /openapi.json: every route is listed in this module's docstring.
    app = FastAPI(title="rvrun serve", lifespan=lifespan, openapi_url=None)
    app.state.rvrun = state

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(ApiError)
    async def _on_api_error(_: Request, exc: ApiError):
        return exc.response()

    _install_http_guards(app, http or HttpOptions())  # before _CountRequests: it sees them all
    app.add_middleware(_CountRequests, state=state)
    if access_log is not None:  # outermost: it sees every response
        app.add_middleware(AccessLog, write=access_log)

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
        try:
            plan = chat_tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls)
            messages = chat_tools.template_messages(body.messages)
        except chat_tools.ToolRequestError as e:
            raise ApiError(400, str(e), param=e.param) from e
        try:
            text = model.apply_chat_template(messages, plan.tools)
        except Exception as e:  # a template that rejects these messages (roles, order)
            raise ApiError(400, f"messages: {str(e).splitlines()[0]}", param="messages") from e
        try:
            stop = model.chat_stop(body.stop)
        except RequestError as e:
            raise ApiError(400, str(e), param=e.param) from e
        ids = model.encode(text, add_bos=False)
        max_tokens = body.max_tokens if body.max_completion_tokens is None \
            else body.max_completion_tokens
        return await _serve(model, state, options, body, ids, max_tokens, request, chat=True,
                            stop=stop, plan=plan)

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


class _Delivery:
    """The engine thread's outputs for the requests' queues on the event loop, handed over once
    per engine step (EngineThread's after_outputs): one wake-up of the loop and one callback
    for a step's hundreds of outputs, not one each. `put` and `flush` run on the engine thread
    only."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: list[tuple[asyncio.Queue, RequestOutput]] = []

    def put(self, queue: asyncio.Queue, out: RequestOutput) -> None:
        self.pending.append((queue, out))

    def flush(self) -> None:
        if self.pending:
            batch, self.pending = self.pending, []
            self.loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in batch:
        queue.put_nowait(out)


def _check_common(body: _Sampling, options: ServeOptions) -> None:
    if body.model != options.model_name:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{options.model_name!r}", param="model", code="model_not_found")
    problem = body.unsupported()
    if problem:
        raise ApiError(400, problem)
    body.want_logprobs()  # refuses top_logprobs without logprobs


async def _serve(model: Model, state: dict, options: ServeOptions, body: _Sampling,
                 ids: list[int], max_tokens: int | None, request: Request, *, chat: bool,
                 stop: tuple[str, ...] | None = None, plan: chat_tools.ToolPlan | None = None):
    """`stop`: the stop strings (default the body's); `plan`: a chat request's tools."""
    received = time.perf_counter()
    thread: EngineThread = state["thread"]
    metrics: Metrics = state["metrics"]
    delivery: _Delivery = state["delivery"]
    if max_tokens is None:  # what the context leaves (at least 1: a full prompt is refused)
        max_tokens = max(model.max_context - len(ids), 1)
    if stop is None:
        stop = body.stop if body.stop is not None else ()
    seed = random.getrandbits(31) if body.seed is None else body.seed
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    sampled = Penalties(body.presence_penalty, body.frequency_penalty, body.repetition_penalty)
    constraint = _constraint(body, plan)
    logprobs = body.want_logprobs()
    # the server's speculative decoding speeds up what it can: the verify step's sampler takes
    # no extras, so requests that use them decode plainly
    plain = body.n != 1 or logprobs is not None or sampled.active or constraint is not None
    engine_request = EngineRequest(
        rid, ids, max_tokens, Sampling(body.temperature, body.top_k, body.top_p, seed), stop,
        body.ignore_eos, n=body.n, logprobs=logprobs, penalties=sampled,
        stop_token_ids=tuple(body.stop_token_ids or ()), constraint=constraint,
        stream=body.stream, speculation=None if plain else options.speculation)

    def sink(out: RequestOutput) -> None:  # on the engine thread
        if out.finished:
            metrics.finished.labels(out.finish_reason).inc()
            metrics.generation_tokens.inc(out.completion_tokens)
        delivery.put(queue, out)

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
    access = record(request.scope) or AccessRecord()  # none without the access log
    access.tokens_in = len(ids)
    stream = _Stream(rid, queue, thread, metrics, received, body.n, access)
    lp = _Logprobs(model, chat) if engine_request.logprobs is not None else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _chat_events(stream, options.model_name, include_usage, lp, plan) if chat \
            else _completion_events(stream, options.model_name, include_usage, lp)
        return StreamingResponse(events, media_type="text/event-stream")
    return await _complete(stream, options.model_name, request, chat, lp, plan)


def _constraint(body: _Sampling, plan: chat_tools.ToolPlan | None) -> Constraint | None:
    """The grammar the answer must follow: a forced tool call's, or response_format's."""
    forced = plan.grammar if plan is not None else None
    if forced is not None and body.response_format is not None:
        raise ApiError(400, "tool_choice: a required or named tool call and response_format "
                            "cannot both constrain one answer", param="tool_choice")
    if forced is not None:
        return Constraint.lark(forced, param="tool_choice")
    return body.response_format.constraint() if body.response_format else None


def _param(param: str, body: _Sampling, chat: bool) -> str:
    """A request_limits field as this request spelled it."""
    if param == "prompt" and chat:
        return "messages"
    if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if param == "logprobs" and chat and body.top_logprobs is not None:
        return "top_logprobs"
    return param


class _Stream:
    """One request's outputs on the event loop, with its latency metrics. `close` aborts the
    request if it is still running (a client gone, a server shutting down)."""

    def __init__(self, rid: str, queue: asyncio.Queue, thread: EngineThread, metrics: Metrics,
                 received: float, n: int = 1, access: AccessRecord | None = None):
        self.rid, self.queue, self.thread, self.metrics = rid, queue, thread, metrics
        self.access = access or AccessRecord()  # what the access log shows of this request
        self.received, self.last = received, None
        self.created = int(time.time())
        self.done = False
        self.left = n  # samples not finished yet

    async def next(self) -> RequestOutput:
        out = await self.queue.get()
        now = time.perf_counter()
        if out.token_ids:
            if self.last is None:
                self.metrics.ttft.observe(now - self.received)
                self.access.ttft_s = now - self.received
            else:  # a device-side decode loop hands over several tokens at once: per token
                gap = (now - self.last) / len(out.token_ids)
                for _ in out.token_ids:
                    self.metrics.itl.observe(gap)
            self.last = now
        self.access.tokens_out = out.completion_tokens
        if out.finished:
            self.left -= 1
            self.done = self.left == 0 or out.finish_reason == "error"
        return out

    def close(self) -> None:
        if not self.done:
            self.thread.abort(self.rid)
            self.done = True


def _usage(outs: list[RequestOutput]) -> dict:
    """Usage of a request from each sample's last output: the prompt counted once."""
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": outs[0].prompt_tokens, "completion_tokens": completion,
            "total_tokens": outs[0].prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": min(o.cached_tokens for o in outs)}}


class _Logprobs:
    """Log-probabilities in OpenAI's shapes: chat's {"content": [{token, logprob, bytes,
    top_logprobs}]}, completions' {tokens, token_logprobs, top_logprobs, text_offset}."""

    def __init__(self, model: Model, chat: bool):
        self.model, self.chat = model, chat

    def piece(self, token: int) -> str:
        return self.model.tokenizer.decode([token], skip_special_tokens=False)

    def entry(self, s: Sampled) -> dict:
        text = self.piece(s.token)
        return {"token": text, "logprob": s.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": self.piece(t), "logprob": lp,
                                  "bytes": list(self.piece(t).encode())} for t, lp in s.top]}

    def of(self, sampled: list[Sampled], offset: int = 0) -> dict:
        """The log-probabilities of these tokens; `offset`: the completion text's length
        before them (completions' text_offset)."""
        if self.chat:
            return {"content": [self.entry(s) for s in sampled]}
        tokens = [self.piece(s.token) for s in sampled]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [s.logprob for s in sampled],
                "top_logprobs": [{self.piece(t): lp for t, lp in s.top} for s in sampled],
                "text_offset": offsets}


def _check_finished(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise ApiError(500, out.error, type_="server_error")


async def _complete(stream: _Stream, model_name: str, request: Request, chat: bool,
                    lp: _Logprobs | None = None, plan: chat_tools.ToolPlan | None = None):
    """Collect the whole answer; a client that goes away meanwhile aborts the request at once
    (its disconnect is the next message on the request's ASGI channel, its body being read)."""

    async def collect() -> tuple[dict[int, list[RequestOutput]], RequestOutput]:
        outs: dict[int, list[RequestOutput]] = {}
        while True:
            out = await stream.next()
            outs.setdefault(out.index, []).append(out)
            if stream.done:
                return outs, out

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
    outs, out = collector.result()
    _check_finished(out)
    choices = []
    for index, parts in sorted(outs.items()):
        text = "".join(p.text for p in parts)
        logprobs = lp.of([s for p in parts for s in p.logprobs]) if lp else None
        if chat:
            message, reason = _chat_message(text, parts[-1].finish_reason, plan)
            choices.append({"index": index, "message": message, "finish_reason": reason,
                            "logprobs": logprobs})
        else:
            choices.append({"index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": parts[-1].finish_reason})
    return {"id": stream.rid, "object": "chat.completion" if chat else "text_completion",
            "created": stream.created, "model": model_name, "choices": choices,
            "usage": _usage([parts[-1] for _, parts in sorted(outs.items())])}


def _chat_message(text: str, reason: str, plan: chat_tools.ToolPlan | None) -> tuple[dict, str]:
    """A whole chat answer as an OpenAI message (its calls as `tool_calls`), and the finish
    reason: "tool_calls" when the model stopped after calling."""
    if plan is None or not plan.parse:
        return {"role": "assistant", "content": text}, reason
    parsed = tool_calls.parse_message(text, plan.names, plan.parallel)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}, reason
    calls = [_call_json(c) for c in parsed.calls]
    return ({"role": "assistant", "content": parsed.content, "tool_calls": calls},
            "tool_calls" if reason == "stop" else reason)


def _call_json(call: tool_calls.ToolCall) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _events(stream: _Stream, include_usage: bool, head: dict, first: dict | None,
                  pieces, lp: _Logprobs | None, n: int) -> AsyncIterator[str]:
    """SSE of one request: `first` (if any) per sample, then the chunks `pieces(text, None,
    index)` makes of each sample's new text (the first carrying the new tokens'
    log-probabilities when asked), the chunks of `pieces("", finish_reason, index)` when the
    sample ends (the last with its finish reason), the usage chunk if asked for, and [DONE]."""
    last: dict[int, RequestOutput] = {}
    offsets = [0] * n
    try:
        if first is not None:
            for index in range(n):
                yield _sse({**head, "choices": [{**first, "index": index}]})
        while not stream.done:
            out = await stream.next()
            if out.finish_reason == "error":
                yield _sse({"error": {"message": out.error, "type": "server_error",
                                      "param": None, "code": None}})
                return
            if out.text or (lp and out.logprobs):
                chunks = pieces(out.text, None, out.index)
                if lp and out.logprobs:
                    if not chunks:  # text held back (a possible tool call): its tokens still go
                        chunks = [pieces("", None, out.index, empty=True)[0]]
                    chunks[0]["logprobs"] = lp.of(list(out.logprobs), offsets[out.index])
                    offsets[out.index] += sum(len(lp.piece(s.token)) for s in out.logprobs)
                for c in chunks:
                    yield _sse({**head, "choices": [c]})
            if out.finished:
                last[out.index] = out
                for c in pieces("", out.finish_reason, out.index):
                    yield _sse({**head, "choices": [c]})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(list(last.values()))})
        yield _sse("[DONE]")
    finally:
        stream.close()


def _chat_events(stream: _Stream, model_name: str, include_usage: bool,
                 lp: _Logprobs | None = None,
                 plan: chat_tools.ToolPlan | None = None) -> AsyncIterator[str]:
    """Chat chunks, per sample; with tools, text that may still become a call is held back
    until it does (a `tool_calls` delta with the whole call) or does not (content)."""
    head = {"id": stream.rid, "object": "chat.completion.chunk", "created": stream.created,
            "model": model_name}
    parse = bool(plan and plan.parse)
    calls = {i: tool_calls.CallStream(plan.names, plan.parallel)
             for i in range(stream.left)} if parse else {}
    given = [0] * stream.left  # per sample: tool calls sent so far, the next one's index

    def chunk(delta: dict, index: int, reason: str | None = None) -> dict:
        return {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}

    def pieces(text: str, reason: str | None, index: int, empty: bool = False) -> list[dict]:
        if empty:
            return [chunk({}, index)]
        if not parse:
            return ([chunk({"content": text} if text else {}, index, reason)]
                    if text or reason else [])
        out = []
        for p in calls[index].feed(text) if reason is None else calls[index].finish():
            if p.call is None:
                out.append(chunk({"content": p.text}, index))
            else:
                out.append(chunk({"tool_calls": [{"index": given[index], **_call_json(p.call)}]},
                                 index))
                given[index] += 1
        if reason is not None:
            out.append(chunk({}, index,
                             "tool_calls" if given[index] and reason == "stop" else reason))
        return out

    first = chunk({"role": "assistant", "content": ""}, 0)
    return _events(stream, include_usage, head, first, pieces, lp, stream.left)


def _completion_events(stream: _Stream, model_name: str, include_usage: bool,
                       lp: _Logprobs | None = None) -> AsyncIterator[str]:
    head = {"id": stream.rid, "object": "text_completion", "created": stream.created,
            "model": model_name}

    def pieces(text: str, reason: str | None, index: int, empty: bool = False) -> list[dict]:
        return [{"index": index, "text": text, "finish_reason": reason, "logprobs": None}]

    return _events(stream, include_usage, head, None, pieces, lp, stream.left)


# ---------------------------------------------------------------------------------- HTTP guards

_log = logging.getLogger("uvicorn.error")  # the server's own log: same stream and format
_OPEN_ROUTES = ("/health", "/metrics")  # no API key needed: probes and scrapers
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class HttpOptions:
    """Limits of the HTTP layer (`rvrun serve` flags)."""

    api_key: str | None = None  # set: routes but _OPEN_ROUTES need `Authorization: Bearer <key>`
    max_body_bytes: int = 8 << 20  # a longer request body gets 413
    body_timeout_s: float = 30.0  # a body not all there this long after its headers gets 408


def _install_http_guards(app: FastAPI, http: HttpOptions) -> None:
    """Error bodies for everything FastAPI and Starlette answer themselves, the strict JSON body
    parser, and the guard middleware; sets `app.state.drain` for `run`. Called before any route
    is added (the route class applies to routes added after it)."""
    app.router.route_class = _JsonRoute
    app.exception_handler(HTTPException)(_on_http_exception)
    app.state.drain = drain = _Drain()
    # add_middleware puts each one outside the ones before: requests meet them bottom to top.
    app.add_middleware(_BodyGuard, max_bytes=http.max_body_bytes, timeout_s=http.body_timeout_s)
    if http.api_key is not None:
        app.add_middleware(_ApiKey, key=http.api_key)
    app.add_middleware(_Draining, drain=drain)
    app.add_middleware(_InternalErrors)


async def _on_http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    """404 (no such route), 405 (wrong method), 400 (a body FastAPI could not parse) and our own
    body errors, as OpenAI-style errors (Starlette's default is `{"detail": ...}`)."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"Invalid URL ({where}): no such route"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"Invalid method ({where}): this route allows {allowed}"
    else:
        message = str(exc.detail)
    type_ = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    response = ApiError(exc.status_code, message, type_=type_).response()
    response.headers.update(exc.headers or {})
    return response


async def _send_error(scope, receive, send, error: ApiError, *, close: bool = False,
                      headers: dict[str, str] | None = None) -> None:
    """Answer from a middleware. `close`: end the connection after it (an unread or partial
    body is left on it)."""
    response = error.response()
    response.headers.update(headers or {})
    if close:
        response.headers["connection"] = "close"
    await response(scope, receive, send)


def _json_body(body: bytes) -> Any:
    """A request body as JSON: UTF-8 text (RFC 8259; json.loads alone also takes UTF-16 and
    UTF-32), the JSON grammar's numbers only (no NaN or Infinity), and valid Unicode in every
    string (json.loads keeps a lone surrogate escape such as \\ud800, which no tokenizer can
    encode). A syntax error stays json.JSONDecodeError, which FastAPI reports as invalid JSON."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPException(400, f"the request body is not UTF-8: byte 0x{body[e.start]:02x} at "
                                 f"offset {e.start}") from None

    def no_constant(name: str) -> None:
        raise HTTPException(400, f"the request body is not valid JSON: {name} is not a number")

    try:
        value = json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise HTTPException(400, "the request body nests arrays or objects too deeply") from None
    pending = [value]  # a stack, not recursion: json.loads took the nesting, so can we
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            lone = _LONE_SURROGATE.search(item)
            if lone:
                raise HTTPException(400, f"the request body holds a lone surrogate "
                                         f"\\u{ord(lone.group()):04x} in a string: not Unicode")
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return value


class _JsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = _json_body(await self.body())
        return self._json


class _JsonRoute(APIRoute):
    """Routes whose JSON body goes through `_json_body` (FastAPI's documented way to change how
    a request is read: a custom Request in a custom route class)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def strict_json(request: Request) -> Response:
            return await handler(_JsonRequest(request.scope, request.receive))

        return strict_json


class _InternalErrors:
    """ASGI middleware: an exception escaping a route is logged with its traceback under an error
    id, and the client gets a 500 naming only that id; the server goes on serving. A response
    already under way (a stream) cannot change its status: it is cut (uvicorn closes the
    connection)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            error_id = uuid.uuid4().hex[:16]
            _log.exception("rvrun: error %s in %s %s", error_id, scope["method"], scope["path"])
            if not started:
                await _send_error(scope, receive, send, ApiError(
                    500, f"the server failed on this request (error id {error_id} in its log)",
                    type_="server_error", code="internal_error"))


class _Drain:
    """Shutdown state, shared by `_Draining` and `run`: once `draining`, new requests get 503
    while the `active` ones (their tasks) finish; `cut` cancels those still running."""

    def __init__(self):
        self.draining = False
        self.cutting = False
        self.active: set[asyncio.Task] = set()

    def cut(self) -> None:
        self.cutting = True
        for task in self.active:
            task.cancel()


class _Draining:
    """ASGI middleware: refuses requests with 503 while the server drains, and tracks the tasks
    of those in flight. A request cut by the drain timeout gets a 503 if its response has not
    started, else its connection closes; its engine request is aborted as for a client gone."""

    def __init__(self, app, drain: _Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining:
            return await _send_error(scope, receive, send, ApiError(
                503, "the server is shutting down; retry elsewhere or later",
                type_="server_error", code="server_shutting_down"), close=True)
        task = asyncio.current_task()
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.drain.active.add(task)
        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not self.drain.cutting:
                raise
            task.uncancel()  # our own cancel, handled here: the task carries on normally
            if not started:
                await _send_error(scope, receive, send, ApiError(
                    503, "the server shut down before this request finished",
                    type_="server_error", code="server_shutting_down"), close=True)
        finally:
            self.drain.active.discard(task)


class _ApiKey:
    """ASGI middleware: every route but _OPEN_ROUTES needs `Authorization: Bearer <key>` (401
    otherwise). The keys are compared as SHA-256 digests with hmac.compare_digest: in constant
    time, whatever the length of the key sent."""

    def __init__(self, app, key: str):
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _OPEN_ROUTES:
            return await self.app(scope, receive, send)
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(
                hashlib.sha256(token.strip()).digest(), self.digest):
            return await self.app(scope, receive, send)
        message = ("incorrect API key in the Authorization header" if value else
                   "this server needs an API key: send the header `Authorization: Bearer <key>`")
        await _send_error(scope, receive, send, ApiError(401, message, code="invalid_api_key"),
                          headers={"www-authenticate": "Bearer"})


class _BodyGuard:
    """ASGI middleware: reads each request's whole body before the app runs. A body longer than
    `max_bytes` gets 413 (before reading, when Content-Length says so); one not complete within
    `timeout_s` of the headers gets 408 (a slow or truncated upload); both close the connection.
    Only that request waits: the event loop serves the others meanwhile. uvicorn has no such
    timeout (its timeout_keep_alive covers idle connections between requests). The app then
    receives the body as one message, and the client's later messages (a disconnect) as sent."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((int(v) for k, v in scope["headers"] if k == b"content-length"), None)
        too_large = ApiError(413, f"the request body is larger than this server's limit of "
                                  f"{self.max_bytes} bytes", code="request_too_large")
        if declared is not None and declared > self.max_bytes:
            return await _send_error(scope, receive, send, too_large, close=True)
        chunks, size, more = [], 0, True
        try:
            async with asyncio.timeout(self.timeout_s):
                while more and size <= self.max_bytes:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client left: nobody to answer
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    more = message.get("more_body", False)
        except TimeoutError:
            of = f" of {declared}" if declared is not None else ""
            return await _send_error(scope, receive, send, ApiError(
                408, f"the request body did not arrive within {self.timeout_s:g} s (got {size}"
                     f"{of} bytes)", code="request_timeout"), close=True)
        if size > self.max_bytes:
            return await _send_error(scope, receive, send, too_large, close=True)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


# ---------------------------------------------------------------------------------- serving


def run(app: FastAPI, sock: socket.socket, drain_timeout_s: float,
        log: Callable[[str], None]) -> int:
    """Serve `app` (from create_app) on the listening `sock` until SIGTERM or SIGINT, then
    drain: new requests get 503 while the in-flight ones finish for up to `drain_timeout_s`;
    those still running then are cut; the engine stops. A second signal cuts at once. Returns
    the exit code: 0 after SIGTERM, 130 after SIGINT."""
    server = _DrainingServer(uvicorn.Config(app, log_level="warning",
                                            timeout_graceful_shutdown=1),
                             app.state.drain, drain_timeout_s, log)
    server.run(sockets=[sock])
    return 130 if server.stopped_by == signal.SIGINT else 0


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server, draining on the first signal. uvicorn's own graceful shutdown closes
    the listening socket at once (new clients get a refused connection, not a 503) and raises
    the signal again once stopped (so SIGTERM would end the process with -15, not 0)."""

    def __init__(self, config: uvicorn.Config, drain: _Drain, timeout_s: float,
                 log: Callable[[str], None]):
        super().__init__(config)
        self.drain, self.timeout_s, self.log = drain, timeout_s, log
        self.stopped_by: int | None = None  # the first signal
        self.hurry = False  # a second signal: cut now
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drainer: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's handler of SIGINT and SIGTERM (main thread, between two steps of the loop)."""
        if self.stopped_by is not None:
            self.hurry = True
            return
        self.stopped_by = sig
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.drainer = self.loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        drain = self.drain
        drain.draining = True
        what = "interrupted" if self.stopped_by == signal.SIGINT else "SIGTERM"
        self.log(f"rvrun: {what}: new requests get 503; waiting up to {self.timeout_s:g} s for "
                 f"{len(drain.active)} in flight (a second signal cuts them)")
        deadline = self.loop.time() + self.timeout_s
        while drain.active and not self.hurry and self.loop.time() < deadline:
            await asyncio.sleep(0.05)  # polling: a few wake-ups a second, only while stopping
        if drain.active:
            self.log(f"rvrun: cutting {len(drain.active)} requests still running")
            drain.cut()
            deadline = self.loop.time() + 1.0
            while drain.active and self.loop.time() < deadline:  # they unwind at their next await
                await asyncio.sleep(0.01)
        self.should_exit = True
