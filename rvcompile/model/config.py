"""Gemma 4 text-decoder configuration: one frozen dataclass, per-layer variation as data.

`Gemma4Config` holds the model-level numbers; `cfg.layers` derives one `LayerSpec` per decoder
layer (attention kind, head dim, KV heads, K=V, which layer's KV cache it reads, MLP width).
`Gemma4Config.from_hf_dict` reads both config.json forms (Hub files with `global_head_dim` /
`num_global_key_value_heads`, transformers' `save_pretrained` with `per_layer_config`) and the
multimodal wrapper (`text_config`). Errors are `ConfigError` with one line naming the field.

Every field is checked once, on construction (presets and config.json alike), and named by its
config.json key: sizes are integers >= 1, head dims even, each layer's query heads a multiple of
its KV heads, layer_types known and one per layer with a full last layer, sliding_window >= 1,
RoPE thetas and factors > 0, rms_norm_eps > 0, the softcap > 0 or null, token ids inside the
vocabulary, MoE experts >= top_k >= 1, KV-shared layers within the stack. `from_hf_dict` also
refuses what the dataclass cannot express: an activation other than GELU's tanh approximation,
attention biases, bidirectional attention, values of the wrong JSON type, per-layer overrides of
other fields.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

SUPPORTED_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified")
# transformers' names for GELU with the tanh approximation, the only activation Gemma 4 uses
# (ACT2FN: GELUTanh, its Python twin, NewGELUActivation; all 0.5x(1 + tanh(sqrt(2/pi)(x +
# 0.044715x^3)))). "gelu" (exact erf) and the rest compute something else: refused.
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new")
# The fields transformers' `per_layer_config` may override per layer; any other is refused.
LAYER_OVERRIDE_KEYS = ("head_dim", "num_key_value_heads")


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
        _check_fields(self)
        if len(self.layer_kinds) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_kinds)} entries but num_hidden_layers is "
                f"{self.num_layers}"
            )
        if self.layer_kinds[-1] is not AttnKind.FULL:
            raise ConfigError("layer_types: the last layer must be full_attention")
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
        try:
            return cls._from_hf(raw, name)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def _from_hf(cls, raw: dict[str, Any], name: str) -> Gemma4Config:
        d = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
        model_type = d.get("model_type", raw.get("model_type"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not a Gemma 4 decoder "
                f"(expected one of {', '.join(SUPPORTED_MODEL_TYPES)})"
            )

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ConfigError(f"required field {key!r} is missing")
            return d[key]

        _check_semantics(d)
        num_layers = need("num_hidden_layers")
        _check_int("num_hidden_layers", num_layers, 1)
        kinds = _layer_kinds(d.get("layer_types"), num_layers)
        k_eq_v = _get(d, "attention_k_eq_v", False)
        global_head_dim = d.get("global_head_dim")
        global_kv = d.get("num_global_key_value_heads") if k_eq_v is True else None
        overrides = _layer_overrides(d.get("per_layer_config"))
        full_ids = [i for i, k in enumerate(kinds) if k is AttnKind.FULL]
        if global_head_dim is None and overrides and full_ids:
            global_head_dim = dict(dict(overrides).get(full_ids[0], ())).get("head_dim")
        if d.get("tie_word_embeddings", True) is not True:
            raise ConfigError(f"tie_word_embeddings is {_show(d['tie_word_embeddings'])}; Gemma 4 "
                              "ties the head to the embedding and rvcompile supports only that")
        rope = _get(d, "rope_parameters", {})
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters is {_show(rope)}; expected a JSON object")
        eos = _get(d, "eos_token_id", 1)
        moe = _get(d, "enable_moe_block", False)
        return cls(
            name=name,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_layers=num_layers,
            num_heads=need("num_attention_heads"),
            layer_kinds=kinds,
            head_dim=need("head_dim"),
            global_head_dim=512 if global_head_dim is None else global_head_dim,
            num_kv_heads=need("num_key_value_heads"),
            num_global_kv_heads=global_kv,
            attention_k_eq_v=k_eq_v,
            intermediate_size=need("intermediate_size"),
            use_double_wide_mlp=_get(d, "use_double_wide_mlp", False),
            hidden_size_per_layer_input=_get(d, "hidden_size_per_layer_input", 0),
            vocab_size_per_layer_input=_get(d, "vocab_size_per_layer_input", d.get("vocab_size")),
            num_kv_shared_layers=_get(d, "num_kv_shared_layers", 0),
            sliding_window=need("sliding_window"),
            max_position_embeddings=_get(d, "max_position_embeddings", 131072),
            rms_norm_eps=_get(d, "rms_norm_eps", 1e-6),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            rope_sliding=_rope_from_hf(rope, "sliding_attention", 1e4),
            rope_full=_rope_from_hf(rope, "full_attention", 1e6, 0.25),
            enable_moe_block=moe,
            num_experts=_get(d, "num_experts", 0) if moe else 0,
            top_k_experts=_get(d, "top_k_experts", 0) if moe else 0,
            moe_intermediate_size=_get(d, "moe_intermediate_size", 0) if moe else 0,
            pad_token_id=_get(d, "pad_token_id", 0),
            bos_token_id=_get(d, "bos_token_id", 2),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
            layer_overrides=overrides,
        )

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


def _rope_from_hf(rope: dict[str, Any], kind: str, default_theta: float,
                  default_fraction: float = 1.0) -> RopeSpec:
    """rope_parameters[kind]; ranges are checked with the config's other fields."""
    key = f"rope_parameters.{kind}"
    p = rope.get(kind)
    if p is None:
        return RopeSpec(theta=default_theta, rotary_fraction=default_fraction)
    if not isinstance(p, dict):
        raise ConfigError(f"{key} is {_show(p)}; expected a JSON object")
    rope_type = p.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ConfigError(f"{key}.rope_type {_show(rope_type)} is not supported "
                          "(default, proportional)")
    theta = _get(p, "rope_theta", default_theta)
    if rope_type == "proportional":
        return RopeSpec(theta=theta, rotary_fraction=_get(p, "partial_rotary_factor", 1.0),
                        factor=_get(p, "factor", 1.0))
    for ignored in ("partial_rotary_factor", "factor"):
        # transformers' default RoPE reads neither: honouring one would compute another model.
        if _get(p, ignored, 1.0) != 1.0:
            raise ConfigError(f"{key}.{ignored} is {_show(p[ignored])}, but rope_type 'default' "
                              "does not apply it (only 'proportional' does)")
    return RopeSpec(theta=theta)


