"""IR-to-IR passes. Each module exposes `run(ir: ModelIR) -> ModelIR` and states what it expects
and guarantees; `weight_math` holds the per-tensor functions the build applies while streaming."""
