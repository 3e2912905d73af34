"""`rvrun serve` survives anything a request can do (issue 12, part 1), on loopback, serving a
tiny bf16 artifact with the device-side decode loop (8 steps a call, as `rvcompile build` makes
by default) on the CPU, in small KV pools (16 full and 8 sliding blocks of 16 tokens: two
128-token sequences), so concurrent requests preempt each other while the loop runs:

- values out of range (top_k >= 2**31, NaN temperature, ...) get a 400 naming the field, from
  the engine's one request check; the next request is served; the same from `rvrun` and the
  Python API;
- a step that fails (injected into the executor of an in-process server) fails only its
  requests, with an OpenAI-style error, and the server serves on; a device error marks it
  unhealthy, and /health and the log say why; the XLA executor reports a call that lost its
  KV pools as a device error, any other failure as itself;
- a client that disconnects from a non-streaming request has it aborted within a step;
- a load of streaming and non-streaming clients, some of them hanging up, in waves into the
  small pools: every request is answered or cleanly aborted, none lost, the pools whole after.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest
import uvicorn
from cli_output import without_progress
from test_serve import KV_BLOCKS, NAME, POOLS, Server

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime import cli
from rvcompile.runtime.executor_api import DeviceError, SeqChunk
from rvcompile.runtime.request_limits import RequestError
from rvcompile.runtime.serve.server import ServeOptions, create_app

LOOP_STEPS = 8


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reliability") / "tiny.rvp"
    build_artifact("gemma-4-tiny", out, BuildOptions("tpu-bf16", max_context=128,
                                                     prefill_buckets=(8, 32), max_seqs=4,
                                                     platforms=("cpu",),
                                                     decode_loop_steps=LOOP_STEPS),
                   random_weights=True, progress=False, log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def server(artifact):
    s = Server(artifact, *POOLS)
    yield s
    s.stop()
    assert "Traceback" not in "".join(s.lines)  # nothing here fails a step


def error_body(r: httpx.Response) -> dict:
    body = r.json()["error"]
    assert set(body) >= {"message", "type", "param", "code"}
    return body


def test_out_of_range_values_get_a_400_and_the_server_serves_on(server):
    c = server.client()
    for call in (
            lambda: c.completions.create(model=NAME, prompt="hi", max_tokens=4,
                                         extra_body={"top_k": 2**31}),
            lambda: c.chat.completions.create(model=NAME, max_tokens=4,
                                              messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"top_k": 2**31}),
            lambda: list(c.completions.create(model=NAME, prompt="hi", max_tokens=4,
                                              stream=True, extra_body={"top_k": 2**31}))):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == "top_k" and "vocabulary" in e.value.body["message"]
    r = c.completions.create(model=NAME, prompt="hi", max_tokens=4, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    for field, value in (("temperature", "-1"), ("temperature", "1e39"), ("top_p", "0"),
                         ("top_p", "1e-50"), ("seed", str(2**64)), ("max_tokens", "0"),
                         ("top_k", "-2")):
        r = httpx.post(f"{server.url}/completions", content=(
            f'{{"model": "{NAME}", "prompt": "hi", "max_tokens": 4, "{field}": {value}}}'
            if field != "max_tokens" else
            f'{{"model": "{NAME}", "prompt": "hi", "{field}": {value}}}'),
            headers={"content-type": "application/json"})
        assert r.status_code == 400, (field, value, r.text)
        assert error_body(r)["param"] == field, r.text
    # JSON has no NaN or Infinity: the body parser refuses them (the request check would too).
    for value in ("NaN", "Infinity", "-Infinity"):
        r = httpx.post(f"{server.url}/completions", headers={"content-type": "application/json"},
                       content=f'{{"model": "{NAME}", "prompt": "hi", "temperature": {value}}}')
        assert r.status_code == 400 and f"{value} is not a number" in error_body(r)["message"]
    r = httpx.post(f"{server.url}/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 500})
    assert r.status_code == 400 and error_body(r)["param"] == "max_completion_tokens"
    assert error_body(r)["code"] == "context_length_exceeded"
    r = httpx.post(f"{server.url}/completions", json={
        "model": NAME, "prompt": "hi", "stop": ["x"] * 17})
    assert r.status_code == 400 and error_body(r)["param"] == "stop"
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    m = server.wait_idle()
    assert m.get("rvrun_request_finish_total{reason=error}", 0) == 0


@pytest.fixture(scope="module")
def model(artifact):
    """The artifact in this process, in the server's pools (compiled once: a cache hit)."""
    return runtime.load(artifact, verify=False, kv_blocks=KV_BLOCKS)


