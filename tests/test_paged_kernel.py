"""The Pallas TPU decode attention kernel (targets/xla/paged_kernel.py), on the CPU:

- its values, run in Pallas' interpreter, against the XLA lowering it replaces
  (lower.attention_blockwise) and the direct attention: sliding rings on the oracle configs'
  shapes and a 31B-like slice (head dim 256, 2 query heads a KV head, window 1024, a ring of
  81 blocks of 16), wrapped rings, lanes of different lengths, shorter than the window, an
  idle lane; full layers of a 31B-like K=V head (512 wide, 8 query heads, keys rope(cache *
  k_norm) on 64 of 256 pairs, a table of 128 blocks) and of stored keys; int8 pools of both
  kinds with their scale pools (the same shapes, and the sliding layers' 4 heads a device at
  TP = 4);
- where the programs run it: decode steps of TPU-only exports (not prefill, not exports for
  several platforms; under tensor parallelism only with static pools, which the build's
  lowering gives tensor-parallel TPU-only programs: export.fixed_pools);
- with libtpu (a subprocess compiling for v6e:1x1, no TPU): Mosaic compiles it, and the
  traffic table counts its custom call by the pages its grid DMAs, against a hand count, and
  no instruction writes a whole pool or scale pool (a relayout; `whole_pool_writes`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_xla_topology import run_with_libtpu

from rvcompile.ir.graph import reads
from rvcompile.ir.ops import AttentionAttrs, CachePositionsAttrs, RopeAttrs, quantize_kv_rows
from rvcompile.model.presets import ROPE_FULL
from rvcompile.targets.xla import lower, patterns
from rvcompile.targets.xla.paged_kernel import (
    PAGES_PER_STEP,
    KeyFold,
    kernel_slot_pages,
    needed_pages,
    paged_decode,
    scale_rows,
    window_pages,
)

# (KV heads, query heads a KV head, head dim, window (None: a full layer), table width, pool
# dtype (int8: with scale pools, as quantize_kv_rows makes them), K=V, lane lengths)
SHAPES = {
    # the oracle configs' sliding layers (head dim 32, window 8; rings of 3 blocks at 64
    # tokens with chunks of 16): 2 KV heads, and 1 (kv_shared); float32 pools (xla-f32)
    "oracle": (2, 2, 32, 8, 3, jnp.float32, False, (100, 5, 1, 0, 17)),
    "oracle_kv_shared": (1, 4, 32, 8, 3, jnp.float32, False, (49, 0, 8, 33)),
    # the 31B's sliding layers at TP = 8 (2 of 16 KV heads a device), bf16 pools: wrapped
    # (2048, 1500 > 81 * 16), within the first ring (700 < window, 1030), an idle lane
    "31B": (2, 2, 256, 1024, 81, jnp.bfloat16, False, (2048, 1500, 700, 0, 1030, 1)),
    # the 31B's full layers at TP = 4: one K=V head of 512 a device, 8 query heads on it
    "31B_full": (1, 8, 512, None, 128, jnp.bfloat16, True, (2048, 1500, 700, 0, 17, 1)),
    # a full layer with stored keys (the E4B's: 2 KV heads of 512)
    "full_stored": (2, 2, 512, None, 8, jnp.float32, False, (128, 100, 0, 5)),
    # int8 pools (contexts above 32K tokens), with their scales: the 31B's cases above, and its
    # sliding layers at TP = 4 (4 KV heads a device)
    "31B_int8": (2, 2, 256, 1024, 81, jnp.int8, False, (2048, 1500, 700, 0, 1030, 1)),
    "31B_int8_tp4": (4, 2, 256, 1024, 81, jnp.int8, False, (2048, 1500, 700, 0, 1030, 1)),
    "31B_full_int8": (1, 8, 512, None, 128, jnp.int8, True, (2048, 1500, 700, 0, 17, 1)),
}
# the int8 cases of 2 and more heads again with their scales as row pools [n, blocks, 1, S]
# (lower.scale_block_shape: how programs store them), which the kernel pages as its pools
SHAPES |= {f"{s}_rows": SHAPES[s] for s in ("31B_int8", "31B_int8_tp4")}


def as_rows(scale: np.ndarray) -> np.ndarray:
    """Scale blocks [n, blocks, 16, K] as rows [n, blocks, 1, S] (lower.scale_block_shape, one
    shard): head-major, zeros past 16 K lanes (lower.scales_as_slots' inverse)."""
    n, blocks, _, kh = scale.shape
    rows = np.zeros((n, blocks, *lower.scale_block_shape(kh, 1)), np.float32)
    rows[..., 0, :16 * kh] = np.swapaxes(scale, -1, -2).reshape(n, blocks, 16 * kh)
    return rows


# shape -> the XLA lowering's and the direct attention's outputs in
# test_kernel_equals_the_xla_lowering,
# computed once for a shape's Pallas and TPU interpret cases (the same inputs: seed 7)
_REFERENCES: dict[str, tuple[np.ndarray, np.ndarray]] = {}


@pytest.mark.parametrize("shape, interpreter", [*((s, "pallas") for s in SHAPES),
                                                ("31B", "tpu"), ("31B_int8_tp4", "tpu"),
                                                ("31B_full_int8", "tpu"),
                                                ("31B_int8_tp4_rows", "tpu")])
def test_kernel_equals_the_xla_lowering(shape, interpreter):
    """One decode row a lane; bound as the blockwise-vs-direct tests': 2e-6 of the largest
    value (float32 summation order). Queries of 4 / sqrt(D) so that scores are O(1) at every
    head dim, as the d = 32 and 64 tests' are: with unit queries at D = 256 (scores up to
    30) float32 rounding of the scores alone put the XLA lowering 5.9e-6 and the kernel 1.3e-5
    from a float64 reference (measured; a different summation order of the same dots).
    Interpreters: Pallas' own, and its TPU interpret mode (pltpu.InterpretParams), which
    simulates the pipeline's DMAs into VMEM with uninitialised memory as NaN and out-of-bounds
    reads raising: a page the kernel used without DMAing it would show."""
    kh, group, d, window, width, dtype, k_eq_v, lengths = SHAPES[shape]
    rng = np.random.default_rng(7)
    lanes, ring = len(lengths), window is not None
    blocks = lanes * width + 5
    pools, scales = [], []
    for _ in range(1 if k_eq_v else 2):
        x = rng.standard_normal((2, blocks, 16, kh, d)).astype(np.float32)
        if dtype == jnp.int8:
            x, scale = quantize_kv_rows(x)
            scales.append(jnp.asarray(as_rows(scale) if shape.endswith("_rows") else scale))
        pools.append(jnp.asarray(x.reshape(2, blocks, 16, kh * d), dtype))
    table = jnp.asarray(rng.permutation(blocks)[:lanes * width].reshape(lanes, width),
                        jnp.int32)
    k, v = (lower.PagedSlice(pools[-i], 1, table, ring, kh, scales[-i] if scales else None)
            for i in (0, 1))
    cache_len = jnp.asarray(lengths, jnp.int32)
    q_pos = jnp.where(cache_len > 0, cache_len - 1, -1)
    k_pos = lower.cache_positions(CachePositionsAttrs(width * 16, ring), cache_len)
    q = jnp.asarray(rng.standard_normal((lanes, 1, kh * group, d)) * 4 / np.sqrt(d),
                    jnp.float32)
    attrs = AttentionAttrs(window=window, scale=0.5)
    fold = keys = None
    if k_eq_v:  # keys rope(cache * k_norm), as a K=V full layer's
        k_norm = jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32)
        rope = RopeAttrs(tuple(ROPE_FULL.inv_freq(d)))
        keys = lower.rope_lazy(rope, lower.mul_lazy(None, k, k_norm), k_pos)
        assert lower.FoldedKeys.of(keys, lower.CacheView(k)) is not None
        freqs = np.asarray(rope.inv_freq, np.float32)
        fold = KeyFold(k_norm, freqs[freqs > 0])
        assert len(fold.freqs) == 64

    def direct_keys():
        return k.read() if keys is None else lower.rope(rope, k.read() * k_norm, k_pos)

    if shape not in _REFERENCES:  # the same inputs (seed 7) in both interpreters' cases
        _REFERENCES[shape] = (
            np.asarray(jax.jit(lambda q: lower.attention_blockwise(
                attrs, q, k if keys is None else keys, v, q_pos[:, None], k_pos))(q)),
            np.asarray(jax.jit(lambda q: lower.attention(
                attrs, q, direct_keys(), v.read(), q_pos[:, None], k_pos))(q)))
    xla, direct = _REFERENCES[shape]
    ours = np.asarray(jax.jit(lambda q: paged_decode(
        q.reshape(lanes, kh, group, d), k.pool, v.pool, jnp.asarray([1, 1]), table, q_pos,
        window=window, scale=0.5, fold=fold, scales=(k.scale, v.scale) if scales else None,
        interpret=True if interpreter == "pallas" else pltpu.InterpretParams()))(q)
    ).reshape(xla.shape)
    errs = {ref: float(np.abs(ours - x).max()) for ref, x in (("xla", xla), ("direct", direct))}
    print(f"\npaged kernel ({shape}, {interpreter}) max abs vs the XLA lowering "
          f"{errs['xla']:.2e}, vs direct {errs['direct']:.2e} (largest value "
          f"{np.abs(xla).max():.2f})")
    assert not ours[lengths.index(0)].any()  # an idle lane: zeros, as the XLA lowering's
    assert max(errs.values()) <= 2e-6 * np.abs(xla).max()


