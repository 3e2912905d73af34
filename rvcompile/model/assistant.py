"""Gemma 4 assistant (multi-token-prediction drafter) configuration, and how it fits a target.

An assistant (transformers' `Gemma4AssistantForCausalLM`, model_type `gemma4_assistant`, and
`gemma4_unified_assistant` for the 12B) drafts tokens for one target model. One draft step: the
target's embedding of the last token (times sqrt(H), as the target embeds) concatenated with a
hidden state [B, 2H] -> `pre_projection` to the drafter's width D -> the drafter's decoder layers
-> its final norm -> `post_projection` back to H (the next step's hidden state) and logits through
its own embedding table (tied head; no softcap). The first step's hidden state is the target's
last hidden state after its final norm (transformers' `hidden_states[-1]`, tied to
`last_hidden_state`). Small models' drafters (`use_ordered_embeddings`) score only the tokens of
the top `centroid_intermediate_top_k` of `num_centroids` clusters (`token_ordering` lists each
cluster's tokens); the rest get the smallest selected logit minus 1.

Every drafter layer is KV-shared: it has no k/v projections and attends with its own query to the
target's KV cache of the target's last non-shared layer of its own kind (sliding or full). Its
query is rotated at the position p of the token it reads; it sees the target's keys at positions
[p - window, p - 1] (sliding) or [0, p - 1] (full): the target has not run that token yet.

`AssistantConfig` is frozen and checked on construction; `from_hf_dict` reads an assistant's
config.json and refuses, in one line naming the key, what the drafter cannot be (per-layer inputs,
MoE, a double-wide MLP, layers that are not all KV-shared, an untied head, centroids that do not
divide the vocabulary). `target_layers(target)` says which target layer each drafter layer reads
and refuses an assistant that does not fit the target: another backbone width or vocabulary, a
layer kind the target lacks, a cache layout (head dim, KV heads, K=V) other than the one it
reads, or a window longer than the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rvcompile.model.config import AttnKind, ConfigError, Gemma4Config, _check_int, _show

ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
# text_config model types by assistant model type (transformers' sub-config defaults).
_TEXT_MODEL_TYPES = {"gemma4_assistant": "gemma4_text",
                     "gemma4_unified_assistant": "gemma4_unified_text"}
_ARCHITECTURES = {"gemma4_assistant": "Gemma4AssistantForCausalLM",
                  "gemma4_unified_assistant": "Gemma4UnifiedAssistantForCausalLM"}
TENSOR_PREFIX = "assistant."  # the drafter's tensors and weights, beside the target's


@dataclass(frozen=True)
class AssistantConfig:
    name: str
    model_type: str  # "gemma4_assistant" or "gemma4_unified_assistant"
    # The drafter's decoder: width D, heads, MLP, layer kinds and their cache layout, window,
    # RoPE. Its num_kv_shared_layers is 0 here: every layer reads the target's caches instead,
    # which `target_layers` maps.
    text: Gemma4Config
    backbone_hidden_size: int  # the target's width H
    use_ordered_embeddings: bool  # centroid-masked head (small models' drafters)
    num_centroids: int  # token clusters of the masked head
    centroid_intermediate_top_k: int  # clusters whose tokens are scored

    def __post_init__(self) -> None:
        if self.model_type not in ASSISTANT_MODEL_TYPES:
            raise ConfigError(f"model_type {self.model_type!r} is not a Gemma 4 assistant "
                              f"(expected one of {', '.join(ASSISTANT_MODEL_TYPES)})")
        if not isinstance(self.text, Gemma4Config):
            raise ConfigError(f"text_config is {self.text!r}; expected a Gemma4Config")
        _check_int("backbone_hidden_size", self.backbone_hidden_size, 1)
        if not isinstance(self.use_ordered_embeddings, bool):
            raise ConfigError(f"use_ordered_embeddings is {_show(self.use_ordered_embeddings)}; "
                              "expected true or false")
        _check_int("num_centroids", self.num_centroids, 1)
        _check_int("centroid_intermediate_top_k", self.centroid_intermediate_top_k, 1,
                   self.num_centroids)
        t = self.text
        if self.use_ordered_embeddings and t.vocab_size % self.num_centroids:
            raise ConfigError(f"num_centroids {self.num_centroids} does not divide vocab_size "
                              f"{t.vocab_size}: token_ordering is read as [num_centroids, "
                              "vocab_size / num_centroids]")
        for key, bad in (("hidden_size_per_layer_input", t.ple),
                         ("enable_moe_block", t.enable_moe_block),
                         ("use_double_wide_mlp", t.use_double_wide_mlp)):
            if bad:
                raise ConfigError(f"text_config.{key}: an assistant has no per-layer inputs, "
                                  "MoE or double-wide MLP")
        if t.num_kv_shared_layers:
            raise ConfigError("text_config.num_kv_shared_layers: AssistantConfig.text keeps 0 "
                              "(every assistant layer reads the target's caches)")

    @property
    def hidden_size(self) -> int:
        """D, the drafter's own width."""
        return self.text.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def tokens_per_centroid(self) -> int:
        return self.text.vocab_size // self.num_centroids

    def target_layers(self, target: Gemma4Config) -> tuple[int, ...]:
        """The target layer whose KV cache each drafter layer reads: the target's last
        non-shared layer of the drafter layer's kind. ConfigError, one line, when the assistant
        does not fit `target`."""
        where = f"assistant {self.name} does not fit {target.name}"
        if self.backbone_hidden_size != target.hidden_size:
            raise ConfigError(f"{where}: backbone_hidden_size {self.backbone_hidden_size} is not "
                              f"the target's hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"{where}: text_config.vocab_size {self.vocab_size} is not the "
                              f"target's vocab_size {target.vocab_size}")
        first_shared = target.num_layers - target.num_kv_shared_layers
        producers = {target.layer_kinds[i]: i for i in range(first_shared)}
        reads = []
        for spec in self.text.layers:
            if spec.kind not in producers:
                raise ConfigError(f"{where}: text_config.layer_types[{spec.index}] is "
                                  f"{spec.kind.value}, which the target has no layer of")
            src = target.layers[producers[spec.kind]]
            mine = (spec.head_dim, spec.num_kv_heads, spec.k_eq_v)
            theirs = (src.head_dim, src.num_kv_heads, src.k_eq_v)
            if mine != theirs:
                raise ConfigError(
                    f"{where}: layer {spec.index} ({spec.kind.value}: head_dim, KV heads, K=V "
                    f"{mine}) reads target layer {src.index}'s cache, which is {theirs}")
            if spec.kind is AttnKind.SLIDING and spec.window > src.window:
                raise ConfigError(f"{where}: text_config.sliding_window {spec.window} is longer "
                                  f"than the target's {src.window}, whose cache holds no more")
            reads.append(src.index)
        return tuple(reads)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json an assistant checkpoint carries (round-trips through from_hf_dict)."""
        text = self.text.to_hf_dict()
        text.pop("architectures", None)
        text.update(model_type=_TEXT_MODEL_TYPES[self.model_type],
                    num_kv_shared_layers=self.text.num_layers, vocab_size_per_layer_input=0)
        return {
            "model_type": self.model_type,
            "architectures": [_ARCHITECTURES[self.model_type]],
            "backbone_hidden_size": self.backbone_hidden_size,
            "use_ordered_embeddings": self.use_ordered_embeddings,
            "num_centroids": self.num_centroids,
            "centroid_intermediate_top_k": self.centroid_intermediate_top_k,
            "tie_word_embeddings": True,
            "text_config": text,
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "assistant",
                     source: str = "config.json") -> AssistantConfig:
        """Parse an assistant's config.json dict; `source` names the file in errors."""
        try:
            return cls._from_hf(raw, name, source)
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith(source) else f"{source}: {msg}") from None

    @classmethod
    def _from_hf(cls, raw: dict[str, Any], name: str, source: str) -> AssistantConfig:
        model_type = raw.get("model_type")
        if model_type not in ASSISTANT_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not a Gemma 4 assistant "
                              f"(expected one of {', '.join(ASSISTANT_MODEL_TYPES)})")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"text_config is {_show(text)}; expected a JSON object")
        if raw.get("tie_word_embeddings", True) is not True:
            raise ConfigError(f"tie_word_embeddings is {_show(raw['tie_word_embeddings'])}; the "
                              "assistant's head is tied to its embedding")
        if raw.get("backbone_hidden_size") is None:
            raise ConfigError("required field 'backbone_hidden_size' is missing")
        text_type = text.get("model_type")
        if text_type not in (None, "gemma4_text", "gemma4_unified_text"):
            raise ConfigError(f"text_config.model_type {text_type!r} is not a Gemma 4 text "
                              "decoder (gemma4_text or gemma4_unified_text)")
        for key in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
            if text.get(key) not in (None, 0, False):
                raise ConfigError(f"text_config.{key} is {_show(text[key])}; an assistant has "
                                  "no per-layer inputs, MoE or double-wide MLP")
        layers = text.get("num_hidden_layers")
        shared = text.get("num_kv_shared_layers")
        if shared not in (None, 0) and shared != layers:
            # transformers turns 0 into all layers and refuses anything else.
            raise ConfigError(f"text_config.num_kv_shared_layers is {_show(shared)}; every "
                              f"assistant layer reads the target's KV caches ({_show(layers)})")
        # The dataclass describes the drafter's layers as data; their KV comes from the target.
        # No per-layer inputs, so the per-layer vocabulary (0 in released files) means nothing.
        plain = {k: v for k, v in text.items() if k != "vocab_size_per_layer_input"}
        plain.update(model_type="gemma4_text", num_kv_shared_layers=0)
        cfg = Gemma4Config.from_hf_dict(plain, name=name, source=f"{source}: text_config")
        return cls(
            name=name, model_type=model_type, text=cfg,
            backbone_hidden_size=raw["backbone_hidden_size"],
            use_ordered_embeddings=_default(raw, "use_ordered_embeddings", False),
            num_centroids=_default(raw, "num_centroids", 2048),
            centroid_intermediate_top_k=_default(raw, "centroid_intermediate_top_k", 32),
        )


def _default(d: dict[str, Any], key: str, default: Any) -> Any:
    """d[key] unless missing or null (transformers' class default then)."""
    v = d.get(key)
    return default if v is None else v
