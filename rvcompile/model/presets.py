"""Named Gemma 4 configurations: the released text decoders, their assistant drafters and small
test models.

Each preset is a keyword-only factory; `get_preset(name)` resolves a name or raises
`ConfigError` listing the known ones. Released numbers follow shared/GEMMA4.md.

Assistant presets (`get_assistant_preset("gemma-4-31B-assistant")`, one per target preset) give
the drafter's shape for `--assistant NAME --random-weights`. A drafter's cache layout (head dims,
KV heads, K=V, window, RoPE) is the target's, since its layers read the target's caches; what
each drafter's own numbers rest on (Google publishes no table; these come from the released
config.json files as third parties quote them):
- E2B: D 256, MLP 2048, 4 layers S S S F, 4 query heads, centroid head (2048 clusters, top 32):
  the released config.json of google/gemma-4-E2B-it-assistant, quoted whole in a public log.
- E4B: as E2B (78.5M parameters in a load probe), quoted by several third-party test fixtures.
- 31B: D 1024, MLP 8192, 4 layers S S S F, 32 query heads, dense tied head: a third-party test
  fixture (mlx-swift-lm) and issue 15; the window (the target's 1024) is an ASSUMPTION.
- 26B-A4B: D 1024 (vLLM PR 54822, a user loading google/gemma-4-26B-A4B-it-assistant) and a
  dense head (mlx-vlm's drafter table); 4 layers S S S F, 16 query heads and MLP 8192 are
  ASSUMPTIONS (the 31B drafter's).
- 12B (gemma4_unified_assistant): no shape seen published; D 1024, MLP 8192, 4 layers S S S F,
  16 query heads and a dense head are all ASSUMPTIONS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rvcompile.model.assistant import AssistantConfig
from rvcompile.model.config import AttnKind, ConfigError, Gemma4Config, RopeSpec

VOCAB = 262144
ROPE_SLIDING = RopeSpec(theta=1e4)
ROPE_FULL = RopeSpec(theta=1e6, rotary_fraction=0.25)
CHAT_EOS = (1, 106, 50)


def _pattern(num_layers: int, period: int) -> tuple[AttnKind, ...]:
    """(period-1) sliding layers then one full layer, repeated; the last layer is always full."""
    kinds = [AttnKind.FULL if (i + 1) % period == 0 else AttnKind.SLIDING
             for i in range(num_layers)]
    kinds[-1] = AttnKind.FULL
    return tuple(kinds)


def _gemma4(*, name: str, hidden: int, layers: int, period: int, heads: int, kv_heads: int,
            global_kv_heads: int | None, k_eq_v: bool, mlp: int, ple: int, kv_shared: int,
            window: int, max_pos: int, double_wide: bool = False, vocab: int = VOCAB,
            head_dim: int = 256, global_head_dim: int = 512,
            moe: tuple[int, int, int] | None = None,
            eos: tuple[int, ...] = CHAT_EOS) -> Gemma4Config:
    experts, top_k, moe_width = moe or (0, 0, 0)
    return Gemma4Config(
        name=name, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        layer_kinds=_pattern(layers, period), head_dim=head_dim, global_head_dim=global_head_dim,
        num_kv_heads=kv_heads, num_global_kv_heads=global_kv_heads, attention_k_eq_v=k_eq_v,
        intermediate_size=mlp, use_double_wide_mlp=double_wide, hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=vocab, num_kv_shared_layers=kv_shared, sliding_window=window,
        max_position_embeddings=max_pos, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
        rope_sliding=ROPE_SLIDING, rope_full=ROPE_FULL, enable_moe_block=moe is not None,
        num_experts=experts, top_k_experts=top_k, moe_intermediate_size=moe_width,
        eos_token_ids=eos,
    )


def gemma_4_e2b() -> Gemma4Config:
    return _gemma4(name="gemma-4-E2B", hidden=1536, layers=35, period=5, heads=8, kv_heads=1,
                   global_kv_heads=None, k_eq_v=False, mlp=6144, double_wide=True, ple=256,
                   kv_shared=20, window=512, max_pos=131072)


def gemma_4_e4b() -> Gemma4Config:
    return _gemma4(name="gemma-4-E4B", hidden=2560, layers=42, period=6, heads=8, kv_heads=2,
                   global_kv_heads=None, k_eq_v=False, mlp=10240, ple=256, kv_shared=18,
                   window=512, max_pos=131072)


def gemma_4_12b() -> Gemma4Config:
    return _gemma4(name="gemma-4-12B", hidden=3840, layers=48, period=6, heads=16, kv_heads=8,
                   global_kv_heads=1, k_eq_v=True, mlp=15360, ple=0, kv_shared=0, window=1024,
                   max_pos=262144)


def gemma_4_26b_a4b() -> Gemma4Config:
    return _gemma4(name="gemma-4-26B-A4B", hidden=2816, layers=30, period=6, heads=16, kv_heads=8,
                   global_kv_heads=2, k_eq_v=True, mlp=2112, ple=0, kv_shared=0, window=1024,
                   max_pos=262144, moe=(128, 8, 704))


def gemma_4_31b() -> Gemma4Config:
    return _gemma4(name="gemma-4-31B", hidden=5376, layers=60, period=6, heads=32, kv_heads=16,
                   global_kv_heads=4, k_eq_v=True, mlp=21504, ple=0, kv_shared=0, window=1024,
                   max_pos=262144)


def gemma_4_tiny() -> Gemma4Config:
    """Every Gemma 4 feature at toy size: sliding/full with their own head dims and KV heads,
    K=V, PLE, KV sharing with the double-wide MLP, MoE. The README's default model."""
    return _gemma4(name="gemma-4-tiny", vocab=1024, hidden=128, layers=8, period=4, heads=4,
                   kv_heads=2, global_kv_heads=1, k_eq_v=True, mlp=256, double_wide=True,
                   ple=16, kv_shared=4, window=16, max_pos=4096, head_dim=32, global_head_dim=64,
                   moe=(8, 2, 64), eos=(1, 106))