def test_pages_a_lane_dmas():
    """The traffic table's count of a lane's pages (per pool): slot p holds pages p, p + 8, ..;
    a slot with none below `needed` fetches its first page once."""
    assert window_pages(1024, 81) == 65 and window_pages(8, 3) == 2
    assert window_pages(None, 128) == window_pages(0, 128) == 128
    assert needed_pages(2048, 1024, 81) == 64 and needed_pages(1030, 1024, 81) == 65
    assert needed_pages(1024, 1024, 81) == 64 and needed_pages(40, 256, 20) == 3
    assert needed_pages(None, 1024, 81) == 65
    assert needed_pages(2048, 0, 128) == 128 and needed_pages(100, None, 20) == 7

    def total(needed):
        return sum(kernel_slot_pages(needed, p, PAGES_PER_STEP) for p in range(PAGES_PER_STEP))

    assert [total(n) for n in (0, 3, 8, 9, 17, 65)] == [8, 8, 8, 9, 17, 65]


def test_scale_rows_gathers_without_a_fill_select():
    """`scale_rows` (an int8 pool's scales, gathered for the kernel) of block ids inside the
    pool, as paged_decode passes them: each lane's pages' scales in order, keys along lanes,
    and no select after the gather (jnp.take's default "fill" mode adds one, which XLA kept as
    a pass over the gathered scales and a relayout: the 31B at 128K, est.)."""
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((3, 40, 16, 2)).astype(np.float32)  # [n, blocks, 16, K]
    blocks = rng.integers(0, 40, (2, 24)).astype(np.int32)
    got = jax.jit(scale_rows)(pool, 1, blocks)
    want = pool[1][blocks].transpose(0, 3, 1, 2).reshape(2, 2, 24 * 16)
    np.testing.assert_array_equal(np.asarray(got), want)
    text = jax.jit(scale_rows).lower(pool, 1, blocks).as_text()
    assert "stablehlo.gather" in text
    # (a select of integers stays: the layer index's, scalar)
    assert not [line for line in text.splitlines() if "stablehlo.select" in line and "f32" in line]


