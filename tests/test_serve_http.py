"""`rvrun serve`'s HTTP layer and `rvrun`'s command line under hostile or unlucky input, against
live processes on loopback serving the tiny artifact of test_serve (its `Server` and fixture).

- Poisonous requests, over raw sockets where a client library would refuse to send them: bodies
  that are not JSON, not UTF-8, or hold lone surrogates or NaN; unknown routes and methods;
  oversized, truncated and slow bodies; missing or wrong API keys. Each gets an OpenAI-style
  error (the 408 and 413 also close the connection), and a normal request succeeds after each.
- An exception in a route: a 500 naming an error id, the traceback in the server's log only.
- SIGTERM: in-flight requests finish while new ones get 503, then exit 0; Ctrl-C drains too and
  exits 130; the drain timeout cuts what is left; no traceback.
- `rvrun`: bad listening flags and non-UTF-8 prompts or text files give one line and exit 2;
  Ctrl-C while generating or loading gives one line and exit 130; a closed stdout exits 141
  quietly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import test_serve
import uvicorn
from cli_output import without_progress
from test_serve import BIN, KV_BLOCKS, NAME, POOLS, Server

from rvcompile import runtime
from rvcompile.artifacts import ArtifactError
from rvcompile.runtime.serve.server import HttpOptions, ServeOptions, create_app

KEY = "sk-test-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
LIMIT = 64 << 10  # --max-body-bytes of the guarded server
BODY_TIMEOUT = 1.0  # its --body-timeout
RVRUN = str(BIN / "rvrun")
JSON = {"content-type": "application/json"}

artifact = test_serve.artifact  # its fixture (module-scoped: built again for this module)


@pytest.fixture(scope="module")
def guarded(artifact):
    s = Server(artifact, *POOLS, "--api-key", KEY, "--max-body-bytes", str(LIMIT),
               "--body-timeout", str(BODY_TIMEOUT))
    yield s
    s.stop()
    assert s.proc.returncode == 0, "".join(s.lines)
    assert "Traceback" not in "".join(s.lines)


# ---------------------------------------------------------------------------------------------
# Helpers


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: dict
    closed: bool  # the server closed the connection after the response


def _connect(server: Server) -> socket.socket:
    host, port = server.base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=15)


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: test", *(f"{k}: {v}" for k, v in
                                                         headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_reply(sock: socket.socket) -> Reply:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the response body"
        rest += chunk
    closed = False
    if headers.get("connection") == "close":
        sock.settimeout(5)
        closed = sock.recv(1) == b""
    return Reply(int(status_line.split()[1]), headers, json.loads(rest[:length]), closed)


def raw(server: Server, method: str, path: str, body: bytes = b"", headers=None,
        content_length: int | None = None) -> Reply:
    """One request as given, on a new connection (a header given as None is left out)."""
    hdrs = {**AUTH, **JSON, **(headers or {})}
    hdrs = {k: v for k, v in hdrs.items() if v is not None}
    if method == "POST" or body:
        hdrs["content-length"] = str(len(body) if content_length is None else content_length)
    with _connect(server) as sock:
        sock.sendall(_head(method, path, hdrs) + body)
        return _read_reply(sock)


def openai_error(reply: Reply, status: int, needle: str = "") -> dict:
    assert reply.status == status, reply
    error = reply.body["error"]
    assert set(error) == {"message", "type", "param", "code"}, reply.body
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert needle in error["message"], (needle, error)
    return error


def normal(server: Server) -> None:
    """A plain request the server must still answer in full."""
    r = httpx.post(f"{server.url}/completions", headers=AUTH, timeout=60, json={
        "model": NAME, "prompt": "In the beginning", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def completion(prompt) -> bytes:
    return json.dumps({"model": NAME, "prompt": prompt, "max_tokens": 2}).encode()


POISON_BODIES = [  # (body, message needle): each a 400 from POST /v1/completions
    (b"{not json", "not valid JSON"),
    (b"", "the request body is empty"),
    (b"[1, 2]", "body"),
    (b'{"model": "tiny", "prompt": "caf\xe9"}', "not UTF-8: byte 0xe9"),
    ('{"model": "tiny", "prompt": "hi"}'.encode("utf-16"), "not UTF-8"),
    (b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', "not UTF-8"),  # a surrogate, encoded
    (b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "lone surrogate \\ud800"),
    (b'{"model": "tiny", "prompt": ["\\udc00"], "max_tokens": 2}', "lone surrogate \\udc00"),
    (b'{"model": "tiny", "prompt": "x", "\\ud83d": 1}', "lone surrogate \\ud83d"),  # a key
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "NaN is not a number"),
    (b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}', "-Infinity is not a number"),
    (b'{"model": "tiny", "prompt": [' + b"1" * 5000 + b"]}", "error parsing the body"),
    (b"[" * 5000 + b"]" * 5000, "nests arrays or objects too deeply"),
]


# ---------------------------------------------------------------------------------------------
# Poisonous requests


@pytest.mark.parametrize("body,needle", POISON_BODIES)
def test_bad_bodies_get_400(guarded, body, needle):
    openai_error(raw(guarded, "POST", "/v1/completions", body), 400, needle)
    normal(guarded)


@pytest.mark.parametrize("path,fields,message,param", [
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, "prompt.0: Input should be a valid integer",
     "prompt.0"),
    ("/v1/completions", {"prompt": None},
     "prompt: Input should be a valid string, or a valid list", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]},
     "messages.0.content.0.text: Input should be a valid string", "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tool_choice": "bogus"},
     "tool_choice: Input should be 'none', 'auto' or 'required', or a valid dictionary",
     "tool_choice"),
])
def test_a_value_no_union_member_takes_gets_the_requests_own_path(guarded, path, fields,
                                                                   message, param):
    """pydantic puts the union member it tried into an error's location ("prompt.str: Input
    should be a valid string" for a list of lists): the 400 names the request's own path, the
    part that is wrong where a member got inside the value, else what each member takes."""
    body = json.dumps({"model": NAME, "max_tokens": 2, **fields}).encode()
    error = openai_error(raw(guarded, "POST", path, body), 400, message)
    assert error["param"] == param
    normal(guarded)


def test_chat_with_lone_surrogate_gets_400(guarded):
    body = (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\udfff"}]}')
    openai_error(raw(guarded, "POST", "/v1/chat/completions", body), 400, "lone surrogate")
    normal(guarded)


def test_surrogate_pair_is_unicode(guarded):
    """A pair of surrogate escapes is one character (U+1F600): accepted."""
    r = raw(guarded, "POST", "/v1/completions", completion("smile \ud83d\ude00"))
    assert r.status == 200 and r.body["usage"]["completion_tokens"] == 2, r


def test_unknown_routes_and_methods(guarded):
    for method, path in (("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/docs"),
                         ("GET", "/openapi.json")):
        openai_error(raw(guarded, method, path), 404, f"Invalid URL ({method} {path})")
        normal(guarded)
    for method, path, allowed in (("GET", "/v1/completions", "POST"),
                                  ("DELETE", "/v1/models", "GET"),
                                  ("PUT", "/v1/chat/completions", "POST")):
        r = raw(guarded, method, path)
        openai_error(r, 405, f"allows {allowed}")
        assert r.headers["allow"] == allowed
        normal(guarded)


def test_oversized_bodies_get_413_and_close(guarded):
    # Content-Length over the limit: answered before the body is read.
    with _connect(guarded) as sock:
        sock.sendall(_head("POST", "/v1/completions", {**AUTH, "content-length":
                                                       str(LIMIT + 1)}))
        r = _read_reply(sock)
    assert openai_error(r, 413, str(LIMIT))["code"] == "request_too_large" and r.closed
    normal(guarded)
    # Chunked, no Content-Length: refused once the limit is passed.
    with _connect(guarded) as sock:
        sock.sendall(_head("POST", "/v1/completions", {**AUTH, "transfer-encoding": "chunked"}))
        sock.sendall(b"%x\r\n%s\r\n" % (LIMIT + 10, b" " * (LIMIT + 10)))
        r = _read_reply(sock)
    assert openai_error(r, 413)["code"] == "request_too_large" and r.closed
    normal(guarded)
    # Just at the limit: read and parsed (whitespace after a JSON document).
    body = completion("hi")
    r = raw(guarded, "POST", "/v1/completions", body + b" " * (LIMIT - len(body)))
    assert r.status == 200, r


def test_truncated_body_times_out_without_blocking_others(guarded):
    body = completion("a truncated request")
    with _connect(guarded) as sock:
        sock.sendall(_head("POST", "/v1/completions", {**AUTH, "content-length":
                                                       str(len(body) + 50)}) + body)
        t0 = time.monotonic()
        normal(guarded)  # served while this one waits for its missing 50 bytes
        assert time.monotonic() - t0 < BODY_TIMEOUT
        r = _read_reply(sock)
        waited = time.monotonic() - t0
    error = openai_error(r, 408, f"got {len(body)} of {len(body) + 50} bytes")
    assert error["code"] == "request_timeout" and r.closed
    assert BODY_TIMEOUT * 0.9 < waited < BODY_TIMEOUT + 3
    normal(guarded)


def test_slow_body_times_out(guarded):
    """A byte every 0.2 s never lets the read go idle: the timeout is for the whole body."""
    body = completion("slow")
    with _connect(guarded) as sock:
        sock.sendall(_head("POST", "/v1/completions", {**AUTH, "content-length":
                                                       str(len(body))}))
        t0 = time.monotonic()
        sent = 0
        try:
            while sent < len(body) and time.monotonic() - t0 < BODY_TIMEOUT + 3:
                sock.sendall(body[sent:sent + 1])
                sent += 1
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed meanwhile
        r = _read_reply(sock)
    assert openai_error(r, 408)["code"] == "request_timeout" and r.closed
    assert sent < len(body)
    normal(guarded)


def test_client_gone_mid_body(guarded):
    with _connect(guarded) as sock:
        sock.sendall(_head("POST", "/v1/completions", {**AUTH, "content-length": "500"})
                     + b'{"model": ')
    normal(guarded)


def test_malformed_http_is_refused(guarded):
    """Below the app: uvicorn's HTTP parser answers 400 (in its own plain-text body) and the
    server goes on."""
    with _connect(guarded) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")
    normal(guarded)


def test_api_key(guarded):
    for headers, needle in (({"authorization": None}, "needs an API key"),
                            ({"authorization": ""}, "needs an API key"),
                            ({"authorization": "Bearer wrong"}, "incorrect API key"),
                            ({"authorization": f"Bearer {KEY}x"}, "incorrect API key"),
                            ({"authorization": f"Basic {KEY}"}, "incorrect API key"),
                            ({"authorization": KEY}, "incorrect API key")):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"),
                             ("GET", "/v1/nope")):  # no route listing without a key
            r = raw(guarded, method, path, completion("hi") if method == "POST" else b"",
                    headers=headers)
            assert openai_error(r, 401, needle)["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
            normal(guarded)
    assert raw(guarded, "GET", "/v1/models", headers={"authorization": f"bearer {KEY}"}).status \
        == 200  # the scheme is case-insensitive
    for path in ("/health", "/metrics"):  # open for probes and scrapers
        assert httpx.get(f"{guarded.base}{path}").status_code == 200
    assert 'status="401"' in httpx.get(f"{guarded.base}/metrics").text


# ---------------------------------------------------------------------------------------------
# An exception in a route


def test_exception_in_a_route_is_a_500_and_logged(artifact, caplog):
    """The app in this process, its model's encode failing on one prompt; a live uvicorn on a
    loopback port in a thread."""
    model = runtime.load(artifact, verify=False, kv_blocks=KV_BLOCKS)
    encode = model.encode

    def failing_encode(text, *args, **kwargs):
        if text == "boom":
            raise RuntimeError("secret internals")
        return encode(text, *args, **kwargs)

    model.encode = failing_encode
    app = create_app(model, ServeOptions(NAME), HttpOptions())
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        with caplog.at_level("ERROR", logger="uvicorn.error"):
            r = httpx.post(f"{base}/completions", json={"model": NAME, "prompt": "boom"})
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        assert "secret" not in r.text and "Traceback" not in r.text
        error_id = error["message"].split("error id ")[1].split()[0]
        (record,) = [rec for rec in caplog.records if error_id in rec.getMessage()]
        assert record.exc_info[0] is RuntimeError
        for _ in range(2):  # still serving
            ok = httpx.post(f"{base}/completions", json={"model": NAME, "prompt": "fine",
                                                          "max_tokens": 2})
            assert ok.status_code == 200, ok.text
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


# ---------------------------------------------------------------------------------------------
# Shutdown


def _stream_body(prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True, "temperature": 0,
                       "stream_options": {"include_usage": True}}).encode()


def _sse_events(lines) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def _refused_with_503(server: Server) -> httpx.Response:
    """Poll with new requests until one is refused (the signal is handled asynchronously)."""
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(f"{server.url}/models", headers=AUTH, timeout=10)
        if r.status_code == 503:
            return r
        assert r.status_code == 200 and time.monotonic() < deadline, r.text
        time.sleep(0.02)


def _start_partial(server: Server, body: bytes) -> socket.socket:
    """A streamed completion whose body stops halfway: in flight until the rest comes. A request
    answered on another connection afterwards shows it has reached the app (uvicorn reads the
    ready connections in order)."""
    sock = _connect(server)
    sock.sendall(_head("POST", "/v1/completions", {**AUTH, **JSON, "content-length":
                                                   str(len(body))}) + body[:len(body) // 2])
    assert httpx.get(f"{server.url}/models", headers=AUTH).status_code == 200
    return sock


def test_sigterm_drains_in_flight_requests_and_exits_0(artifact, monkeypatch):
    monkeypatch.setenv("RVRUN_API_KEY", KEY)  # the key from the environment
    drain_timeout = 20
    s = Server(artifact, *POOLS, "--drain-timeout", str(drain_timeout), "--body-timeout", "60")
    try:
        assert httpx.get(f"{s.url}/models").status_code == 401
        waiting = _start_partial(s, _stream_body("the second", 8))
        with httpx.stream("POST", f"{s.url}/completions", headers={**AUTH, **JSON}, timeout=60,
                          content=_stream_body("the first", 100)) as streaming:
            lines = streaming.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            refused = _refused_with_503(s)
            assert refused.json()["error"]["code"] == "server_shutting_down"
            assert refused.headers["connection"] == "close"
            events = _sse_events(lines)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 100  # all of it
        assert s.proc.poll() is None  # still draining: `waiting` is in flight
        body = _stream_body("the second", 8)
        waiting.sendall(body[len(body) // 2:])
        answer = b""
        while not answer.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked body
            chunk = waiting.recv(65536)
            assert chunk, answer
            answer += chunk
        waiting.close()
        assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
        assert s.proc.wait(drain_timeout) == 0
        assert time.monotonic() - t0 < drain_timeout
    finally:
        if s.proc.poll() is None:
            s.stop()
    log = "".join(s.lines)
    assert "rvrun: SIGTERM: new requests get 503" in log and "Traceback" not in log


def test_ctrl_c_drains_and_the_drain_timeout_cuts_what_is_left(artifact):
    """Ctrl-C drains as SIGTERM does (and exits 130); a request still in flight when the drain
    timeout is up is cut: a 503 here, its response not having started."""
    s = Server(artifact, *POOLS, "--drain-timeout", "1", "--body-timeout", "60")
    try:
        with _start_partial(s, _stream_body("never finished", 8)) as waiting:
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGINT)
            r = _read_reply(waiting)
        assert openai_error(r, 503, "shut down before this request finished")
        assert r.closed
        assert s.proc.wait(15) == 130
        assert 0.9 < time.monotonic() - t0 < 10
    finally:
        if s.proc.poll() is None:
            s.stop()
    log = "".join(s.lines)
    assert "rvrun: interrupted: new requests get 503; waiting up to 1 s for 1 in flight" in log
    assert "rvrun: cutting 1 requests still running" in log and "Traceback" not in log


def test_a_second_signal_cuts_at_once(artifact):
    s = Server(artifact, *POOLS, "--drain-timeout", "60", "--body-timeout", "60")
    try:
        with _start_partial(s, _stream_body("never finished", 8)) as waiting:
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            _refused_with_503(s)  # draining, `waiting` in flight
            s.proc.send_signal(signal.SIGTERM)
            r = _read_reply(waiting)
        assert openai_error(r, 503, "shut down before this request finished")
        assert s.proc.wait(15) == 0
        assert time.monotonic() - t0 < 15
    finally:
        if s.proc.poll() is None:
            s.stop()
    assert "Traceback" not in "".join(s.lines)


# ---------------------------------------------------------------------------------------------
# rvrun's command line


def _run(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([RVRUN, *args], capture_output=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


def _one_error_line(p: subprocess.CompletedProcess, needle: str) -> None:
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("rvrun: error: ") and needle in lines[0], lines[0]


def test_bad_serve_flags_one_line(artifact):
    for args, needle in ((["--port", "70000"], "--port must be in 0..65535"),
                         (["--port", "-1"], "--port must be in 0..65535"),
                         (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1"),
                         (["--api-key", ""], "--api-key"),
                         (["--api-key", "a key "], "--api-key"),
                         (["--max-body-bytes", "0"], "--max-body-bytes"),
                         (["--body-timeout", "nan"], "--body-timeout"),
                         (["--drain-timeout", "-1"], "--drain-timeout"),
                         (["--prefill-budget", "0"], "--prefill-budget must be at least 1, got 0")):
        _one_error_line(_run("serve", str(artifact), *args), needle)


def test_non_utf8_prompt_and_text_one_line(artifact, tmp_path):
    p = subprocess.run([RVRUN.encode(), bytes(artifact), b"--prompt", b"caf\xe9 au lait"],
                       capture_output=True, timeout=120)
    _one_error_line(p, "--prompt is not valid UTF-8 text (byte 0xe9 at character 3)")
    text = tmp_path / "latin1.txt"
    text.write_bytes("In the beginning: café".encode("latin-1"))
    _one_error_line(_run("ppl", str(artifact), "--text", str(text)), "can't decode byte 0xe9")


def _with_default_sigint(*args: str) -> list[str]:
    """A command run with Ctrl-C at its default (a test run from a background shell job
    inherits it ignored, and rvrun then keeps ignoring it, as it should)."""
    return [sys.executable, "-c", "import os, signal, sys; "
            "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])",
            *args]


def test_ctrl_c_while_generating(artifact):
    p = subprocess.Popen(_with_default_sigint(RVRUN, str(artifact), "--prompt", "In the",
                                              "--max-tokens", "120", "--ignore-eos",
                                              "--no-verify"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read1(4096)  # the first piece: generating
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert first and p.returncode == 130, err
    assert [line for line in without_progress(err.decode()) if line] == ["rvrun: interrupted"], err


def test_closed_stdout_ends_quietly(artifact):
    """`rvrun ... | head`: the reader goes away while rvrun writes."""
    p = subprocess.Popen([RVRUN, str(artifact), "--prompt", "In the", "--max-tokens", "120",
                          "--ignore-eos", "--no-verify"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.read1(4096)  # the first piece: generating
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(60) == 141 and without_progress(err.decode()) == [], err


def _opened(pid: int, path) -> bool:
    """Whether process `pid` has `path` open or mapped (Linux)."""
    try:
        fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # a descriptor closed between the listing and the readlink
        return False
    return str(path) in fds or str(path) in maps


def test_ctrl_c_while_loading(artifact):
    p = subprocess.Popen(_with_default_sigint(RVRUN, str(artifact), "--prompt", "In the",
                                              "--no-verify"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not _opened(p.pid, artifact.resolve()):  # the load has begun: jax, compiling are next
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and out == b"", err  # nothing generated: stopped in the load
    assert [line for line in err.decode().splitlines() if line] == ["rvrun: interrupted"], err


def test_gpu_memory_utilization_refused_for_an_xla_artifact(artifact, capsys):
    """The fraction sizes h100 artifacts' pools; an XLA artifact's take --kv-blocks: one line,
    exit 2, from `rvrun serve` as from runtime.load."""
    with pytest.raises(ArtifactError) as e:
        runtime.load(artifact, verify=False, gpu_memory_utilization=0.5)
    assert str(e.value) == (f"{artifact.name}: gpu_memory_utilization sizes the KV pools of h100 "
                            "artifacts; an XLA artifact's take kv_blocks")
    from rvcompile.runtime.cli import main

    assert main(["serve", str(artifact), "--port", "0", "--no-verify",
                 "--gpu-memory-utilization", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"rvrun: error: {e.value}"
