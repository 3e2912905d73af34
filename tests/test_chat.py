"""Chat on Gemma 4's format without compiling a model: the default model's chat template, `rvcompile
build --chat-template`, and `rvrun serve`'s tool calling seen through the official `openai`
client, the model's answers scripted.

- models/rv-gemma4-tiny ships a chat template in Gemma 4's format: turns, the system turn with
  tool declarations, calls and tool answers in the model's turn render as the pinned texts
  below; the build reads it from the directory. The markers are text to its tokenizer (its 8192
  ids are all taken), so a chat generation stops at their text (Model.chat_stops).
- `rvcompile build --chat-template FILE` sets a template (the artifact carries it), and refuses
  one that does not render in the sandbox, or a file it cannot read, in one line, writing
  nothing.
- A server whose model answers from a script (a ScriptedExecutor emits the tokens of a given
  text): tool calls come back as `tool_calls` with ids and JSON arguments and finish_reason
  "tool_calls", whole and streamed, and the two agree; a malformed call, an undeclared tool, or
  text that only looks like a call come back as content; tool_choice "none" parses nothing;
  bad tool fields (and a forced call with response_format) get 400s naming the field.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import uvicorn

from rvcompile.artifacts import Artifact
from rvcompile.artifacts.contents import read_contents
from rvcompile.artifacts.manifest import read_manifest
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.chat_template import compile_template
from rvcompile.runtime.executor_api import KvKind, SeqChunk
from rvcompile.runtime.model import Model, text_decoder
from rvcompile.runtime.serve.server import ServeOptions, create_app
from rvcompile.sources.checkpoint import load_model_source

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"
TEMPLATE = (MODEL_DIR / "chat_template.jinja").read_text()
BIN = Path(sys.executable).parent
Q = '<|"|>'

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "opts": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}},
        "required": ["city"]}}}
WEATHER_DECLARATION = (
    "<|tool>declaration:get_weather{description:<|\"|>The weather now<|\"|>,parameters:{"
    "properties:{city:{description:<|\"|>City<|\"|>,type:<|\"|>STRING<|\"|>},"
    "days:{type:<|\"|>INTEGER<|\"|>},"
    "opts:{properties:{x:{type:<|\"|>BOOLEAN<|\"|>}},required:[<|\"|>x<|\"|>],"
    "type:<|\"|>OBJECT<|\"|>},"
    "tags:{items:{type:<|\"|>STRING<|\"|>},type:<|\"|>ARRAY<|\"|>},"
    "unit:{enum:[<|\"|>c<|\"|>,<|\"|>f<|\"|>],type:<|\"|>STRING<|\"|>}},"
    "required:[<|\"|>city<|\"|>],type:<|\"|>OBJECT<|\"|>}}<tool|>")


def render(messages, tools=None, add_generation_prompt=True) -> str:
    extra = {} if tools is None else {"tools": tools}
    return compile_template(TEMPLATE).render(messages, bos_token="<bos>",
                                             add_generation_prompt=add_generation_prompt, **extra)


# ------------------------------------------------------------------------------ the template

def test_the_default_model_ships_the_template():
    assert load_model_source(str(MODEL_DIR)).chat_template == TEMPLATE


def test_turns_and_system():
    assert render([{"role": "user", "content": "Hello"}]) == \
        "<bos><|turn>user\nHello<turn|>\n<|turn>model\n"
    assert render([{"role": "user", "content": "Hello"}], add_generation_prompt=False) == \
        "<bos><|turn>user\nHello<turn|>\n"
    assert render([{"role": "system", "content": " Be brief. "},
                   {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello there"},
                   {"role": "user", "content": [{"type": "text", "text": " Again "}]}]) == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
        "<|turn>model\nHello there<turn|>\n<|turn>user\nAgain<turn|>\n<|turn>model\n")


def test_tool_declarations_in_the_system_turn():
    assert render([{"role": "user", "content": "Hi"}], [WEATHER]) == (
        "<bos><|turn>system\n" + WEATHER_DECLARATION + "<turn|>\n<|turn>user\nHi<turn|>\n"
        "<|turn>model\n")
    small = {"type": "function", "function": {"name": "ping"}}
    assert render([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
                  [small]) == ("<bos><|turn>system\nS<|tool>declaration:ping{description:"
                               "<|\"|><|\"|>}<tool|><turn|>\n<|turn>user\nHi<turn|>\n"
                               "<|turn>model\n")


# The tool loop as Gemma 4's own template renders it (the same text as pinned by other
# implementations of the format): calls, then the answers in the same model turn.
def test_calls_and_tool_answers_in_the_model_turn():
    call = {"id": "c1", "type": "function", "function": {"name": "weather",
                                                         "arguments": {"city": "Paris"}}}
    tools = [{"type": "function", "function": {
        "name": "weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "description": "City"}},
                       "required": ["city"]}}}]
    conversation = [{"role": "user", "content": "Plan"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert render(conversation, tools) == (
        "<bos><|turn>system\n"
        "<|tool>declaration:weather{description:<|\"|>Weather<|\"|>,parameters:{"
        "properties:{city:{description:<|\"|>City<|\"|>,type:<|\"|>STRING<|\"|>}},"
        "required:[<|\"|>city<|\"|>],type:<|\"|>OBJECT<|\"|>}}<tool|><turn|>\n"
        "<|turn>user\nPlan<turn|>\n<|turn>model\n"
        "<|tool_call>call:weather{city:<|\"|>Paris<|\"|>}<tool_call|>"
        "<|tool_response>response:weather{value:<|\"|>sunny<|\"|>}<tool_response|>")
    # the model's answer after the tool's closes the turn; the next user turn follows
    after = render([*conversation, {"role": "assistant", "content": "Sunny."},
                    {"role": "user", "content": "Thanks"}])
    assert after.endswith("<tool_response|>Sunny.<turn|>\n<|turn>user\nThanks<turn|>\n"
                          "<|turn>model\n")


def test_argument_values_and_parallel_answers():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {
                 "s": "x", "n": 2, "r": 1.5, "b": True, "z": None, "l": ["p", 3],
                 "o": {"k": False}}}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": {}}}]
    text = render([{"role": "user", "content": "Go"},
                   {"role": "assistant", "content": None, "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "b", "content": " two "},
                   {"role": "tool", "tool_call_id": "a", "content": "one"}])
    assert text.endswith(
        "<|turn>model\n<|tool_call>call:f{b:true,l:[<|\"|>p<|\"|>,3],n:2,o:{k:false},r:1.5,"
        "s:<|\"|>x<|\"|>,z:null}<tool_call|><|tool_call>call:g{}<tool_call|>"
        "<|tool_response>response:g{value:<|\"|> two <|\"|>}<tool_response|>"
        "<|tool_response>response:f{value:<|\"|>one<|\"|>}<tool_response|>")


def test_markers_are_text_to_the_default_tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert tok.get_vocab_size(with_added_tokens=True) == config["vocab_size"] == 8192
    text = render([{"role": "user", "content": "Hi"}], [WEATHER])
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == 2 and tok.decode(ids[1:]) == text.removeprefix("<bos>")
    for marker in ("<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", Q):
        assert tok.token_to_id(marker) is None


def test_special_call_markers_stay_in_decoded_text():
    """Where a tokenizer has Gemma 4's call markers as special tokens (the released ones do),
    decoding keeps them, and drops the other special tokens."""
    from tokenizers import AddedToken

    from rvcompile.sources.tokenizer_files import synthetic_tokenizer

    tok = synthetic_tokenizer(1024)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|tool_call>", "<tool_call|>", Q, "<|turn>")])
    text = "<|turn>model\n<|tool_call>call:f{a:" + Q + "x" + Q + "}<tool_call|><eos>"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) < len(text) - 20  # the markers are one token each
    decode = text_decoder(tok)
    assert decode(ids) == "model\n<|tool_call>call:f{a:" + Q + "x" + Q + "}<tool_call|>"
    assert decode(ids[:3]) == tok.decode(ids[:3], skip_special_tokens=True) == "mo"


# ------------------------------------------------------------------------------ the build

@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """The default model, built once (its programs are never compiled here)."""
    out = tmp_path_factory.mktemp("chat") / "tiny.rvp"
    build_artifact(str(MODEL_DIR), out, BuildOptions("xla-f32", max_context=256,
                                                     prefill_buckets=(64,), max_seqs=2,
                                                     platforms=("cpu",)),
                   progress=False, log=lambda *a: None)
    return out


def chat_template_of(path: Path) -> str:
    art = Artifact.open(path)
    return read_contents(art, read_manifest(art)).chat_template


def test_the_artifact_carries_the_template(artifact):
    assert chat_template_of(artifact) == TEMPLATE


def rvcompile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "rvcompile"), "build", "gemma-4-tiny", "--target",
                           "xla-f32", "--random-weights", "--max-context", "64",
                           "--prefill-buckets", "16", "--platforms", "cpu", "--no-progress",
                           *args], capture_output=True, text=True, timeout=300)


def test_build_chat_template_sets_one(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
                        "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[model] "
                        "{% endif %}")
    out = tmp_path / "a.rvp"
    r = rvcompile("--chat-template", str(template), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert chat_template_of(out) == template.read_text()


@pytest.mark.parametrize("text, words", [
    ("{{ ''.__class__ }}", "access to attribute '__class__'"),
    ("{% for m in messages %}", "line 1: Unexpected end of template"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("   \n", "the file is empty"),
    (None, "cannot read"),
    (b"\xff\xfe{{ x }}", "cannot read"),
])
def test_build_chat_template_refuses_in_one_line(tmp_path, text, words):
    template = tmp_path / "t.jinja"
    if isinstance(text, str):
        template.write_text(text)
    elif isinstance(text, bytes):
        template.write_bytes(text)
    out = tmp_path / "a.rvp"
    r = rvcompile("--chat-template", str(template), "-o", str(out))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rvcompile: error: --chat-template "
                                                   f"{template}: "), r.stderr
    assert words in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == ([template] if text is not None
                                                             else [])


# ------------------------------------------------------------------------------ scripted server

class ScriptedExecutor:
    """Answers every prompt with the tokens of `self.reply`, then EOS (a fake executor: no
    model, no KV; the engine still schedules, batches and detokenizes as for a real one)."""

    prefill_buckets = (64,)
    max_chunk = 64
    max_context = 1024
    max_seqs = 2
    block_size = 16
    load_note = "scripted"

    def __init__(self, encode, eos: int):
        self.kinds = {"full": KvKind("full", 64, False, None, 256)}
        self.encode, self.eos = encode, eos
        self.reply: list[int] = []

    def say(self, text: str) -> None:
        self.reply = [*self.encode(text), self.eos]

    def _next(self, chunk: SeqChunk) -> int:
        # a prefill chunk before the prompt's last has a negative step: its token is dropped
        return self.reply[min(max(chunk.step, 0), len(self.reply) - 1)]

    def prefill(self, chunk: SeqChunk) -> int:
        return self._next(chunk)

    def decode(self, lanes) -> list[int]:
        return [self._next(c) for c in lanes]

    def logits(self, chunk: SeqChunk) -> np.ndarray:
        raise NotImplementedError


@pytest.fixture(scope="module")
def scripted(artifact):
    """(openai client, ScriptedExecutor, Model) of a server in this process."""
    art = Artifact.open(artifact)
    contents = read_contents(art, read_manifest(art))

    def encode(text):
        return contents.tokenizer.encode(text, add_special_tokens=False).ids

    executor = ScriptedExecutor(encode, min(contents.eos_ids))
    model = Model(art, executor, contents=contents)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(model, ServeOptions("tiny")),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = sock.getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=60)
    yield client, executor, model
    server.should_exit = True
    thread.join(10)


def ask(client, **kw):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "max_tokens": 120, **kw}
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True))
    return whole, chunks


def streamed(chunks):
    """(content, [(index, id, name, arguments)], finish_reason) of a stream."""
    content, calls, reason = "", [], None
    for c in chunks:
        (choice,) = c.choices
        content += choice.delta.content or ""
        for t in choice.delta.tool_calls or []:
            calls.append((t.index, t.id, t.function.name, t.function.arguments))
        reason = choice.finish_reason or reason
    return content, calls, reason


def test_a_call_comes_back_as_tool_calls(scripted):
    client, executor, model = scripted
    executor.say("<|tool_call>call:get_weather{city:" + Q + "Paris" + Q + ",days:2}"
                 "<tool_call|><|tool_response>ignored")
    whole, chunks = ask(client)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and len(call.id) == 29
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    content, calls, reason = streamed(chunks)
    assert reason == "tool_calls" and content == ""
    [(index, call_id, name, arguments)] = calls
    assert (index, name, json.loads(arguments)) == (0, "get_weather", json.loads(
        call.function.arguments)) and call_id.startswith("call_")


def test_text_then_two_calls(scripted):
    client, executor, _ = scripted
    text = "Checking both.\n"
    executor.say(text + "<|tool_call>call:get_weather{city:" + Q + "A" + Q + "}<tool_call|>"
                 "<|tool_call>call:get_weather{city:" + Q + "B" + Q + "}<tool_call|>")
    whole, chunks = ask(client)
    (choice,) = whole.choices
    assert choice.message.content == text and choice.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls] == \
        ["A", "B"]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    content, calls, reason = streamed(chunks)
    assert content == text and reason == "tool_calls"
    assert [(i, json.loads(a)["city"]) for i, _, _, a in calls] == [(0, "A"), (1, "B")]
    # parallel_tool_calls false: the second call is text
    whole, chunks = ask(client, parallel_tool_calls=False)
    (choice,) = whole.choices
    assert len(choice.message.tool_calls) == 1
    assert choice.message.content == text + "<|tool_call>call:get_weather{city:" + Q + "B" + Q \
        + "}<tool_call|>"
    assert streamed(chunks)[0] == choice.message.content


@pytest.mark.parametrize("reply", [
    "<|tool_call>call:get_weather{city:" + Q + "Paris}<tool_call|>",  # unterminated string
    "<|tool_call>call:launch{now:true}<tool_call|>",  # not a declared tool
    "<|tool_call>call:get_weather{city:" + Q + "Paris" + Q + "}",  # never closed
    'call:get_weather{city:"Paris"} is how one would ask',  # no markers
    "In the beginning was the Word.",
])
def test_anything_else_is_text(scripted, reply):
    client, executor, _ = scripted
    executor.say(reply)
    whole, chunks = ask(client)
    (choice,) = whole.choices
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == reply
    assert streamed(chunks) == (reply, [], "stop")


def test_tool_choice_none_parses_nothing_and_declares_nothing(scripted):
    client, executor, model = scripted
    reply = "<|tool_call>call:get_weather{city:" + Q + "Paris" + Q + "}<tool_call|>"
    executor.say(reply + "<|tool_response>")
    whole, chunks = ask(client, tool_choice="none")
    (choice,) = whole.choices
    assert choice.message.tool_calls is None and choice.message.content == reply
    assert choice.finish_reason == "stop"
    # no tools in the prompt: the usage counts the prompt without their declarations
    plain = model.encode(model.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"}]), add_bos=False)
    assert whole.usage.prompt_tokens == len(plain)


def test_a_tool_answer_goes_back_into_the_template(scripted):
    client, executor, model = scripted
    executor.say("It is sunny in Paris.")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.choices[0].finish_reason == "stop"
    prompt = render(messages[:1] + [{**messages[1], "tool_calls": [
        {**messages[1]["tool_calls"][0], "function": {"name": "get_weather",
                                                      "arguments": {"city": "Paris"}}}]},
                                    messages[2]], [WEATHER])
    assert prompt.endswith("<|tool_response>response:get_weather{value:<|\"|>sunny, 21 C<|\"|>}"
                           "<tool_response|>")
    assert r.usage.prompt_tokens == len(model.encode(prompt, add_bos=False))


def test_turn_end_text_stops_the_answer(scripted):
    client, executor, model = scripted
    assert model.chat_stops == ("<turn|>", "<|tool_response>")
    executor.say("Amen.<turn|>\n<|turn>user\nmore")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == "Amen." and r.choices[0].finish_reason == "stop"
    # the template's own stops leave a chat request 14 of its own
    e = error(lambda: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}],
        stop=[f"s{i}" for i in range(15)]))
    assert e.status_code == 400 and e.body["param"] == "stop"
    assert "at most 14 strings" in e.body["message"]


def error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value


@pytest.mark.parametrize("fields, param, words", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot both constrain"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "declared twice"),
    ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "y"}]},
     "messages[0].tool_call_id", "answers no call"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "nope"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not JSON"),
])
def test_bad_tool_requests_get_400(scripted, fields, param, words):
    client, _, _ = scripted
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "tools": [WEATHER], **fields}
    e = error(lambda: client.chat.completions.create(**body))
    assert e.status_code == 400 and e.body["param"] == param and words in e.body["message"]
