"""Named Gemma 4 configurations: the released text decoders and small test models.

Each preset is a keyword-only factory; `get_preset(name)` resolves a name or raises
`ConfigError` listing the known ones. Released numbers follow shared/GEMMA4.md.
"""

from __future__ import annotations

from collections.abc import Callable

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
