"""The fusion passes (fuse_residual_norm, fuse_gated_mlp, fuse_qkv) against the IR's numpy
references, on the tiny presets (gemma-4-tiny: every feature; gemma-4-tiny-dense: a toy 31B)
with random weights, for the float32 IR and after cast_bf16 and cast_bf16 + quantize_int8.

For each pass, preset and dtype, and for the three passes composed: the pass fires where it
should (counted per layer, from the config), the result passes the spec check, a second run
returns the same object, and ReferenceModel gives the same logits before and after over a
20-token prefill and 3 decode steps. Also: the counts on the real 31B IR (shape only), the new
ops' spec rules, and the new ops' XLA lowerings (fused vs unfused tiny layers under jax.jit).

"The same" is bit for bit, at every dtype: each fused op's reference is the unfused ops'
references called in the same order on the same arrays (ref_linear per weight, ref_rmsnorm, the
ADD/MUL float32 steps), so there is no rounding difference to bound. A fused *kernel* may sum
differently; its tolerance belongs to the kernel's test against this reference.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from rvcompile.ir.frontend import build_model_ir
from rvcompile.ir.graph import GraphBuilder, ModelIR, check_model
from rvcompile.ir.interpret import ReferenceModel
from rvcompile.ir.ops import MultiLinearAttrs, Op, SliceLastAttrs, SpecError
from rvcompile.model.config import Gemma4Config
from rvcompile.model.presets import get_preset
from rvcompile.passes import (
    cast_bf16,
    fuse_gated_mlp,
    fuse_qkv,
    fuse_residual_norm,
    quantize_int8,
)
from rvcompile.passes.weight_math import encode
from rvcompile.sources.random_weights import random_tensors

PRESETS = ("gemma-4-tiny", "gemma-4-tiny-dense")
DTYPES = ("f32", "bf16", "int8")
PROMPT = 20
N_DECODE = 3
PASSES = {p.NAME: p for p in (fuse_residual_norm, fuse_gated_mlp, fuse_qkv)}
NEW_OP = {"fuse_residual_norm": Op.RESIDUAL_RMSNORM, "fuse_gated_mlp": Op.GATED_LINEAR,
          "fuse_qkv": Op.MULTI_LINEAR}


def expected_per_layer(name: str, cfg: Gemma4Config) -> list[int]:
    """How many nodes of the pass's new op each layer runs."""
    if name == "fuse_residual_norm":  # post-attn, post-ffw; PLE post-norm; MoE branch add
        return [2 + cfg.ple + s.moe for s in cfg.layers]
    if name == "fuse_gated_mlp":
        return [1 for _ in cfg.layers]
    return [0 if s.kv_shared else 1 for s in cfg.layers]  # a KV-shared layer has q alone


def per_layer(ir: ModelIR, op: Op) -> list[int]:
    counts = [sum(n.op is op for n in g.nodes) for g in ir.layers]
    return [counts[t] for t in ir.layer_template]


def outside_layers(ir: ModelIR, op: Op) -> int:
    return sum(n.op is op for g in (ir.embed, ir.head, ir.sampler) for n in g.nodes)


@functools.cache
def model(preset: str) -> tuple[dict[str, ModelIR], dict[str, np.ndarray]]:
    """The f32 / bf16 / int8 IRs of a preset and its float32 random checkpoint tensors."""
    cfg = get_preset(preset)
    f32 = build_model_ir(cfg, max_context=32, max_chunk=PROMPT)
    bf16 = cast_bf16.run(f32)
    irs = {"f32": f32, "bf16": bf16, "int8": quantize_int8.run(bf16)}
    return irs, {t.name: t.load() for t in random_tensors(cfg, seed=0)}