def test_kernel_writes_bf16_as_its_f32_output_rounds():
    """`out_dtype=bf16` (the output read only by linears that round it to bf16 first,
    patterns.read_as_bf16): bit for bit the float32 output rounded to bf16."""
    kh, group, d, window, width, dtype, _, lengths = SHAPES["31B"]
    rng = np.random.default_rng(3)
    lanes, blocks = len(lengths), len(lengths) * width + 5
    pools = [jnp.asarray(rng.standard_normal((2, blocks, 16, kh * d)), dtype) for _ in (0, 1)]
    table = jnp.asarray(rng.permutation(blocks)[:lanes * width].reshape(lanes, width),
                        jnp.int32)
    cache_len = jnp.asarray(lengths, jnp.int32)
    q_pos = jnp.where(cache_len > 0, cache_len - 1, -1)
    q = jnp.asarray(rng.standard_normal((lanes, kh, group, d)) * 4 / np.sqrt(d), jnp.float32)

    def run(out_dtype):
        return np.asarray(jax.jit(lambda q: paged_decode(
            q, *pools, jnp.asarray([1, 1]), table, q_pos, window=window, scale=0.5,
            interpret=True, out_dtype=out_dtype))(q))

    wide, narrow = run(jnp.float32), run(jnp.bfloat16)
    assert narrow.dtype == jnp.bfloat16
    assert np.array_equal(narrow.view(np.uint16),
                          wide.astype(jnp.bfloat16).view(np.uint16))


@pytest.mark.parametrize("shape", ["31B", "31B_full"])
def test_kernel_norms_and_rotates_the_query(shape):
    """A NormedQuery (the query's RMSNORM and ROPE left to the kernel: patterns.lazy_queries) in
    the kernel, against the XLA lowering of the same attention on rope(rmsnorm(q)) (the
    sliding layers' RoPE over every pair, the full layers' over 64 of 256): the bound of
    `test_kernel_equals_the_xla_lowering`, 2e-6 of the largest value."""
    from rvcompile.ir.ops import RMSNormAttrs
    from rvcompile.model.presets import ROPE_SLIDING

    kh, group, d, window, width, dtype, k_eq_v, lengths = SHAPES[shape]
    rng = np.random.default_rng(11)
    lanes, blocks = len(lengths), len(lengths) * width + 5
    pools = [jnp.asarray(rng.standard_normal((2, blocks, 16, kh * d)), dtype)
             for _ in range(1 if k_eq_v else 2)]
    table = jnp.asarray(rng.permutation(blocks)[:lanes * width].reshape(lanes, width),
                        jnp.int32)
    k, v = (lower.PagedSlice(pools[-i], 1, table, window is not None, kh) for i in (0, 1))
    cache_len = jnp.asarray(lengths, jnp.int32)
    q_pos = jnp.where(cache_len > 0, cache_len - 1, -1)
    k_pos = lower.cache_positions(CachePositionsAttrs(width * 16, window is not None),
                                  cache_len)
    rope = RopeAttrs(tuple((ROPE_FULL if k_eq_v else ROPE_SLIDING).inv_freq(d)))
    x = jnp.asarray(rng.standard_normal((lanes, 1, kh * group, d)) * 3, jnp.float32)
    w = jnp.asarray(rng.uniform(0.02, 0.1, d), jnp.float32)  # scores O(1): |q| about 1
    query = lower.NormedQuery(x, w, RMSNormAttrs(1e-6), rope, q_pos[:, None])
    attrs = AttentionAttrs(window=window, scale=1.0)
    keys, fold = k, None
    if k_eq_v:
        k_norm = jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32)
        keys = lower.rope_lazy(rope, lower.mul_lazy(None, k, k_norm), k_pos)
        freqs = np.asarray(rope.inv_freq, np.float32)
        fold = KeyFold(k_norm, freqs[freqs > 0])

    xla = np.asarray(jax.jit(lambda x: lower.attention_blockwise(
        attrs, dataclasses.replace(query, x=x).read(), keys, v, q_pos[:, None], k_pos))(x))
    ours = np.asarray(jax.jit(lambda x: paged_decode(
        x.reshape(lanes, kh, group, d), k.pool, v.pool, jnp.asarray([1, 1]), table, q_pos,
        window=window, scale=1.0, fold=fold, interpret=True,
        qnorm=dataclasses.replace(query, x=x).kernel_norm()))(x)).reshape(xla.shape)
    err = float(np.abs(ours - xla).max())
    print(f"\nkernel's own query norm and RoPE ({shape}): max abs {err:.2e} (largest value "
          f"{np.abs(xla).max():.2f})")
    assert not ours[lengths.index(0)].any()
    assert err <= 2e-6 * np.abs(xla).max()


@pytest.mark.parametrize("shape, normed, out_dtype", [
    ("31B", False, jnp.float32), ("31B", True, jnp.bfloat16),
    ("31B_full", True, jnp.bfloat16), ("31B_int8_tp4", False, jnp.bfloat16)])
