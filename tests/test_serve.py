"""`rvrun serve` as a client sees it: the official `openai` client (and raw HTTP where the client
cannot send a malformed body) against a live server process on loopback, serving a tiny bf16
artifact on the CPU. Its KV pools are small (16 full and 8 sliding blocks of 16 tokens: two
128-token sequences), so concurrent requests preempt each other.

- chat and text completions, plain and streamed (token by token, usage chunk), usage counts,
  finish reasons, the artifact's chat template; greedy output equal to Model.generate in this
  process;
- each sampling parameter (temperature, top_k, top_p, seed, max_tokens) and stop strings;
- errors with OpenAI-style bodies and codes: 400, 404, 503 (full queue);
- batched == one at a time (greedy and seeded), with a shared prefix and with preemption;
- on chat: logprobs, n samples streamed, a json_schema response_format (issue 16);
- 64 concurrent streaming clients with mixed prompts and disconnects: every request completes
  or is aborted, and the KV pools are whole afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from cli_output import without_progress
from prometheus_client.parser import text_string_to_metric_families

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact

BIN = Path(sys.executable).parent
NAME = "tiny"
POOLS = ["--kv-blocks", "16", "--kv-sliding-blocks", "8"]
KV_BLOCKS = {"full": 16, "sliding": 8}
SYSTEM = list(range(300, 340))  # a 40-token shared prefix


class Server:
    """`rvrun serve` in a subprocess on a free loopback port."""

    def __init__(self, artifact: Path, *args: str):
        self.proc = subprocess.Popen(
            [str(BIN / "rvrun"), "serve", str(artifact), "--port", "0", "--model-name", NAME,
             "--no-verify", *args], stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                if "serving" in line:
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300):
            self.stop()
            raise AssertionError(f"server did not start: {''.join(self.lines)}")
        self.url = next(w for w in self.lines[-1].split() if w.startswith("http://"))
        self.base = self.url.removesuffix("/v1")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.base}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{label}}}" if label else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds a KV block."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["rvrun_running_sequences"] == m["rvrun_waiting_sequences"] == 0 and \
                    m["rvrun_kv_blocks_used{kind=full}"] == 0 and \
                    m["rvrun_kv_blocks_used{kind=sliding}"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {m}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "tiny.rvp"
    build_artifact("gemma-4-tiny", out, BuildOptions("tpu-bf16", max_context=128,
                                                     prefill_buckets=(8, 32), max_seqs=4,
                                                     platforms=("cpu",)),
                   random_weights=True, progress=False, log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def server(artifact):
    s = Server(artifact, *POOLS)
    yield s
    s.stop()  # a graceful shutdown re-raises the SIGTERM it handled
    assert s.proc.returncode in (0, -signal.SIGTERM), "".join(s.lines)
    assert "Traceback" not in "".join(s.lines)


@pytest.fixture(scope="module")
def model(server, artifact):
    """The same artifact and pools in this process (the server compiled them: a cache hit)."""
    return runtime.load(artifact, verify=False, kv_blocks=KV_BLOCKS)


def greedy(model, ids, n) -> str:
    return model.generate(ids, max_tokens=n, ignore_eos=True).text


# ---------------------------------------------------------------------------------------------
# The API


def test_serve_prints_its_load_report_before_serving(server):
    text = "".join(server.lines)
    load = text.index("rvrun: load ")
    assert load < text.index("rvrun: weights ") < text.index("rvrun: serving ")
    assert "not checked (--no-verify)" in text


def test_models_health_metrics(server):
    c = server.client()
    (m,) = c.models.list().data
    assert m.id == NAME and m.owned_by == "rvcompile"
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    metrics = server.metrics()
    for name in ("rvrun_running_sequences", "rvrun_waiting_sequences",
                 "rvrun_kv_blocks_total{kind=full}", "rvrun_prefix_cache_hit_rate",
                 "rvrun_time_to_first_token_seconds_count",
                 "rvrun_inter_token_latency_seconds_count", "rvrun_prompt_tokens_total",
                 "rvrun_generation_tokens_total"):
        assert name in metrics, name
    assert metrics["rvrun_kv_blocks_total{kind=full}"] == 16
    assert metrics["rvrun_kv_blocks_total{kind=sliding}"] == 8


def access_lines(server) -> list[str]:
    return [line for line in list(server.lines) if line.startswith("rvrun: access")]


def test_completions_plain_and_streamed(server, model):
    c = server.client()
    before = len(access_lines(server))  # the module's server logged earlier tests' requests
    prompt = "The quick brown fox"
    ids = model.encode(prompt)
    want = greedy(model, ids, 12)
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == NAME
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    assert r.usage.total_tokens == len(ids) + 12
    times, pieces, chunks = [], [], list(c.completions.create(
        model=NAME, prompt=ids, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    for ch in chunks[:-1]:
        times.append(time.monotonic())
        pieces.append(ch.choices[0].text)
    assert "".join(pieces) == want
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert sum(bool(p) for p in pieces) >= 6  # a chunk per token, not one at the end
    httpx.get(f"{server.base}/nope")
    deadline = time.monotonic() + 10  # each line is written once its response has ended
    while len(access_lines(server)) < before + 3:
        assert time.monotonic() < deadline, "".join(server.lines)
        time.sleep(0.05)
    access = [line.split() for line in access_lines(server)[before:before + 3]]
    for fields in access[:2]:
        assert fields[2:5] == ["POST", "/v1/completions", "200"]
        assert fields[5:7] == [f"tokens_in={len(ids)}", "tokens_out=12"]
        assert float(fields[7].removeprefix("ttft_ms=")) > 0
        assert float(fields[8].removeprefix("duration_ms=")) >= float(fields[7][8:])
    assert access[2][2:8] == ["GET", "/nope", "404", "tokens_in=-", "tokens_out=-", "ttft_ms=-"]


def test_chat_plain_and_streamed_with_the_artifacts_template(server, model):
    c = server.client()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
    ids = model.encode(model.apply_chat_template(messages), add_bos=False)
    want = greedy(model, ids, 10)
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    # max_completion_tokens is the chat spelling of max_tokens
    r = c.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_chat_logprobs_n_and_json_schema(server, model):
    """Issue 16 on the chat route: logprobs with top_logprobs (greedy: the token is the top
    one), n samples streamed with an index and logprobs each, a json_schema response_format.
    (Their values against the logits: tests/test_serve_extras.py, on a float32 artifact.)"""
    c = server.client()
    messages = [{"role": "user", "content": "Hello there"}]
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                  logprobs=True, top_logprobs=2,
                                  extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob <= 0
        assert e.top_logprobs[1].logprob <= e.logprob and e.bytes == list(e.token.encode())
    stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=4, n=2,
                                       temperature=1.0, seed=3, logprobs=True, stream=True,
                                       extra_body={"ignore_eos": True})
    tokens = {0: 0, 1: 0}
    finished = set()
    for chunk in stream:
        for ch in chunk.choices:
            tokens[ch.index] += len(ch.logprobs.content) if ch.logprobs else 0
            if ch.finish_reason:
                finished.add(ch.index)
    assert tokens == {0: 4, 1: 4} and finished == {0, 1}
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=1.0,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "a", "schema": schema, "strict": True}})
    assert json.loads(r.choices[0].message.content) in ({"a": "x"}, {"a": "y"})
    assert r.choices[0].finish_reason == "stop"
    assert server.wait_idle()


def test_sampling_parameters(server, model):
    c = server.client()
    ids = [2, *range(40, 60)]
    greedy_text = greedy(model, ids, 16)

    def text(**kw) -> str:
        extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
        r = c.completions.create(model=NAME, prompt=ids, max_tokens=16, extra_body=extra, **kw)
        return r.choices[0].text

    assert text(temperature=0) == greedy_text
    hot = {"temperature": 1.5}
    assert text(seed=7, **hot) == text(seed=7, **hot)  # same seed, same request: same text
    assert len({text(seed=s, **hot) for s in (7, 8, 9)}) > 1
    assert text(seed=7, **hot) != greedy_text
    assert text(seed=7, extra_body={"top_k": 1}, **hot) == greedy_text  # only the argmax left
    assert text(seed=7, top_p=1e-6, **hot) == greedy_text  # the nucleus is the top token
    assert text(seed=7, extra_body={"top_k": 5}, **hot) != text(seed=7, **hot)
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_stop_strings(server, model):
    c = server.client()
    ids = [2, *range(70, 90)]
    res = model.generate(ids, max_tokens=24, ignore_eos=True)
    full = res.text
    # A stop string from where token k's text starts into token k + 1's, found first there.
    for k in range(2, 20):
        head = model.decode(res.token_ids[:k])
        piece = model.decode(res.token_ids[:k + 1])[len(head):]
        at = len(head)
        stop = full[at:at + len(piece) + 2]
        if full.startswith(head) and piece and "\ufffd" not in stop and full.find(stop) == at:
            break
    else:
        raise AssertionError(f"no stop string found in {full!r}")
    for stops in (stop, [stop, "never-appears"]):
        r = c.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0,
                                 stop=stops, extra_body={"ignore_eos": True})
        assert r.choices[0].text == full[:at] and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 24
    streamed = c.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0,
                                    stop=[stop], stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks) == full[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_errors(server, model):
    c = server.client()

    def error(call) -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as e:
            call()
        assert set(e.value.body) >= {"message", "type", "param", "code"}
        return e.value

    e = error(lambda: c.completions.create(model="other", prompt="hi", max_tokens=2))
    assert e.status_code == 404 and e.body["code"] == "model_not_found"
    e = error(lambda: c.completions.create(model=NAME, prompt="hi", max_tokens="x"))
    assert e.status_code == 400 and e.body["param"] == "max_tokens"
    e = error(lambda: c.completions.create(model=NAME, prompt="hi", temperature="hot"))
    assert e.status_code == 400 and e.body["param"] == "temperature"
    e = error(lambda: c.completions.create(model=NAME, prompt="hi", extra_body={"bogus": 1}))
    assert e.status_code == 400 and "bogus" in e.body["message"]
    e = error(lambda: c.completions.create(model=NAME, prompt=list(range(2, 120)),
                                           max_tokens=20))
    assert e.status_code == 400 and e.body["code"] == "context_length_exceeded"
    e = error(lambda: c.completions.create(model=NAME, prompt=list(range(2, 140))))
    assert e.status_code == 400 and e.body["code"] == "context_length_exceeded"
    e = error(lambda: c.completions.create(model=NAME, prompt=[5, 99999], max_tokens=2))
    assert e.status_code == 400 and "vocabulary" in e.body["message"]
    e = error(lambda: c.completions.create(model=NAME, prompt="hi", n=17))
    assert e.status_code == 400 and e.body["param"] == "n"
    e = error(lambda: c.chat.completions.create(model=NAME, messages=[]))
    assert e.status_code == 400 and e.body["param"] == "messages"
    e = error(lambda: c.chat.completions.create(
        model=NAME, messages=[{"role": "robot", "content": "hi"}]))
    assert e.status_code == 400
    for body in (b"{not json", b"[1, 2]", b""):
        r = httpx.post(f"{server.url}/completions", content=body,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert server.wait_idle()


def test_full_queue_gets_503(artifact, server):
    """One running sequence, one waiting: the next request is refused while they last."""
    small = Server(artifact, *POOLS, "--max-num-seqs", "1", "--max-waiting", "1")
    try:
        c = small.client()
        first = c.completions.create(model=NAME, prompt="a", max_tokens=120, stream=True,
                                     extra_body={"ignore_eos": True})
        next(iter(first))  # running
        second = c.completions.create(model=NAME, prompt="b", max_tokens=5, stream=True,
                                      extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 30
        while small.metrics()["rvrun_waiting_sequences"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=NAME, prompt="c", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
        first.close()
        assert len(list(second)) > 1  # the waiting one still completes
        small.wait_idle()
    finally:
        small.stop()


# ---------------------------------------------------------------------------------------------
# The engine under concurrency


def _requests() -> list[dict]:
    """Six requests long enough (~110 tokens: 7 of the 16 full blocks each) that four running
    at once preempt; the first three share SYSTEM; two sample with a seed."""
    out = []
    for i in range(6):
        tail = list(range(500 + 7 * i, 500 + 7 * i + 3 + i))
        prompt = (SYSTEM if i < 3 else list(range(600 + 50 * i, 630 + 50 * i))) + tail
        sampling = {"temperature": 1.2, "seed": 100 + i} if i in (1, 4) else {"temperature": 0}
        out.append({"prompt": prompt, "max_tokens": 110 - len(prompt), **sampling})
    return out


async def _complete(client: openai.AsyncOpenAI, req: dict):
    r = await client.completions.create(model=NAME, extra_body={"ignore_eos": True}, **req)
    return r.choices[0].text, r.usage


def test_batched_equals_one_at_a_time_with_prefix_sharing_and_preemption(server):
    reqs = _requests()

    async def one_at_a_time():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="none",
                                      max_retries=0) as client:
            return [await _complete(client, r) for r in reqs]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="none",
                                      max_retries=0) as client:
            return await asyncio.gather(*[_complete(client, r) for r in reqs])

    before = server.wait_idle()
    alone = asyncio.run(one_at_a_time())
    middle = server.wait_idle()
    together = asyncio.run(all_at_once())
    after = server.wait_idle()
    assert [t for t, _ in together] == [t for t, _ in alone]
    # One at a time: the requests after the first with SYSTEM found its first 32 tokens (its
    # first chunk) cached, in the full layers and the sliding layers' window.
    assert [u.prompt_tokens_details.cached_tokens for _, u in alone] == [0, 32, 32, 0, 0, 0]
    assert middle["rvrun_preemptions_total"] == before["rvrun_preemptions_total"]
    assert after["rvrun_preemptions_total"] > middle["rvrun_preemptions_total"]


def test_disconnect_frees_the_sequence_at_once(server):
    before = server.wait_idle()
    c = server.client()
    stream = c.completions.create(model=NAME, prompt=list(range(2, 40)), max_tokens=80,
                                  stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()
    after = server.wait_idle(timeout=5)
    aborted = "rvrun_request_finish_total{reason=abort}"
    assert after[aborted] == before.get(aborted, 0) + 1
    generated = after["rvrun_generation_tokens_total"] - before["rvrun_generation_tokens_total"]
    assert generated < 40  # stopped long before its 80 tokens


def test_load_64_streaming_clients_with_disconnects(server):
    """64 concurrent streams, prompts of 1 to 60 tokens, every fourth client hanging up after a
    few chunks. Every other request finishes with a reason; nothing is left running or waiting,
    and every KV block is back in its pool."""
    n = 64

    async def client_task(client: openai.AsyncOpenAI, i: int):
        prompt = [2, *range(10 + i, 10 + i + (i * 7) % 60)]
        stream = await client.completions.create(
            model=NAME, prompt=prompt, max_tokens=8 + i % 17, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": i % 2 == 0},
            temperature=0.7, seed=i)
        got, reason, usage = 0, None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                continue
            got += 1
            reason = chunk.choices[0].finish_reason or reason
            if i % 4 == 3 and got == 3:
                await stream.close()
                return "disconnected", None
        return reason, usage

    async def run():
        limits = httpx.Limits(max_connections=n + 8)
        async with openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=limits, timeout=300)) as client:
            return await asyncio.gather(*[client_task(client, i) for i in range(n)])

    before = server.wait_idle()
    results = asyncio.run(run())
    after = server.wait_idle()
    for i, (reason, usage) in enumerate(results):
        if i % 4 == 3:
            assert reason in ("disconnected", "stop", "length"), (i, reason)
        else:
            assert reason in ("stop", "length"), (i, reason)
            assert usage is not None and usage.completion_tokens >= 1
            if reason == "length":
                assert usage.completion_tokens == 8 + i % 17
    finished = sum(after.get(f"rvrun_request_finish_total{{reason={r}}}", 0)
                   - before.get(f"rvrun_request_finish_total{{reason={r}}}", 0)
                   for r in ("stop", "length", "abort"))
    assert finished == n  # every request ended exactly once: completed or aborted
    assert after["rvrun_request_finish_total{reason=abort}"] > \
        before.get("rvrun_request_finish_total{reason=abort}", 0)
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}


def test_serve_refuses_bad_options(artifact):
    env = {**os.environ, "COLUMNS": "200"}
    for args, needle in ((["--kv-blocks", "3"], "cannot hold one sequence"),
                         (["--max-num-seqs", "9"], "max_num_seqs"),
                         (["--max-model-len", "0"], "--max-model-len")):
        p = subprocess.run([str(BIN / "rvrun"), "serve", str(artifact), "--port", "0",
                            "--no-verify", *args], capture_output=True, text=True, env=env,
                           timeout=300)
        assert p.returncode == 2, p.stderr
        lines = without_progress(p.stderr)
        assert len(lines) == 1 and lines[0].startswith("rvrun: error: ") and needle in lines[0]


def test_a_hostile_chat_template_gets_400_and_runs_nothing(artifact, tmp_path):
    """An artifact written by hand around the build's template check (issue 12): the template
    renders in jinja2's sandbox, so a request gets a one-line 400 and the command never runs."""
    from rvcompile.artifacts import Artifact, ArtifactWriter

    marker = tmp_path / "pwned"
    hostile = tmp_path / "hostile.rvp"
    template = f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"
    with Artifact.open(artifact) as art, ArtifactWriter(hostile, art.header) as w:
        for name in art.sections:
            w.add(name, template.encode() if name == "chat_template" else art.buffer(name))
        w.commit(art.manifest)
    s = Server(hostile, *POOLS)  # the same programs: a compile-cache hit
    try:
        c = s.client()
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2)
        assert e.value.status_code == 400 and e.value.body["param"] == "messages"
        assert e.value.body["message"] == ("messages: chat template: access to attribute "
                                           "'__init__' of 'type' object is unsafe")
        r = c.completions.create(model=NAME, prompt="hi", max_tokens=2)  # still serving
        assert r.usage.completion_tokens == 2
    finally:
        s.stop()
    assert not marker.exists()
    assert "Traceback" not in "".join(s.lines)


def test_inter_token_latency_is_observed_per_token():
    """A device-side decode loop hands several tokens over in one output: the histogram still
    gets one observation per token after the first, with the gap spread over them."""
    from rvcompile.runtime.engine import RequestOutput
    from rvcompile.runtime.serve.server import Metrics, _Stream

    metrics = Metrics(thread=None)  # the engine collector is only read at scrape time
    queue: asyncio.Queue = asyncio.Queue()
    stream = _Stream("r", queue, None, metrics, received=time.perf_counter())
    for i, tokens in enumerate(([7], [8, 9, 10], [11])):
        queue.put_nowait(RequestOutput("r", tokens, "", i == 2, "length" if i == 2 else None,
                                       3, 0, 0))

    async def drain():
        for _ in range(3):
            await stream.next()

    asyncio.run(drain())
    get = metrics.registry.get_sample_value
    assert get("rvrun_time_to_first_token_seconds_count") == 1
    assert get("rvrun_inter_token_latency_seconds_count") == 4
