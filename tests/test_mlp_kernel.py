"""The Pallas TPU gated-MLP kernel (targets/xla/mlp_kernel.py) and how the decode programs use
it (patterns.gated_mlps, lower.decode_mlp_kernel, run_graph's `mlp`): its values against the op by
op lowering, in Pallas' interpreter (any machine); which programs run it; the traffic table's
count of its stacked weights, compiled for v6e through libtpu where it is installed."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_kernel import _export_decode, _kernel_calls
from test_xla_topology import run_with_libtpu

from rvcompile.ir.graph import GraphBuilder, reads
from rvcompile.ir.ops import LinearAttrs, Op, RMSNormAttrs
from rvcompile.targets.xla import lower, patterns

LAYERS, WIDTH, HIDDEN, ROWS, ATTN = 3, 768, 256, 8, 512  # stacked layers, I, H, lanes, o_proj in
BOUND = 2e-6  # of the largest value: float32 rounding (the down dot summed in tiles of I)


def _weights(quantized: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """A layer stack's MLP weights (int8 with per-row scales, or bf16) and one layer's
    projection and norm weights, as the decode program's layer scan holds them."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in (("gate", (LAYERS, WIDTH, HIDDEN)), ("up", (LAYERS, WIDTH, HIDDEN)),
                        ("down", (LAYERS, HIDDEN, WIDTH)), ("o", (LAYERS, HIDDEN, ATTN))):
        if quantized:
            out[name] = rng.integers(-127, 128, shape).astype(np.int8)
            # scales making each product's terms about the size of a trained layer's
            out[name + ".scale"] = (rng.uniform(0.5, 1.5, shape[:2]) / 127
                                    / np.sqrt(shape[2])).astype(np.float32)
        else:
            out[name] = (rng.normal(size=shape) / np.sqrt(shape[2])).astype(jnp.bfloat16)
    for name in ("pre", "post"):
        out[name] = rng.normal(size=(LAYERS, HIDDEN)).astype(np.float32)
    return out


def _graph(quantized: bool, residual: bool):
    """A layer's MLP half as the front end builds it: [ADD(h, RMSNORM(LINEAR o(a), w_r)) ->]
    RMSNORM -> gate, up -> GELU_TANH x up -> down, the stream's next residual add after it."""
    b = GraphBuilder("mlp")
    shape = ("B", "T", HIDDEN)

    def linear(x, name, out, inp):
        ins = (x, b.param(name, (out, inp), "int8" if quantized else "bfloat16"))
        if quantized:
            ins += (b.param(name + ".scale", (out,)),)
        return b.add(Op.LINEAR, ins, LinearAttrs())

    h = b.arg("h", shape)
    x = h
    if residual:
        o = linear(b.arg("a", ("B", "T", ATTN)), "o", HIDDEN, ATTN)
        x = b.add(Op.ADD, (h, b.add(Op.RMSNORM, (o, b.param("post", (HIDDEN,))),
                                    RMSNormAttrs(1e-6))))
    n = b.add(Op.RMSNORM, (x, b.param("pre", (HIDDEN,))), RMSNormAttrs(1e-6))
    act = b.add(Op.GELU_TANH, (linear(n, "gate", WIDTH, HIDDEN),))
    y = linear(b.add(Op.MUL, (act, linear(n, "up", WIDTH, HIDDEN))), "down", HIDDEN, WIDTH)
    return b.build({"h": b.add(Op.ADD, (x, y)), "y": y})


def _run(g, weights, args, layer, mlp):
    """run_graph of `g` on layer `layer` of the stacks, with the kernel (`mlp`) or without:
    its outputs "h" (the stream after the MLP's residual add) and "y" (the MLP's), stacked."""
    stacks = {k: jnp.asarray(v) for k, v in weights.items()}
    param = lambda name: stacks[name][layer]  # noqa: E731

    def fn(args):
        kernel = mlp and functools.partial(mlp, stacked=lambda name: (stacks[name],
                                                                      jnp.int32(layer)))
        out = lower.run_graph(g, args, param, mlp=kernel)
        return jnp.stack([out["h"], out["y"]])

    return jax.jit(fn)(args)


