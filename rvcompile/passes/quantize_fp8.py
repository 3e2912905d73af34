"""FP8 weight quantization (h100-fp8): every LINEAR weight except the router and the tied
embedding/head, and MoE expert stacks, to e4m3 with a float32 scale per output row, amax/448
(see quantize_per_channel). The embedding table and the tied head keep their dtype, as issue 3
asks until a measured quality check says otherwise."""

from __future__ import annotations

from rvcompile.ir.graph import ModelIR
from rvcompile.passes.quantize_per_channel import QuantFormat, quantize

FP8 = QuantFormat("quantize_fp8", "float8_e4m3fn", "fp8")


def run(ir: ModelIR) -> ModelIR:
    return quantize(ir, FP8, embeddings=False)
