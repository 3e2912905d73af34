"""`rvrun serve`'s access log: one line per HTTP request, written when its response has ended
(the last body chunk of a stream included) or the request died:

    rvrun: access POST /v1/chat/completions 200 tokens_in=12 tokens_out=64 ttft_ms=35.1 \
duration_ms=1234.5

method, path, status (the one sent; 500 for an exception that escaped before one was; 0 when
the request ended without either, a client gone before its headers), prompt tokens, generated
tokens (EOS included, as `usage` counts them), time to the first generated token, and the time
from the request's arrival to its end; "-" where the route generated nothing (GET /health, a
refused body, a 4xx).

Contract: `AccessLog` is the outermost ASGI middleware, so it sees every response, the HTTP
guards' included. It leaves an `AccessRecord` in the request's scope; a generating route fills
it in through `record(scope)` (server.py: prompt tokens when the request is accepted, TTFT at
the first token, generated tokens at the end). Lines go to `write`, one call each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

SCOPE_KEY = "rvrun.access"


@dataclass
class AccessRecord:
    """What a generating route tells the access log about its request (mutable: filled in as
    the request runs)."""

    tokens_in: int | None = None  # prompt tokens, once accepted
    tokens_out: int | None = None  # generated tokens, once finished (or so far when cut)
    ttft_s: float | None = None  # arrival -> first generated token


def record(scope: dict) -> AccessRecord | None:
    """The request's record, or None outside AccessLog (an app built without it)."""
    return scope.get(SCOPE_KEY)


def format_line(method: str, path: str, status: int, rec: AccessRecord,
                duration_s: float) -> str:
    def n(v: int | None) -> str:
        return "-" if v is None else str(v)

    ttft = "-" if rec.ttft_s is None else f"{rec.ttft_s * 1e3:.1f}"
    return (f"rvrun: access {method} {path} {status} tokens_in={n(rec.tokens_in)} "
            f"tokens_out={n(rec.tokens_out)} ttft_ms={ttft} duration_ms={duration_s * 1e3:.1f}")


class AccessLog:
    """ASGI middleware writing one line per HTTP request (module docstring)."""

    def __init__(self, app, write: Callable[[str], None],
                 clock: Callable[[], float] = time.perf_counter):
        self.app, self.write, self.clock = app, write, clock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = self.clock()
        rec = scope[SCOPE_KEY] = AccessRecord()
        status = 0

        async def logging_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, logging_send)
        except Exception:
            status = status or 500  # what the server answers for an exception nobody caught
            raise
        finally:
            self.write(format_line(scope["method"], scope["path"], status, rec,
                                   self.clock() - t0))
