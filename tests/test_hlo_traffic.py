"""The traffic table of a compiled program (targets/xla/hlo_traffic.py), on CPU programs.

Checked against XLA's own figure: on a program without loops the table's total is XLA's cost
analysis "bytes accessed" within 1% (XLA counts the same operands and outputs; measured, it also
counts a few scalar bytes the table leaves out: 16 of 36,604 bytes on the first program here). A
scan's body is scaled by its trip count, which XLA's figure is not. Classes follow the program's
arguments: weights, embeddings (`*embed*` weights), KV pools, io, and computed values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from rvcompile.targets.xla.hlo_traffic import shape_bytes, traffic

ROOTS = ("weights", "pools")  # the jitted functions' own parameter names
TOLERANCE = 0.01  # of XLA's bytes accessed; see the module docstring


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _decode_like(weights, pools, x):
    h = x @ weights["w"].astype(jnp.float32) * weights["w.scale"]
    logits = jnp.tanh(h) @ weights["embed"].T
    return {k: v + 1 for k, v in pools.items()}, logits.sum()


WEIGHTS = {"w": sds((64, 32), jnp.int8), "w.scale": sds((32,), jnp.float32),
           "embed": sds((100, 32), jnp.float32)}
POOLS = {"kv": sds((4, 16, 8), jnp.bfloat16)}


def _xla_bytes(compiled) -> float:
    return float(compiled.cost_analysis()["bytes accessed"])


def test_totals_equal_xla_cost_analysis_without_loops():
    compiled = jax.jit(_decode_like, donate_argnums=(1,)).lower(
        WEIGHTS, POOLS, sds((2, 64), jnp.float32)).compile()
    t = traffic(compiled.as_text(), ROOTS)
    assert not t.trips and not t.unknown_trips
    assert t.total() == t.total(scaled=False)
    assert abs(t.total() - _xla_bytes(compiled)) <= TOLERANCE * _xla_bytes(compiled)
    cls = t.by_class()
    # every weight byte is read once, the embedding table once, the pool read and written once
    assert cls["weights"]["read"] == 64 * 32 + 32 * 4
    assert cls["embeddings"]["read"] == 100 * 32 * 4
    assert cls["kv"]["read"] == cls["kv"]["written"] == 4 * 16 * 8 * 2
    assert cls["io"]["read"] == 2 * 64 * 4
    assert sum(v["read"] + v["written"] for v in cls.values()) == t.total()


def _scan(ws, x):
    def body(h, w):
        return jnp.tanh(h @ w), None
    return jax.lax.scan(body, x, ws)[0]


def test_a_scan_is_scaled_by_its_trip_count():
    layers = 10
    compiled = jax.jit(lambda weights, x: _scan(weights["w"], x)).lower(
        {"w": sds((layers, 64, 64), jnp.float32)}, sds((2, 64), jnp.float32)).compile()
    t = traffic(compiled.as_text(), ROOTS)
    assert list(t.trips.values()) == [layers] and not t.unknown_trips
    # each iteration slices one layer: the stack is read once a call, not once an iteration
    assert t.by_class()["weights"]["read"] == layers * 64 * 64 * 4
    body = sum(r.bytes for r in t.rows if r.runs == layers)
    assert body > 0 and t.total() == t.total(scaled=False) + (layers - 1) * body
    # XLA's figure counts the body once, as the table's unscaled total does
    assert abs(t.total(scaled=False) - _xla_bytes(compiled)) <= TOLERANCE * _xla_bytes(compiled)


def test_a_pool_carried_through_the_layer_scan_stays_kv():
    """Decode's shape: a scan over layers writes one row of the layer's cache in place and
    reads the layer's whole cache; each layer's slice is read once a step and one row written,
    and a slice materialized before a dot is a temp.
    (f32: the CPU backend widens a bf16 pool whole to update it, which the table would count.)"""
    layers, slots, dim = 4, 32, 16

    def f(weights, pools, x, pos):
        def body(carry, i):
            h, pool = carry
            k = h @ weights["w"][i]
            pool = jax.lax.dynamic_update_slice(pool, k[None], (i, pos, 0))
            return (h + jnp.tanh(pool[i] @ h[0]).sum(), pool), None
        (h, pool), _ = jax.lax.scan(body, (x, pools["kv"]), jnp.arange(layers))
        return {"kv": pool}, h

    compiled = jax.jit(f, donate_argnums=(1,)).lower(
        {"w": sds((layers, dim, dim), jnp.float32)},
        {"kv": sds((layers, slots, dim), jnp.float32)}, sds((1, dim), jnp.float32),
        sds((), jnp.int32)).compile()
    t = traffic(compiled.as_text(), ROOTS)
    cls = t.by_class()
    assert list(t.trips.values()) == [layers]
    assert cls["kv"]["read"] == layers * slots * dim * 4
    assert cls["kv"]["written"] == layers * dim * 4
    assert cls["weights"]["read"] == layers * dim * dim * 4
    # the CPU program copies each layer's weight and cache slice out before its dot: temps
    slices = layers * (dim * dim + slots * dim) * 4
    assert cls["temps"]["read"] == cls["temps"]["written"] == slices


def test_a_pool_scattered_in_place_writes_its_rows():
    """Paged KV_WRITE's shape: rows scattered into a donated pool through a block table update it
    in place: the pool is not read, the rows are written."""
    blocks, size, dim, lanes = 64, 16, 32, 4

    def f(weights, pools, rows, block, slot):
        return {"kv": pools["kv"].at[block, slot].set(rows @ weights["w"], mode="drop")}

    compiled = jax.jit(f, donate_argnums=(1,)).lower(
        {"w": sds((dim, dim), jnp.float32)}, {"kv": sds((blocks, size, dim), jnp.float32)},
        sds((lanes, dim), jnp.float32), sds((lanes,), jnp.int32),
        sds((lanes,), jnp.int32)).compile()
    assert " scatter(" in compiled.as_text()
    cls = traffic(compiled.as_text(), ROOTS).by_class()
    assert cls["kv"] == {"read": 0.0, "written": lanes * dim * 4}


def test_a_loop_without_a_readable_trip_count_is_counted_once_and_named():
    def f(weights, n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1])),
                                  (0, weights["w"]))[1]

    compiled = jax.jit(f).lower({"w": sds((8, 128), jnp.float32)},
                                sds((), jnp.int32)).compile()
    t = traffic(compiled.as_text(), ROOTS)
    assert t.unknown_trips and all(t.trips[w] == 1 for w in t.unknown_trips)
    assert t.total() == t.total(scaled=False)


@pytest.mark.parametrize("shape, total, on_chip", [
    ("f32[2,3]{1,0}", 24, 0),
    ("(s8[4]{0}, bf16[2,2]{1,0:T(2,128)S(1)}, /*index=2*/u32[]{:S(2)})", 16, 12),
    ("pred[]", 1, 0),
])
def test_shape_bytes(shape, total, on_chip):
    assert shape_bytes(shape) == total
    assert shape_bytes(shape, on_chip_only=True) == on_chip


def test_a_step_counts_the_branches_it_runs():
    """Rows of a conditional in a BRANCHES scope carry (name, branch): total(taken=...) counts
    the branches a step runs (lax.switch's list order; lax.cond's false branch 0), the plain
    total every branch; rows of an unnamed conditional count in every case. On the sampler:
    the greedy / top-k / sort switch and the penalties' cond (cost_report.STEP_CASES)."""
    from rvcompile.targets.xla import sampler
    from rvcompile.targets.xla.hlo_traffic import BRANCHES

    def step(weights, pools, logits, i, pen_ids):
        logits = sampler.penalize(logits, pen_ids, pen_ids, *(jnp.ones(4),) * 3)
        with jax.named_scope(BRANCHES.format(name="demo")):
            y = jax.lax.switch(i, [lambda: logits[:, :8].sum(), lambda: jnp.sort(logits).sum(),
                                   lambda: jnp.exp(logits).sum()])
        z = jax.lax.cond(i > 5, lambda: jnp.cumsum(logits, -1).sum(), lambda: logits[0, 0])
        return y + z

    args = ({}, {}, sds((4, 4096), jnp.float32), sds((), jnp.int32), sds((4, 2), jnp.int32))
    t = traffic(jax.jit(step).lower(*args).compile().as_text(), ROOTS)
    assert {"demo", "penalties"} <= t.branch_names()
    every = t.total()
    cases = [t.total(taken={"demo": k, "penalties": 0}) for k in range(3)]
    assert all(c < every for c in cases)
    assert cases[0] < min(cases[1], cases[2])  # 8 columns against a sort / a whole exp
    big = 4 * 4096 * 4
    assert every - cases[0] >= 2 * big  # the sort's and the exp's reads at least
    with_pen = t.total(taken={"demo": 0, "penalties": 1})
    assert with_pen > cases[0]
    assert t.total(taken={"demo": 0}) == pytest.approx(with_pen)  # penalties: both counted
    assert t.by_class(taken={"demo": 0, "penalties": 0})["activations"]["read"] < \
        t.by_class()["activations"]["read"]


def test_a_steps_collectives_are_those_of_the_branches_it_runs():
    """Traffic.collectives(taken=...): a collective inside a branch the step does not run is not
    counted (cost_report's per-step collectives term: the decode program gathers the logits
    inside some of the sampler's branches, sampler.sample_step)."""
    from rvcompile.targets.xla.hlo_traffic import Row, Traffic

    rows = (Row("body", "all-reduce.1", "all-reduce", "", 10, {}, 4.0, "activations", 0.0),
            Row("main", "all-gather-start.1", "all-gather-start", "", 1, {}, 8.0, "activations",
                0.0, branches=(("sample", 1),)))
    t = Traffic(rows, ())
    both = {"all-reduce": {"count": 10, "bytes": 40.0}, "all-gather": {"count": 1, "bytes": 8.0}}
    assert t.collectives() == both
    assert t.collectives({"sample": 1}) == both
    assert t.collectives({"sample": 0}) == {"all-reduce": {"count": 10, "bytes": 40.0}}