def _check_semantics(d: dict[str, Any]) -> None:
    """config.json switches the dataclass cannot express: only Gemma 4's own values pass."""
    act = _get(d, "hidden_activation", _get(d, "hidden_act", "gelu_pytorch_tanh"))
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"hidden_activation {_show(act)} is not supported: Gemma 4 uses GELU "
                          f"with the tanh approximation ({', '.join(SUPPORTED_ACTIVATIONS)})")
    if _get(d, "attention_bias", False) is not False:
        raise ConfigError(f"attention_bias is {_show(d['attention_bias'])}; Gemma 4 has no biases")
    bidirectional = d.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        # "vision" only changes image tokens, which a text decoder never sees.
        raise ConfigError(f"use_bidirectional_attention is {_show(bidirectional)}; only causal "
                          "text attention is supported (null or \"vision\")")


def _layer_kinds(layer_types: Any, num_layers: int) -> tuple[AttnKind, ...]:
    """layer_types, or transformers' default (5 sliding, 1 full) when absent."""
    if layer_types is None:
        return tuple(AttnKind.FULL if (i + 1) % 6 == 0 else AttnKind.SLIDING
                     for i in range(num_layers))
    if not isinstance(layer_types, list):
        raise ConfigError(f"layer_types is {_show(layer_types)}; expected a list")
    known = [k.value for k in AttnKind]
    for i, t in enumerate(layer_types):
        if t not in known:
            raise ConfigError(f"layer_types[{i}] is {_show(t)}; expected {' or '.join(known)}")
    return tuple(AttnKind(t) for t in layer_types)


def _layer_overrides(per_layer: Any) -> tuple[tuple[int, tuple[tuple[str, int], ...]], ...]:
    """transformers' `per_layer_config` {"3": {"head_dim": 512, ...}} as sorted tuples; the
    values' ranges are checked with the config's other fields."""
    if per_layer is None:
        return ()
    if not isinstance(per_layer, dict):
        raise ConfigError(f"per_layer_config is {_show(per_layer)}; expected a JSON object")
    out = []
    for key, val in per_layer.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ConfigError(f"per_layer_config key {key!r} is not a layer index")
        if not isinstance(val, dict):
            raise ConfigError(f"per_layer_config.{key} is {_show(val)}; expected a JSON object")
        out.append((int(key), tuple(sorted(val.items()))))
    return tuple(sorted(out))


def _rope_to_hf(r: RopeSpec, rope_type: str) -> dict[str, Any]:
    d: dict[str, Any] = {"rope_type": rope_type, "rope_theta": r.theta}
    if rope_type == "proportional":
        d["partial_rotary_factor"] = r.rotary_fraction
    if r.factor != 1.0:
        d["factor"] = r.factor
    return d


# ---------------------------------------------------------------------------------------------
# Field checks (names are config.json keys)


