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
that a layer scan of dots (B = 4) reads each layer of the stacked weight once, counts the one
all-reduce of a row-parallel projection over a v6e:2x2 slice (Traffic.collectives; once also
where TPU runs it asynchronously, in async collective fusions or on a SparseCore) and the one
all-reduce of a token lookup in a table split by row (lower.embed under the mesh; XLA's
partitioner all-reduced the gathered int8 blocks and the scales apart), and that the
MoE decode over that slice reads a device's share of the picked experts (within 1.3x), where
the whole-expert split it replaced read tp times that, and that a whole model's decode program
reads its live keys and writes its new rows only, copying no KV pool whole, and that a K=V
layer's rotated keys are computed inside their dots (lower.FoldedKeys.rotated_scores) where
the one dot over them concatenated had them written to on-chip memory; the collectives term of
the cost report is checked by hand.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_xla_topology import run_with_libtpu

from rvcompile.ir import ops
from rvcompile.targets.xla import lower
from rvcompile.targets.xla.cost_report import (
    ASSUMED_COLLECTIVE_LATENCY_S,
    CHIPS,
    collectives_term,
)
from rvcompile.targets.xla.hlo_traffic import ASYNC_COLLECTIVE_START, span_loop_trips, traffic

ROOTS = ("weights", "pools")  # the jitted functions' own parameter names
# libtpu's flags that run an all-reduce asynchronously, in fusions beside independent work
# (defaults: disabled, false, false; docs/TPU_COST.md, "the collectives, what XLA allows")
ASYNC_ALL_REDUCE = {"xla_enable_async_all_reduce": True,
                    "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
                    "xla_tpu_enable_async_collective_fusion_fuse_kloop_fusions": True}
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
    experts = {"g0.0.experts.gate_up_proj": sds((layers, e, 2, im, h), jnp.int8),
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
        g = jnp.einsum("nh,nkgih->nkgi", h.astype(jnp.bfloat16), gu[idx].astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
        hidden = (lower.gelu_tanh(g[..., 0, :]) * g[..., 1, :]).astype(jnp.bfloat16)
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
    # beside independent work (a column-parallel projection), run asynchronously: in libtpu's
    # async collective fusions (one row), offloaded to a SparseCore (64 rows: it offloads
    # messages of 64 KiB and up); either way the table counts the all-reduce once
    w["q_proj"] = sds((8192, 4096), jnp.int8, sharding=NamedSharding(mesh, PartitionSpec(
        "tp", None)))
    for name, options, rows, started in (
            ("fused", ASYNC_ALL_REDUCE, 1, ASYNC_COLLECTIVE_START),
            ("offloaded", {"xla_tpu_enable_sparse_core_collective_offload_all_reduce": True},
             64, " call-start(")):
        x_o, x_q = (sds((rows, n), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(
            None, split))) for n, split in ((8192, "tp"), (4096, None)))
        hlo = jax.jit(lambda weights, x, y: (lower.linear(None, x, weights["o_proj"]),
                                             jnp.tanh(lower.linear(None, y, weights["q_proj"])))
                      ).lower(w, x_o, x_q).compile(compiler_options=options).as_text()
        out[name] = {"started": started in hlo, "collectives": traffic(hlo, ROOTS).collectives()}
    out["embed"] = _embed_collectives(mesh)
    out["moe_tp"] = _moe_tp_reads(mesh)
    out["pools"] = _decode_pool_traffic()
    out["spans"] = _span_relayouts(mesh)
    out["one_row"] = _one_row_spans(dev[0])
    out["folded"] = _folded_rotated_scores(dev[0])
    print(json.dumps(out))


def _embed_collectives(mesh) -> dict:
    """4 lanes' token lookup in an int8 table with per-row scales split by vocabulary row over a
    v6e:2x2 mesh (as sharding.py splits the tied table): the collectives of lower.embed under
    the mesh, and of the same lookup left to XLA's partitioner (no mesh)."""
    from jax.sharding import NamedSharding, PartitionSpec

    v, d, lanes = 65536, 2048, 4

    def placed(shape, dtype, *spec):
        return sds(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    weights = {"t": placed((v, d), jnp.int8, "tp", None), "s": placed((v,), jnp.float32, "tp")}
    ids = placed((lanes, 1), jnp.int32)
    out = {"row": lanes * d * 4}
    for name, m in (("mesh", mesh), ("partitioner", None)):
        def lookup(weights, ids, m=m):
            return lower.embed(ops.EmbedAttrs(2.0), weights["t"], ids, weights["s"], mesh=m)
        hlo = jax.jit(lookup).lower(weights, ids).compile().as_text()
        out[name] = traffic(hlo, ROOTS).collectives()
    return out


def _one_row_spans(device) -> dict:
    """Full-layer attention of one query head over one KV head of 512 (the E4B's a device at
    TP = 8), 2 layers, one lane at 2048 tokens, bf16 and int8 pools, on v6e:1x1: the KV read
    and the on-chip bytes a call, for lower.span_dots and, bf16, for the dot without the zero
    row it pads (XLA widened every span to float32 on chip first)."""
    from jax.sharding import SingleDeviceSharding

    one = SingleDeviceSharding(device)
    d, width, layers = 512, 128, 2

    def attention():
        def attend(weights, pools, q, table, cache_len):  # a new function: jit caches traces
            def body(h, i):
                k, v = (lower.PagedSlice(pools[n], i, table, False, 1, pools.get(n + ".scale"))
                        for n in ("k", "v"))
                k_pos = lower.cache_positions(ops.CachePositionsAttrs(width * 16, False),
                                              cache_len)
                return h + lower.attention_blockwise(
                    ops.AttentionAttrs(window=None, scale=1.0), h, k, v,
                    (cache_len - 1)[:, None], k_pos), None
            return jax.lax.scan(body, q, jnp.arange(layers))[0]
        return attend

    def unpadded(kind, x, span, mesh=None):  # the dot before: a matrix-vector product
        eq = {"scores": "btkgd,bskd->bkgts", "values": "bkgts,bskd->bkgtd"}[kind]
        return jnp.einsum(eq, x, lower.f32(span), precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)

    q, table, cache_len = (sds(shape, dt, sharding=one) for shape, dt in (
        ((1, 1, 1, d), jnp.float32), ((1, width), jnp.int32), ((1,), jnp.int32)))
    out = {}
    padded = lower.span_dots
    for name, dtype, dots in (("bf16", jnp.bfloat16, padded), ("int8", jnp.int8, padded),
                              ("bf16_unpadded", jnp.bfloat16, unpadded)):
        pools = {n: sds((layers, width + 1, 16, d), dtype, sharding=one) for n in ("k", "v")}
        if dtype == jnp.int8:
            pools |= {n + ".scale": sds((layers, width + 1, 16, 1), jnp.float32, sharding=one)
                      for n in ("k", "v")}
        lower.span_dots = dots
        try:
            hlo = jax.jit(attention()).lower({}, pools, q, table, cache_len).compile()
            t = traffic(hlo.as_text(), ROOTS, context=2048)
        finally:
            lower.span_dots = padded
        out[name] = {"kv": t.by_class()["kv"]["read"], "on_chip": t.on_chip()}
    return out


def _folded_rotated_scores(device) -> dict:
    """A K=V full layer pair as the 31B's at TP = 4 (one KV head of 512 a device, 8 query
    heads, 64 of 256 pairs rotating), 1 and 4 lanes at 2048 tokens of an int8 pool, on
    v6e:1x1: {lanes: {form: KV read and on-chip bytes a call}} for the rotated dims' scores of
    lower.FoldedKeys.rotated_scores ("ours"), for the one dot over both halves concatenated that
    it replaced (TPU wrote those float32 keys to on-chip memory and read them back) and, at 4
    lanes, for its one-lane form there (two dots over the rotated columns only)."""
    from jax.sharding import SingleDeviceSharding

    one = SingleDeviceSharding(device)
    d, group, width, layers = 512, 8, 128, 2
    freqs = np.zeros(d // 2)
    freqs[:64] = 1e6 ** (-np.arange(64) * 2.0 / d)
    rope = ops.RopeAttrs(tuple(float(f) for f in freqs))

    def attention():
        def attend(weights, pools, q, table, cache_len):  # a new function: jit caches traces
            def body(h, i):
                cache = lower.PagedSlice(pools["kv"], i, table, False, 1, pools["kv.scale"])
                k_pos = lower.cache_positions(ops.CachePositionsAttrs(width * 16, False),
                                              cache_len)
                k = lower.rope_lazy(rope, lower.mul_lazy(None, cache, weights["k_norm"]), k_pos)
                return h + lower.attention_blockwise(
                    ops.AttentionAttrs(window=None, scale=1.0), h, k, cache,
                    (cache_len - 1)[:, None], k_pos), None
            return jax.lax.scan(body, q, jnp.arange(layers))[0]
        return attend

    def rotated(self, c, slots, scales):  # the rotated keys' halves over the n columns
        half, n = c.shape[-1] // 2, self.n
        x1, x2 = (lower.f32(c[..., o:o + n]) * scales[..., None] * self.w[o:o + n]
                  for o in (0, half))
        freq = jnp.asarray(np.asarray(self.rope.inv_freq, np.float32)[:n])
        ang = jnp.take_along_axis(self.pos, slots, axis=1).astype(jnp.float32)[..., None] * freq
        cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    def dot(q, keys):
        return jnp.einsum("btkgd,bskd->bkgts", q, keys, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)

    def concatenated(self, q_rot, c, slots, scales=None):  # the form before: one dot
        return dot(jnp.concatenate(q_rot, -1), jnp.concatenate(rotated(self, c, slots, scales),
                                                               -1))

    def columns(self, q_rot, c, slots, scales=None):  # the one-lane form at any lanes
        k1, k2 = rotated(self, c, slots, scales)
        return dot(q_rot[0], k1) + dot(q_rot[1], k2)

    weights = {"k_norm": sds((d,), jnp.float32, sharding=one)}
    ours = lower.FoldedKeys.rotated_scores
    out = {}
    for lanes, forms in ((1, ("ours", "concatenated")), (4, ("ours", "concatenated", "columns"))):
        pools = {"kv": sds((layers, lanes * width + 1, 16, d), jnp.int8, sharding=one),
                 "kv.scale": sds((layers, lanes * width + 1, 16, 1), jnp.float32,
                                 sharding=one)}
        q, table, cache_len = (sds(shape, dt, sharding=one) for shape, dt in (
            ((lanes, 1, group, d), jnp.float32), ((lanes, width), jnp.int32),
            ((lanes,), jnp.int32)))
        out[lanes] = {}
        for name in forms:
            lower.FoldedKeys.rotated_scores = {"ours": ours, "concatenated": concatenated,
                                               "columns": columns}[name]
            try:
                hlo = jax.jit(attention()).lower(weights, pools, q, table, cache_len).compile()
                t = traffic(hlo.as_text(), ROOTS, context=2048)
            finally:
                lower.FoldedKeys.rotated_scores = ours
            out[lanes][name] = {"kv": t.by_class()["kv"]["read"], "on_chip": t.on_chip()}
    return out


def _span_relayouts(mesh) -> dict:
    """Sliding-layer attention over a v6e:2x2 mesh (8 KV heads of 256, 2 a device, as the
    26B-A4B's at TP = 4; one lane at 2048 tokens): the bytes of relayout instructions (reshape,
    copy, transpose) of at least one gathered span, and the collectives, for lower.span_dots'
    per-head dots and for the dot batched over the heads' [.., K, D] view it replaced."""
    from jax.sharding import NamedSharding, PartitionSpec

    kh, group, d, width, window, layers = 8, 2, 256, 81, 1024, 2

    def placed(shape, dtype, *spec):
        return sds(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    pools = {"k": placed((layers, width + 1, 16, kh * d), jnp.bfloat16, None, None, None, "tp"),
             "v": placed((layers, width + 1, 16, kh * d), jnp.bfloat16, None, None, None, "tp")}
    q = placed((1, 1, kh * group, d), jnp.float32, None, None, "tp", None)
    table, cache_len = placed((1, width), jnp.int32), placed((1,), jnp.int32)
    span = lower.span_blocks(width, window) * 16 * (kh // 4) * d * 2  # bytes on one device

    def attention(dots):
        def attend(weights, pools, q, table, cache_len):  # a new function: jit caches traces
            def body(h, i):
                k, v = (lower.PagedSlice(pools[n], i, table, True, kh) for n in ("k", "v"))
                k_pos = lower.cache_positions(ops.CachePositionsAttrs(width * 16, True),
                                              cache_len)
                return h + lower.attention_blockwise(
                    ops.AttentionAttrs(window=window, scale=1.0), h, k, v,
                    (cache_len - 1)[:, None], k_pos, mesh=mesh), None
            return jax.lax.scan(body, q, jnp.arange(layers))[0]
        return attend

    def batched(kind, x, span, mesh=None):  # the dots before: over the [.., K, D] view
        eq = {"scores": "btkgd,bskd->bkgts", "values": "bkgts,bskd->bkgtd"}[kind]
        return jnp.einsum(eq, x, lower.f32(span), precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)

    out = {"span": span}
    per_head = lower.span_dots
    for name, dots in (("per_head", per_head), ("batched", batched)):
        lower.span_dots = dots
        try:
            hlo = jax.jit(attention(dots)).lower({}, pools, q, table, cache_len).compile()
            t = traffic(hlo.as_text(), ROOTS, context=2048)
        finally:
            lower.span_dots = per_head
        out[name] = {"relayout": sum(r.bytes * r.runs for r in t.rows
                                     if r.opcode in ("reshape", "copy", "transpose")
                                     and r.bytes >= span),
                     "collectives": sum(c["count"] for c in t.collectives().values())}
    return out


def _decode_pool_traffic() -> dict:
    """The KV bytes a decode step of gemma-4-tiny-dense's exported program (512 tokens of
    context, one lane, its 6 layers in one period) reads and writes, compiled for v6e:1x1, by
    the traffic table at 512 tokens, with the live keys the roofline reads there."""
    from types import SimpleNamespace

    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.model.presets import get_preset
    from rvcompile.targets.xla.cost_report import cost_report as report
    from rvcompile.targets.xla.cost_report import query_per_kv, read_model
    from rvcompile.targets.xla.export import lower_to_xla
    from rvcompile.targets.xla.precompile import compile_entries, parse_topology, topology_devices

    opts = BuildOptions(target="tpu-int8", max_context=512, max_seqs=1, platforms=("tpu",))
    ir = lower_model(SimpleNamespace(config=get_preset("gemma-4-tiny-dense")), opts,
                     log=lambda s: None)
    low = lower_to_xla(ir, max_seqs=1, prefill_buckets=opts.prefill_buckets, platforms=("tpu",))
    decode = compile_entries(low.programs, low.manifest,
                             topology_devices(parse_topology("v6e:1x1")),
                             names=("decode_1",))["decode_1"]
    rep = report(decode, 1, CHIPS["v6e"], query_per_kv(ir), 512, read_model(ir),
                 tuple(g["count"] for g in low.manifest["layer_groups"]))
    kv = rep["traffic"]["classes"]["kv"]
    return {"read": kv["read"], "written": kv["written"], "live": rep["kv_read_per_lane"]}


def _moe_tp_reads(mesh) -> dict:
    """One token's MoE decode through a 3-layer scan over a v6e:2x2 mesh: the weight bytes a
    device reads, for lower.moe (experts split as sharding.py splits them: every expert's
    intermediate rows, gate/up in the layout's [E, 2, I, H] view) and for the lowering it
    replaced (whole experts per device), with the device's share of the picked experts."""
    from jax.sharding import NamedSharding, PartitionSpec

    e, k, h, im, layers, tp = 32, 4, 2048, 512, 3, 4
    attrs = ops.MoEAttrs(k, quantized=False)

    def placed(shape, *spec):
        return sds(shape, jnp.int8, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    x = sds((1, h), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    split_i = {"gate_up_proj": placed((layers, e, 2, im, h), None, None, None, "tp", None),
               "down_proj": placed((layers, e, h, im), None, None, None, "tp")}
    split_e = {"gate_up_proj": placed((layers, e, 2 * im, h), None, "tp", None, None),
               "down_proj": placed((layers, e, h, im), None, "tp", None, None)}

    def layers_of(one_layer):
        def fn(weights, x):
            def body(x, p):
                gu, dn = (jax.lax.dynamic_index_in_dim(weights[n], p, 0, False)
                          for n in ("gate_up_proj", "down_proj"))
                return x + one_layer(x, gu, dn), None
            return jax.lax.scan(body, x, jnp.arange(layers))[0]
        return fn

    def split_intermediate(x, gu, dn):
        return lower.moe(attrs, x, x[:, :e], jnp.ones(e), gu, dn, mesh=mesh)

    def whole_experts(x, gu, dn):  # the decode before: each device slices all k picked experts
        _, idx = jax.lax.top_k(jax.nn.softmax(x[:, :e]), k)

        def local(x, idx, gu, dn):
            mine = idx[0] - jax.lax.axis_index("tp") * gu.shape[0]
            held = (mine >= 0) & (mine < gu.shape[0])
            mine = jnp.clip(mine, 0, gu.shape[0] - 1)
            y = jnp.zeros(h, jnp.float32)
            for j in range(k):
                g = jnp.sum(x[0] * jax.lax.dynamic_index_in_dim(gu, mine[j], 0, False)
                            .astype(jnp.float32), -1)
                hid = lower.gelu_tanh(g[:im]) * g[im:]
                y = y + jnp.where(held[j], 1.0, 0.0) * jnp.sum(
                    hid * jax.lax.dynamic_index_in_dim(dn, mine[j], 0, False)
                    .astype(jnp.float32), -1)
            return jax.lax.psum(y, "tp")[None]

        whole, split = PartitionSpec(), PartitionSpec("tp")
        return jax.shard_map(local, mesh=mesh, in_specs=(whole, whole, split, split),
                             out_specs=whole, check_vma=False)(x, idx, gu, dn)

    out = {"share": layers * k * 3 * im * h // tp}
    for name, form, weights in (("split_intermediate", split_intermediate, split_i),
                                ("whole_experts", whole_experts, split_e)):
        hlo = jax.jit(layers_of(form)).lower(weights, x).compile().as_text()
        out[name] = traffic(hlo, ROOTS).by_class()["weights"]["read"]
    return out


def test_tpu_decode_lowerings_copy_no_whole_weight():
    got = run_with_libtpu(__file__)
    assert got["take_rows"] == [] and got["moe_picked"] == [], got
    assert got["take"] and got["moe_gathered"], got  # the check fails on the forms replaced
    assert got["collectives"] == {"all-reduce": {"count": 1, "bytes": 4096 * 4}}
    for name, rows in (("fused", 1), ("offloaded", 64)):
        assert got[name] == {"started": True, "collectives": {
            "all-reduce": {"count": 1, "bytes": rows * 4096 * 4}}}, got[name]
    # a lookup in a table split by row: one all-reduce of the finished float32 rows; left to
    # XLA's partitioner, take_rows' 32-row blocks all-reduced as int bits, then the scales
    emb = got["embed"]
    assert emb["mesh"] == {"all-reduce": {"count": 1, "bytes": emb["row"]}}, emb
    assert emb["partitioner"]["all-reduce"]["count"] == 2, emb
    assert emb["partitioner"]["all-reduce"]["bytes"] >= 8 * emb["row"], emb
    assert got["dot_weights_read"] == 3 * 2048 * 2048
    # MoE decode under TP = 4: a device reads its share of the picked experts (1/4 of each);
    # split by whole experts, it read all k picked experts a token, 4 times its share
    moe = got["moe_tp"]
    assert moe["share"] <= moe["split_intermediate"] <= 1.3 * moe["share"], moe
    assert moe["whole_experts"] >= 3 * moe["share"], moe
    # a whole model's decode step reads its live keys and writes only its new rows: TPU relays
    # no pool whole (measured 165,120 bytes read, 1,280 written, 147,456 live; with blocks
    # [16, K, D], at the commit before, 951,552 read and 787,712 written)
    pools = got["pools"]
    assert pools["live"] <= pools["read"] <= 1.3 * pools["live"], pools
    assert pools["written"] <= 0.01 * pools["live"], pools
    # a sliding layer's span dots read each head's columns of the gathered rows: no relayout
    # of a span into a [.., K, D] view (the batched dot it replaced: one for K and one for V
    # each span) and no collective (split up globally, the per-head dots were resharded)
    spans = got["spans"]
    assert spans["per_head"] == {"relayout": 0, "collectives": 0}, spans
    assert spans["batched"]["relayout"] >= 2 * 3 * 2 * spans["span"], spans
    # one query row a KV head: the span dots read the stored span, bf16 or int8 (its scales on
    # the scores and probabilities), with at most twice its bytes on chip (gathered, read by
    # the dot); as a matrix-vector product each bf16 span was widened to float32 on chip first
    one = got["one_row"]
    for name in ("bf16", "int8"):
        assert one[name]["on_chip"] <= 2.2 * one[name]["kv"], one
    assert one["bf16_unpadded"]["on_chip"] >= 3.5 * one["bf16_unpadded"]["kv"], one
    # a K=V layer's rotated keys: each half computed inside its dot. One lane, over the rotated
    # columns: measured 9.0 MiB on chip for 2.0 MiB of KV read (over whole tiles 10.0, 4.9x),
    # against 14.2 MiB concatenated (written to on-chip memory in float32 and read by one dot).
    # Four lanes, over whole 128-column tiles: 39.9 MiB for 8.1 MiB read, against 43.9 over the
    # rotated columns (copied out and relaid first) and 48.8 concatenated
    single, four = got["folded"]["1"], got["folded"]["4"]
    assert single["ours"]["on_chip"] <= 4.6 * single["ours"]["kv"], single
    assert single["ours"]["on_chip"] <= 0.75 * single["concatenated"]["on_chip"], single
    assert four["ours"]["on_chip"] <= 0.95 * four["columns"]["on_chip"], four
    assert four["ours"]["on_chip"] <= 0.9 * four["concatenated"]["on_chip"], four


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


# ---- KV as long as the sequence (issue 19, item 3) ------------------------------------------

@pytest.mark.parametrize("window, width", [(None, 8), (None, 128), (40, 8), (1024, 81)])
def test_span_loop_trips_are_the_lowerings(window, width):
    """The traffic table's trip count of a span loop at a context is the one the lowering
    computes for lanes decoding there (lower.span_plan), and a ring's loop never passes its
    window's blocks."""
    blocks = lower.span_blocks(width, window)
    for context in (1, 15, 16, 17, 100, 1023, 1024, 1025, 1296, 5000, 131072):
        if window is None and context > width * 16:
            continue  # a full table holds at most width blocks
        q_pos = jnp.full((3, 1), context - 1, jnp.int32).at[2].set(-1)  # lane 2 idle
        lo, needed, trips = lower.span_plan(q_pos, window, width, blocks)
        assert int(trips) == span_loop_trips(context, blocks, window or 0, width), context
        assert int(needed[2]) == 0 and int(needed.max()) <= width
    if window:  # decode reads its window's blocks, not the ring's
        assert blocks * span_loop_trips(10**6, blocks, window, width) <= -(-window // 16) + 2


def _attention_kv_read(fn, width: int, window: int | None, contexts) -> list[float]:
    """KV bytes read by `fn`'s compiled attention over a paged pool (2 lanes, 2 KV heads of 16)
    at each context, by the traffic table."""
    lanes, kh, d = 2, 2, 16
    pools = {"g0.0.cache_k": sds((2, lanes * width + 1, lower.BLOCK_SIZE, kh * d), jnp.float32)}
    args = (pools, sds((lanes, 1, 2 * kh, d), jnp.float32), sds((lanes, width), jnp.int32),
            sds((lanes,), jnp.int32))

    def attend(weights, pools, q, table, cache_len):
        cache = lower.PagedSlice(pools["g0.0.cache_k"], 1, table, window is not None, kh)
        k_pos = lower.cache_positions(ops.CachePositionsAttrs(width * 16, window is not None),
                                      cache_len)
        attrs = ops.AttentionAttrs(window=window, scale=1.0)
        return fn(attrs, q, cache, cache, (cache_len - 1)[:, None], k_pos)

    hlo = jax.jit(attend).lower({}, *args).compile().as_text()
    return [traffic(hlo, ROOTS, context=c).by_class()["kv"]["read"] for c in contexts]


def _whole_read(attrs, q, k, v, q_pos, k_pos):  # the lowering before item 3
    return lower.attention(attrs, q, k.read(), v.read(), q_pos, k_pos)


def test_attention_reads_a_lanes_live_blocks_only():
    """Blockwise attention reads the blocks a lane's length needs: a full layer's grow with the
    context (a span of 32 blocks a trip for each of 2 lanes; K = V here, so XLA gathers once),
    a ring's stop at its window's blocks. The lowering it replaced read the whole table or ring
    at any length, and fails."""
    slot = 2 * 16 * 4  # bytes of one slot: 2 KV heads of 16 float32
    full = _attention_kv_read(lower.attention_blockwise, 128, None, (16, 512, 513, 2048))
    assert full == [2 * 32 * 16 * slot * n for n in (1, 1, 2, 4)]
    ring = _attention_kv_read(lower.attention_blockwise, 81, 1024, (100, 10**6))
    span = lower.span_blocks(81, 1024)
    assert ring == [2 * span * 16 * slot * n for n in (1, 3)] and 3 * span < 81
    # the check fails on a lowering that reads a lane's whole table or ring
    whole = _attention_kv_read(_whole_read, 128, None, (16, 2048))
    assert whole[0] == whole[1] == 2 * 128 * 16 * slot
    whole = _attention_kv_read(_whole_read, 81, 1024, (100, 10**6))
    assert whole[0] == whole[1] == 2 * 81 * 16 * slot


def test_decode_program_reads_kv_as_long_as_the_sequence(monkeypatch):
    """The exported decode program of a whole model (gemma-4-tiny-dense, 2 lanes, 512 tokens
    of context, spans of 4 blocks), compiled here: the KV its traffic table reads a step grows
    with the lanes' length, within 1.3x of every attending layer's live keys read once (a
    sliding layer's window) from 256 tokens on, where the whole tables are 32 blocks a lane."""
    from types import SimpleNamespace

    from rvcompile.artifacts.xla_executables import compile_entries
    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.model.presets import get_preset
    from rvcompile.targets.xla.cost_report import cost_report, read_model
    from rvcompile.targets.xla.export import lower_to_xla

    monkeypatch.setattr(lower, "SPAN_BLOCKS", 4)
    opts = BuildOptions(target="xla-f32", max_context=512, max_seqs=2, prefill_buckets=(16,),
                        platforms=("cpu",))
    ir = lower_model(SimpleNamespace(config=get_preset("gemma-4-tiny-dense")), opts,
                     lambda s: None)
    low = lower_to_xla(ir, max_seqs=2, prefill_buckets=(16,), platforms=("cpu",))
    decode = compile_entries(low.programs, low.manifest, jax.devices("cpu")[:1],
                             names=("decode_2",))["decode_2"]
    kv, need = {}, {}
    for context in (16, 128, 256, 512):
        rep = cost_report(decode, 2, CHIPS["v6e"], 2, 512, read_model(ir), at_context=context)
        assert rep["at_context"] == context and not rep["traffic"]["unknown_trips"]
        kv[context] = rep["traffic"]["classes"]["kv"]["read"]
        need[context] = 2 * rep["kv_read_per_lane"]
    # the table counts every branch of the sampler; a greedy and a top-k step their own only
    cases = rep["traffic"]["cases"]
    assert cases["greedy"]["total_bytes"] < rep["traffic"]["total_bytes"]
    assert cases["greedy"]["total_bytes"] <= cases["top_k"]["total_bytes"] \
        < rep["traffic"]["total_bytes"]
    print(f"\nKV read a step (table / live keys): "
          f"{ {c: round(kv[c] / need[c], 2) for c in kv} }")
    assert kv[16] < kv[128] < kv[256] < kv[512]
    assert all(kv[c] >= need[c] for c in kv)
    assert kv[256] <= 1.3 * need[256] and kv[512] <= 1.3 * need[512]
