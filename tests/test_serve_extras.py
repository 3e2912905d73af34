"""The OpenAI fields of issue 16 item 4 through a live `rvrun serve` on the default model's
xla-f32 artifact (the official `openai` client): log-probabilities (values against the
in-process model's logits), n samples (plain and streamed), penalties, stop token ids, usage
with cached prompt tokens, and 400s naming the field.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_serve import NAME, Server

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"
PROMPT = ("In the beginning God created the heaven and the earth. And the earth was without "
          "form, and void")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve-extras") / "tiny.rvp"
    build_artifact(str(MODEL_DIR), out,
                   BuildOptions("xla-f32", max_context=256, prefill_buckets=(16, 64),
                                max_seqs=8, platforms=("cpu",), decode_loop_steps=8),
                   progress=False, log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def model(artifact):
    return runtime.load(artifact)


@pytest.fixture(scope="module")
def server(artifact):
    s = Server(artifact)
    yield s
    s.stop()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_completion_logprobs_are_the_models(server, model):
    r = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=6,
                                           temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    m = model
    ids = m.encode(PROMPT) + m.encode(r.choices[0].text, add_bos=False)
    ref = log_softmax(m.logits(ids[:-1]))[len(m.encode(PROMPT)) - 1:]
    for i, tok in enumerate(ids[len(m.encode(PROMPT)):]):
        assert abs(lp.token_logprobs[i] - ref[i, tok]) < 1e-4
        assert len(lp.top_logprobs[i]) == 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i].max(), abs=1e-4)


def test_n_samples_with_logprobs_plain_and_streamed(server, model):
    c = server.client()
    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5,
                             n=4, logprobs=0)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    assert len({ch.text for ch in r.choices}) == 4
    assert all(len(ch.logprobs.token_logprobs) == 8 for ch in r.choices)
    assert r.usage.completion_tokens == 32
    assert r.usage.prompt_tokens == len(model.encode(PROMPT))  # counted once
    stream = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                  seed=5, n=4, stream=True,
                                  stream_options={"include_usage": True})
    text = {i: "" for i in range(4)}
    reasons = {}
    usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text[ch.index] += ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert text == {ch.index: ch.text for ch in r.choices}  # same seed, same samples
    assert set(reasons) == {0, 1, 2, 3} and usage.completion_tokens == 32


def test_penalties_stop_token_ids_and_cached_usage(server, model):
    c = server.client()
    prompt = model.encode(PROMPT)
    plain = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    again = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert again.choices[0].text == plain.choices[0].text
    # whole blocks, less the last token, which must run to sample the first one
    assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16
    pen = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                               frequency_penalty=2.0, presence_penalty=1.0,
                               extra_body={"repetition_penalty": 1.5})
    assert pen.choices[0].text != plain.choices[0].text
    tokens = model.generate(prompt, max_tokens=12).token_ids
    assert model.decode(tokens) == plain.choices[0].text
    stop = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                extra_body={"stop_token_ids": [tokens[4]]})
    assert stop.choices[0].finish_reason == "stop"
    assert stop.choices[0].text == model.decode(tokens[:tokens.index(tokens[4])])


@pytest.mark.parametrize("body,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"logprobs": 21}, "logprobs"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_fields_get_a_400_naming_them(server, body, param):
    r = httpx.post(f"{server.url}/completions",
                   json={"model": NAME, "prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_top_logprobs_needs_logprobs(server):
    r = httpx.post(f"{server.url}/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(f"{server.url}/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
        "top_logprobs": 21, "max_completion_tokens": 0})
    assert r.status_code == 400


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["law", "war"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def valid(value) -> bool:
    """value against SCHEMA, by hand (jsonschema is not a dependency)."""
    return (isinstance(value, dict) and {"name", "age"} <= set(value) <= set(SCHEMA["properties"])
            and isinstance(value["name"], str) and len(value["name"]) <= 6
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and (isinstance(value.get("tags", []), list) and len(value.get("tags", [])) <= 2
                 and all(t in ("law", "war") for t in value.get("tags", []))))


def test_json_schema_outputs_are_valid_100_of_100(server):
    c = server.client()

    def one(i: int):
        return c.completions.create(
            model=NAME, prompt=f"Record {i}:", max_tokens=48, temperature=1.0, seed=i,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "schema": SCHEMA, "strict": True}}})

    before = server.metrics()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(100)))
    texts = [r.choices[0].text for r in results]
    assert all(r.choices[0].finish_reason == "stop" for r in results), texts
    assert all(valid(json.loads(t)) for t in texts), texts
    assert len(set(texts)) > 50  # sampled, not one answer
    after = server.metrics()  # the grammar counters: masks, their host time, the time waited
    tokens = sum(r.usage.completion_tokens for r in results)
    masks = after["rvrun_grammar_masks_total"] - before["rvrun_grammar_masks_total"]
    # one per sampled token, but a request's first (the engine keeps its grammar's), give or
    # take one unused per request
    assert tokens - 100 <= masks <= tokens + 100
    assert after["rvrun_grammar_mask_seconds_total"] > before["rvrun_grammar_mask_seconds_total"]
    assert "rvrun_grammar_mask_wait_seconds_total" in after
    # an XLA executor waits before its calls: nothing waited inside them (late masks)
    assert after["rvrun_grammar_mask_late_wait_seconds_total"] == 0
    assert after["rvrun_engine_steps_total"] > before["rvrun_engine_steps_total"]
    step_s, executor_s = (after[f"rvrun_engine_{x}_seconds_total"]
                          - before[f"rvrun_engine_{x}_seconds_total"] for x in ("step", "executor"))
    assert 0 < executor_s <= step_s


def test_json_object_gives_an_object(server):
    r = server.client().completions.create(
        model=NAME, prompt="Data:", max_tokens=64, temperature=0,
        extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("fmt,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
     "foo"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}, ""),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
    ({"type": "xml"}, ""),
])
def test_schemas_that_cannot_compile_get_a_400(server, fmt, needle):
    r = httpx.post(f"{server.url}/completions", json={
        "model": NAME, "prompt": "x", "max_tokens": 4, "response_format": fmt})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("response_format") and needle in error["message"]
