"""The assistant drafter on an h100-fp8 artifact (issue 15's performance table), on the bare
executor at B = 1: what a draft token costs, what verifying k drafts costs against a decode
step, and the tok/s those give at a given accepted length.

    rvcompile build gemma-4-31B --target h100-fp8 --random-weights \\
        --assistant gemma-4-31B-assistant --num-draft-tokens 7 --max-context 2048 \\
        --max-seqs 8 --prefill-buckets 16,64,256 -o /tmp/31b-assistant.rvp
    python benchmarks/h100_assistant.py /tmp/31b-assistant.rvp [--json OUT]

Measured (median of --reps calls after a warm-up, each call as the engine makes it: io written,
the entry's CUDA graph replayed, results read back), one sequence with --prompt random tokens
prefilled:
- decode: a decode call of one lane (decode_1), the plain step;
- verify(k), k = 0 .. K (the artifact's draft_tokens): the lane's token and k drafts as one
  verify call (k + 1 rows: decode_{2,4,8} or verify_{R}); k = 0 is a decode call that also
  returns its state;
- draft: one draft call (draft_1: always K drafter steps); per token = draft / K;
- sampled verify(k), k = 1 .. K, at temperature 1 (no top_k or top_p cut: the sampler's
  widest case) on drafts a sampled draft call made: by exact match (no draft_probs) and by the
  ratio rule (the draft's draft_probs; an artifact of kernel schedule version 10): what the
  rule's spec_ratio adds (random weights reject the first draft about always, so the rule
  sums the residual over the whole vocabulary every call: its dearest path);
- with --batch B (<= max_seqs): decode, verify(k) and draft at B lanes too, and the same table
  for B lanes (the c = 8 question).
The table: tok/s at B = 1 for accepted length a (tokens a round yields, the bonus token
included: what random weights cannot show, so it is tabulated) and k drafts a round, a round
costing k draft tokens (k x the per-token cost: what an artifact built with
--num-draft-tokens k drafts) plus verify(k); and per a the best k. Then, as a check that the
path runs end to end on this model, Model.generate greedy with and without the assistant
(--gen tokens, num_draft_tokens 3): equal tokens, drafts accepted (random weights: about none),
tok/s of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import numpy as np

from rvcompile import runtime
from rvcompile.runtime.executor_api import DraftLane, Sampling, SeqChunk

ACCEPTED = (1.5, 2.0, 2.5, 3.0, 4.0)


def lane_tables(ex, i: int, tokens: int) -> dict[str, list[int]]:
    """Sequence i's block tables for `tokens` tokens: its own blocks of each kind, the unused
    tail repeating its first (never read or written)."""
    out = {}
    for k in ex.kinds.values():
        need = min(-(-tokens // ex.block_size), k.table_width)
        own = list(range(i * need, (i + 1) * need))
        out[k.name] = own + [own[0]] * (k.table_width - need)
    return out


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def prefilled(ex, rng, vocab: int, lanes: int, prompt: int, room: int):
    """`lanes` sequences of `prompt` random tokens prefilled, each with blocks for `room` more;
    per lane (tables, its last token, a state from a verify of it)."""
    out = []
    for i in range(lanes):
        tables = lane_tables(ex, i, prompt + room)
        ids = rng.integers(0, vocab, prompt).tolist()
        tok = 0
        for s in range(0, prompt, ex.max_chunk):
            tok = ex.prefill(SeqChunk(ids[s:s + ex.max_chunk], s, tables))
        out.append((tables, tok))
    verified = ex.verify([SeqChunk([tok], prompt, tables) for tables, tok in out])
    return [(tables, tok, v.states[0]) for (tables, tok), v in zip(out, verified, strict=True)]


def costs(ex, lanes, prompt: int, k_max: int, reps: int) -> dict:
    """verify(k) for k = 0..k_max and one draft call, over the given prefilled lanes (ms)."""
    verify = {}
    for k in range(k_max + 1):
        chunks = [SeqChunk([tok, *[tok] * k], prompt, tables, step=1)
                  for tables, tok, _ in lanes]
        verify[k] = median_ms(lambda c=chunks: ex.verify(c), reps)
    draft_lanes = [DraftLane(SeqChunk([tok], prompt, tables, step=1), state)
                   for tables, tok, state in lanes]
    draft = median_ms(lambda: ex.draft(draft_lanes, k_max), reps)
    out = {"verify_ms": verify, "draft_ms": draft}
    if getattr(ex, "has_ratio", False):
        sampled = [replace(d, chunk=replace(d.chunk, sampling=Sampling(1.0, 0, 1.0, i)))
                   for i, d in enumerate(draft_lanes)]
        made = ex.draft(sampled, k_max)  # its draft_probs hold until the next draft call
        for rule in ("exact", "ratio"):
            out[f"sampled_{rule}_ms"] = {k: median_ms(lambda k=k, rule=rule: ex.verify([
                replace(d.chunk, tokens=[*d.chunk.tokens, *m.tokens[:k]],
                        draft_probs=m.draft_probs if rule == "ratio" else None)
                for d, m in zip(sampled, made, strict=True)]), reps)
                for k in range(1, k_max + 1)}
    return out


def table(decode_ms: float, draft_token_ms: float, verify_ms: dict[int, float],
          lanes: int = 1) -> list[dict]:
    """Per accepted length a: tok/s of `lanes` lanes each yielding a tokens a round of k draft
    tokens plus verify(k), for every k that can yield a; the best k, and its rate over plain
    decoding's (lanes tokens a decode step)."""
    rows = []
    for a in ACCEPTED:
        rates = {k: lanes * a / ((k * draft_token_ms + verify_ms[k]) / 1e3)
                 for k in verify_ms if k >= 1 and k + 1 >= a}
        best = max(rates, key=rates.get)
        rows.append({"accepted": a, "tok_s": rates, "best_k": best, "best_tok_s": rates[best],
                     "vs_decode": rates[best] * decode_ms / 1e3 / lanes})
    return rows