def test_kernel_on_rows_equals_it_on_blocks(shape, normed, out_dtype):
    """`kv_heads` (the query as rows [B, K * G * D] and the output as rows [B, K * G * Dv],
    one block each, as lower.decode_attention_kernel passes them: no relayouts around the
    call) against the kernel on [B, K, G, D] blocks: bit for bit (the same arithmetic, a
    lane's heads sliced from its row in VMEM), with the kernel's own query norm and RoPE, a
    K=V layer's folded keys, int8 pools, float32 and bf16 outputs; idle lanes zeros."""
    from rvcompile.ir.ops import RMSNormAttrs
    from rvcompile.model.presets import ROPE_SLIDING

    kh, group, d, window, width, dtype, k_eq_v, lengths = SHAPES[shape]
    rng = np.random.default_rng(5)
    lanes, blocks = len(lengths), len(lengths) * width + 5
    pools, scales = [], None
    for _ in range(1 if k_eq_v else 2):
        x = rng.standard_normal((2, blocks, 16, kh, d)).astype(np.float32)
        if dtype == jnp.int8:
            x, scale = quantize_kv_rows(x)
            scales = (scales or ()) + (jnp.asarray(scale),)
        pools.append(jnp.asarray(x.reshape(2, blocks, 16, kh * d), dtype))
    if k_eq_v:
        pools.append(pools[0])
    table = jnp.asarray(rng.permutation(blocks)[:lanes * width].reshape(lanes, width),
                        jnp.int32)
    cache_len = jnp.asarray(lengths, jnp.int32)
    q_pos = jnp.where(cache_len > 0, cache_len - 1, -1)
    rope = RopeAttrs(tuple((ROPE_FULL if k_eq_v else ROPE_SLIDING).inv_freq(d)))
    fold = None
    if k_eq_v:
        freqs = np.asarray(rope.inv_freq, np.float32)
        fold = KeyFold(jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32), freqs[freqs > 0])
    x = jnp.asarray(rng.standard_normal((lanes, 1, kh * group, d)), jnp.float32)
    qnorm = None
    if normed:
        qnorm = lower.NormedQuery(x, jnp.asarray(rng.uniform(0.02, 0.1, d), jnp.float32),
                                  RMSNormAttrs(1e-6), rope, q_pos[:, None]).kernel_norm()
    else:
        x = x * 4 / np.sqrt(d)

    def run(q, **kw):
        return np.asarray(jax.jit(lambda q: paged_decode(
            q, *pools, jnp.asarray([1, 1]), table, q_pos, window=window, scale=0.5, fold=fold,
            scales=None if scales is None else scales * (2 if k_eq_v else 1), qnorm=qnorm,
            out_dtype=out_dtype, interpret=True, **kw))(q))

    blocks_out = run(x.reshape(lanes, kh, group, d))
    rows_out = run(x.reshape(lanes, kh * group * d), kv_heads=kh)
    assert rows_out.shape == (lanes, kh * group * d) and rows_out.dtype == out_dtype
    assert np.array_equal(rows_out.reshape(blocks_out.shape).view(np.uint8),
                          blocks_out.view(np.uint8))
    assert not rows_out[lengths.index(0)].any() and np.abs(rows_out).max() > 0


def test_decode_kernel_norms_and_rotates_the_query_itself():
    """In a TPU-only decode step the kernel gets each layer's query as the q projection's rows
    with its norm weight [1, D] and each lane's cos and sin rows [B, 1, D / 2] as its last
    operands (patterns.lazy_queries / NormedQuery): XLA's passes over the query on chip (norm,
    RoPE halves, their concatenation, a relayout; 5.5 MiB a sliding layer at B = 64, TP = 4,
    0.28 GiB a step, est.) would come back without them."""
    calls = _kernel_calls(_export_decode(("tpu",))["decode_2"])
    ends = [re.findall(r"tensor<([\dx?]+)xf32>, tensor<([\dx?]+)xf32>, tensor<([\dx?]+)xf32>\) ->",
                       line) for line in calls]
    assert ends == [[("1x256", "2x1x128", "2x1x128")], [("1x512", "2x1x256", "2x1x256")]]


def test_decode_kernel_writes_bf16_where_the_output_projection_rounds_it():
    """The kernel's output is bf16 where the attention's one reader (through a RESHAPE) is the
    output projection of a target whose linears round their activation to bf16 (tpu-bf16,
    tpu-int8: patterns.read_as_bf16), float32 where it is not (xla-f32's float32 weights); what
    it saved (the convert after the kernel, 0.068 GiB a step on chip for the 31B at B = 64, TP
    = 4, est.) would come back with a float32 output."""
    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.ir.ops import Op
    from rvcompile.model.presets import get_preset

    def outputs(text):
        return [re.search(r"@tpu_custom_call\(.*-> tensor<[\dx]+x(\w+)>", line).group(1)
                for line in _kernel_calls(text)]

    assert outputs(_export_decode(("tpu",))["decode_2"]) == ["bf16", "bf16"]
    assert outputs(_export_decode(("tpu",), target="tpu-int8")["decode_2"]) == ["bf16", "bf16"]
    assert outputs(_export_decode(("tpu",), target="xla-f32")["decode_2"]) == ["f32", "f32"]
    cfg = get_preset("gemma-4-31B")
    cfg = dataclasses.replace(cfg, num_layers=2, layer_kinds=cfg.layer_kinds[4:6],
                              vocab_size=4096)
    for target, rounded in (("tpu-int8", True), ("xla-f32", False)):
        opts = BuildOptions(target=target, max_context=2048, max_seqs=2, platforms=("tpu",))
        g = lower_model(SimpleNamespace(config=cfg), opts, log=lambda s: None).layers[0]
        attn = [i for i, n in enumerate(g.nodes) if n.op is Op.ATTENTION]
        assert len(attn) == 1
        assert (attn[0] in patterns.read_as_bf16(g, reads(g))) is rounded


