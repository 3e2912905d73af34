"""The Pallas TPU kernel for a layer's input norm and its q, k, v projections
(targets/xla/proj_kernel.py) and how the decode programs use it (patterns.normed_projections,
lower.decode_projections_kernel, run_graph's `proj`): its values against the op by op lowering
in Pallas' interpreter; which programs run it; the traffic table's count of its stacks."""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_kernel import _export_decode, _kernel_calls
from test_xla_topology import run_with_libtpu

from rvcompile.ir.graph import GraphBuilder, reads
from rvcompile.ir.ops import (
    KVWriteAttrs,
    LinearAttrs,
    Op,
    ReshapeAttrs,
    RMSNormAttrs,
    RopeAttrs,
)
from rvcompile.targets.xla import lower, patterns

LAYERS, HIDDEN, ROWS, D = 3, 256, 8, 128
HEADS = {"q": 4, "k": 2, "v": 2}
ROPE = RopeAttrs(tuple(10000.0 ** (-np.arange(D // 2) / (D // 2))))


def _graph(quantized: bool):
    """A layer's input norm read by its q, k and v projections, each split into heads; k's
    heads normed (with a weight) and rotated, v's normed, into their caches (bf16)."""
    b = GraphBuilder("qkv")
    n = b.add(Op.RMSNORM, (b.arg("h", ("B", "T", HIDDEN)), b.param("w", (HIDDEN,))),
              RMSNormAttrs(1e-6))
    pos = b.arg("positions", ("B", "T"), "int32")
    outs = {}
    for name, heads in HEADS.items():
        ins = (n, b.param(name, (heads * D, HIDDEN), "int8" if quantized else "bfloat16"))
        if quantized:
            ins += (b.param(name + ".scale", (heads * D,)),)
        lin = b.add(Op.LINEAR, ins, LinearAttrs())
        x = b.add(Op.RESHAPE, (lin,), ReshapeAttrs(("B", "T", heads, D)))
        if name == "q":
            outs[name] = x
            continue
        norm = (x, b.param(name + "_norm", (D,))) if name == "k" else (x,)
        x = b.add(Op.RMSNORM, norm, RMSNormAttrs(1e-6))
        if name == "k":
            x = b.add(Op.ROPE, (x, pos), ROPE)
        cache = b.arg("cache_" + name, ("B", 32, heads, D), "bfloat16")
        outs[name] = b.add(Op.KV_WRITE, (cache, x, pos), KVWriteAttrs(ring=False))
    return b.build(outs)


def _weights(quantized: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {"w": rng.normal(size=(LAYERS, HIDDEN)).astype(np.float32),
           "k_norm": rng.normal(size=(LAYERS, D)).astype(np.float32)}
    for name, heads in HEADS.items():
        shape = (LAYERS, heads * D, HIDDEN)
        if quantized:
            out[name] = rng.integers(-127, 128, shape).astype(np.int8)
            out[name + ".scale"] = (rng.uniform(0.5, 1.5, shape[:2]) / 127
                                    / np.sqrt(HIDDEN)).astype(np.float32)
        else:
            out[name] = (rng.normal(size=shape) / np.sqrt(HIDDEN)).astype(jnp.bfloat16)
    return out


def _run(g, weights, x, layer, proj):
    """run_graph of `g` on layer `layer` of the stacks for rows x [B, T, H] at positions 5 ..,
    empty caches, with the kernel (`proj`) or without."""
    stacks = {k: jnp.asarray(v) for k, v in weights.items()}
    b, t = x.shape[:2]
    args = {"h": x, "positions": jnp.broadcast_to(5 + jnp.arange(t, dtype=jnp.int32), (b, t))}
    for name in ("k", "v"):
        args["cache_" + name] = jnp.zeros((b, 32, HEADS[name], D), jnp.bfloat16)

    def fn(args):
        kernel = proj and functools.partial(proj, stacked=lambda name: (stacks[name],
                                                                        jnp.int32(layer)))
        return lower.run_graph(g, args, lambda name: stacks[name][layer], proj=kernel)

    return {k: np.asarray(v.astype(jnp.float32)) for k, v in jax.jit(fn)(args).items()}


@pytest.mark.parametrize("quantized", [True, False], ids=["int8", "bf16"])
def test_kernel_equals_the_xla_lowering(quantized):
    """The norm and three projections through the kernel (Pallas' interpreter) against
    run_graph op by op, with k's heads normed and rotated and v's normed into their bf16
    caches in the kernel: bit for bit here (the same arithmetic, one dot over all of H per
    output column), int8 with scales and bf16; declined with one lane or several rows a lane
    (op by op, bit for bit what run_graph computes without `proj`)."""
    g = _graph(quantized)
    (norm, projs), = patterns.normed_projections(g, reads(g)).items()
    assert g.nodes[norm].op is Op.RMSNORM and [p.heads for p in projs] == list(HEADS.values())
    ops = [[g.nodes[i].op if i is not None else None for i in (p.norm, p.rope)] for p in projs]
    assert ops == [[None, None], [Op.RMSNORM, Op.ROPE], [Op.RMSNORM, None]]
    assert [p.cache_dtype for p in projs] == [None, "bfloat16", "bfloat16"]
    w = _weights(quantized)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(ROWS, 1, HIDDEN)) * 3, jnp.float32)
    plain = _run(g, w, x, 2, None)
    got = _run(g, w, x, 2, functools.partial(lower.decode_projections_kernel, interpret=True))
    for name in HEADS:
        assert np.array_equal(got[name], plain[name]), name
    assert np.all(np.abs(got["k"][:, 5]).max(axis=-1) > 0)  # the caches' rows were written
    assert not np.array_equal(_run(g, w, x, 1, None)["q"], plain["q"])
    for rows in (x[:1], jnp.concatenate([x, x], axis=1)):
        declined = _run(g, w, rows, 2, lower.decode_projections_kernel)
        op_by_op = _run(g, w, rows, 2, None)
        assert all(np.array_equal(declined[k], op_by_op[k]) for k in HEADS)


def test_tpu_only_decode_runs_the_projections_kernel():
    """One call a layer in decode steps of programs exported for TPU alone (the 2-layer 31B:
    q, k, v of the sliding layer; q, k of the K=V full layer), bf16 and int8, under tensor
    parallelism (static pools) too; not in prefill, not for TPU and the CPU, not for xla-f32;
    and the MLP's pre-norm stays the gated MLP kernel's."""
    def calls(text):
        return len(_kernel_calls(text, "rv_normed_projections"))

    for target in ("tpu-bf16", "tpu-int8"):
        tpu = _export_decode(("tpu",), target=target)
        assert calls(tpu["decode_2"]) == 2
        assert len(_kernel_calls(tpu["decode_2"], "rv_gated_mlp")) == 2
        assert not calls(tpu["prefill_16"]) and not calls(tpu["logits_16"])
    assert not any(map(calls, _export_decode(("tpu", "cpu")).values()))
    assert not calls(_export_decode(("tpu",), target="xla-f32")["decode_2"])
    assert calls(_export_decode(("tpu",), tp=4, static_pools=True)["decode_2"]) == 2


def _traffic_child() -> None:
    """Compile the kernel for one v6e:1x1 device over int8 stacks and print its traffic row."""
    from rvcompile.targets.xla.hlo_traffic import traffic
    from rvcompile.targets.xla.precompile import parse_topology, topology_devices
    from rvcompile.targets.xla.proj_kernel import normed_projections

    dev = topology_devices(parse_topology("v6e:1x1"))[0]
    sh = jax.sharding.SingleDeviceSharding(dev)

    def sds(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    def fn(weights, x, layer):
        outs = normed_projections(x, weights["w"][layer[0]], 1e-6, layer,
                                  [weights[k] for k in HEADS],
                                  [weights[k + ".scale"][layer[0]] for k in HEADS])
        return sum(o.sum() for o in outs)

    weights = {k: sds(v.shape, v.dtype) for k, v in _weights(True).items()}
    text = jax.jit(fn).lower(weights, sds((ROWS, HIDDEN)), sds((1,), jnp.int32)).compile()
    rows = [r for r in traffic(text.as_text(), ("weights", "pools")).rows
            if r.opcode == "custom-call"]
    print(json.dumps({"custom_calls": len(rows), "read": rows[0].read,
                      "written": rows[0].written}))


def test_traffic_counts_the_kernels_stacked_weights_as_one_layer():
    """Against a hand count, compiled for v6e: the q, k, v stacks [3, N, 256] int8 (N = 512,
    256, 256) are read one layer each (262,144 bytes, not the stacks' 786,432); x [8, 256]
    float32 and the layer index whole; the layer's norm weight and scales (256 + 1024
    float32, sliced by XLA before the call); the outputs [8, N] float32."""
    got = run_with_libtpu(__file__, "traffic", timeout=600)
    print(f"\n[measured] the kernel's traffic row: {got}")
    assert got["custom_calls"] == 1
    assert got["read"] == {"weights": 1024 * HIDDEN, "io": ROWS * HIDDEN * 4 + 4,
                           "temps": 4 * (HIDDEN + 1024)}
    assert got["written"] == ROWS * 1024 * 4


if __name__ == "__main__":
    if sys.argv[1:] == ["traffic"]:
        _traffic_child()


@pytest.mark.parametrize("quantized", [True, False], ids=["int8", "bf16"])
def test_kernel_makes_the_previous_layers_end(quantized):
    """An ARG h given as the previous layer's end (lower.LayerEnd: (h0 + rmsnorm(y * s, w_r))
    * scalar, kept lazy by run_graph's `lazy_end`) goes into the kernel, which makes those
    rows with its input norm and returns them for the ARG's other readers (Pallas'
    interpreter): the rows within one float32 ulp of each value of the op by op lowering's
    (`LayerEnd.read`; the norm's mean summed in another order: measured 4.8e-7 of 8.3), the
    projections bit for bit run_graph's op by op on those rows; declined (one lane), read op
    by op once, bit for bit."""
    from rvcompile.ir.ops import RMSNormAttrs as Attrs

    g = _graph(quantized)
    w = _weights(quantized)
    rng = np.random.default_rng(4)
    h0, y = (jnp.asarray(rng.normal(size=(ROWS, 1, HIDDEN)) * k, jnp.float32) for k in (3, 50))
    s = jnp.asarray(rng.uniform(0.5, 1.5, HIDDEN) / 40, jnp.float32) if quantized else None
    w_r = jnp.asarray(rng.uniform(0.5, 1.5, HIDDEN), jnp.float32)
    scalar = jnp.asarray([0.7], jnp.float32)
    attrs = Attrs(1e-6)

    def end(h0, y):
        return lower.LayerEnd(h0, y, s, w_r, attrs, scalar, lambda: (h0 + lower.rmsnorm(
            attrs, y if s is None else y * s, w_r)) * scalar)

    stacks = {k: jnp.asarray(v) for k, v in w.items()}

    def run(h0, y, proj):
        b = h0.shape[0]
        h = end(h0, y) if y is not None else h0  # y None: h0 the rows themselves
        args = {"h": h, "positions": jnp.full((b, 1), 5, jnp.int32)}
        for name in ("k", "v"):
            args["cache_" + name] = jnp.zeros((b, 32, HEADS[name], D), jnp.bfloat16)
        kernel = proj and functools.partial(proj, stacked=lambda name: (stacks[name],
                                                                        jnp.int32(2)))
        seen = {}

        def spy(*a, **k):  # the rows the kernel returns for h's other readers
            out = kernel(*a, **k)
            if out is not None and isinstance(a[1], lower.LayerEnd):
                seen["rows"] = out[-1]
            return out

        outs = lower.run_graph(g, args, lambda name: stacks[name][2],
                               proj=spy if proj else None)
        return outs, seen.get("rows")

    def plain(h0, y):
        return end(h0, y).read()

    got, rows = jax.jit(lambda h0, y: run(h0, y, functools.partial(
        lower.decode_projections_kernel, interpret=True)))(h0, y)
    want, none = jax.jit(lambda h: run(h, None, None))(rows)
    assert none is None and rows is not None
    ref = jax.jit(plain)(h0, y)
    diff = np.abs(np.asarray(rows) - ref)
    print(f"\nthe previous layer's end made in the kernel: max abs {diff.max():.2e} of "
          f"{np.abs(ref).max():.2f}")
    assert np.all(diff <= np.spacing(np.abs(ref)))
    for name in HEADS:
        assert np.array_equal(np.asarray(got[name].astype(jnp.float32)),
                              np.asarray(want[name].astype(jnp.float32))), name
    one, _ = jax.jit(lambda h0, y: run(h0, y, lower.decode_projections_kernel))(h0[:1], y[:1])
    ref, _ = jax.jit(lambda h0, y: run(h0, y, None))(h0[:1], y[:1])
    assert all(np.array_equal(np.asarray(one[k]), np.asarray(ref[k])) for k in HEADS)
