"""The sliding layers' Pallas TPU decode kernel (targets/xla/sliding_kernel.py), on the CPU:

- its values, run in Pallas' interpreter, against the XLA lowering it replaces
  (lower.attention_blockwise) and the direct attention, on the oracle configs' sliding shapes
  and a 31B-like slice (head dim 256, 2 query heads a KV head, window 1024, a ring of 81
  blocks of 16): wrapped rings, lanes of different lengths, shorter than the window, an idle
  lane;
- where the programs run it: decode steps of TPU-only exports (not prefill, not exports for
  several platforms; under tensor parallelism only with static pools);
- with libtpu (a subprocess compiling for v6e:1x1, no TPU): Mosaic compiles it, and the
  traffic table counts its custom call by the pages its grid DMAs, against a hand count.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_xla_topology import _libtpu_env

from rvcompile.ir.ops import AttentionAttrs, CachePositionsAttrs
from rvcompile.targets.xla import lower
from rvcompile.targets.xla.hlo_traffic import kernel_slot_pages, needed_pages, window_pages
from rvcompile.targets.xla.sliding_kernel import PAGES_PER_STEP, sliding_decode

# (KV heads, query heads a KV head, head dim, window, ring width, pool dtype, lane lengths)
SHAPES = {
    # the oracle configs' sliding layers (head dim 32, window 8; rings of 3 blocks at 64
    # tokens with chunks of 16): 2 KV heads, and 1 (kv_shared); float32 pools (xla-f32)
    "oracle": (2, 2, 32, 8, 3, jnp.float32, (100, 5, 1, 0, 17)),
    "oracle_kv_shared": (1, 4, 32, 8, 3, jnp.float32, (49, 0, 8, 33)),
    # the 31B's sliding layers at TP = 8 (2 of 16 KV heads a device), bf16 pools: wrapped
    # (2048, 1500 > 81 * 16), within the first ring (700 < window, 1030), an idle lane
    "31B": (2, 2, 256, 1024, 81, jnp.bfloat16, (2048, 1500, 700, 0, 1030, 1)),
}


@pytest.mark.parametrize("shape, interpreter", [*((s, "pallas") for s in SHAPES),
                                                ("31B", "tpu")])
def test_kernel_equals_the_xla_lowering(shape, interpreter):
    """One decode row a lane; bound as the blockwise-vs-direct tests': 2e-6 of the largest
    value (float32 summation order). Queries of 4 / sqrt(D) so that scores are O(1) at every
    head dim, as the d = 32 and 64 tests' are: with unit queries at D = 256 (scores up to
    30) float32 rounding of the scores alone put the XLA lowering 5.9e-6 and the kernel 1.3e-5
    from a float64 reference (measured; a different summation order of the same dots).
    Interpreters: Pallas' own, and its TPU interpret mode (pltpu.InterpretParams), which
    simulates the pipeline's DMAs into VMEM with uninitialised memory as NaN and out-of-bounds
    reads raising: a page the kernel used without DMAing it would show."""
    kh, group, d, window, width, dtype, lengths = SHAPES[shape]
    rng = np.random.default_rng(7)
    lanes = len(lengths)
    blocks = lanes * width + 5
    pools = [jnp.asarray(rng.standard_normal((2, blocks, 16, kh * d)), dtype) for _ in "kv"]
    table = jnp.asarray(rng.permutation(blocks)[:lanes * width].reshape(lanes, width),
                        jnp.int32)
    k, v = (lower.PagedSlice(p, 1, table, True, kh) for p in pools)
    cache_len = jnp.asarray(lengths, jnp.int32)
    q_pos = jnp.where(cache_len > 0, cache_len - 1, -1)
    k_pos = lower.cache_positions(CachePositionsAttrs(width * 16, True), cache_len)
    q = jnp.asarray(rng.standard_normal((lanes, 1, kh * group, d)) * 4 / np.sqrt(d),
                    jnp.float32)
    attrs = AttentionAttrs(window=window, scale=0.5)

    xla = np.asarray(jax.jit(lambda q: lower.attention_blockwise(
        attrs, q, k, v, q_pos[:, None], k_pos))(q))
    direct = np.asarray(jax.jit(lambda q: lower.attention(
        attrs, q, k.read(), v.read(), q_pos[:, None], k_pos))(q))
    ours = np.asarray(jax.jit(lambda q: sliding_decode(
        q.reshape(lanes, kh, group, d), k.pool, v.pool, jnp.asarray([1, 1]), table, q_pos,
        window=window, scale=0.5,
        interpret=True if interpreter == "pallas" else pltpu.InterpretParams()))(q)
    ).reshape(xla.shape)
    errs = {ref: float(np.abs(ours - x).max()) for ref, x in (("xla", xla), ("direct", direct))}
    print(f"\nsliding kernel ({shape}, {interpreter}) max abs vs the XLA lowering "
          f"{errs['xla']:.2e}, vs direct {errs['direct']:.2e} (largest value "
          f"{np.abs(xla).max():.2f})")
    assert not ours[lengths.index(0)].any()  # an idle lane: zeros, as the XLA lowering's
    assert max(errs.values()) <= 2e-6 * np.abs(xla).max()


def test_pages_a_lane_dmas():
    """The traffic table's count of a lane's pages (per pool): slot p holds pages p, p + 8, ..;
    a slot with none below `needed` fetches its first page once."""
    assert window_pages(1024, 81) == 65 and window_pages(8, 3) == 2
    assert needed_pages(2048, 1024, 81) == 64 and needed_pages(1030, 1024, 81) == 65
    assert needed_pages(1024, 1024, 81) == 64 and needed_pages(40, 256, 20) == 3
    assert needed_pages(None, 1024, 81) == 65

    def total(needed):
        return sum(kernel_slot_pages(needed, p, PAGES_PER_STEP) for p in range(PAGES_PER_STEP))

    assert [total(n) for n in (0, 3, 8, 9, 17, 65)] == [8, 8, 8, 9, 17, 65]


def _export_decode(platforms, tp=1, static_pools=False) -> str:
    """The StableHLO text of the decode program of a 2-layer gemma-4-31B (sliding head dim 256,
    window 1024, at 2048 tokens: a ring of 81 blocks), one sliding and one full layer."""
    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.model.presets import get_preset
    from rvcompile.targets.xla.export import lower_to_xla

    cfg = get_preset("gemma-4-31B")
    cfg = dataclasses.replace(cfg, num_layers=2, layer_kinds=cfg.layer_kinds[4:6])
    opts = BuildOptions(target="tpu-bf16", max_context=2048, max_seqs=2, platforms=platforms,
                        tp=tp, prefill_buckets=(16,))
    ir = lower_model(SimpleNamespace(config=cfg), opts, log=lambda s: None)
    low = lower_to_xla(ir, max_seqs=2, prefill_buckets=(16,), platforms=platforms, tp=tp,
                       static_pools=static_pools)
    return {name: jax.export.deserialize(bytearray(b)).mlir_module()
            for name, b in low.programs.items()}


def test_tpu_only_decode_runs_the_kernel():
    """The kernel runs in the decode steps of programs exported for TPU alone: not in prefill
    (several query rows), not in programs exported for TPU and the CPU, not under tensor
    parallelism with symbolic pools (see lower.sliding_kernel_fits), and there with static
    ones."""
    def kernels(text):
        return text.count("@tpu_custom_call(")

    tpu = _export_decode(("tpu",))
    assert kernels(tpu["decode_2"]) == 1  # the sliding layer (the full layer: XLA)
    assert not kernels(tpu["prefill_16"]) and not kernels(tpu["logits_16"])
    assert not any(map(kernels, _export_decode(("tpu", "cpu")).values()))
    assert not kernels(_export_decode(("tpu",), tp=4)["decode_2"])
    assert kernels(_export_decode(("tpu",), tp=4, static_pools=True)["decode_2"]) == 1


def _traffic_child() -> None:
    """Compile the kernel for one v6e:1x1 device inside a jitted function of (weights, pools,
    ...) and print its traffic row's KV bytes at two contexts and with none."""
    from rvcompile.targets.xla.hlo_traffic import traffic
    from rvcompile.targets.xla.precompile import parse_topology, topology_devices

    dev = topology_devices(parse_topology("v6e:1x1"))[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    lanes, kh, group, d, window, width, blocks = 3, 2, 2, 256, 256, 20, 64

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    def fn(weights, pools, q, table, q_pos):
        out = sliding_decode(q * weights["s"], pools["k"], pools["v"], jnp.asarray([1, 0]),
                             table, q_pos, window=window, scale=1.0)
        return out.sum()

    pool = sds((2, blocks, 16, kh * d), jnp.bfloat16)
    compiled = jax.jit(fn).lower({"s": sds((d,), jnp.float32)}, {"k": pool, "v": pool},
                                 sds((lanes, kh, group, d), jnp.float32),
                                 sds((lanes, width), jnp.int32), sds((lanes,), jnp.int32)
                                 ).compile()
    text = compiled.as_text()
    out = {"custom_calls": text.count('custom_call_target="tpu_custom_call"')}
    for context in (1000, 40, None):
        rows = [r for r in traffic(text, ("weights", "pools"), context).rows
                if r.opcode == "custom-call"]
        out[str(context)] = [r.read.get("kv", 0.0) for r in rows]
    print(json.dumps(out))


def test_traffic_counts_the_kernel_by_its_pages():
    """Against a hand count: 3 lanes, 2 KV heads of 256 (a page: 16 rows of 512 bf16, 16 KiB),
    window 256, a ring of 20 blocks. At 1000 tokens a lane needs 17 pages (positions 744 ..
    999: blocks 46 .. 62); slot 0 DMAs pages 0, 8, 16, slots 1 .. 7 two each: 17 a pool. At
    40 tokens 3 pages, and the 5 slots without one fetch their first page once: 8 a pool.
    With no context, every lane at its window's most pages: 17. K and V: twice that. (Counted
    as its operands, the table would read the two 2 MiB pools 8 times each.)"""
    env = _libtpu_env()
    if env is None:
        pytest.skip("libtpu is not installed (scripts/setup.sh puts it in .venv/tpu-aot)")
    p = subprocess.run([sys.executable, __file__, "traffic"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    page = 16 * 512 * 2
    print(f"\n[measured] kernel custom call's KV bytes by context: {got}")
    assert got["custom_calls"] == 1
    assert got["1000"] == [3 * 2 * 17 * page]
    assert got["40"] == [3 * 2 * 8 * page]
    assert got["None"] == [3 * 2 * 17 * page]


if __name__ == "__main__":
    if sys.argv[1:] == ["traffic"]:
        _traffic_child()
