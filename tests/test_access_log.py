"""serve/access_log.py: one line per request, with what its route recorded (in-process ASGI,
a fake clock: exact lines)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from rvcompile.runtime.serve.access_log import AccessLog, record


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.25  # each reading a quarter second later
        return self.t


def _app(lines: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/gen")
    async def gen(request: Request):
        rec = record(request.scope)
        rec.tokens_in = 5

        async def body():
            for i in range(3):
                if i == 0:
                    rec.ttft_s = 0.0125
                rec.tokens_out = i + 1
                yield f"{i}\n"

        return StreamingResponse(body())

    @app.get("/boom")
    async def boom():
        raise RuntimeError("boom")

    app.add_middleware(AccessLog, write=lines.append, clock=Clock())
    return app


def test_a_streamed_request_logs_once_it_ended():
    lines: list[str] = []
    with TestClient(_app(lines)) as c:
        assert c.post("/gen").text == "0\n1\n2\n"
    assert lines == ["rvrun: access POST /gen 200 tokens_in=5 tokens_out=3 ttft_ms=12.5 "
                     "duration_ms=250.0"]


def test_routes_that_generate_nothing_and_errors():
    lines: list[str] = []
    with TestClient(_app(lines), raise_server_exceptions=False) as c:
        assert c.get("/missing").status_code == 404
        assert c.get("/boom").status_code == 500
    assert lines == [
        "rvrun: access GET /missing 404 tokens_in=- tokens_out=- ttft_ms=- duration_ms=250.0",
        "rvrun: access GET /boom 500 tokens_in=- tokens_out=- ttft_ms=- duration_ms=250.0"]