def weights(ir: ModelIR, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {p.name: encode(p.derive, tensors[p.source]) for p in ir.params}


def logits(ir: ModelIR, w: dict[str, np.ndarray]) -> np.ndarray:
    """Logits [PROMPT + N_DECODE, V]: one prefill step of PROMPT tokens, then one token a step."""
    ids = np.random.default_rng(7).integers(4, ir.config.vocab_size, PROMPT + N_DECODE)
    ids = ids.astype(np.int32)
    ref = ReferenceModel(ir, w)
    rows = [ref.step(ids[None, :PROMPT], np.array([0]), np.array([PROMPT]))[0]]
    for i in range(PROMPT, PROMPT + N_DECODE):
        rows.append(ref.step(ids[None, i:i + 1], np.array([i]), np.array([1]))[0])
    return np.concatenate(rows)


@functools.cache
def baseline(preset: str, dtype: str) -> np.ndarray:
    irs, tensors = model(preset)
    return logits(irs[dtype], weights(irs[dtype], tensors))


def check_same_function(preset: str, dtype: str, fused: ModelIR) -> None:
    _, tensors = model(preset)
    before = baseline(preset, dtype)
    after = logits(fused, weights(fused, tensors))
    print(f"\n{preset} {dtype} {fused.notes}: max abs {np.abs(after - before).max():.3g}")
    np.testing.assert_array_equal(after, before)  # bit for bit: see the module docstring


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", list(PASSES))
def test_fusion_pass(name, preset, dtype):
    ir = model(preset)[0][dtype]
    fused = PASSES[name].run(ir)
    check_model(fused)
    op = NEW_OP[name]
    assert per_layer(fused, op) == expected_per_layer(name, ir.config)
    assert outside_layers(fused, op) == 0
    assert fused.notes == (*ir.notes, name) and fused.params == ir.params
    assert PASSES[name].run(fused) is fused  # nothing left to fuse: the same object back
    if name == "fuse_residual_norm":  # the last add of every layer takes its layer_scalar
        scaled = [sum(n.op is op and len(n.inputs) == 4 for n in fused.layers[t].nodes)
                  for t in fused.layer_template]
        assert scaled == [1] * ir.config.num_layers
    if name == "fuse_qkv":  # q, k, v; q and k (K=V)
        widths = {(g.name, n.attrs.count) for g in fused.layers for n in g.nodes if n.op is op}
        assert {c for _, c in widths} == {2, 3}
    check_same_function(preset, dtype, fused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", PRESETS)
def test_all_fusions_together(preset, dtype):
    """The three passes composed (qkv first: it must leave the MLP's gate and up alone)."""
    ir = model(preset)[0][dtype]
    fused = fuse_residual_norm.run(fuse_gated_mlp.run(fuse_qkv.run(ir)))
    check_model(fused)
    for name, op in NEW_OP.items():
        assert per_layer(fused, op) == expected_per_layer(name, ir.config)
    linear_weights = {g.nodes[n.inputs[1]].attrs.name for g in fused.layers for n in g.nodes
                      if n.op is Op.LINEAR}
    assert not linear_weights & {"mlp.gate_proj.weight", "mlp.up_proj.weight"}
    check_same_function(preset, dtype, fused)


def test_counts_on_31b():
    """Shape-only: the real 31B IR (60 layers, every 6th full with K=V), f32 and int8."""
    f32 = build_model_ir(get_preset("gemma-4-31B"), max_context=4096, max_chunk=256)
    for ir in (f32, quantize_int8.run(cast_bf16.run(f32))):
        for name, p in PASSES.items():
            fused = p.run(ir)
            check_model(fused)
            assert sum(per_layer(fused, NEW_OP[name])) == {
                "fuse_residual_norm": 120, "fuse_gated_mlp": 60, "fuse_qkv": 60}[name]


def test_new_ops_reject_bad_inputs():
    b = GraphBuilder("bad")
    x = b.arg("x", ("B", "T", 8))
    w1, w2 = b.param("w1", (4, 8)), b.param("w2", (4, 8), "int8")
    s2 = b.param("w2.scale", (4,))
    with pytest.raises(SpecError):  # an int8 weight needs its scale
        b.add(Op.MULTI_LINEAR, (x, w1, w2), MultiLinearAttrs(2))
    with pytest.raises(SpecError):  # one scale for two weights
        b.add(Op.GATED_LINEAR, (x, w2, w2, s2))
    with pytest.raises(SpecError):
        b.add(Op.SLICE_LAST, (x,), SliceLastAttrs(4, 9))
    with pytest.raises(SpecError):  # residual and input shapes differ
        b.add(Op.RESIDUAL_RMSNORM, (b.arg("h", ("B", 1, 8)), x, b.param("n", (8,))))
    assert b.nodes[b.add(Op.GATED_LINEAR, (x, w2, w2, s2, s2))].shape == ("B", "T", 4)


@pytest.mark.parametrize("dtype", ["f32", "int8"])
def test_xla_lowerings_of_fused_ops(dtype):
    """rvcompile.targets.xla.lower runs the fused ops too (no XLA pipeline uses them yet): one
    tiny layer with q, k, v and one with q, k (K=V), fused vs unfused, gives the same bits."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from rvcompile.ir.graph import resolve_param
    from rvcompile.targets.xla.lower import run_graph
    from rvcompile.targets.xla.program import layout_shape

    irs, tensors = model("gemma-4-tiny")
    ir = irs[dtype]
    fused = fuse_residual_norm.run(fuse_gated_mlp.run(fuse_qkv.run(ir)))
    w = {k: jnp.asarray(v) for k, v in weights(ir, tensors).items()}
    rng = np.random.default_rng(3)
    for t in (0, 1):
        spec = ir.config.layers[ir.layer_template.index(t)]
        g = ir.layers[t]
        args = {"positions": jnp.arange(5, dtype=jnp.int32)[None],
                "cache_len": jnp.array([5], jnp.int32)}
        for name, node in g.args().items():
            if name not in args:
                shape = [{"B": 1, "T": 5}.get(d, d) for d in node.shape]
                args[name] = jnp.asarray(rng.standard_normal(shape, np.float32))
        # each weight as a program argument holds it (program.layout_shape: MoE gate/up rows)
        param = functools.partial(lambda s, rel: w[resolve_param(rel, s)].reshape(
            layout_shape(rel, w[resolve_param(rel, s)].shape)), spec)
        before, after = (jax.jit(functools.partial(run_graph, graph, param=param))(args)
                         for graph in (g, fused.layers[t]))
        for name in before:
            np.testing.assert_allclose(np.asarray(after[name]), np.asarray(before[name]),
                                       rtol=0, atol=1e-5)  # measured: the same bits
