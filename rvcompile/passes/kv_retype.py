"""Give every KV cache of a ModelIR another stored dtype: the CacheSpecs and the cache ARGs of
every graph. What the dtype means (rounding at KV_WRITE, dequantising reads) is the IR ops'
business; the passes that call this (kv_int8, kv_fp8) say why their dtype is safe."""

from __future__ import annotations

from dataclasses import replace

from rvcompile.ir.graph import CACHE_ARGS, Graph, ModelIR, rewrite_nodes
from rvcompile.ir.ops import Op


def retype_kv_caches(ir: ModelIR, dtype: str, note: str) -> ModelIR:
    def retype(g: Graph) -> Graph:
        def rule(b, n, ins):
            if n.op is Op.ARG and n.attrs.name in CACHE_ARGS and n.dtype != dtype:
                return b.arg(n.attrs.name, n.shape, dtype)
            return None

        return rewrite_nodes(g, rule)

    caches = tuple(replace(c, dtype=dtype) for c in ir.caches)
    return replace(ir.with_graphs(retype), caches=caches, notes=(*ir.notes, note))
