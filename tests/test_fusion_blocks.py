"""The block fusion passes (fuse_attention, fuse_moe, fuse_ple, fuse_next_norm: what the H100
kernels run as units) against the IR's numpy references, on the tiny presets (gemma-4-tiny:
every feature; gemma-4-tiny-dense: a toy 31B) with random weights, float32 and after cast_bf16 +
quantize_fp8 (the h100-fp8 IR) or + quantize_int8 (a quantized per-layer table).

Each pass runs after the three fusions it expects (fuse_residual_norm, fuse_gated_mlp,
fuse_qkv), alone and all four together as the h100 pipelines run them: it fires where it should
(counted per layer, from the config), what it swallows is gone, the result passes the spec
check, a second run returns the same object, and ReferenceModel gives the same logits bit for bit
as the unfused IR over a 20-token prefill and 3 decode steps (each new op's reference is the
replaced ops' references in the same order). Also: every preset's h100 pipelines leave only ops
the H100 lowering has launches for, `--dump-ir` shows the blocks, and the new ops' spec rules.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from test_fusion_passes import baseline, logits, model, weights

from rvcompile.build import BuildOptions, lower_model
from rvcompile.ir.graph import Graph, GraphBuilder, ModelIR, check_graph, check_model
from rvcompile.ir.ops import (
    AttentionBlockAttrs,
    KVStoreAttrs,
    MoEBlockAttrs,
    Op,
    PleEmbedAttrs,
    RMSNormAttrs,
    RopeAttrs,
    SpecError,
)
from rvcompile.model.config import Gemma4Config
from rvcompile.model.presets import PRESETS, get_preset
from rvcompile.passes import (
    fuse_attention,
    fuse_gated_mlp,
    fuse_moe,
    fuse_next_norm,
    fuse_ple,
    fuse_qkv,
    fuse_residual_norm,
    quantize_fp8,
)
from rvcompile.sources.model_source import ModelSource
from rvcompile.targets import registry
from rvcompile.targets.h100.launches import LOWER

PASSES = {p.NAME: p for p in (fuse_attention, fuse_moe, fuse_ple, fuse_next_norm)}
# What each pass swallows: none of these ops is left in a layer after it.
GONE = {"fuse_attention": {Op.ATTENTION, Op.KV_WRITE, Op.ROPE, Op.CACHE_POSITIONS,
                           Op.SLICE_LAST},
        "fuse_moe": {Op.MOE, Op.SCALE}, "fuse_ple": {Op.GELU_TANH},
        "fuse_next_norm": set()}


@functools.cache
def irs(preset: str) -> tuple[dict[str, ModelIR], dict[str, np.ndarray]]:
    """The f32 / bf16 / int8 / fp8 IRs of a preset and its random checkpoint tensors."""
    base, tensors = model(preset)
    return {**base, "fp8": quantize_fp8.run(base["bf16"])}, tensors


def prefused(preset: str, dtype: str) -> ModelIR:
    ir = irs(preset)[0][dtype]
    return fuse_qkv.run(fuse_gated_mlp.run(fuse_residual_norm.run(ir)))


def reference_logits(preset: str, dtype: str) -> np.ndarray:
    if dtype != "fp8":
        return baseline(preset, dtype)
    ir, tensors = irs(preset)[0]["fp8"], irs(preset)[1]
    return logits(ir, weights(ir, tensors))


def per_layer(ir: ModelIR, op: Op) -> list[int]:
    counts = [sum(n.op is op for n in g.nodes) for g in ir.layers]
    return [counts[t] for t in ir.layer_template]


def expected(name: str, cfg: Gemma4Config) -> dict[Op, list[int]]:
    """Per layer, how many nodes of each new op the pass leaves."""
    if name == "fuse_attention":
        stores = [0 if s.kv_shared else 1 if s.k_eq_v else 2 for s in cfg.layers]
        return {Op.ATTENTION_BLOCK: [1] * cfg.num_layers, Op.KV_STORE: stores}
    if name == "fuse_moe":
        return {Op.MOE_BLOCK: [int(s.moe) for s in cfg.layers]}
    if name == "fuse_ple":
        return {Op.PLE_PROJECTION: [int(cfg.ple > 0)] * cfg.num_layers}
    # the post-attention add's (the MLP's pre-norm) and the last add's (the next input norm)
    return {Op.NEXT_NORM: [2] * cfg.num_layers}


def check_fused(name: str, before: ModelIR, after: ModelIR, dtype: str) -> None:
    cfg = before.config
    for op, counts in expected(name, cfg).items():
        assert per_layer(after, op) == counts, op
    left = {n.op for g in after.layers for n in g.nodes}
    assert not left & GONE[name]
    if name == "fuse_ple":  # an int8 per-layer table is a quantized EMBED: not fused
        want = int(cfg.ple > 0 and dtype != "int8")
        assert sum(n.op is Op.PLE_EMBED for n in after.embed.nodes) == want
    if name == "fuse_next_norm":
        check_handed_on(before, after)


def check_handed_on(before: ModelIR, after: ModelIR) -> None:
    """Every layer and the head take "x"; the head no longer takes "h"; the last layer's
    template is its own (its "x" is normed with the head's weight)."""
    for g in (*after.layers, after.head):
        assert "x" in g.args()
    assert "h" not in after.head.args()
    assert "x" in dict(after.embed.outputs)
    last = after.layer_template[-1]
    assert after.layer_template.count(last) == 1
    assert len(after.layers) <= len(before.layers) + 1


@pytest.mark.parametrize("dtype", ["f32", "fp8", "int8"])
@pytest.mark.parametrize("preset", ["gemma-4-tiny", "gemma-4-tiny-dense"])
@pytest.mark.parametrize("name", list(PASSES))
def test_block_fusion_pass(name, preset, dtype):
    ir = prefused(preset, dtype)
    fused = PASSES[name].run(ir)
    if name in ("fuse_moe", "fuse_ple") and preset == "gemma-4-tiny-dense":
        assert fused is ir  # no MoE, no PLE: nothing to fuse, the same object back
        return
    check_model(fused)
    check_fused(name, ir, fused, dtype)
    assert fused.notes == (*ir.notes, name) and fused.params == ir.params
    assert fused.caches == ir.caches
    assert PASSES[name].run(fused) is fused
    _, tensors = irs(preset)
    np.testing.assert_array_equal(logits(fused, weights(fused, tensors)),
                                  reference_logits(preset, dtype))


@pytest.mark.parametrize("dtype", ["f32", "fp8"])
@pytest.mark.parametrize("preset", ["gemma-4-tiny", "gemma-4-tiny-dense"])
def test_block_fusions_together(preset, dtype):
    """The four passes in the h100 pipelines' order."""
    ir = prefused(preset, dtype)
    fused = ir
    for p in PASSES.values():
        fused = p.run(fused)
        check_model(fused)
    for name in PASSES:
        for op, counts in expected(name, ir.config).items():
            assert per_layer(fused, op) == counts
    _, tensors = irs(preset)
    np.testing.assert_array_equal(logits(fused, weights(fused, tensors)),
                                  reference_logits(preset, dtype))


def _shape_only(preset: str, target: str, dump_ir: str | None = None, log=None) -> ModelIR:
    source = ModelSource(get_preset(preset), (), "", {}, None, preset)
    opts = BuildOptions(target, max_context=1024, prefill_buckets=(16, 64), dump_ir=dump_ir)
    return lower_model(source, opts, log=log or (lambda s: None))


@pytest.mark.parametrize("target", [t for t, s in registry().items() if s.runtime == "h100"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_h100_pipelines_leave_only_ops_with_launches(preset, target):
    """Shape only: after the pipeline, every op of every graph has an entry in the H100
    lowering's table, and the blocks are there (one attention block per layer)."""
    ir = _shape_only(preset, target)
    ops = {n.op for g in ir.graphs() for n in g.nodes}
    assert ops <= set(LOWER), sorted(o.value for o in ops - set(LOWER))
    assert per_layer(ir, Op.ATTENTION_BLOCK) == [1] * ir.config.num_layers
    assert per_layer(ir, Op.MOE_BLOCK) == [int(s.moe) for s in ir.config.layers]


def test_h100_lowering_matches_no_patterns():
    """Without the block passes the H100 lowering refuses the unfused ops, naming them: it does
    not trace attention clusters itself."""
    from rvcompile.targets.h100.lower import LoweringError, lower_to_h100

    ir = prefused("gemma-4-tiny-dense", "fp8")
    with pytest.raises(LoweringError, match=r"layer0_template, node %\d+ \(\w+\): no H100 "):
        lower_to_h100(ir, slots=1, prefill_buckets=(4,))


def test_dump_ir_shows_the_blocks():
    out: list[str] = []
    _shape_only("gemma-4-tiny", "h100-fp8", dump_ir="fuse_next_norm", log=out.append)
    [text] = out
    for op in ("attention_block", "kv_store", "moe_block", "ple_embed", "ple_projection",
               "next_norm", "residual_rmsnorm"):
        assert f"= {op}(" in text, op
    assert "= attention(" not in text and "= moe(" not in text


# ---------------------------------------------------------------- the new ops' spec rules

def test_new_ops_reject_bad_inputs():
    b = GraphBuilder("bad")
    qkv = b.arg("qkv", ("B", "T", 64))
    pos = b.arg("positions", ("B", "T"), "int32")
    cache_len = b.arg("cache_len", ("B",), "int32")
    cache = b.arg("cache_k", ("B", 32, 1, 16))
    w16 = b.param("w16", (16,))
    rope = RopeAttrs((0.5,) * 8)
    store = KVStoreAttrs(32, 1, 16, 1e-6, rope, False)
    ok = b.add(Op.KV_STORE, (cache, qkv, pos, w16), store)
    assert b.nodes[ok].shape == ("B", 32, 1, 16)
    with pytest.raises(SpecError):  # columns past the projection
        b.add(Op.KV_STORE, (cache, qkv, pos), KVStoreAttrs(56, 1, 16, 1e-6, None, False))
    with pytest.raises(SpecError):  # RoPE frequencies for another head dim
        b.add(Op.KV_STORE, (cache, qkv, pos), KVStoreAttrs(32, 1, 16, 1e-6, RopeAttrs((1.0,)),
                                                           False))
    block = AttentionBlockAttrs(2, 16, 1e-6, rope, None, 1.0, False, False)
    att = b.add(Op.ATTENTION_BLOCK, (qkv, pos, cache_len, w16, ok, ok), block)
    assert b.nodes[att].shape == ("B", "T", 2, 16)
    with pytest.raises(SpecError):  # a K=V block's last input is the k norm, not a cache
        b.add(Op.ATTENTION_BLOCK, (qkv, pos, cache_len, w16, ok, ok),
              AttentionBlockAttrs(2, 16, 1e-6, rope, None, 1.0, False, True))
    with pytest.raises(SpecError):  # 5 x 16 query columns of a 64-column projection
        b.add(Op.ATTENTION_BLOCK, (qkv, pos, cache_len, w16, ok, ok),
              AttentionBlockAttrs(5, 16, 1e-6, rope, None, 1.0, False, False))
    h = b.arg("h", ("B", "T", 8))
    w8 = b.param("w8", (8,))
    router = b.param("router", (4, 8))
    gate_up, down = b.param("gate_up", (4, 6, 8)), b.param("down", (4, 8, 3))
    pes = b.param("pes", (4,))
    moe_in = (h, h, w8, router, w8, pes, gate_up, down, w8, w8)
    assert b.nodes[b.add(Op.MOE_BLOCK, moe_in, MoEBlockAttrs(2, 1e-6, 0.5))].shape == (
        "B", "T", 8)
    with pytest.raises(SpecError):  # quantized experts without their scales
        b.add(Op.MOE_BLOCK, moe_in, MoEBlockAttrs(2, 1e-6, 0.5, quantized=True))
    ctx = b.arg("ctx", ("B", "T", 12))
    ids = b.arg("tokens", ("B", "T"), "int32")
    table, w4 = b.param("table", (10, 12)), b.param("w4", (4,))
    ple_embed = b.add(Op.PLE_EMBED, (ctx, table, ids, w4), PleEmbedAttrs(3, 4, 1.0, 2.0, 0.7, 1e-6))
    assert b.nodes[ple_embed].shape == ("B", "T", 3, 4)
    with pytest.raises(SpecError):  # 12 columns are not 2 layers of 4
        b.add(Op.PLE_EMBED, (ctx, table, ids, w4), PleEmbedAttrs(2, 4, 1.0, 2.0, 0.7, 1e-6))
    gate, ple = b.arg("gate", ("B", "T", 4)), b.arg("ple", ("B", "T", 4))
    proj = b.param("proj", (8, 4))
    assert b.nodes[b.add(Op.PLE_PROJECTION, (gate, ple, proj))].shape == ("B", "T", 8)
    with pytest.raises(SpecError):  # gate and per-layer input of different shapes
        b.add(Op.PLE_PROJECTION, (gate, h, proj))


def test_next_norm_must_read_one_residual():
    b = GraphBuilder("g")
    h, x = b.arg("h", ("B", "T", 8)), b.arg("x", ("B", "T", 8))
    w = b.param("w", (8,))
    eps = RMSNormAttrs(1e-6)
    r = b.add(Op.RESIDUAL_RMSNORM, (h, x, w), eps)
    first = b.add(Op.NEXT_NORM, (r, w), eps)
    check_graph(b.build({"y": first}))
    second = b.add(Op.NEXT_NORM, (r, w), eps)  # a residual writes one normed copy
    with pytest.raises(SpecError, match="only next_norm"):
        check_graph(b.build({"y": second}))
    c = GraphBuilder("g")
    plain = c.add(Op.NEXT_NORM, (c.arg("h", ("B", "T", 8)), c.param("w", (8,))), eps)
    with pytest.raises(SpecError, match="reads %0 \\(arg\\)"):
        check_graph(Graph("g", tuple(c.nodes), (("y", plain),)))
