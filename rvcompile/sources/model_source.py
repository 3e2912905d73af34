"""What every weight source produces, and what it must produce.

A `ModelSource` is a config, one `TensorRef` per tensor of `expected_tensors(config)`, and the
tokenizer files. A TensorRef reads one tensor on `load()` (float32, checked finite); a
pre-quantized FP8 one also gives its `Fp8Tensor` as stored through `load_stored()`; a
checkpoint's also reads a range of rows (`rows`), which is how the build streams large ones.
The sources (checkpoint.py: a Hugging Face directory; random_weights.py: `--random-weights
--seed S`) build them; the front end and the build consume them. Every error is a one-line
`CheckpointError` naming the file and/or tensor.

Tensor names are the text decoder's, without the "model." prefix ("layers.3.self_attn.q_proj.
weight"); `expected_tensors(cfg)` lists them with their shapes (shared/GEMMA4.md, "Weights").
An assistant drafter's source (`AssistantSource`, `--assistant`) holds the tensors of
`expected_assistant_tensors(config)`, named "assistant." + the checkpoint's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rvcompile.model.assistant import TENSOR_PREFIX, AssistantConfig
from rvcompile.model.config import Gemma4Config


class CheckpointError(ValueError):
    """A weight source that cannot be used; the one-line message names the file and/or tensor."""


@dataclass(frozen=True)
class Fp8Tensor:
    """A pre-quantized checkpoint matrix as stored: the weight is values * scales[:, None]."""

    values: np.ndarray  # float8_e4m3fn [N, K], the checkpoint's bytes
    scales: np.ndarray  # float32 [N], one per output row (a per-tensor scale repeated)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: each e4m3 value (exact in float32) times its row's scale."""
        return self.values.astype(np.float32) * self.scales[:, None]


