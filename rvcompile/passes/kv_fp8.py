"""FP8 KV cache, the h100-fp8 build option `--kv-cache fp8`. Expects a ModelIR with float KV
caches. Guarantees: every CacheSpec and every cache ARG is "float8_e4m3fn" (IR semantics in
ir/ops.py: KV_WRITE rounds each value once, from float32, to the nearest e4m3, saturating at
+-448; readers widen exactly); nothing else changes. The H100 pools halve in bytes.

Scale: none (unit). Every value the caches hold is RMS-normalised per (token, KV head): V and
K=V layers' bases are rmsnorm(x) with no weight, so |x_i| <= sqrt(D) (22.6 at D = 512, all
energy in one dim), and K is rope(rmsnorm(k) * k_norm weight), bounded by sqrt(D) * max|w|;
e4m3 reaches 448, so a k_norm weight would have to exceed ~19 before anything saturates. On
the oracle configs (dense, k_eq_v, kv_shared, ple, moe; 4 x 40 tokens, every layer) the
measured amax is 1.7-1.8 for K and 3.7-4.3 for V (rms 0.38 and 1), and 2.3% of the values lie
below e4m3's smallest normal 2^-6, where the step is 2^-9 (an absolute error under 1e-3 of a
unit-rms row). A per-token scale would buy nothing over this range and cost a read per row.
"""

from __future__ import annotations

from rvcompile.ir.graph import ModelIR
from rvcompile.passes.kv_retype import retype_kv_caches

KV_DTYPE = "float8_e4m3fn"


def run(ir: ModelIR) -> ModelIR:
    return retype_kv_caches(ir, KV_DTYPE, "kv_fp8")
