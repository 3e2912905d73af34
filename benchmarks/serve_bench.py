"""Serving benchmark against any OpenAI-compatible endpoint (`rvrun serve`, or a peer such as
vLLM), so the same script measures both.

For each concurrency C of the sweep, C clients each send streaming /v1/completions requests back
to back until `--requests` have finished at that level. Each request asks for `--output-tokens`
tokens with `ignore_eos` (peers that lack it may stop early; the report counts what came back,
from the usage chunk when the server sends one). Prompts are synthetic text of about
`--prompt-words` words, different per request (how many tokens that is depends on the tokenizer:
the synthetic one of a `--random-weights` build makes about 4.7 per word), or with
`--prompt-tokens` exactly that many random token ids. A warm-up request per level is excluded.

Per level: output tokens/s over the level's wall time, requests/s, and p50/p90/p99 of time to
first token (request sent -> first content chunk) and inter-token latency (gaps between content
chunks of a request, over all requests). With `--response-format`, every request is
constrained (structured outputs); against rvrun the report adds the host time per grammar mask
and, per engine step, the host time computing masks and the part the engine waited for (the
rest was hidden behind other work). Against rvrun every level also reports where the engine's
time went: the share of the wall time inside executor calls and the share the engine spent on
its own host work between them (its /metrics counters). Prints a table, writes a JSON report.

    python benchmarks/serve_bench.py --url http://127.0.0.1:8080/v1 --concurrency 1,2,4,8 \\
        --requests 32 --prompt-words 64 --output-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

WORDS = ("the of and to in is that for it as with was on be by at this from or an are which "
         "not but have had they one were all their there been has more when will would who so "
         "no if out up what about into than them can only other new some time could these two "
         "may then do first any my now such like our over man me even most made after also did "
         "many before must through back years where much your way well down should because "
         "each just those people how too little state good very make world still own see men "
         "work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three")


PROMPT_IDS = (100, 8000)  # within every Gemma 4 vocabulary and the embedded default's (8,192)


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def prompt_ids(rng: random.Random, tokens: int) -> list[int]:
    """A prompt of exactly `tokens` token ids (PROMPT_IDS: ids every vocabulary here has),
    as the OpenAI API's token-array prompt: the same length whatever the tokenizer."""
    return [rng.randrange(*PROMPT_IDS) for _ in range(tokens)]