def _kernel_calls(text: str, name: str = "rv_paged_decode") -> list[str]:
    """The lines of StableHLO `text` that call the Pallas kernel `name` (the decode attention
    kernel; "rv_gated_mlp": mlp_kernel.py's)."""
    return [line for line in text.splitlines()
            if "@tpu_custom_call(" in line and f'kernel_name = "{name}"' in line]


def _export_decode(platforms, tp=1, static_pools=False, target="tpu-bf16") -> dict[str, str]:
    """The StableHLO text of each program of a 2-layer gemma-4-31B at 2048 tokens: one sliding
    layer (head dim 256, window 1024, a ring of 81 blocks) and one full K=V layer (512)."""
    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.model.presets import get_preset
    from rvcompile.targets.xla.export import lower_to_xla

    cfg = get_preset("gemma-4-31B")
    cfg = dataclasses.replace(cfg, num_layers=2, layer_kinds=cfg.layer_kinds[4:6],
                              vocab_size=4096)
    opts = BuildOptions(target=target, max_context=2048, max_seqs=2, platforms=platforms,
                        tp=tp, prefill_buckets=(16,))
    ir = lower_model(SimpleNamespace(config=cfg), opts, log=lambda s: None)
    low = lower_to_xla(ir, max_seqs=2, prefill_buckets=(16,), platforms=platforms, tp=tp,
                       static_pools=static_pools)
    return {name: jax.export.deserialize(bytearray(b)).mlir_module()
            for name, b in low.programs.items()}


def test_tpu_only_decode_runs_the_kernel():
    """The kernel runs in the decode steps of programs exported for TPU alone, for both layers:
    not in prefill (several query rows), not in programs exported for TPU and the CPU, not
    under tensor parallelism with symbolic pools (see lower.decode_kernel_fits), and there
    with static ones."""
    def kernels(text):
        return len(_kernel_calls(text))

    tpu = _export_decode(("tpu",))
    assert kernels(tpu["decode_2"]) == 2
    assert not kernels(tpu["prefill_16"]) and not kernels(tpu["logits_16"])
    assert not any(map(kernels, _export_decode(("tpu", "cpu")).values()))
    assert not kernels(_export_decode(("tpu",), tp=4)["decode_2"])
    assert kernels(_export_decode(("tpu",), tp=4, static_pools=True)["decode_2"]) == 2


def test_fixed_pools_rule():
    """The build fixes the pools of tensor-parallel programs for TPU alone, and no others."""
    from rvcompile.targets.xla.export import fixed_pools

    assert fixed_pools(("tpu",), 2) and fixed_pools(("tpu",), 8)
    assert not fixed_pools(("tpu",), 1)
    assert not fixed_pools(("tpu", "cpu"), 4) and not fixed_pools(("tpu", "cuda", "cpu"), 4)
    assert not fixed_pools(("cpu",), 2)


def test_tp_tpu_only_build_runs_the_kernel():
    """Through the build's lowering (XlaTarget.lower, as `rvcompile build --platforms tpu --tp 4`
    exports; no devices needed): the 2-layer 31B's pools are exported at a whole sequence per
    decode slot, the manifest says they are fixed, and decode_2 runs the kernel in both
    layers inside shard_map."""
    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.model.presets import get_preset
    from rvcompile.progress import Phases
    from rvcompile.targets import get_target

    cfg = get_preset("gemma-4-31B")
    cfg = dataclasses.replace(cfg, num_layers=2, layer_kinds=cfg.layer_kinds[4:6],
                              vocab_size=4096)
    target = get_target("tpu-bf16")
    opts = target.check_options(BuildOptions(
        target="tpu-bf16", max_context=2048, max_seqs=2, platforms=("tpu",), tp=4,
        prefill_buckets=(16,), decode_loop_steps=0))
    ir = lower_model(SimpleNamespace(config=cfg), opts, log=lambda s: None)
    low = target.lower(ir, opts, lambda s: None, Phases("test", "off"))
    xla = low.manifest["xla"]
    kv = xla["kv"]
    assert kv["fixed_blocks"] is True
    blocks = {k: v["default_blocks"] for k, v in kv["kinds"].items()}
    assert blocks == {k: 2 * v["table_width"] for k, v in kv["kinds"].items()}  # max_seqs 2
    assert kv["kinds"]["full"]["table_width"] == 2048 // 16
    loc = xla["programs"]["decode_2"]
    exp = jax.export.deserialize(bytearray(
        low.sections["programs"][loc["offset"]:loc["offset"] + loc["size"]]))
    assert exp.nr_devices == 4
    assert len(_kernel_calls(exp.mlir_module())) == 2
    pools = jax.tree.unflatten(exp.in_tree, exp.in_avals)[0][1]
    kind = {p["key"]: p["kind"] for p in kv["pools"]}
    assert {key: aval.shape[1] for key, aval in pools.items()} == {
        key: blocks[kind[key]] for key in pools}