def gemma_4_tiny_dense() -> Gemma4Config:
    """A toy 31B: dense, K=V, no PLE, no sharing."""
    return _gemma4(name="gemma-4-tiny-dense", vocab=1024, hidden=128, layers=6, period=3,
                   heads=4, kv_heads=2, global_kv_heads=1, k_eq_v=True, mlp=256, ple=0,
                   kv_shared=0, window=16, max_pos=4096, head_dim=32, global_head_dim=64,
                   eos=(1, 106))


PRESETS: dict[str, Callable[[], Gemma4Config]] = {
    "gemma-4-E2B": gemma_4_e2b,
    "gemma-4-E4B": gemma_4_e4b,
    "gemma-4-12B": gemma_4_12b,
    "gemma-4-26B-A4B": gemma_4_26b_a4b,
    "gemma-4-31B": gemma_4_31b,
    "gemma-4-tiny": gemma_4_tiny,
    "gemma-4-tiny-dense": gemma_4_tiny_dense,
}


def get_preset(name: str) -> Gemma4Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    return PRESETS[name]()


# ---------------------------------------------------------------------------------------------
# Assistant drafters


def _assistant(target: Gemma4Config, *, hidden: int, mlp: int, heads: int, layers: int = 4,
               ordered: bool = False, centroids: int = 2048, top_k: int = 32,
               model_type: str = "gemma4_assistant") -> AssistantConfig:
    """A drafter for `target`: its own width, MLP and query heads, (layers - 1) sliding layers
    then one full layer, each with the cache layout of the target layer it reads."""
    text = dataclasses.replace(
        target, name=f"{target.name}-assistant", hidden_size=hidden, num_layers=layers,
        num_heads=heads, layer_kinds=_pattern(layers, layers), intermediate_size=mlp,
        use_double_wide_mlp=False, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
        enable_moe_block=False, num_experts=0, top_k_experts=0, moe_intermediate_size=0,
        final_logit_softcapping=None, layer_overrides=(),
    )
    return AssistantConfig(
        name=f"{target.name}-assistant", model_type=model_type, text=text,
        backbone_hidden_size=target.hidden_size, use_ordered_embeddings=ordered,
        num_centroids=centroids, centroid_intermediate_top_k=top_k)


ASSISTANT_PRESETS: dict[str, Callable[[], AssistantConfig]] = {
    "gemma-4-E2B-assistant": lambda: _assistant(gemma_4_e2b(), hidden=256, mlp=2048, heads=4,
                                                ordered=True),
    "gemma-4-E4B-assistant": lambda: _assistant(gemma_4_e4b(), hidden=256, mlp=2048, heads=4,
                                                ordered=True),
    "gemma-4-12B-assistant": lambda: _assistant(gemma_4_12b(), hidden=1024, mlp=8192, heads=16,
                                                model_type="gemma4_unified_assistant"),
    "gemma-4-26B-A4B-assistant": lambda: _assistant(gemma_4_26b_a4b(), hidden=1024, mlp=8192,
                                                    heads=16),
    "gemma-4-31B-assistant": lambda: _assistant(gemma_4_31b(), hidden=1024, mlp=8192, heads=32),
    # Test drafters: the tiny (E2B-like) preset's has the centroid head, tiny-dense's the dense.
    "gemma-4-tiny-assistant": lambda: _assistant(gemma_4_tiny(), hidden=64, mlp=128, heads=4,
                                                 layers=2, ordered=True, centroids=16, top_k=4),
    "gemma-4-tiny-dense-assistant": lambda: _assistant(gemma_4_tiny_dense(), hidden=64, mlp=128,
                                                       heads=4, layers=2),
}


def get_assistant_preset(name: str) -> AssistantConfig:
    if name not in ASSISTANT_PRESETS:
        raise ConfigError(f"unknown assistant preset {name!r} (known: "
                          f"{', '.join(ASSISTANT_PRESETS)})")
    return ASSISTANT_PRESETS[name]()
