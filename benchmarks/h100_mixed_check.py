"""Mixed calls on a real artifact (kernel_schedule's mixed_{P}_{B} entries): the promise that
packed prompt chunks and decode lanes compute bit for bit in one mixed call what they compute in
their own two calls (prefill_packed, decode), checked at the artifact's own shapes
(tests/test_h100_mixed.py checks it on a tiny build), and the time of each way.

    python benchmarks/h100_mixed_check.py ART [--lanes 64,256] [--prompts 2] [--prompt 128]
        [--context 128] [--json OUT]

Per lane count B: --prompts sequences of --prompt random tokens (packed, one chunk each) and B
decode lanes at position --context over their own blocks, seeded sampling at temperature 1 (a
changed logit bit can change the sample). Apart: prefill_packed, then decode; mixed: one
prefill_decode. The sampled tokens and the bytes of every block the chunks and lanes name (all
pools) must be equal. Prints and writes the timings (median of 5) and the verdict; exits 1 on a
difference.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from h100_packed_check import blocks_bytes, timed  # benchmarks/h100_packed_check.py

from rvcompile import runtime
from rvcompile.artifacts import ArtifactError
from rvcompile.runtime.executor_api import Sampling, SeqChunk


def tables(ex, first: int, blocks: int) -> dict[str, list[int]]:
    """Block tables over `blocks` blocks from `first` on (a ring's later entries repeat the
    last: nothing reads them)."""
    return {k.name: [first + min(j, blocks - 1) for j in range(k.table_width)]
            for k in ex.kinds.values()}


def check(ex, rng, lanes: int, prompts: int, prompt: int, context: int) -> dict:
    vocab = ex.schedule.vocab_size
    per_prompt = -(-prompt // ex.block_size)
    per_lane = -(-(context + 1) // ex.block_size)
    chunks = [SeqChunk(rng.integers(4, vocab, prompt).tolist(), 0,
                       tables(ex, i * per_prompt, per_prompt), Sampling(1.0, 0, 1.0, 100 + i), 0)
              for i in range(prompts)]
    base = prompts * per_prompt
    decode = [SeqChunk([int(rng.integers(4, vocab))], context,
                       tables(ex, base + i * per_lane, per_lane),
                       Sampling(1.0, 0, 1.0, 1000 + i), context) for i in range(lanes)]
    every = [*chunks, *decode]
    apart, apart_s = timed(lambda: (ex.prefill_packed(chunks), ex.decode(decode)), 5)
    kv_apart = blocks_bytes(ex, every)
    _, decode_s = timed(lambda: ex.decode(decode), 5)
    mixed, mixed_s = timed(lambda: ex.prefill_decode(chunks, decode), 5)
    kv_mixed = blocks_bytes(ex, every)
    p, b = ex.mixed_entry(chunks, lanes)
    return {"lanes": lanes, "prompts": prompts, "prompt": prompt, "context": context,
            "entry": f"mixed_{p}_{b}", "tokens_equal": list(mixed) == list(apart),
            "kv_equal": kv_mixed == kv_apart, "kv_bytes_compared": len(kv_apart),
            "apart_s": apart_s, "decode_s": decode_s, "mixed_s": mixed_s,
            "mixed_over_decode": mixed_s / decode_s, "saved_s": apart_s - mixed_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--lanes", default="64,256")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        lanes = [int(x) for x in args.lanes.split(",")]
    except ValueError:
        lanes = []
    if not lanes or min(lanes) < 1 or args.prompts < 1 or args.prompt < 1 or args.context < 1:
        print(f"--lanes must be positive integers (comma-separated; got {args.lanes!r}) and "
              "--prompts, --prompt and --context at least 1", file=sys.stderr)
        return 2
    try:
        m = runtime.load(args.artifact, verify=False)
    except ArtifactError as e:  # unreadable, or no GPU here
        print(f"error: {e}", file=sys.stderr)
        return 2
    ex = m.executor
    if not ex.mixed_shapes:
        print("this artifact has no mixed entries", file=sys.stderr)
        return 2
    if not (args.prompt <= ex.max_chunk and args.context < ex.max_context
            and max(lanes) <= ex.max_seqs):
        print(f"--prompt must be 1..{ex.max_chunk}, --context 1..{ex.max_context - 1} and "
              f"--lanes 1..{ex.max_seqs}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    results = []
    for b in lanes:
        probe = [SeqChunk([0] * args.prompt, 0, tables(ex, 0, 1), Sampling(), 0)] * args.prompts
        if not ex.mixes(probe, b):
            print(f"no mixed entry takes {args.prompts} x {args.prompt} tokens and {b} lanes",
                  file=sys.stderr)
            return 2
        results.append(check(ex, rng, b, args.prompts, args.prompt, args.context))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["tokens_equal"] and r["kv_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