@pytest.mark.parametrize("preset", ["gemma-4-26B-A4B", "gemma-4-E4B"])
def test_tp8_decode_runs_the_kernel_in_every_layer(preset):
    """At TP = 8, one lane, as `tpu_cost_report.py --tp 8 --max-seqs 1` exports (TPU alone,
    fixed pools): every attention layer of a shrunk 26B-A4B (MoE; its K=V full layer's 2
    KV heads stored 4 times, one a device) and E4B (2 KV heads stored 4 times; its last
    two layers read the first two's pools, KV sharing) runs the kernel, none the XLA
    lowering (docs/TPU_COST.md: the goal cases' estimates at TP = 8 rely on it)."""
    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.ir.ops import Op
    from rvcompile.model.presets import get_preset
    from rvcompile.targets.xla.export import lower_to_xla

    cfg = get_preset(preset)
    if preset == "gemma-4-E4B":
        cfg = dataclasses.replace(cfg, num_layers=4, layer_kinds=cfg.layer_kinds[4:6] * 2,
                                  num_kv_shared_layers=2, vocab_size=4096,
                                  vocab_size_per_layer_input=4096)
    else:
        cfg = dataclasses.replace(cfg, num_layers=2, layer_kinds=cfg.layer_kinds[4:6],
                                  vocab_size=4096)
    opts = BuildOptions(target="tpu-int8", max_context=2048, max_seqs=1, platforms=("tpu",),
                        tp=8, prefill_buckets=(16,))
    ir = lower_model(SimpleNamespace(config=cfg), opts, log=lambda s: None)
    low = lower_to_xla(ir, max_seqs=1, prefill_buckets=(16,), platforms=("tpu",), tp=8,
                       static_pools=True)
    text = jax.export.deserialize(bytearray(low.programs["decode_1"])).mlir_module()
    layers = sum(n.op is Op.ATTENTION for g in ir.layers for n in g.nodes)
    assert layers == cfg.num_layers
    assert len(_kernel_calls(text)) == layers


_HLO_INSTR = re.compile(r"^\s*(?:ROOT )?(\S+) = (.*?) ([\w-]+)\(", re.M)
_HLO_ARRAY = re.compile(r"\w+\[([\d,]*)\]")
_NO_WRITE = {"parameter", "get-tuple-element", "bitcast", "tuple"}  # name a value, write none
# a program's own whole-pool outputs: a token's rows written in place, loops and calls carrying
# the pools
_IN_PLACE = {"dynamic-update-slice", "scatter", "while", "conditional", "call"}


def whole_pool_writes(hlo: str, pools, skip=frozenset()) -> list[str]:
    """Instructions of an optimized HLO module that write an array of a pool's (or a scale
    pool's) whole shape, any layout, as "computation: name = opcode: shape": a copy or
    relayout of a whole pool (as XLA made of each int8 scale pool at the start and end of
    each call when it was the kernel's operand: docs/TPU_COST.md), but for opcodes in `skip`.
    `pools`: their shapes. An async start's shape is (operands, output, context): its output
    counts; a fusion's inner instructions do not (the fusion's output does), and a fusion
    whose root's opcode is in `skip` (a token's rows scattered in place) is skipped too."""
    dims = {tuple(x) for x in pools}
    roots = dict(re.findall(r"^(%[\w.-]+) .*\{\n(?:.*\n)*?\s*ROOT \S+ = .*? ([\w-]+)\(", hlo,
                            re.M))
    fused = set(re.findall(r" fusion\(.*?calls=(%[\w.-]+)", hlo))
    found = []
    comp = ""
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            comp = line.split(" ")[1 if line.startswith("ENTRY") else 0]
            comp = ("ENTRY " if line.startswith("ENTRY") else "") + comp
            continue
        m = _HLO_INSTR.match(line)
        if m is None or comp in fused:
            continue
        name, out, opcode = m.groups()
        if opcode == "fusion":
            called = re.search(r"calls=(%[\w.-]+)", line)
            opcode = f"fusion:{roots.get(called.group(1)) if called else None}"
        if opcode in skip or opcode.removeprefix("fusion:") in skip:
            continue
        arrays = _HLO_ARRAY.findall(out)
        if opcode.endswith("-start") and out.startswith("(("):  # past the operands' tuple
            arrays = _HLO_ARRAY.findall(out[out.index(")") + 1:])[:1]
        shapes = {tuple(int(d) for d in m.split(",") if d) for m in arrays}
        if shapes & dims and opcode not in _NO_WRITE:
            found.append(f"{comp}: {name} = {opcode}: {out}")
    return found


def test_whole_pool_writes_finds_a_relayout():
    """The check the traffic test makes, on the relayout XLA made of an int8 scale pool when
    the pool itself was the kernel's operand (the reverted 63e92a2, the 31B at 128K: lines
    written here with the shapes and layouts docs/TPU_COST.md quotes from its optimized HLO),
    and on what names or slices a pool without writing one."""
    hlo = """ENTRY %main (p: f32[10,8192,16,1]) -> f32[10,8192,16,1] {
  %copy.156 = f32[10,8192,16,1]{3,2,1,0:T(8,128)} copy(f32[10,8192,16,1]{1,3,2,0:T(1,128)} %p)
  %cs = (f32[10,8192,16,1]{1,3,2,0:T(1,128)}, f32[10,8192,16,1]{3,2,1,0:T(8,128)S(1)}, u32[]) copy-start(%p)
  %p = f32[10,8192,16,1]{1,3,2,0:T(1,128)} parameter(3)
  %gte = f32[10,8192,16,1]{1,3,2,0:T(1,128)} get-tuple-element(%t), index=0
  %ss = ((f32[10,8192,16,1]{1,3,2,0:T(1,128)}), f32[1,8192,16,1]{1,3,2,0:T(1,128)S(1)}, s32[]) slice-start(%p)
"""  # noqa: E501
    found = whole_pool_writes(hlo, [(10, 8192, 16, 1)])
    assert [x.split(" = ")[0] for x in found] == ["ENTRY %main: %copy.156", "ENTRY %main: %cs"]


