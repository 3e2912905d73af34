"""Every H100 kernel entry by name: the ENTRIES each kernel module declares (contract.py).

`entry(name)` is what the lowering emits against and the reference executor runs; a name that
no module declares is a LoweringError. tests/test_h100_contract.py checks the registry against
the .cu sources: every `extern "C" __global__` function is declared here, with its parameters.
"""

from __future__ import annotations

from types import MappingProxyType

from rvcompile.targets.h100 import (
    attn_decode,
    attn_prefill,
    draft_rows,
    gelu_mul,
    gemm_fp8w,
    gemm_tc,
    gemv_bf16,
    gemv_f32,
    gemv_fp8,
    gemv_mma_fp8,
    head,
    moe,
    norms,
    ple,
    qkv_post,
    ratio,
    rows,
    sample,
    sha256,
)
from rvcompile.targets.h100.contract import Entry
from rvcompile.targets.h100.layout import LoweringError

MODULES = (attn_decode, attn_prefill, draft_rows, gelu_mul, gemm_tc, gemm_fp8w, gemv_bf16,
           gemv_f32, gemv_fp8, gemv_mma_fp8, head, moe, norms, ple, qkv_post, ratio, rows, sample,
           sha256)


def _collect() -> MappingProxyType:
    out: dict[str, Entry] = {}
    for module in MODULES:
        for e in module.ENTRIES:
            if e.name in out:
                raise ValueError(f"kernel entry {e.name} declared twice ({out[e.name].source}, "
                                 f"{e.source})")
            out[e.name] = e
    return MappingProxyType(out)


ENTRIES = _collect()


def entry(name: str) -> Entry:
    if name not in ENTRIES:
        raise LoweringError(f"no H100 kernel entry {name!r} is declared")
    return ENTRIES[name]