@pytest.mark.parametrize("quantized", [True, False], ids=["int8", "bf16"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "plain"])
def test_kernel_equals_the_xla_lowering(quantized, residual):
    """A layer's MLP half through the kernel (Pallas' interpreter) against run_graph op by op:
    within float32 rounding of the largest value (BOUND; the down dot's sum over I runs in
    tiles), for int8 weights with their scales and bf16 ones, with the residual add (and the
    output projection's scale) in the kernel and without."""
    g = _graph(quantized, residual)
    mlps = patterns.gated_mlps(g, reads(g))
    assert len(mlps) == 1
    c = next(iter(mlps.values()))
    assert (c.add is not None, c.proj is not None) == (residual, residual and quantized)
    rng = np.random.default_rng(1)
    args = {"h": jnp.asarray(rng.normal(size=(ROWS, 1, HIDDEN)) * 4, jnp.float32),
            "a": jnp.asarray(rng.normal(size=(ROWS, 1, ATTN)), jnp.float32)}
    w = _weights(quantized)
    want = _run(g, w, args, 2, None)
    got = _run(g, w, args, 2, functools.partial(lower.decode_mlp_kernel, interpret=True))
    for name, a, b in zip(("stream", "mlp"), got, want, strict=True):
        err, top = float(jnp.max(jnp.abs(a - b))), float(jnp.max(jnp.abs(b)))
        print(f"\n[measured] {name}: max abs {err:.3g} of largest {top:.3g}")
        assert err <= BOUND * top
    # the same layer read from the stack: another layer gives other values
    other = _run(g, w, args, 1, None)[1]
    assert float(jnp.max(jnp.abs(other - want[1]))) > 100 * BOUND * float(
        jnp.max(jnp.abs(want[1])))


def test_run_graph_is_op_by_op_where_the_kernel_declines():
    """Where the kernel declines (mlp answers None: one lane, a prefill chunk, float32 weights)
    run_graph lowers the chain op by op: bit for bit what it computes without `mlp`."""
    g = _graph(True, True)
    rng = np.random.default_rng(2)
    args = {"h": jnp.asarray(rng.normal(size=(ROWS, 3, HIDDEN)), jnp.float32),
            "a": jnp.asarray(rng.normal(size=(ROWS, 3, ATTN)), jnp.float32)}
    w = _weights(True)
    declined = _run(g, w, args, 0, lambda *a, **k: None)
    assert np.array_equal(np.asarray(declined), np.asarray(_run(g, w, args, 0, None)))
    # decode_mlp_kernel itself declines a prefill chunk (T = 3) and a single lane
    assert np.array_equal(np.asarray(_run(g, w, args, 0, lower.decode_mlp_kernel)),
                          np.asarray(declined))
    one = {k: v[:1, :1] for k, v in args.items()}
    assert np.array_equal(np.asarray(_run(g, w, one, 0, lower.decode_mlp_kernel)),
                          np.asarray(_run(g, w, one, 0, None)))


def test_gated_mlps_of_the_31b_layers():
    """Each layer of the 31B (a sliding and a K=V full layer) has one gated MLP the kernel
    takes whole, with its residual add and its output projection (int8: a scale); an MLP
    whose normed rows have a third reader is left alone."""
    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.model.presets import get_preset

    cfg = get_preset("gemma-4-31B")
    cfg = dataclasses.replace(cfg, num_layers=2, layer_kinds=cfg.layer_kinds[4:6])
    opts = BuildOptions(target="tpu-int8", max_context=2048, max_seqs=2, platforms=("tpu",))
    for g in lower_model(SimpleNamespace(config=cfg), opts, log=lambda s: None).layers:
        mlps = patterns.gated_mlps(g, reads(g))
        assert len(mlps) == 1
        c = next(iter(mlps.values()))
        assert None not in (c.add, c.post, c.proj)
        assert [g.nodes[i].op for i in (c.proj, c.post, c.add, c.norm, c.gate, c.act, c.up,
                                        c.mul, c.down)] == [
            Op.LINEAR, Op.RMSNORM, Op.ADD, Op.RMSNORM, Op.LINEAR, Op.GELU_TANH, Op.LINEAR,
            Op.MUL, Op.LINEAR]
    g = _graph(True, False)
    n = next(iter(patterns.gated_mlps(g, reads(g)).values())).norm
    b = GraphBuilder("mlp")
    b.nodes = list(g.nodes)
    extra = b.add(Op.MUL, (n, n))
    g2 = b.build({**dict(g.outputs), "extra": extra})
    assert patterns.gated_mlps(g2, reads(g2)) == {}


