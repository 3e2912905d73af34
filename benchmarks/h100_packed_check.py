"""Packed prefill on a real artifact (kernel_schedule.PrefillPacking): the promise that a chunk's
rows compute bit for bit the same alone, in a wider entry and packed with others, checked at the
artifact's own shapes (tests/test_h100_packed_prefill.py checks it on a tiny build), and the
time of each way.

    python benchmarks/h100_packed_check.py ART [--prompts 8] [--prompt 128] [--json OUT]

--prompts sequences of --prompt random tokens (one chunk each), seeded sampling at temperature 1
(a changed logit bit can change the sample): each prefilled alone, then again alone in the
largest prefill entry, then all packed (as many calls as the engine's packing makes); the sampled
tokens and the KV bytes of every sequence's blocks (all pools) must be equal. Prints and writes
the timings (median of 3) and the verdict; exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import numpy as np
from h100_batch import pack_chunks  # benchmarks/h100_batch.py

from rvcompile import runtime
from rvcompile.artifacts import ArtifactError
from rvcompile.runtime.executor_api import Sampling, SeqChunk


def blocks_bytes(ex, chunks: list[SeqChunk]) -> bytes:
    """The bytes of every block the chunks' tables name, pool by pool."""
    s = ex.schedule
    offsets, _ = s.pool_offsets(ex.device.kv_blocks)
    out = []
    for pool, base in zip(s.kv.pools, offsets, strict=True):
        for c in chunks:
            for b in sorted(set(c.tables[pool.kind])):
                out.append(ex.device.read(base + b * pool.block_bytes, pool.block_bytes))
    return b"".join(out)


def timed(fn, runs: int = 3) -> tuple[object, float]:
    """fn's last result and its median wall time over `runs` runs."""
    times, got = [], None
    for _ in range(runs):
        t = time.perf_counter()
        got = fn()
        times.append(time.perf_counter() - t)
    return got, statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        m = runtime.load(args.artifact, verify=False)
    except ArtifactError as e:  # unreadable, or no GPU here
        print(f"error: {e}", file=sys.stderr)
        return 2
    ex = m.executor
    if ex.prefill_packing is None:
        print("this artifact does not pack prefill chunks", file=sys.stderr)
        return 2
    if (not 0 < args.prompt <= ex.max_chunk or not 1 < args.prompts <= ex.max_seqs
            or any(args.prompts * -(-args.prompt // ex.block_size) > k.num_blocks
                   for k in ex.kinds.values())):
        print(f"--prompt must be 1..{ex.max_chunk} and --prompts 2..{ex.max_seqs}, their "
              "blocks within the pools", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    vocab = ex.schedule.vocab_size
    blocks = -(-args.prompt // ex.block_size)
    chunks = []
    for i in range(args.prompts):
        tables = {k.name: [i * blocks + min(j, blocks - 1) for j in range(k.table_width)]
                  for k in ex.kinds.values()}
        chunks.append(SeqChunk(rng.integers(4, vocab, args.prompt).tolist(), 0, tables,
                               Sampling(1.0, 0, 1.0, 100 + i), 0))
    alone, alone_s = timed(lambda: [ex.prefill(c) for c in chunks])
    kv_alone = blocks_bytes(ex, chunks)
    widest = ex.prefill_buckets[-1]
    wide, wide_s = timed(lambda: [ex.prefill(dataclasses.replace(c, rows=widest))
                                  for c in chunks])
    kv_wide = blocks_bytes(ex, chunks)
    calls = pack_chunks(ex, chunks)
    packed, packed_s = timed(lambda: [t for p in calls for t in (
        ex.prefill_packed(p) if len(p) > 1 else [ex.prefill(p[0])])])
    kv_packed = blocks_bytes(ex, chunks)
    same = alone == wide == packed and kv_alone == kv_wide == kv_packed
    tokens = args.prompts * args.prompt
    result = {"prompts": args.prompts, "prompt": args.prompt, "calls_packed": len(calls),
              "widest": widest, "packing": dataclasses.asdict(ex.prefill_packing),
              "tokens_equal": alone == wide == packed, "kv_equal": kv_alone == kv_wide == kv_packed,
              "kv_bytes_compared": len(kv_alone),
              "alone_s": alone_s, "wide_s": wide_s, "packed_s": packed_s,
              "alone_tok_s": tokens / alone_s, "wide_tok_s": tokens / wide_s,
              "packed_tok_s": tokens / packed_s}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
