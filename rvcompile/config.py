"""Gemma 4 text-decoder configuration: one frozen dataclass, per-layer variation as data.

`Gemma4Config` holds the model-level numbers; `cfg.layers` derives one `LayerSpec` per decoder
layer (attention kind, head dim, KV heads, K=V, which layer's KV cache it reads, MLP width).
`Gemma4Config.from_hf_dict` reads both config.json forms (Hub files with `global_head_dim` /
`num_global_key_value_heads`, transformers' `save_pretrained` with `per_layer_config`) and the
multimodal wrapper (`text_config`). Errors are `ConfigError` with one line naming the field.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

SUPPORTED_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified")


class ConfigError(ValueError):
    """A config that cannot describe a Gemma 4 decoder; the message names the field."""


class AttnKind(enum.Enum):
    SLIDING = "sliding_attention"
    FULL = "full_attention"


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_fraction: float = 1.0  # "proportional" RoPE rotates only this fraction of the angles
    factor: float = 1.0  # inverse frequencies are divided by this

    def inv_freq(self, head_dim: int) -> list[float]:
        """Inverse frequencies for the half-split layout: head_dim // 2 of them, the rest zero."""
        n_rot = int(self.rotary_fraction * head_dim // 2)
        freqs = [1.0 / (self.theta ** (2 * j / head_dim)) / self.factor for j in range(n_rot)]
        return freqs + [0.0] * (head_dim // 2 - n_rot)


@dataclass(frozen=True)
class LayerSpec:
    """Everything that varies between decoder layers, derived once from the config."""

    index: int
    kind: AttnKind
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool  # K and V come from k_proj; the cache stores the shared normalized tensor once
    kv_source: int  # layer whose K/V this layer attends to (itself unless KV-shared)
    mlp_width: int
    window: int | None  # sliding window in keys (including the query itself); None = full
    rope: RopeSpec
    moe: bool

    @property
    def kv_shared(self) -> bool:
        return self.kv_source != self.index


@dataclass(frozen=True)
class Gemma4Config:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_kinds: tuple[AttnKind, ...]
    head_dim: int  # sliding layers
    global_head_dim: int  # full layers
    num_kv_heads: int  # sliding layers (and full layers unless K=V sets its own count)
    num_global_kv_heads: int | None  # full layers when attention_k_eq_v
    attention_k_eq_v: bool
    intermediate_size: int
    use_double_wide_mlp: bool
    hidden_size_per_layer_input: int  # P; 0 = no per-layer embeddings
    vocab_size_per_layer_input: int
    num_kv_shared_layers: int
    sliding_window: int
    max_position_embeddings: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    rope_sliding: RopeSpec
    rope_full: RopeSpec
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    # Per-layer overrides from transformers' `per_layer_config` (layer index -> field -> value).
    layer_overrides: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = field(default=())

    def __post_init__(self) -> None:
        if len(self.layer_kinds) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_kinds)} entries but num_hidden_layers is "
                f"{self.num_layers}"
            )
        if self.layer_kinds[-1] is not AttnKind.FULL:
            raise ConfigError("layer_types: the last layer must be full_attention")
        if self.hidden_size_per_layer_input < 0:
            raise ConfigError("hidden_size_per_layer_input must be >= 0")
        if self.enable_moe_block and not (
            self.num_experts > 0 and 0 < self.top_k_experts <= self.num_experts
            and self.moe_intermediate_size > 0
        ):
            raise ConfigError(
                "enable_moe_block needs num_experts > 0, 0 < top_k_experts <= num_experts and "
                "moe_intermediate_size > 0"
            )
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ConfigError("num_kv_shared_layers must be in [0, num_hidden_layers)")
        for spec in self.layers:
            if self.num_heads % spec.num_kv_heads:
                raise ConfigError(
                    f"layer {spec.index}: num_attention_heads {self.num_heads} is not a multiple "
                    f"of its {spec.num_kv_heads} KV heads"
                )
            if spec.head_dim % 2:
                raise ConfigError(f"layer {spec.index}: head_dim {spec.head_dim} must be even")

    @cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        overrides = {i: dict(kv) for i, kv in self.layer_overrides}
        first_shared = self.num_layers - self.num_kv_shared_layers
        producers: dict[AttnKind, int] = {}
        for i in range(first_shared):
            producers[self.layer_kinds[i]] = i  # the last non-shared layer of each kind
        specs = []
        for i, kind in enumerate(self.layer_kinds):
            full = kind is AttnKind.FULL
            head_dim = self.global_head_dim if full else self.head_dim
            kv_heads = self.num_kv_heads
            if full and self.attention_k_eq_v and self.num_global_kv_heads:
                kv_heads = self.num_global_kv_heads
            head_dim = overrides.get(i, {}).get("head_dim", head_dim)
            kv_heads = overrides.get(i, {}).get("num_key_value_heads", kv_heads)
            shared = i >= first_shared
            if shared and kind not in producers:
                raise ConfigError(
                    f"num_kv_shared_layers: KV-shared layer {i} ({kind.value}) has no earlier "
                    "non-shared layer of its type to read from"
                )
            source = producers[kind] if shared else i
            width = self.intermediate_size * (2 if shared and self.use_double_wide_mlp else 1)
            specs.append(LayerSpec(
                index=i, kind=kind, head_dim=head_dim, num_kv_heads=kv_heads,
                k_eq_v=self.attention_k_eq_v and full, kv_source=source, mlp_width=width,
                window=None if full else self.sliding_window,
                rope=self.rope_full if full else self.rope_sliding, moe=self.enable_moe_block,
            ))
        for spec in specs:  # a shared layer must match its producer's cache layout
            src = specs[spec.kv_source]
            if (spec.head_dim, spec.num_kv_heads, spec.k_eq_v) != (
                src.head_dim, src.num_kv_heads, src.k_eq_v
            ):
                raise ConfigError(
                    f"layer {spec.index} shares layer {src.index}'s KV cache but their head_dim/"
                    "KV heads differ"
                )
        return tuple(specs)

    @property
    def ple(self) -> bool:
        return self.hidden_size_per_layer_input > 0

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    @property
    def pattern_period(self) -> int:
        """Layers per (nS, F) period: the distance from the start to the first full layer + 1."""
        return self.layer_kinds.index(AttnKind.FULL) + 1

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a Hub text checkpoint would carry (round-trips through from_hf_dict)."""
        d: dict[str, Any] = {
            "model_type": "gemma4_text",
            "architectures": ["Gemma4ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "global_head_dim": self.global_head_dim,
            "num_global_key_value_heads": self.num_global_kv_heads,
            "attention_k_eq_v": self.attention_k_eq_v,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "sliding_window": self.sliding_window,
            "layer_types": [k.value for k in self.layer_kinds],
            "final_logit_softcapping": self.final_logit_softcapping,
            "hidden_size_per_layer_input": self.hidden_size_per_layer_input,
            "vocab_size_per_layer_input": self.vocab_size_per_layer_input,
            "num_kv_shared_layers": self.num_kv_shared_layers,
            "use_double_wide_mlp": self.use_double_wide_mlp,
            "enable_moe_block": self.enable_moe_block,
            "num_experts": self.num_experts or None,
            "top_k_experts": self.top_k_experts or None,
            "moe_intermediate_size": self.moe_intermediate_size or None,
            "tie_word_embeddings": True,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "rope_parameters": {
                "sliding_attention": _rope_to_hf(self.rope_sliding, "default"),
                "full_attention": _rope_to_hf(self.rope_full, "proportional"),
            },
        }
        if self.layer_overrides:
            d["per_layer_config"] = {str(i): dict(kv) for i, kv in self.layer_overrides}
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "checkpoint",
                     source: str = "config.json") -> Gemma4Config:
        """Parse a Hugging Face Gemma 4 config dict; `source` names the file in errors."""
        d = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
        model_type = d.get("model_type", raw.get("model_type"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not a Gemma 4 decoder "
                f"(expected one of {', '.join(SUPPORTED_MODEL_TYPES)})"
            )

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            return d[key]

        num_layers = int(need("num_hidden_layers"))
        layer_types = d.get("layer_types")
        if layer_types is None:
            layer_types = [
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                for i in range(num_layers)
            ]
        try:
            kinds = tuple(AttnKind(t) for t in layer_types)
        except ValueError as e:
            raise ConfigError(f"{source}: layer_types: {e}") from None
        k_eq_v = bool(d.get("attention_k_eq_v", False))
        overrides: list[tuple[int, tuple[tuple[str, int], ...]]] = []
        per_layer = d.get("per_layer_config")
        global_head_dim = d.get("global_head_dim")
        global_kv = d.get("num_global_key_value_heads") if k_eq_v else None
        if isinstance(per_layer, dict) and per_layer:
            for key, val in sorted(per_layer.items(), key=lambda kv: int(kv[0])):
                fields = tuple(sorted(
                    (k, int(v)) for k, v in val.items()
                    if k in ("head_dim", "num_key_value_heads")
                ))
                overrides.append((int(key), fields))
            full_ids = [i for i, k in enumerate(kinds) if k is AttnKind.FULL]
            if not full_ids:
                raise ConfigError(f"{source}: layer_types has no full_attention layer")
            first_full = dict(dict(overrides).get(full_ids[0], ()))
            global_head_dim = global_head_dim or first_full.get("head_dim")
        head_dim = int(need("head_dim"))
        if d.get("tie_word_embeddings", True) is False:
            raise ConfigError(f"{source}: tie_word_embeddings is false; Gemma 4 ties the head to "
                              "the embedding and rvcompile supports only that")
        rope = d.get("rope_parameters") or {}
        eos = d.get("eos_token_id", 1)
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
        moe = bool(d.get("enable_moe_block", False))
        try:
            return cls(
                name=name,
                vocab_size=int(need("vocab_size")),
                hidden_size=int(need("hidden_size")),
                num_layers=num_layers,
                num_heads=int(need("num_attention_heads")),
                layer_kinds=kinds,
                head_dim=head_dim,
                global_head_dim=int(global_head_dim or 512),
                num_kv_heads=int(need("num_key_value_heads")),
                num_global_kv_heads=int(global_kv) if global_kv else None,
                attention_k_eq_v=k_eq_v,
                intermediate_size=int(need("intermediate_size")),
                use_double_wide_mlp=bool(d.get("use_double_wide_mlp", False)),
                hidden_size_per_layer_input=int(d.get("hidden_size_per_layer_input") or 0),
                vocab_size_per_layer_input=int(
                    d.get("vocab_size_per_layer_input") or d["vocab_size"]
                ),
                num_kv_shared_layers=int(d.get("num_kv_shared_layers") or 0),
                sliding_window=int(need("sliding_window")),
                max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                final_logit_softcapping=d.get("final_logit_softcapping"),
                rope_sliding=_rope_from_hf(rope.get("sliding_attention"), 1e4, source),
                rope_full=_rope_from_hf(rope.get("full_attention"), 1e6, source, 0.25),
                enable_moe_block=moe,
                num_experts=int(d.get("num_experts") or 0) if moe else 0,
                top_k_experts=int(d.get("top_k_experts") or 0) if moe else 0,
                moe_intermediate_size=int(d.get("moe_intermediate_size") or 0) if moe else 0,
                pad_token_id=int(_get(d, "pad_token_id", 0)),
                bos_token_id=int(_get(d, "bos_token_id", 2)),
                eos_token_ids=eos_ids,
                layer_overrides=tuple(overrides),
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: {e}") from None

    def shape_signature(self) -> dict[str, Any]:
        """The fields a preset and a checkpoint's config must agree on."""
        d = self.to_hf_dict()
        for k in ("max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
                  "architectures"):
            d.pop(k, None)
        d["layers"] = [
            (s.kind.value, s.head_dim, s.num_kv_heads, s.k_eq_v, s.kv_source, s.mlp_width)
            for s in self.layers
        ]
        d.pop("per_layer_config", None)
        d.pop("global_head_dim", None)
        d.pop("num_global_key_value_heads", None)
        return d


def _get(d: dict[str, Any], key: str, default: Any) -> Any:
    """d[key] unless missing or null (0 is a valid token id)."""
    v = d.get(key)
    return default if v is None else v


def _rope_from_hf(p: dict | None, default_theta: float, source: str,
                  default_fraction: float = 1.0) -> RopeSpec:
    if p is None:
        return RopeSpec(theta=default_theta, rotary_fraction=default_fraction)
    rope_type = p.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported")
    fraction = float(p.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
    return RopeSpec(theta=float(p.get("rope_theta", default_theta)), rotary_fraction=fraction,
                    factor=float(p.get("factor", 1.0)))


def _rope_to_hf(r: RopeSpec, rope_type: str) -> dict[str, Any]:
    d: dict[str, Any] = {"rope_type": rope_type, "rope_theta": r.theta}
    if rope_type == "proportional":
        d["partial_rotary_factor"] = r.rotary_fraction
    if r.factor != 1.0:
        d["factor"] = r.factor
    return d
