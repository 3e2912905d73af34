"""int8 weight quantization (tpu-int8): every matrix, embedding tables included, to int8 with a
float32 scale per output row, amax/127 (see quantize_per_channel for the exact guarantees)."""

from __future__ import annotations

from rvcompile.ir.graph import ModelIR
from rvcompile.passes.quantize_per_channel import QuantFormat, quantize

INT8 = QuantFormat("quantize_int8", "int8", "int8")


def run(ir: ModelIR) -> ModelIR:
    return quantize(ir, INT8, embeddings=True)