@dataclass(frozen=True)
class TensorRef:
    """One decoder tensor, read on demand."""

    name: str  # canonical, without "model.": "layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    source_dtype: str  # "bfloat16" | "float16" | "float32" | "float8_e4m3fn" (pre-quantized)
    origin: str  # file path, or "random(seed=S)"
    # Returns the float32 C-contiguous array; picklable (a functools.partial of a module function).
    reader: Callable[[], np.ndarray] = field(repr=False, compare=False)
    # Pre-quantized FP8 tensors only: returns the Fp8Tensor as stored (`reader` dequantizes it).
    fp8_reader: Callable[[], Fp8Tensor] | None = field(default=None, repr=False, compare=False)
    # (first, stop) -> rows [first, stop) of what load_stored() returns, the tensor seen as
    # [prod(shape[:-1]), shape[-1]] (float32 rows, or an Fp8Tensor's rows and their scales), so
    # the build streams a large tensor in blocks; None where only the whole tensor is read.
    rows: Callable[[int, int], np.ndarray | Fp8Tensor] | None = field(
        default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def load(self) -> np.ndarray:
        """float32, C-contiguous, `shape`; CheckpointError (naming origin and tensor) on NaN/Inf."""
        return self.reader()

    def load_stored(self) -> np.ndarray | Fp8Tensor:
        """What the build encodes: a pre-quantized tensor's Fp8Tensor as stored, else load()."""
        return self.load() if self.fp8_reader is None else self.fp8_reader()


@dataclass(frozen=True)
class ModelSource:
    config: Gemma4Config
    tensors: tuple[TensorRef, ...]  # exactly expected_tensors(config), file by file, by offset
    tokenizer_json: str  # tokenizer.json text
    generation_config: dict[str, Any]  # bos_token_id, eos_token_id (a list), pad_token_id, ...
    chat_template: str | None  # jinja text
    origin: str  # preset name or directory


def expected_tensors(cfg: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every stored text-decoder tensor, in model order."""
    H, L, P = cfg.hidden_size, cfg.num_layers, cfg.hidden_size_per_layer_input
    nh = cfg.num_heads
    t: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, H)}
    if cfg.ple:
        t["embed_tokens_per_layer.weight"] = (cfg.vocab_size_per_layer_input, L * P)
        t["per_layer_model_projection.weight"] = (L * P, H)
        t["per_layer_projection_norm.weight"] = (P,)
    for s in cfg.layers:
        p = f"layers.{s.index}."
        d, kd = s.head_dim, s.num_kv_heads * s.head_dim
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            t[p + norm + ".weight"] = (H,)
        t[p + "layer_scalar"] = (1,)
        t[p + "self_attn.q_proj.weight"] = (nh * d, H)
        t[p + "self_attn.q_norm.weight"] = (d,)
        t[p + "self_attn.o_proj.weight"] = (H, nh * d)
        if not s.kv_shared:
            t[p + "self_attn.k_proj.weight"] = (kd, H)
            t[p + "self_attn.k_norm.weight"] = (d,)
            if not s.k_eq_v:
                t[p + "self_attn.v_proj.weight"] = (kd, H)
        t[p + "mlp.gate_proj.weight"] = (s.mlp_width, H)
        t[p + "mlp.up_proj.weight"] = (s.mlp_width, H)
        t[p + "mlp.down_proj.weight"] = (H, s.mlp_width)
        if s.moe:
            E, Im = cfg.num_experts, cfg.moe_intermediate_size
            t[p + "router.proj.weight"] = (E, H)
            t[p + "router.scale"] = (H,)
            t[p + "router.per_expert_scale"] = (E,)
            t[p + "experts.gate_up_proj"] = (E, 2 * Im, H)
            t[p + "experts.down_proj"] = (E, H, Im)
            for norm in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                         "post_feedforward_layernorm_2"):
                t[p + norm + ".weight"] = (H,)
        if cfg.ple:
            t[p + "per_layer_input_gate.weight"] = (P, H)
            t[p + "per_layer_projection.weight"] = (H, P)
            t[p + "post_per_layer_input_norm.weight"] = (H,)
    t["norm.weight"] = (H,)
    return t


@dataclass(frozen=True)
class AssistantSource:
    config: AssistantConfig
    tensors: tuple[TensorRef, ...]  # exactly expected_assistant_tensors(config), "assistant.*"
    origin: str  # assistant preset name or directory


TOKEN_ORDERING = TENSOR_PREFIX + "masked_embedding.token_ordering"


def expected_assistant_tensors(a: AssistantConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name ("assistant." + the checkpoint's name without "model.") -> shape of every
    stored assistant tensor. Its layers have no k/v weights (they read the target's caches);
    `lm_head.weight` is tied to embed_tokens and skipped like a target's."""
    d, hb, v = a.hidden_size, a.backbone_hidden_size, a.vocab_size
    p = TENSOR_PREFIX
    t: dict[str, tuple[int, ...]] = {p + "embed_tokens.weight": (v, d)}
    for s in a.text.layers:
        lp = f"{p}layers.{s.index}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            t[lp + norm + ".weight"] = (d,)
        t[lp + "layer_scalar"] = (1,)
        t[lp + "self_attn.q_proj.weight"] = (a.text.num_heads * s.head_dim, d)
        t[lp + "self_attn.q_norm.weight"] = (s.head_dim,)
        t[lp + "self_attn.o_proj.weight"] = (d, a.text.num_heads * s.head_dim)
        t[lp + "mlp.gate_proj.weight"] = (s.mlp_width, d)
        t[lp + "mlp.up_proj.weight"] = (s.mlp_width, d)
        t[lp + "mlp.down_proj.weight"] = (d, s.mlp_width)
    t[p + "norm.weight"] = (d,)
    t[p + "pre_projection.weight"] = (d, 2 * hb)
    t[p + "post_projection.weight"] = (hb, d)
    if a.use_ordered_embeddings:
        t[p + "masked_embedding.centroids.weight"] = (a.num_centroids, d)
        t[TOKEN_ORDERING] = (v,)
    return t