def test_rvrun_and_the_python_api_refuse_the_same_values(artifact, model, capsys, monkeypatch):
    m = model
    # rvrun's loads get this model: the artifact compiled once, for these pools.
    monkeypatch.setattr(runtime, "load", lambda *args, **kw: m)

    def rvrun(*args: str) -> tuple[int, list[str]]:
        rc = cli.main([str(artifact), "--prompt", "hi", "--max-tokens", "4", *args])
        return rc, without_progress(capsys.readouterr().err)

    for args, needle in ((["--top-k", str(2**31)], "--top-k: "),  # before the load
                         (["--temperature", "nan"], "--temperature: must be finite"),
                         (["--temperature", "inf"], "--temperature: must be finite"),
                         (["--top-p", "0"], "--top-p: "),
                         (["--stop", ""], "--stop: "),
                         (["--top-k", "1025"], "--top-k: must be -1 or 0 (no cut) to 1024"),
                         (["--max-tokens", "200"], "--max-tokens: this model's maximum")):
        rc, lines = rvrun(*args)
        assert rc == 2 and len(lines) == 1, (args, lines)
        assert lines[0].startswith(f"rvrun: error: {needle}"), (args, lines[0])
    rc, lines = rvrun("--top-k", "1024", "--temperature", "1", "--ignore-eos")
    assert rc == 0 and "new 4 tokens" in lines[-1], lines
    for kw, param in (({"top_k": 2**31}, "top_k"), ({"temperature": float("nan")}, "temperature"),
                      ({"seed": 2**70}, "seed"), ({"stop": [""]}, "stop"),
                      ({"ignore_eos": "no"}, "ignore_eos"), ({"max_tokens": 0}, "max_tokens"),
                      ({"max_tokens": 200}, "max_tokens")):
        with pytest.raises(RequestError) as e:
            m.generate("hi", **kw)
        assert e.value.param == param
    with pytest.raises(RequestError, match="prompt: token id 5000 is outside"):
        m.generate([2, 5000])
    assert len(m.generate("hi", max_tokens=4, ignore_eos=True).token_ids) == 4