def _check_fields(c: Gemma4Config) -> None:
    """Type and range of every field; ConfigError naming the config.json key otherwise."""
    if not isinstance(c.name, str):
        raise ConfigError(f"name is {c.name!r}; expected a string")
    for key, value in (
        ("vocab_size", c.vocab_size), ("hidden_size", c.hidden_size),
        ("num_hidden_layers", c.num_layers), ("num_attention_heads", c.num_heads),
        ("head_dim", c.head_dim), ("global_head_dim", c.global_head_dim),
        ("num_key_value_heads", c.num_kv_heads), ("intermediate_size", c.intermediate_size),
        ("sliding_window", c.sliding_window),
        ("max_position_embeddings", c.max_position_embeddings),
    ):
        _check_int(key, value, 1)
    if c.num_global_kv_heads is not None:
        _check_int("num_global_key_value_heads", c.num_global_kv_heads, 1)
    for key, flag in (("attention_k_eq_v", c.attention_k_eq_v),
                      ("use_double_wide_mlp", c.use_double_wide_mlp),
                      ("enable_moe_block", c.enable_moe_block)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{key} is {_show(flag)}; expected true or false")
    _check_int("hidden_size_per_layer_input", c.hidden_size_per_layer_input, 0)
    _check_int("vocab_size_per_layer_input", c.vocab_size_per_layer_input, 1)
    if c.ple and c.vocab_size_per_layer_input < c.vocab_size:
        # The per-layer table is indexed by the same token ids as embed_tokens.
        raise ConfigError(f"vocab_size_per_layer_input {c.vocab_size_per_layer_input} is "
                          f"smaller than vocab_size {c.vocab_size}: token ids would index past "
                          "the per-layer embedding table")
    _check_int("num_kv_shared_layers", c.num_kv_shared_layers, 0, c.num_layers - 1)
    _check_float("rms_norm_eps", c.rms_norm_eps)
    if c.final_logit_softcapping is not None:
        # transformers divides the logits by it: 0 is not "off" (null is), it is NaN.
        _check_float("final_logit_softcapping", c.final_logit_softcapping)
    _check_rope("rope_parameters.sliding_attention", c.rope_sliding)
    _check_rope("rope_parameters.full_attention", c.rope_full)
    if c.enable_moe_block:
        _check_int("num_experts", c.num_experts, 1)
        _check_int("top_k_experts", c.top_k_experts, 1, c.num_experts)
        _check_int("moe_intermediate_size", c.moe_intermediate_size, 1)
    for key, value in (("pad_token_id", c.pad_token_id), ("bos_token_id", c.bos_token_id)):
        _check_int(key, value, 0, c.vocab_size - 1)
    if not isinstance(c.eos_token_ids, tuple):
        raise ConfigError(f"eos_token_id is {_show(c.eos_token_ids)}; expected a list of token "
                          "ids")
    for value in c.eos_token_ids:
        _check_int("eos_token_id", value, 0, c.vocab_size - 1)
    if not isinstance(c.layer_kinds, tuple) or not all(
        isinstance(k, AttnKind) for k in c.layer_kinds
    ):
        raise ConfigError(f"layer_types is {c.layer_kinds!r}; expected a tuple of AttnKind")
    for index, fields in c.layer_overrides:
        if not 0 <= index < c.num_layers:
            raise ConfigError(f"per_layer_config.{index}: no such layer (num_hidden_layers is "
                              f"{c.num_layers})")
        for key, value in fields:
            if key not in LAYER_OVERRIDE_KEYS:
                raise ConfigError(f"per_layer_config.{index}.{key}: only "
                                  f"{' and '.join(LAYER_OVERRIDE_KEYS)} may vary per layer")
            _check_int(f"per_layer_config.{index}.{key}", value, 1)


def _show(value: Any) -> str:
    """`value` as config.json spells it (true, null, NaN, "text"), for error messages."""
    return json.dumps(value, default=repr)


def _check_int(key: str, value: Any, low: int, high: int | None = None) -> None:
    """`value` is an int (not a bool) in [low, high]."""
    want = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} is {_show(value)}; expected {want}")
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{key} is {value}; expected {want}")


def _check_float(key: str, value: Any, low: float = 0.0, *, closed: bool = False,
                 high: float | None = None) -> None:
    """`value` is a finite number (not a bool) > low (>= low if `closed`), <= high if given."""
    want = f"a finite number {'>=' if closed else '>'} {low:g}"
    if high is not None:
        want += f" and <= {high:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} is {_show(value)}; expected {want}")
    above = value >= low if closed else value > low
    if not (math.isfinite(value) and above and (high is None or value <= high)):
        raise ConfigError(f"{key} is {_show(value)}; expected {want}")


def _check_rope(key: str, r: RopeSpec) -> None:
    _check_float(f"{key}.rope_theta", r.theta)
    _check_float(f"{key}.partial_rotary_factor", r.rotary_fraction, closed=True, high=1.0)
    _check_float(f"{key}.factor", r.factor)