def prompt_text(rng: random.Random, words: int) -> str:
    vocab = WORDS.split()
    return " ".join(rng.choice(vocab) for _ in range(words))


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    t0 = time.perf_counter()
    last, res = None, RequestResult(ok=False)
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    res.output_tokens = msg["usage"]["completion_tokens"]
                if msg.get("choices") and msg["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    chunks += 1
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.output_tokens = res.output_tokens or chunks
    res.ok = last is not None
    return res


async def run_level(url: str, model: str, concurrency: int, n_requests: int, args,
                    seed: int) -> dict:
    rng = random.Random(seed)
    bodies = [{"model": model, "prompt": prompt_ids(rng, args.prompt_tokens)
               if args.prompt_tokens else prompt_text(rng, args.prompt_words),
               "max_tokens": args.output_tokens, "temperature": args.temperature,
               "stream": True, "stream_options": {"include_usage": True},
               "ignore_eos": True} for _ in range(n_requests + 1)]
    if args.response_format:
        for b in bodies:
            b["response_format"] = args.response_format
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        await one_request(client, url, bodies.pop())  # warm-up, excluded
        before = engine_counters(url)
        queue = list(range(n_requests))
        results: list[RequestResult] = []

        async def worker():
            while queue:
                i = queue.pop()
                results.append(await one_request(client, url, bodies[i]))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    ttft = np.array([r.ttft_s for r in ok])
    itl = np.array([x for r in ok for x in r.itl_s])
    tokens = sum(r.output_tokens for r in ok)

    def pct(a: np.ndarray) -> dict:
        if not len(a):
            return {}
        return {f"p{p}_ms": float(np.percentile(a, p) * 1e3) for p in (50, 90, 99)}

    masks = engine = None
    if before is not None:  # rvrun's own counters
        after = engine_counters(url)
        d = {k: after[k] - before[k] for k in ENGINE_COUNTERS}
        host_s, n, wait_s, late_s = (d[f"rvrun_grammar_mask{x}_total"] for x in (
            "_seconds", "s", "_wait_seconds", "_late_wait_seconds"))
        steps = d["rvrun_engine_steps_total"]
        step_s, executor_s = (d["rvrun_engine_step_seconds_total"],
                              d["rvrun_engine_executor_seconds_total"])
        engine = {"steps": steps, "step_s": step_s, "executor_s": executor_s,
                  "packed_prefills": d["rvrun_engine_packed_prefills_total"],
                  "mixed_calls": d["rvrun_engine_mixed_calls_total"],
                  "executor_share": executor_s / wall, "engine_host_share":
                  (step_s - executor_s) / wall, "ms_per_step": step_s / steps * 1e3
                  if steps else 0.0}
        masks = {"masks": n, "host_s": host_s, "us_per_mask": host_s / n * 1e6 if n else 0.0,
                 "wait_s": wait_s, "steps": steps,
                 "host_ms_per_step": host_s / steps * 1e3 if steps else 0.0,
                 "wait_ms_per_step": wait_s / steps * 1e3 if steps else 0.0,
                 "late_wait_s": late_s,
                 "late_wait_ms_per_step": late_s / steps * 1e3 if steps else 0.0}
    return {"concurrency": concurrency, "requests": n_requests, "ok": len(ok),
            "grammar_masks": masks, "engine": engine,
            "errors": sorted({r.error for r in results if not r.ok})[:3], "wall_s": wall,
            "output_tokens": tokens, "output_tok_s": tokens / wall,
            "requests_per_s": len(ok) / wall, "ttft": pct(ttft), "itl": pct(itl)}


ENGINE_COUNTERS = ("rvrun_grammar_mask_seconds_total", "rvrun_grammar_masks_total",
                   "rvrun_grammar_mask_wait_seconds_total", "rvrun_engine_steps_total",
                   "rvrun_engine_step_seconds_total", "rvrun_engine_executor_seconds_total",
                   "rvrun_engine_packed_prefills_total", "rvrun_engine_mixed_calls_total",
                   "rvrun_grammar_mask_late_wait_seconds_total")


def engine_counters(url: str) -> dict[str, float] | None:
    """rvrun's engine counters at /metrics (ENGINE_COUNTERS: host seconds computing grammar
    masks, masks, seconds the engine waited for them, engine steps, seconds inside steps and,
    of them, inside executor calls, packed prefills, mixed calls, and seconds waited for
    masks inside decode calls while their forward pass ran); None for other servers."""
    try:
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ENGINE_COUNTERS:
            values[name] = float(value)
    if len(values) != len(ENGINE_COUNTERS):
        return None
    return values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8080/v1", help="the API base URL")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated sweep")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="send prompts of exactly this many random token ids instead of text "
                        "(the length peers' batched benchmarks fix; any tokenizer)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--response-format", default=None,
                   help="structured outputs: 'json_object', or a JSON schema file for "
                        "json_schema (the cost of constrained decoding)")
    a = p.parse_args()
    if a.response_format == "json_object":
        a.response_format = {"type": "json_object"}
    elif a.response_format:
        with open(a.response_format) as f:
            a.response_format = {"type": "json_schema", "json_schema": {
                "name": "bench", "schema": json.load(f), "strict": True}}
    url = a.url.rstrip("/")
    model = a.model or httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]
    report = {"url": url, "model": model, "args": vars(a), "levels": []}
    try:
        report["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip()
    except OSError:
        report["commit"] = ""
    prompts = (f"{a.prompt_tokens} prompt tokens" if a.prompt_tokens
               else f"~{a.prompt_words} prompt words")
    print(f"{model} at {url}: {a.requests} requests per level, {prompts}, "
          f"{a.output_tokens} output tokens")
    print(f"{'conc':>4} {'ok':>4} {'out tok/s':>10} {'req/s':>7} {'TTFT p50/p90/p99 ms':>22} "
          f"{'ITL p50/p90/p99 ms':>22}")
    for i, c in enumerate(int(x) for x in a.concurrency.split(",")):
        level = asyncio.run(run_level(url, model, c, a.requests, a, seed=i))
        report["levels"].append(level)
        t, itl = level["ttft"], level["itl"]

        def fmt(d: dict) -> str:
            return "/".join(f"{d.get(f'p{q}_ms', float('nan')):.0f}" for q in (50, 90, 99))

        print(f"{c:>4} {level['ok']:>4} {level['output_tok_s']:>10.1f} "
              f"{level['requests_per_s']:>7.2f} {fmt(t):>22} {fmt(itl):>22}", flush=True)
        if level["errors"]:
            print(f"     errors: {level['errors']}")
        if level["engine"]:
            e = level["engine"]
            print(f"     engine: {e['steps']:.0f} steps, {e['ms_per_step']:.1f} ms each; of the "
                  f"wall time {100 * e['executor_share']:.0f}% in executor calls, "
                  f"{100 * e['engine_host_share']:.0f}% the engine's host work")
        if level["grammar_masks"] and level["grammar_masks"]["masks"]:
            g = level["grammar_masks"]
            print(f"     grammar masks: {g['masks']:.0f}, {g['us_per_mask']:.0f} us each on "
                  f"the host; per engine step {g['host_ms_per_step']:.2f} ms computing, "
                  f"{g['wait_ms_per_step']:.2f} ms waited for, {g['late_wait_ms_per_step']:.2f}"
                  f" ms more while forward passes ran ({g['steps']:.0f} steps)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