def _traffic_child() -> None:
    """Compile the kernel for one v6e:1x1 device inside a jitted function of (weights, pools,
    ...), for a sliding layer and for a K=V full layer, bf16 and int8 (with scale pools), and
    print their traffic rows' KV bytes and other reads at two contexts and with none, and the
    instructions that write a whole pool."""
    from rvcompile.targets.xla.hlo_traffic import traffic
    from rvcompile.targets.xla.precompile import parse_topology, topology_devices

    dev = topology_devices(parse_topology("v6e:1x1"))[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    lanes, width, blocks = 3, 20, 64

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    freqs = np.asarray(ROPE_FULL.inv_freq(512), np.float32)[:64]

    def fn(weights, pools, q_sliding, q_full, table, q_pos):
        sliding = paged_decode(q_sliding * weights["s"], pools["k"], pools["v"],
                               jnp.asarray([1, 0]), table, q_pos, window=256, scale=1.0)
        full = paged_decode(q_full, pools["kv"], pools["kv"], jnp.asarray([0, 0]), table,
                            q_pos, window=None, scale=1.0,
                            fold=KeyFold(weights["k_norm"], freqs))
        sliding8 = paged_decode(q_sliding, pools["k8"], pools["v8"], jnp.asarray([0, 1]), table,
                                q_pos, window=256, scale=1.0,
                                scales=(pools["k8_scale"], pools["v8_scale"]))
        full8 = paged_decode(q_full, pools["kv8"], pools["kv8"], jnp.asarray([1, 1]), table,
                             q_pos, window=None, scale=1.0,
                             fold=KeyFold(weights["k_norm"], freqs),
                             scales=(pools["kv8_scale"], pools["kv8_scale"]))
        rows8 = paged_decode(q_sliding, pools["k8"], pools["v8"], jnp.asarray([1, 0]), table,
                             q_pos, window=256, scale=1.0,
                             scales=(pools["k8_rows"], pools["v8_rows"]))
        return sliding.sum() + full.sum() + sliding8.sum() + full8.sum() + rows8.sum()

    pool = sds((2, blocks, 16, 2 * 256), jnp.bfloat16)  # 2 KV heads of 256; 1 of 512
    pool8 = sds((2, blocks, 16, 2 * 256), jnp.int8)
    pools = {"k": pool, "v": pool, "kv": pool, "k8": pool8, "v8": pool8, "kv8": pool8,
             "k8_scale": sds((2, blocks, 16, 2), jnp.float32),
             "v8_scale": sds((2, blocks, 16, 2), jnp.float32),
             "kv8_scale": sds((2, blocks, 16, 1), jnp.float32),
             "k8_rows": sds((2, blocks, 1, 128), jnp.float32),
             "v8_rows": sds((2, blocks, 1, 128), jnp.float32)}
    compiled = jax.jit(fn).lower(
        {"s": sds((256,), jnp.float32), "k_norm": sds((512,), jnp.float32)},
        pools, sds((lanes, 2, 2, 256), jnp.float32),
        sds((lanes, 1, 8, 512), jnp.float32), sds((lanes, width), jnp.int32),
        sds((lanes,), jnp.int32)).compile()
    text = compiled.as_text()
    out = {"custom_calls": text.count('custom_call_target="tpu_custom_call"'),
           "whole_pool_writes": whole_pool_writes(text, {x.shape for x in pools.values()})}
    for context in (1000, 100, 40, None):
        rows = [r for r in traffic(text, ("weights", "pools"), context).rows
                if r.opcode == "custom-call"]
        out[str(context)] = sorted(r.read.get("kv", 0.0) for r in rows)
        out[f"{context} other"] = sorted(sum(r.read.values()) - r.read.get("kv", 0.0)
                                         for r in rows)
    print(json.dumps(out))


def test_traffic_counts_the_kernel_by_its_pages():
    """Against a hand count, compiled for v6e (Mosaic compiles both kinds): 3 lanes, pages of
    16 rows of 512 bf16 (16 KiB: 2 sliding KV heads of 256, or one full K=V head of 512), a
    table of 20 blocks. The sliding layer (window 256, K and V): at 1000 tokens a lane needs
    17 pages (positions 744 .. 999: blocks 46 .. 62); slot 0 DMAs pages 0, 8, 16, slots 1 .. 7
    two each: 17 a pool; at 100 tokens 7 pages and at 40 3, and the slots without one fetch
    their first page once: 8; with no context, its window's most pages: 17. The full K=V
    layer (one pool for keys and values): all 20 blocks at 1000 tokens and with no context
    (slots 0 .. 3 three pages, 4 .. 7 two), 8 at 100 (7 pages) and at 40. (Counted as its
    operands, the table would read the 2 MiB pools 8 or 16 times each.) The int8 sliding layer
    with its scales as row pools [2, 64, 1, 128] (2 heads' 32 scales a block, in one 512-byte
    row), paged in page slots of their own: its pages as the other int8 sliding layer's, and
    as many rows (512 bytes each) of K's and V's scales, no other scale operand."""
    got = run_with_libtpu(__file__, "traffic", timeout=600)
    page, page8 = 16 * 512 * 2, 16 * 512
    print(f"\n[measured] kernel custom calls' KV bytes by context: {got}")
    assert got["custom_calls"] == 5
    assert got["whole_pool_writes"] == []
    for context, sliding, full in (("1000", 17, 20), ("100", 8, 8), ("40", 8, 8),
                                   ("None", 17, 20)):
        assert got[context] == sorted([3 * 2 * sliding * page, 3 * full * page,
                                       3 * 2 * sliding * page8, 3 * full * page8,
                                       3 * 2 * sliding * (page8 + 512)])
        # the rest whole: prefetched scalars (284 bytes), the query (float32), a K=V layer's
        # k_norm weight and frequencies (2560), an int8 layer's scale rows [3, K, 3 * 128]
        # (3 steps) for K and V (K=V: one)
        sliding_rest, full_rest = 284 + 3 * 2 * 2 * 256 * 4, 284 + 3 * 8 * 512 * 4 + 2560
        assert got[f"{context} other"] == sorted([
            sliding_rest, full_rest, sliding_rest + 2 * 3 * 2 * 384 * 4,
            full_rest + 3 * 384 * 4, sliding_rest])


def _int8_program_child() -> None:
    """The decode program of a 2-layer 12B (a sliding layer of 8 KV heads, whose scales are a
    row pool, and a K=V full layer of one, whose scales are blocks [16, 1]) with int8 KV at
    128K tokens, one lane, exported for TPU alone and compiled for v6e:1x1: its kernel calls
    and its instructions that write a whole pool or scale pool, other than a token's rows
    written in place and the loops carrying the pools. Its vocabulary is cut to 4,096 (the
    pools, the layers and their kernel calls are the 12B's): on the 31B the 262,144-wide
    sampler, which reads no pool, took 22 of the compile's 33 s and wrote no pool- or
    scale-pool-shaped instruction (the same whole-pool writes at both vocabularies,
    measured)."""
    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.model.presets import get_preset
    from rvcompile.targets.xla.export import lower_to_xla
    from rvcompile.targets.xla.precompile import compile_entries, parse_topology, topology_devices

    cfg = get_preset("gemma-4-12B")
    cfg = dataclasses.replace(cfg, num_layers=2, layer_kinds=cfg.layer_kinds[4:6],
                              vocab_size=4096)
    opts = BuildOptions(target="tpu-int8", max_context=131072, max_seqs=1, platforms=("tpu",),
                        prefill_buckets=(16,))
    ir = lower_model(SimpleNamespace(config=cfg), opts, log=lambda s: None)
    low = lower_to_xla(ir, max_seqs=1, prefill_buckets=(16,), platforms=("tpu",))
    kv = low.manifest["kv"]
    blocks = {k: v["default_blocks"] for k, v in kv["kinds"].items()}
    pools = {p["key"]: (p["layers"], blocks[p["kind"]], *p["block_shape"]) for p in kv["pools"]}
    decode = compile_entries(low.programs, low.manifest,
                             topology_devices(parse_topology("v6e:1x1")),
                             names=("decode_1",))["decode_1"]
    text = decode.as_text()
    print(json.dumps({"pools": pools,
                      "custom_calls": text.count('custom_call_target="tpu_custom_call"'),
                      "writes": whole_pool_writes(text, pools.values(), _IN_PLACE)}))


def test_int8_decode_program_relays_no_value_pool():
    """With libtpu: the 2-layer 12B's decode step at 128K tokens (int8 KV pools, one lane) runs
    the kernel in both layers, and nothing in it writes a whole pool but XLA's staging of the
    scale pool of blocks [16, 1], once a step, in the entry computation (into on-chip memory,
    relaid from its entry layout, whose lanes run along the blocks, to one with blocks major,
    and back at the end): none inside the layer loop, none per kernel call, no int8 pool ever,
    and no row scale pool ever (the kernel pages its rows; the decode writes a lane's
    row in place). A row pool staged whole again (as when a scale pool [16, K] of K = 8 was:
    relaid with K padded to 128 lanes, 0.11 GiB a step of the 31B at TP = 4) or copied in and
    out of on-chip memory in each layer (as when the write was a scatter of its K lanes)
    fails here. The scale pools of one head keep blocks [16, 1], a row being 8 times their
    bytes (lower.scale_block_shape; docs/TPU_COST.md)."""
    got = run_with_libtpu(__file__, "int8_program", timeout=900)
    print("\n[measured] whole-pool writes:\n  " + "\n  ".join(got["writes"]))
    assert got["custom_calls"] == 2
    shapes = {k: f"[{','.join(map(str, v))}]" for k, v in got["pools"].items()}
    rows = {k for k, v in got["pools"].items() if k.endswith(".scale") and v[2] == 1}
    blocks = {k for k, v in got["pools"].items() if k.endswith(".scale") and v[2] == 16}
    assert rows and blocks, got["pools"]  # the sliding layer's rows, the full layer's blocks
    staged = {shapes[k] for k in blocks}
    for w in got["writes"]:
        assert w.startswith("ENTRY "), w  # once a step, never in the layer loop
        shape = re.sub(r"[a-z]\d*\[", "[", w.split(": ", 2)[2].split("{")[0]).lstrip("(")
        assert shape in staged, w  # a scale pool of blocks, never a row pool or an int8 pool


if __name__ == "__main__":
    if sys.argv[1:] == ["traffic"]:
        _traffic_child()
    if sys.argv[1:] == ["int8_program"]:
        _int8_program_child()