def test_non_streaming_disconnect_aborts_within_a_step(server):
    """The client hangs up while its tokens flow; the request is aborted at the next step, not
    run on to max_tokens (which it did when the server looked for a disconnect only after a
    second without output)."""
    before = server.wait_idle()
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps({"model": NAME, "prompt": [2, 7, 8, 9], "max_tokens": 120,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                 b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    gen = "rvrun_generation_tokens_total"
    while server.metrics()["rvrun_running_sequences"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    sock.close()
    after = server.wait_idle(timeout=10)
    aborted = "rvrun_request_finish_total{reason=abort}"
    assert after[aborted] == before.get(aborted, 0) + 1
    assert after[gen] - before[gen] < 60  # far from its 120 tokens


def test_xla_calls_that_lose_the_kv_pools_are_device_errors(model):
    """The XLA executor's calls take the KV pools (donated): a call failing before that is an
    ordinary error, one that took them with it (deleted, or the results of a failed
    computation) is a DeviceError, since no later call could run."""
    ex = model.executor
    name = f"decode_{ex.max_seqs}"
    entry, saved = ex.fns[name], {k: np.asarray(v) for k, v in ex.caches.items()}
    lanes = [SeqChunk([5], 3, {k.name: [0] * k.table_width for k in ex.kinds.values()})]

    def before(weights, caches, *args):
        raise ValueError("refused its arguments")

    def lose(weights, caches, *args):
        for c in caches.values():
            c.delete()
        raise RuntimeError("execution failed")

    try:
        ex.fns[name] = before
        with pytest.raises(ValueError, match="refused its arguments"):
            ex.decode(lanes)
        ex.fns[name] = lose
        with pytest.raises(DeviceError, match="took the KV pools with it: RuntimeError"):
            ex.decode(lanes)
    finally:
        ex.fns[name] = entry
        ex.caches = {k: jax.device_put(v) for k, v in saved.items()}
    assert len(model.generate("hi", max_tokens=2, ignore_eos=True).token_ids) == 2


# ---------------------------------------------------------------------------------------------
# Failures inside a step: an in-process server whose executor fails on request


class InProcessServer:
    """create_app over a Model of this process, run by uvicorn on a free loopback port."""

    def __init__(self, model):
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(model, ServeOptions(NAME)),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


MARK = 1000  # a token id that makes the patched executor fail


def test_a_failing_step_fails_only_its_requests_and_a_device_error_marks_unhealthy(
        artifact, caplog):
    model = runtime.load(artifact, verify=False, kv_blocks=KV_BLOCKS)
    good = [2, *range(40, 60)]
    want = model.generate(good, max_tokens=12, ignore_eos=True).text
    ex = model.executor
    prefill, decode, loop = ex.prefill, ex.decode, ex.decode_many
    failure = {"kind": RuntimeError}

    def failing(call):
        def run(chunks):
            items = chunks if isinstance(chunks, list) else [chunks]
            if any(MARK in getattr(c, "chunk", c).tokens for c in items):
                raise failure["kind"]("injected failure")
            return call(chunks)
        return run

    ex.prefill, ex.decode, ex.decode_many = failing(prefill), failing(decode), failing(loop)
    srv = InProcessServer(model)
    try:
        def complete(prompt, **kw) -> httpx.Response:
            return httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
                "model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, **kw})

        async def together():  # the failing request shares steps with a good one
            async with httpx.AsyncClient(timeout=60) as client:
                bad = {"model": NAME, "prompt": [2, 5, MARK], "max_tokens": 12,
                       "ignore_eos": True}
                return await asyncio.gather(
                    client.post(f"{srv.url}/v1/completions", json=bad),
                    client.post(f"{srv.url}/v1/completions", json={
                        **bad, "prompt": good, "temperature": 0}))

        with caplog.at_level(logging.ERROR, logger="rvcompile.runtime.engine"):
            bad, ok = asyncio.run(together())
        assert bad.status_code == 500, bad.text
        err = error_body(bad)
        assert err["type"] == "server_error" and "injected failure" in err["message"]
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == want
        assert "injected failure" in caplog.text
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={
                "model": NAME, "prompt": [2, MARK], "max_tokens": 4, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "injected failure" in json.loads(events[-1][6:])["error"]["message"]
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
        r = complete(good)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert model.engine.stats().kv_used == {"full": 0, "sliding": 0}

        # A device error: the request fails, the server says why and refuses the next ones.
        failure["kind"] = DeviceError
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="rvcompile.runtime.engine"):
            r = complete([2, 6, MARK])
        assert r.status_code == 500 and "injected failure" in error_body(r)["message"]
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert "the device failed: injected failure" in health.json()["error"]
        assert "the device failed: injected failure" in caplog.text
        r = complete(good)
        assert r.status_code == 503 and "injected failure" in error_body(r)["message"]
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------
# Load


def test_load_small_pool_device_loop_and_disconnects(server):
    """Waves of six clients (two more than run at once) into the small pools with the decode
    loop: long requests preempt each other and are recomputed while the loop runs. Of each
    wave, one streaming client hangs up after two chunks and one non-streaming client hangs up
    after a moment. Every request is answered or cleanly aborted; none is lost (an error, no
    answer, or more than the time bound); the server stays healthy, and every KV block is back
    in its pool."""
    waves, per_wave, bound_s = 8, 6, 240
    rng = random.Random(12)
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    counts = {"sent": 0, "answered": 0, "aborted": 0, "lost": 0}

    def body(i: int, stream: bool) -> dict:
        n = rng.randrange(20, 60)  # with max_tokens, 4 to 8 blocks: 4 at once do not fit
        return {"model": NAME, "prompt": [2, *(rng.randrange(3, 1000) for _ in range(n))],
                "max_tokens": rng.randrange(40, 128 - n - 1), "temperature": 0.8, "seed": i,
                "ignore_eos": i % 3 != 0, "stream": stream}

    async def streaming(client: httpx.AsyncClient, i: int, hang_up: bool) -> str:
        reason = None
        async with client.stream("POST", f"{server.url}/completions",
                                 json=body(i, True)) as r:
            if r.status_code != 200:
                return "lost"
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                if hang_up and chunks == 2:
                    return "aborted"  # leaving the block closes the connection
                choice = json.loads(line[6:]).get("choices", [{}])[0]
                reason = choice.get("finish_reason") or reason
        return "answered" if reason in ("stop", "length") else "lost"

    async def plain(client: httpx.AsyncClient, i: int) -> str:
        r = await client.post(f"{server.url}/completions", json=body(i, False))
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop",
                                                                                  "length")
        return "answered" if ok else "lost"

    async def hang_up_plain(i: int) -> str:
        reader, writer = await asyncio.open_connection(host, int(port))
        data = json.dumps(body(i, False)).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()
        return "aborted"

    async def run():
        async with httpx.AsyncClient(timeout=bound_s) as client:
            for w in range(waves):
                tasks = []
                for k in range(per_wave):
                    i = w * per_wave + k
                    if k == 0:
                        tasks.append(streaming(client, i, hang_up=True))
                    elif k == 1:
                        tasks.append(hang_up_plain(i))
                    elif k % 2:
                        tasks.append(streaming(client, i, hang_up=False))
                    else:
                        tasks.append(plain(client, i))
                counts["sent"] += len(tasks)
                for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                    counts[outcome if isinstance(outcome, str) else "lost"] += 1

    before = server.wait_idle()
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(run(), bound_s))
    elapsed = time.monotonic() - t0
    after = server.wait_idle(timeout=30)
    delta = {r: after.get(f"rvrun_request_finish_total{{reason={r}}}", 0)
             - before.get(f"rvrun_request_finish_total{{reason={r}}}", 0)
             for r in ("stop", "length", "abort", "error")}
    print(f"\nload: {counts} in {elapsed:.1f} s; server finish reasons {delta}; preemptions "
          f"{after['rvrun_preemptions_total'] - before['rvrun_preemptions_total']:.0f}")
    assert counts["sent"] == waves * per_wave and counts["lost"] == 0, counts
    assert counts["answered"] + counts["aborted"] == counts["sent"]
    assert delta["error"] == 0
    assert sum(delta.values()) == counts["sent"]  # every request ended once, server side
    assert 0 < delta["abort"] <= counts["aborted"]
    assert after["rvrun_preemptions_total"] > before["rvrun_preemptions_total"]
    assert after["rvrun_kv_blocks_used{kind=full}"] == 0
    assert after["rvrun_kv_blocks_used{kind=sliding}"] == 0
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