def print_table(rows: list[dict], k_max: int) -> None:
    print("a     " + "".join(f"k={k:<7}" for k in range(1, k_max + 1)) + "best")
    for r in rows:
        cells = "".join(f"{r['tok_s'][k]:<9.1f}" if k in r["tok_s"] else f"{'-':<9}"
                        for k in range(1, k_max + 1))
        print(f"{r['accepted']:<5} {cells}k={r['best_k']}: {r['best_tok_s']:.1f} "
              f"({r['vs_decode']:.2f}x decode)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="also measure at this many lanes (0: no)")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args()
    t = time.perf_counter()
    m = runtime.load(args.artifact, verify=False)
    ex = m.executor
    if not ex.has_drafter:
        raise SystemExit(f"{args.artifact} has no assistant drafter (rvcompile build --assistant)")
    k_max = ex.max_draft_tokens
    vocab = m.manifest["model"]["config"]["vocab_size"]
    rng = np.random.default_rng(0)
    print(f"loaded in {time.perf_counter() - t:.1f} s; K = {k_max}, max_seqs {ex.max_seqs}")
    one = prefilled(ex, rng, vocab, 1, args.prompt, k_max + 1)
    tables, tok, _ = one[0]
    decode_ms = median_ms(lambda: ex.decode([SeqChunk([tok], args.prompt, tables, step=1)]),
                          args.reps)
    b1 = costs(ex, one, args.prompt, k_max, args.reps)
    per_token = b1["draft_ms"] / k_max
    result = {"artifact": args.artifact, "k_max": k_max, "prompt": args.prompt,
              "decode_ms": decode_ms, "b1": b1, "draft_token_ms": per_token}
    print(f"\nB = 1: decode {decode_ms:.2f} ms ({1e3 / decode_ms:.1f} tok/s); draft call "
          f"({k_max} steps) {b1['draft_ms']:.2f} ms = {per_token:.3f} ms a draft token")
    print("k   verify ms   x decode")
    for k, ms in b1["verify_ms"].items():
        print(f"{k:<3} {ms:9.2f}   {ms / decode_ms:8.3f}")
    if "sampled_ratio_ms" in b1:
        print("k   sampled verify ms: exact match   ratio rule")
        for k, ms in b1["sampled_exact_ms"].items():
            print(f"{k:<3} {ms:30.2f} {b1['sampled_ratio_ms'][k]:12.2f}")
    rows = table(decode_ms, per_token, b1["verify_ms"])
    result["table"] = rows
    print("\ntok/s at B = 1 by accepted length a (a round: k draft tokens + verify(k))")
    print_table(rows, k_max)
    if args.batch and args.batch <= ex.max_seqs:
        lanes = prefilled(ex, rng, vocab, args.batch, args.prompt, k_max + 1)
        wide = [SeqChunk([tok], args.prompt, tables, step=1) for tables, tok, _ in lanes]
        decode_b = median_ms(lambda: ex.decode(wide), args.reps)
        bb = costs(ex, lanes, args.prompt, k_max, args.reps)
        result[f"b{args.batch}"] = {"decode_ms": decode_b, **bb}
        print(f"\nB = {args.batch}: decode {decode_b:.2f} ms; draft call {bb['draft_ms']:.2f} ms; "
              "verify ms by k: " + ", ".join(f"{k}: {ms:.2f}" for k, ms in
                                            bb["verify_ms"].items()))
        wide_rows = table(decode_b, bb["draft_ms"] / k_max, bb["verify_ms"], args.batch)
        result[f"b{args.batch}"]["table"] = wide_rows
        print(f"tok/s at B = {args.batch} (every lane the same accepted length a; plain: "
              f"{args.batch * 1e3 / decode_b:.1f})")
        print_table(wide_rows, k_max)
    prompt = rng.integers(0, vocab, args.prompt).tolist()
    plain = m.generate(prompt, max_tokens=args.gen, ignore_eos=True)
    spec = m.generate(prompt, max_tokens=args.gen, ignore_eos=True, speculative="assistant",
                      num_draft_tokens=min(3, k_max))
    same = spec.token_ids == plain.token_ids
    result["generate"] = {"same_tokens": same, "drafted": spec.drafted_tokens,
                          "accepted": spec.accepted_tokens, "plain_tok_s": plain.decode_tok_s,
                          "assistant_tok_s": spec.decode_tok_s}
    print(f"\nModel.generate, {args.gen} greedy tokens: assistant = plain: {same}; accepted "
          f"{spec.accepted_tokens} of {spec.drafted_tokens} drafts; plain "
          f"{plain.decode_tok_s:.1f} tok/s, assistant {spec.decode_tok_s:.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
