"""A decode step meets each weight byte once (issue 19): no instruction of the compiled program
materializes a whole weight matrix or table (hlo_traffic.Traffic.whole_copies).

On the CPU: the detector flags a weight converted ahead of a dot and passes the decode row's
multiply-reduce (lower.linear). With libtpu (scripts/setup.sh puts it in .venv/tpu-aot), in a
subprocess compiling for a v6e:1x1 topology without a TPU: the lowerings of issue 19 have no whole
copy where the forms they replaced have one (so the check fails on them): an int8 table's row
lookup (lower.take_rows against jnp.take, which TPU serves by relayouting the whole table) and
the MoE decode (lower.moe's picked experts against a gather of the chosen experts from a layer
of the stacked experts, which TPU serves by copying the layer's whole expert array). The tiny
model's whole decode program is checked by test_xla_topology's TPU build. The same child checks
that a layer scan of dots (B = 4) reads each layer of the stacked weight once, and counts the one
all-reduce of a row-parallel projection over a v6e:2x2 slice (Traffic.collectives), and
the collectives term of the cost report is checked by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_xla_topology import _libtpu_env

from rvcompile.ir import ops
from rvcompile.targets.xla import lower
from rvcompile.targets.xla.cost_report import (
    ASSUMED_COLLECTIVE_LATENCY_S,
    CHIPS,
    collectives_term,
)
from rvcompile.targets.xla.hlo_traffic import traffic

ROOTS = ("weights", "pools")  # the jitted functions' own parameter names
sds = jax.ShapeDtypeStruct


def _whole_copies(fn, *args) -> list[str]:
    return [r.name for r in traffic(jax.jit(fn).lower(*args).compile().as_text(),
                                    ROOTS).whole_copies()]


def test_a_weight_widened_ahead_of_a_dot_is_a_whole_copy():
    w = {"w": sds((512, 256), jnp.int8)}
    x = sds((1, 256), jnp.float32)

    def widened(weights, x):
        return jnp.einsum("bk,nk->bn", x.astype(jnp.bfloat16),
                          weights["w"].astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    assert _whole_copies(widened, w, x)
    assert not _whole_copies(lambda weights, x: lower.linear(None, x, weights["w"]), w, x)
    # vectors (norms, per-row scales) are never whole copies, even copied whole
    assert not _whole_copies(lambda weights, x: x * jnp.flip(weights["v"]),
                             {"v": sds((256,), jnp.float32)}, x)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32])
def test_take_rows_is_take_bit_for_bit(dtype):
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.normal(0, 30, (512, 40)), dtype)
    table = table.at[7].set(jnp.asarray(-0.0).astype(dtype))  # a float's -0 keeps its sign
    ids = jnp.asarray([[7, 0, 511, 32, 31], *rng.integers(0, 512, (2, 5))], jnp.int32)
    got, want = lower.take_rows(table, ids), jnp.take(table, ids, axis=0)
    assert got.dtype == want.dtype
    assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def _tpu_child() -> None:
    """Compile each form for v6e:1x1 and print {form: whole copies}."""
    from jax.experimental import topologies

    dev = topologies.get_topology_desc("v6e:1x1", "tpu", chips_per_host_bounds=[1, 1, 1]).devices
    assert dev[0].platform == "tpu"
    # big enough that TPU keeps them in HBM (smaller ones it prefetches into VMEM whole)
    v, h, e, k, im, layers = 65536, 2048, 32, 4, 512, 3
    table = {"embed_tokens.weight": sds((v, h), jnp.int8)}
    ids = sds((1, 1), jnp.int32)
    experts = {"g0.0.experts.gate_up_proj": sds((layers, e, 2 * im, h), jnp.int8),
               "g0.0.experts.down_proj": sds((layers, e, h, im), jnp.int8)}
    x = sds((1, h), jnp.float32)
    attrs = ops.MoEAttrs(k, quantized=True)

    def layers_of(one_layer):
        def fn(weights, x):
            def body(h, p):
                gu, dn = (jax.lax.dynamic_index_in_dim(weights[f"g0.0.experts.{n}"], p, 0, False)
                          for n in ("gate_up_proj", "down_proj"))
                return h + one_layer(h, gu, dn), None
            return jax.lax.scan(body, x, jnp.arange(layers))[0]
        return fn

    def picked(h, gu, dn):
        return lower.moe(attrs, h, h[:, :e], jnp.ones(e), gu, dn)

    def gathered(h, gu, dn):  # the lowering before issue 19: the chosen experts gathered
        _, idx = jax.lax.top_k(h[:, :e], k)
        g = jnp.einsum("nh,nkih->nki", h.astype(jnp.bfloat16), gu[idx].astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
        hidden = (lower.gelu_tanh(g[..., :im]) * g[..., im:]).astype(jnp.bfloat16)
        return jnp.einsum("nki,nkhi->nh", hidden, dn[idx].astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)

    forms = {"take_rows": (lambda weights, i: lower.take_rows(
                 weights["embed_tokens.weight"], i).astype(jnp.float32), table, ids),
             "take": (lambda weights, i: jnp.take(
                 weights["embed_tokens.weight"], i, axis=0).astype(jnp.float32), table, ids),
             "moe_picked": (layers_of(picked), experts, x),
             "moe_gathered": (layers_of(gathered), experts, x)}
    out = {}
    for name, (fn, *args) in forms.items():
        compiled = jax.jit(fn, device=dev[0]).lower(*args).compile()
        out[name] = [r.name for r in traffic(compiled.as_text(), ROOTS).whole_copies()]
    # B = 4 rows through a layer scan of bf16 dots: TPU's dot fusion slices the layer out of
    # the stacked int8 weight in a nested fusion; the table reads each layer once a call
    stack = {"g0.0.w": sds((layers, 2048, 2048), jnp.int8)}

    def dots(weights, x):
        def body(h, w):
            return jnp.tanh(lower.linear(None, h, w)), None
        return jax.lax.scan(body, x, weights["g0.0.w"])[0]

    compiled = jax.jit(dots, device=dev[0]).lower(stack, sds((4, 2048), jnp.float32)).compile()
    out["dot_weights_read"] = traffic(compiled.as_text(), ROOTS).by_class()["weights"]["read"]
    # a row-parallel projection over 4 chips: one all-reduce of its [1, 4096] float32 output
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    four = topologies.get_topology_desc("v6e:2x2", "tpu", chips_per_host_bounds=[2, 2, 1])
    mesh = Mesh(np.array(sorted(four.devices, key=lambda d: d.id)), ("tp",))
    w = {"o_proj": sds((4096, 8192), jnp.int8, sharding=NamedSharding(mesh, PartitionSpec(
        None, "tp")))}
    xs = sds((1, 8192), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "tp")))
    compiled = jax.jit(lambda weights, x: lower.linear(None, x, weights["o_proj"])).lower(
        w, xs).compile()
    out["collectives"] = traffic(compiled.as_text(), ROOTS).collectives()
    print(json.dumps(out))


def test_tpu_decode_lowerings_copy_no_whole_weight():
    env = _libtpu_env()
    if env is None:
        pytest.skip("libtpu is not installed (scripts/setup.sh puts it in .venv/tpu-aot)")
    p = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env,
                       timeout=300, cwd=Path(__file__).parent)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["take_rows"] == [] and got["moe_picked"] == [], got
    assert got["take"] and got["moe_gathered"], got  # the check fails on the forms replaced
    assert got["collectives"] == {"all-reduce": {"count": 1, "bytes": 4096 * 4}}
    assert got["dot_weights_read"] == 3 * 2048 * 2048


def test_collectives_term():
    """Ring transfers at the chip's ICI bandwidth plus the assumed latency per collective."""
    chip = CHIPS["v6e"]
    ops = {"all-reduce": {"count": 120, "bytes": 120 * 5376 * 4},
           "all-gather": {"count": 1, "bytes": 262144 * 4}}
    t = collectives_term(ops, 4, chip)
    wire = 1.5 * 120 * 5376 * 4 + 0.75 * 262144 * 4
    assert t["count"] == 121
    assert t["transfer_ms"] == pytest.approx(wire / 448e9 * 1e3)
    assert t["latency_ms"] == pytest.approx(121 * ASSUMED_COLLECTIVE_LATENCY_S * 1e3)
    assert t["ms"] == pytest.approx(t["transfer_ms"] + t["latency_ms"])
    assert collectives_term({}, 4, chip)["ms"] == 0 == collectives_term(ops, 1, chip)["ms"]


if __name__ == "__main__":
    _tpu_child()
