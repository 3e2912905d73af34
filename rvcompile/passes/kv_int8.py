"""int8 KV cache, the long-context option (`--kv-cache int8`). Expects a ModelIR with float KV
caches. Guarantees: every CacheSpec and every cache ARG is "int8" (IR semantics in ir/ops.py:
KV_WRITE stores each row, one token and one KV head, as int8 values times a float32 scale of
amax / 127, and readers see the dequantised rows); nothing else changes. Sliding layers keep
their window-sized rings, in int8 too: one cache dtype per model.

Why: at 128K tokens the global layers' KV dominates what a sequence costs. The gemma-4-31B at
max_context 131072 on a v6e-4 (4 chips x 32 GiB, TP=4, KV pools split by KV head; sliding
layers 16 KV heads of 256, full layers K=V with 4 KV heads of 512), per chip:
- weights (tpu-int8): 28.6 GiB in all, of which the embedding table is 1.31 GiB. Counting it
  whole on every chip and the rest split 4 ways: 27.3 / 4 + 1.31 = 8.14 GiB.
- KV of one 128K sequence: full layers 10 x 131072 slots x 4 heads x 512 B = 2.50 GiB + scales
  (4 B per slot and head) 0.02 GiB; sliding rings 50 x 2 (K, V) x 1296 slots x 16 x 256 B =
  0.49 GiB + scales 0.01 GiB; 3.02 GiB in all, 0.76 GiB per chip (bf16: 1.50 GiB per chip).
- so weights + 4 sequences at 128K (the default decode width) take 8.14 + 3.03 = 11.2 GiB of
  32 GiB per chip; 31 sequences fit before the KV alone passes the 23.9 GiB left (bf16: 15).
tests/test_kv_int8.py recomputes these figures from the IR and the XLA pool layout.
"""

from __future__ import annotations

from rvcompile.ir.graph import ModelIR
from rvcompile.passes.kv_retype import retype_kv_caches

KV_DTYPE = "int8"


def run(ir: ModelIR) -> ModelIR:
    return retype_kv_caches(ir, KV_DTYPE, "kv_int8")