def test_tpu_only_decode_runs_the_mlp_kernel():
    """The kernel runs in the decode steps of programs exported for TPU alone (B = 2), one call
    a layer, bf16 and int8, under tensor parallelism (static pools) too; not in prefill, not
    in programs exported for TPU and the CPU, not for xla-f32's float32 weights."""
    def calls(text):
        return len(_kernel_calls(text, "rv_gated_mlp"))

    for target in ("tpu-bf16", "tpu-int8"):
        tpu = _export_decode(("tpu",), target=target)
        assert calls(tpu["decode_2"]) == 2
        assert not calls(tpu["prefill_16"]) and not calls(tpu["logits_16"])
    assert not any(map(calls, _export_decode(("tpu", "cpu")).values()))
    assert not calls(_export_decode(("tpu",), target="xla-f32")["decode_2"])
    assert calls(_export_decode(("tpu",), tp=4, static_pools=True)["decode_2"]) == 2


def _traffic_child() -> None:
    """Compile the kernel for one v6e:1x1 device inside a jitted function of its stacks (int8,
    with the residual and the output projection's scale), and print its traffic row's reads
    by class, its write and the custom calls' count."""
    from rvcompile.targets.xla.hlo_traffic import traffic
    from rvcompile.targets.xla.mlp_kernel import gated_mlp
    from rvcompile.targets.xla.precompile import parse_topology, topology_devices

    dev = topology_devices(parse_topology("v6e:1x1"))[0]
    sh = jax.sharding.SingleDeviceSharding(dev)

    def sds(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    def fn(weights, x, h, layer):
        s = {k: weights[k][layer[0]] for k in ("gate.scale", "up.scale", "o.scale", "post",
                                               "pre")}
        stream, y = gated_mlp(x, s["pre"], 1e-6, layer, weights["gate"], weights["up"],
                              weights["down"], s["gate.scale"], s["up.scale"],
                              (h, s["post"], 1e-6, s["o.scale"]))
        return stream.sum() + y.sum()

    weights = {k: sds(v.shape, v.dtype) for k, v in _weights(True).items()}
    compiled = jax.jit(fn).lower(weights, sds((ROWS, HIDDEN)), sds((ROWS, HIDDEN)),
                                 sds((1,), jnp.int32)).compile()
    text = compiled.as_text()
    rows = [r for r in traffic(text, ("weights", "pools")).rows if r.opcode == "custom-call"]
    print(json.dumps({"custom_calls": len(rows), "read": rows[0].read,
                      "written": rows[0].written}))


def test_traffic_counts_the_kernels_stacked_weights_as_one_layer():
    """Against a hand count, compiled for v6e (Mosaic compiles the kernel): the gate, up and
    down stacks [3, 768, 256] / [3, 256, 768] int8 are read one layer each (3 x 196,608
    bytes, not the stacks' 3 x 589,824); the rest whole: x and h [8, 256] float32 and the
    layer index (the program's arguments), the layer's norm weights and scales (3 x 256 + 2 x
    768 float32, sliced from their stacks by XLA before the call), the two outputs [8, 256]
    float32."""
    got = run_with_libtpu(__file__, "traffic", timeout=600)
    print(f"\n[measured] the kernel's traffic row: {got}")
    assert got["custom_calls"] == 1
    assert got["read"] == {"weights": 3 * WIDTH * HIDDEN, "io": 2 * ROWS * HIDDEN * 4 + 4,
                           "temps": 4 * (3 * HIDDEN + 2 * WIDTH)}
    assert got["written"] == 2 * ROWS * HIDDEN * 4


if __name__ == "__main__":
    if sys.argv[1:] == ["traffic"]:
        _traffic_child()
