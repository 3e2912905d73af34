"""Chat on the embedded default model, as a user meets it: the artifact scripts/demo.sh builds
(models/rv-gemma4-tiny, xla-f32, context 512), served by `rvrun serve` in a subprocess and asked
through the official `openai` client, and `rvrun chat` driven over a pipe.

- The README's client example runs as written (the address aside) and gets an answer.
- Chat completions, whole and streamed, give the same greedy answer; the prompt is the
  template's rendering (usage); a tool round trip (tools declared, the assistant's call and the
  tool's answer in the history) is rendered and answered; `required` and a named
  function force a call through the grammar-constrained sampler.
- `rvrun ART --chat --prompt` answers as the server does. `rvrun chat` with piped stdin answers
  each line as the server answers the same conversation (greedy), keeps the history, forgets it
  at `/reset`, and exits 0 at the end of the input; Ctrl-C (SIGINT) stops a long answer without
  ending the session.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_serve import Server

from rvcompile.build import BuildOptions, build_artifact

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NAME = "rv-gemma4-tiny"  # the demo artifact's file stem: the server's model id
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """What scripts/demo.sh builds (on the CPU only)."""
    out = tmp_path_factory.mktemp("demo") / f"{NAME}.rvp"
    build_artifact(str(ROOT / "models" / NAME), out,
                   BuildOptions("xla-f32", max_context=512, prefill_buckets=(16, 64),
                                platforms=("cpu",)),
                   progress=False, log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def server(artifact):
    s = Server(artifact, "--model-name", NAME)  # the id a user's server gives it (the stem)
    yield s
    s.stop()
    assert "Traceback" not in "".join(s.lines)


def greedy(client, messages, n=12, **kw):
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=n,
                                       temperature=0, **kw)
    return r


def test_the_readme_client_example_works(server):
    readme = (ROOT / "README.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
                  if "OpenAI(" in b]
    code = example.replace("http://127.0.0.1:8080/v1", server.url)
    assert code != example
    lines = code.strip().splitlines()
    lines[-1] = "result = " + lines[-1]
    scope: dict = {}
    exec("\n".join(lines), scope)
    r = scope["result"]
    assert r.model == NAME and r.object == "chat.completion"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_whole_and_streamed(server):
    c = server.client()
    messages = [{"role": "system", "content": "You are a scribe."},
                {"role": "user", "content": "Who made the heavens?"}]
    r = greedy(c, messages)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    # the prompt is the template's: BOS, a system turn, a user turn, the model's turn opened
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "models" / NAME / "tokenizer.json"))
    prompt = ("<|turn>system\nYou are a scribe.<turn|>\n<|turn>user\nWho made the heavens?"
              "<turn|>\n<|turn>model\n")
    assert r.usage.prompt_tokens == 1 + len(tok.encode(prompt, add_special_tokens=False).ids)
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True)
        if ch.choices]
    assert "".join(pieces) == r.choices[0].message.content and len(pieces) > 3


def test_a_tool_round_trip_on_the_default_model(server):
    c = server.client()
    messages = [{"role": "user", "content": "What is the weather in Jerusalem?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Jerusalem"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "clear skies"}]
    r = greedy(c, messages, n=16, tools=[WEATHER])
    (choice,) = r.choices
    # this model was never taught to call: it answers in text, parsed without error
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    without = greedy(c, messages, n=16, tools=[WEATHER], tool_choice="none")
    assert without.usage.prompt_tokens < r.usage.prompt_tokens  # no declarations in the prompt
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=NAME, messages=messages, max_tokens=16, temperature=0, tools=[WEATHER],
        stream=True) if ch.choices)
    assert streamed == choice.message.content
    # forced: the grammar's token mask makes even this untaught model call, parsed as OpenAI's
    # (an enum keeps the untaught model's string short, and one call a turn ends the grammar:
    # with parallel calls allowed it may go on calling to max_tokens)
    cities = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Jerusalem", "Babylon"]}},
            "required": ["city"]}}}
    for choice_field in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for temperature in (0.0, 1.0):
            forced = c.chat.completions.create(
                model=NAME, messages=messages, max_tokens=64, temperature=temperature, seed=3,
                tools=[cities], tool_choice=choice_field, parallel_tool_calls=False).choices[0]
            assert forced.finish_reason == "tool_calls", forced
            (call,) = forced.message.tool_calls
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments)["city"] in ("Jerusalem", "Babylon")


def rvrun_chat(artifact: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "rvrun"), "chat", str(artifact), "--no-verify", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_rvrun_chat_over_a_pipe(server, artifact):
    c = server.client()
    turns = ["Who made the heavens?", "And the sea?", "/reset", "And the sea?"]
    p = rvrun_chat(artifact, "--max-tokens", "10")
    out, err = p.communicate("\n".join(turns) + "\n", timeout=600)
    assert p.returncode == 0, err
    first = greedy(c, [{"role": "user", "content": turns[0]}], n=10).choices[0].message.content
    second = greedy(c, [{"role": "user", "content": turns[0]},
                        {"role": "assistant", "content": first},
                        {"role": "user", "content": turns[1]}], n=10).choices[0].message.content
    fresh = greedy(c, [{"role": "user", "content": turns[3]}], n=10).choices[0].message.content
    assert out == f"{first}\n{second}\n{fresh}\n"
    assert second != fresh  # the history made a difference


def test_rvrun_chat_flag_answers_as_the_server(server, artifact):
    question = "Who made the heavens?"
    r = subprocess.run([str(BIN / "rvrun"), str(artifact), "--no-verify", "--chat", "--prompt",
                        question, "--max-tokens", "10"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    answer = greedy(server.client(), [{"role": "user", "content": question}], n=10)
    assert r.stdout == answer.choices[0].message.content + "\n"


def test_rvrun_chat_ctrl_c_stops_the_answer_only(server, artifact):
    question = "Tell me of the kings of Israel."
    whole = greedy(server.client(), [{"role": "user", "content": question}], n=400)
    assert whole.choices[0].finish_reason == "length"  # uncut, the answer is 400 tokens
    p = rvrun_chat(artifact, "--max-tokens", "400")
    got: list[str] = []
    started = threading.Event()

    def read():
        while True:
            ch = p.stdout.read(1)
            if not ch:
                return
            got.append(ch)
            started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    p.stdin.write(question + "\n")
    p.stdin.flush()
    assert started.wait(300), p.stderr.read() if p.poll() is not None else "no answer"
    p.send_signal(signal.SIGINT)
    p.stdin.close()  # then the end of the input: the session ends with 0
    assert p.wait(300) == 0, p.stderr.read()
    reader.join(10)
    cut = "".join(got)
    assert cut.endswith("\n") and whole.choices[0].message.content.startswith(cut[:-1])
    assert len(cut) < len(whole.choices[0].message.content) // 2
    assert "interrupted" not in p.stderr.read()
