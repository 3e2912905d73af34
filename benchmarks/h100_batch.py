"""Batched prefill and decode of an h100-fp8 artifact on the bare executor (no engine, no
server), like llama.cpp's batched bench: per batch width B, B sequences of --prompt random tokens
are prefilled one after another, then decoded together for --gen steps (one `decode` call per
step: the decode_{bucket} CUDA graph, host io and the token read-back included).

    python benchmarks/h100_batch.py ART [--batch 1,2,4,8,16,32] [--prompt 128] [--gen 128]
                                    [--chunk 256] [--ttft 1200] [--decode-at 32768,131000]
                                    [--json OUT]
                                    [--gpu-memory-utilization 0.9]

B goes up to the artifact's max_seqs (`rvcompile build --max-seqs 256`: decode entries 1, 2, 4,
..., 256). The KV pools are sized at load (runtime/executors/kv_budget.py: by default 0.90 of
the GPU's memory holds the model and its pools); each sequence gets only the blocks its prompt
and generation fill (`seq_tables`), so 256 sequences of 256 tokens fit where 256 whole contexts
would not, and a B whose blocks the pools cannot hold is skipped with a line saying so.

Prompts run as the engine runs them (runtime/scheduler.py): chunks of max_chunk tokens, each in
the smallest prefill entry that holds it (a 128-token prompt in a 256-row entry when the buckets
are 16 / 64 / 256). Per B: prefill tok/s (B x prompt tokens over the prefill calls' time; and
"packed", the same prompts first prefilled several to a call as the engine packs them, where the
artifact packs: kernel_schedule.PrefillPacking), decode
tok/s (B x gen over the decode calls' time) and the step time, then "loop": the same steps
through the device-side decode loop the engine uses (decode_many: calls of up to the artifact's
loop length, no host io between their steps). --chunk also times one full
prefill chunk of that many rows (median of 5 calls after one warm-up), --ttft the time to the
first token of a prompt of that many tokens at B = 1 on the bare executor (its chunks) and
through Model.generate (the engine), median of 3. --decode-at times B = 1 decode steps at
those contexts (positions before them not filled: a step reads the same keys' bytes).

--speculative K (an artifact built with --num-draft-tokens K or more): instead,
per B, B greedy requests through the engine twice, plain and with n-gram speculation (K
drafts a round): decode tok/s of each (new tokens after every request's first over the time
from then to the last), the drafts made and accepted, tokens per verify lane, and whether the
two runs gave the same tokens. Prompts: B different blocks of --period random tokens, each
repeated to --prompt tokens (so n-gram lookup finds the pattern; what the model then generates
decides what is accepted), or with --text FILE B consecutive --prompt-token pieces of that
text (through the artifact's tokenizer). Then, on the bare executor, the verify step's cost per
B for k = 0 .. the artifact's K drafts a lane (k = 0 is a decode step; median of 5 calls after
a warm-up, B lanes of k + 1 rows at position --prompt).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np

from rvcompile import runtime
from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import LoopLane, Sampling, SeqChunk
from rvcompile.runtime.speculative import Speculation

_IDS = itertools.count()


def blocks_needed(ex, tokens: int) -> dict[str, int]:
    """Blocks of each kind a sequence of `tokens` tokens fills (a ring at most its width)."""
    n = -(-tokens // ex.block_size)
    return {k.name: min(n, k.table_width) for k in ex.kinds.values()}


def seq_tables(ex, i: int, tokens: int) -> dict[str, list[int]]:
    """Sequence i's block tables when every sequence holds `tokens` tokens: blocks
    [i * need, (i + 1) * need) of each kind, the table's unused tail repeating its first block
    (entries past the sequence's length are never read or written)."""
    out = {}
    for k in ex.kinds.values():
        need = blocks_needed(ex, tokens)[k.name]
        own = list(range(i * need, (i + 1) * need))
        out[k.name] = own + [own[0]] * (k.table_width - need)
    return out


def fits(ex, b: int, tokens: int) -> str | None:
    """None when b sequences of `tokens` tokens fit the pools; else why not."""
    for k in ex.kinds.values():
        need = b * blocks_needed(ex, tokens)[k.name]
        if need > k.num_blocks:
            return f"{b} x {tokens} tokens need {need} {k.name} KV blocks; the pool has " \
                   f"{k.num_blocks}"
    if b > ex.max_seqs:
        return f"the artifact decodes at most {ex.max_seqs} sequences a step"
    return None


def prefill(ex, prompt: list[int], tables) -> int:
    """The prompt in max_chunk chunks, as the engine runs it; the first sampled token."""
    for start in range(0, len(prompt), ex.max_chunk):
        tok = ex.prefill(SeqChunk(prompt[start:start + ex.max_chunk], start, tables))
    return tok


def pack_chunks(ex, chunks: list[SeqChunk]) -> list[list[SeqChunk]]:
    """The chunks in prefill calls as the engine packs them (engine._packs: consecutive chunks
    while they fit the largest prefill entry)."""
    packs: list[list[SeqChunk]] = [[]]
    for c in chunks:
        try:
            fits = ex.packed_rows([*packs[-1], c]) <= ex.prefill_buckets[-1]
        except ValueError:
            fits = False
        if fits:
            packs[-1].append(c)
        else:
            packs.append([c])
    return packs


def packed_prefill(ex, prompts: list[list[int]], tables) -> float | None:
    """Seconds to prefill the (one-chunk) prompts packed (pack_chunks); None where the artifact
    or the prompt length does not pack."""
    if ex.prefill_packing is None or len(prompts[0]) > ex.max_chunk:
        return None
    packs = pack_chunks(ex, [SeqChunk(p, 0, tables[i]) for i, p in enumerate(prompts)])
    if max(len(p) for p in packs) < 2:
        return None
    t = time.perf_counter()
    for p in packs:
        if len(p) > 1:
            ex.prefill_packed(p)
        else:
            ex.prefill(p[0])
    return time.perf_counter() - t


def batch_row(ex, rng, vocab: int, b: int, prompt_len: int, gen: int) -> dict:
    prompts = [rng.integers(4, vocab, prompt_len).tolist() for _ in range(b)]
    tables = [seq_tables(ex, i, prompt_len + gen + 1) for i in range(b)]
    packed_s = packed_prefill(ex, prompts, tables) if b > 1 else None
    t = time.perf_counter()
    last = first = [prefill(ex, p, tables[i]) for i, p in enumerate(prompts)]
    prefill_s = time.perf_counter() - t
    ex.decode([SeqChunk([last[i]], prompt_len, tables[i]) for i in range(b)])  # warm-up
    t = time.perf_counter()
    for step in range(gen):
        last = ex.decode([SeqChunk([last[i]], prompt_len + 1 + step, tables[i])
                          for i in range(b)])
    decode_s = time.perf_counter() - t
    loop_s = decode_loop_seconds(ex, first, prompt_len, tables, gen)
    return {"batch": b, "prompt": prompt_len, "gen": gen,
            "prefill_tok_s": b * prompt_len / prefill_s,
            "packed_prefill_tok_s": packed_s and b * prompt_len / packed_s,
            "decode_tok_s": b * gen / decode_s,
            "step_ms": decode_s / gen * 1e3,
            "loop_tok_s": b * gen / loop_s, "loop_step_ms": loop_s / gen * 1e3}


def decode_loop_seconds(ex, first: list[int], start: int, tables, gen: int) -> float:
    """The same `gen` steps from the same start (their KV written to the same slots again)
    through the device-side decode loop, as the engine runs them: calls of up to the
    artifact's loop length (decode_many), each from the last call's tokens, so no host io or
    read-back between the steps of a call."""
    last, done = first, 0
    t = time.perf_counter()
    while done < gen:
        n = min(ex.decode_loop_steps, gen - done)
        out = ex.decode_many([LoopLane(SeqChunk([last[i]], start + done, tables[i]), n,
                                       frozenset()) for i in range(len(first))])
        last, done = [row[-1] for row in out], done + n
    return time.perf_counter() - t


def context_row(ex, rng, vocab: int, at: int, gen: int) -> dict:
    """B = 1 decode steps from position `at` on, the KV positions before it not filled: a step
    reads the same `at` keys' bytes whatever they hold (a prefill of them would take minutes at
    128K), so the time is the step's at that context."""
    tables = seq_tables(ex, 0, at + gen + 1)
    token = int(rng.integers(4, vocab))
    ex.decode([SeqChunk([token], at, tables)])  # warm-up
    t = time.perf_counter()
    for step in range(gen):
        token = ex.decode([SeqChunk([token], at + 1 + step, tables)])[0]
    s = (time.perf_counter() - t) / gen
    return {"context": at, "gen": gen, "step_ms": s * 1e3, "tok_s": 1 / s}


def chunk_row(ex, rng, vocab: int, rows: int) -> dict:
    tables = seq_tables(ex, 0, rows)
    chunk = SeqChunk(rng.integers(4, vocab, rows).tolist(), 0, tables, rows=rows)
    ex.prefill(chunk)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        ex.prefill(chunk)
        times.append(time.perf_counter() - t)
    s = float(np.median(times))
    return {"rows": rows, "ms": s * 1e3, "tok_s": rows / s}


def ttft_row(m, rng, vocab: int, n: int) -> dict:
    """A fresh prompt for every call: the engine's prefix cache must find nothing."""
    ex = m.executor
    bare, engine = [], []
    for _ in range(3):
        t = time.perf_counter()
        prefill(ex, rng.integers(4, vocab, n).tolist(), seq_tables(ex, 0, n))
        bare.append(time.perf_counter() - t)
        prompt = rng.integers(4, vocab, n).tolist()
        engine.append(m.generate(prompt, max_tokens=1, ignore_eos=True).ttft_s)
    return {"prompt": n, "bare_s": float(np.median(bare)), "generate_s": float(np.median(engine))}


def engine_run(m, prompts: list[list[int]], gen: int, k: int) -> dict:
    """The prompts as greedy requests of `gen` tokens through m's engine at once, with n-gram
    speculation of k drafts (0: plain). Timed from the step after which every request has its
    first token (the prefills) to the end."""
    eng = m.engine
    spec = Speculation("ngram", k) if k else None
    ids = [f"bench-{next(_IDS)}" for _ in prompts]
    for rid, p in zip(ids, prompts, strict=True):
        eng.add(Request(rid, p, gen, Sampling(), (), True, speculation=spec))
    got: dict[str, list[int]] = {rid: [] for rid in ids}

    def step() -> None:
        for o in eng.step():
            if o.finish_reason == "error":
                raise RuntimeError(f"request {o.id} failed: {o.error}")
            got[o.id] += o.token_ids

    while not all(got.values()):
        step()
    before, t = eng.stats(), time.perf_counter()
    timed_from = sum(map(len, got.values()))
    while eng.has_work():
        step()
    s = time.perf_counter() - t
    after = eng.stats()
    new = sum(map(len, got.values())) - timed_from
    lanes = after.verify_calls - before.verify_calls
    drafted, acc = after.drafted - before.drafted, after.accepted - before.accepted
    return {"tok_s": new / s, "tokens": [got[rid] for rid in ids], "drafted": drafted,
            "accepted": acc, "verify_calls": lanes,
            # a verify call has a lane per request until requests finish: about
            "tokens_per_lane": new / (lanes * len(prompts)) if lanes else 0.0}


def spec_row(m, prompts: list[list[int]], gen: int, k: int) -> dict:
    """Plain against n-gram speculation on the same prompts; prints the row."""
    plain, spec = engine_run(m, prompts, gen, 0), engine_run(m, prompts, gen, k)
    row = {"batch": len(prompts), "prompt": len(prompts[0]), "gen": gen, "k": k,
           "plain_tok_s": plain["tok_s"], "ngram_tok_s": spec["tok_s"],
           "speedup": spec["tok_s"] / plain["tok_s"], "drafted": spec["drafted"],
           "accepted": spec["accepted"],
           "accept_rate": spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0,
           "verify_calls": spec["verify_calls"], "tokens_per_lane": spec["tokens_per_lane"],
           "same_tokens": plain["tokens"] == spec["tokens"]}
    print(f"B={row['batch']} K={k}: plain {row['plain_tok_s']:.1f} tok/s, n-gram "
          f"{row['ngram_tok_s']:.1f} tok/s ({row['speedup']:.2f}x); accepted "
          f"{row['accepted']}/{row['drafted']} drafts ({row['accept_rate']:.0%}), "
          f"{row['tokens_per_lane']:.2f} tokens per verify lane; same tokens: "
          f"{'yes' if row['same_tokens'] else 'NO'}", flush=True)
    return row


def verify_cost(ex, rng, vocab: int, b: int, at: int) -> dict:
    """ms of one verify call of b lanes of k + 1 rows each, for k = 0 .. K."""
    tables = [seq_tables(ex, i, at + ex.max_draft_tokens + 1) for i in range(b)]
    out = {}
    for k in range(ex.max_draft_tokens + 1):
        lanes = [SeqChunk(rng.integers(4, vocab, k + 1).tolist(), at, tables[i])
                 for i in range(b)]
        ex.verify(lanes)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            ex.verify(lanes)
            times.append(time.perf_counter() - t)
        out[k] = float(np.median(times)) * 1e3
    print(f"verify ms at B={b}, k = 0..{ex.max_draft_tokens} drafts a lane: "
          + ", ".join(f"{ms:.2f}" for ms in out.values())
          + f" (k/0: {', '.join(f'{ms / out[0]:.2f}' for ms in out.values())})", flush=True)
    return {"batch": b, "ms": out}


def spec_prompts(m, rng, vocab: int, b: int, n: int, period: int,
                 text: str | None) -> list[list[int]]:
    if text is None:
        return [np.resize(rng.integers(4, vocab, period), n).tolist() for _ in range(b)]
    ids = m.encode(text)
    if len(ids) < b * n:
        raise SystemExit(f"--text: {len(ids)} tokens, fewer than {b} prompts of {n}")
    return [ids[i * n:(i + 1) * n] for i in range(b)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--batch", default="1,2,4,8,16,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=0, help="also time one chunk of this many rows")
    ap.add_argument("--ttft", type=int, default=0, help="also time a prompt of this many tokens")
    ap.add_argument("--decode-at", default="",
                    help="also time B = 1 decode steps at these contexts (comma-separated; the "
                         "KV before them not filled, the same reads)")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="plain against n-gram speculation of K drafts, through the engine")
    ap.add_argument("--period", type=int, default=16,
                    help="--speculative: the repeated block of the random prompts")
    ap.add_argument("--text", help="--speculative: prompts from this text file instead")
    ap.add_argument("--json")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="the GPU memory share of the model and its KV pools (default 0.90)")
    args = ap.parse_args()
    t = time.perf_counter()
    m = runtime.load(args.artifact, verify=False,
                     gpu_memory_utilization=args.gpu_memory_utilization)
    ex = m.executor
    vocab = m.manifest["model"]["config"]["vocab_size"]
    rng = np.random.default_rng(0)
    result = {"artifact": args.artifact, "load_s": time.perf_counter() - t,
              "decode_buckets": list(ex.decode_buckets),
              "prefill_buckets": list(ex.prefill_buckets),
              "kv_blocks": {k.name: k.num_blocks for k in ex.kinds.values()}, "batches": []}
    print(f"load {result['load_s']:.1f} s; decode buckets {ex.decode_buckets}, prefill buckets "
          f"{ex.prefill_buckets}; KV blocks "
          + ", ".join(f"{n} {k}" for k, n in result["kv_blocks"].items()))
    batches = [int(x) for x in args.batch.split(",")]
    if args.speculative:
        text = None if args.text is None else open(args.text).read()
        result["speculative"] = [
            spec_row(m, spec_prompts(m, rng, vocab, b, args.prompt, args.period, text),
                     args.gen, args.speculative) for b in batches]
        result["verify_ms"] = [verify_cost(ex, rng, vocab, b, args.prompt) for b in batches]
    else:
        print(f"{'B':>4} {'prefill tok/s':>14} {'packed':>8} {'decode tok/s':>13} "
              f"{'step ms':>8} {'loop tok/s':>11} {'loop ms':>8}", flush=True)
        for b in batches:
            why = fits(ex, b, args.prompt + args.gen + 1)
            if why:
                print(f"{b:>4} skipped: {why}", flush=True)
                result["batches"].append({"batch": b, "skipped": why})
                continue
            row = batch_row(ex, rng, vocab, b, args.prompt, args.gen)
            result["batches"].append(row)
            packed = row["packed_prefill_tok_s"]
            print(f"{b:>4} {row['prefill_tok_s']:14.0f} "
                  f"{'-' if packed is None else f'{packed:.0f}':>8} "
                  f"{row['decode_tok_s']:13.1f} {row['step_ms']:8.2f} "
                  f"{row['loop_tok_s']:11.1f} {row['loop_step_ms']:8.2f}", flush=True)
    if args.chunk:
        result["chunk"] = row = chunk_row(ex, rng, vocab, args.chunk)
        print(f"prefill chunk of {row['rows']} rows: {row['ms']:.2f} ms = {row['tok_s']:.0f} "
              "tok/s", flush=True)
    if args.ttft:
        result["ttft"] = row = ttft_row(m, rng, vocab, args.ttft)
        print(f"TTFT of {row['prompt']} tokens at B = 1: bare executor {row['bare_s'] * 1e3:.1f} "
              f"ms, Model.generate {row['generate_s'] * 1e3:.1f} ms", flush=True)
    if args.decode_at:
        result["decode_at"] = []
        for at in (int(x) for x in args.decode_at.split(",")):
            row = context_row(ex, rng, vocab, at, args.gen)
            result["decode_at"].append(row)
            print(f"decode at context {at}: {row['step_ms']:.2f} ms a step = "
                  f"{row['tok_s']:.1f} tok/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
