"""The KV pools of h100 artifacts, sized at load (issue 14 items 5 and 6).

CPU:
- runtime/executors/kv_budget.py over a real schedule (a preset lowered shape-only) and made-up
  memory figures: the default share (0.90 of the GPU's memory, or its free memory when less),
  explicit counts per kind, the even split capped at max_seqs tables, and the one-line refusals;
- the schedule's pool placement (pools after the fixed part, aligned, in order);
- the reference executor with load-time counts: the engine's KvKind counts are the device's, and
  a pool too small for three sequences at once preempts and still gives every request the tokens
  it gets alone;
- a long context: a 4096-token h100-f32 artifact (table 256 blocks wide, sliding ring of 8-token
  windows) greedy-decoding after a 3000-token prompt exactly as the transformers oracle.
GPU (marked gpu): the CUDA executor's load-time sizing by default and with explicit counts, and
the refusal of a share too small for one sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
from h100_helpers import h100_context
from oracle import oracle_greedy, oracle_logits, random_token_ids

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.kernel_schedule import POOL_ALIGN, KernelSchedule
from rvcompile.build import BuildOptions, build_artifact, lower_model
from rvcompile.model.presets import get_preset
from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import SeqChunk
from rvcompile.runtime.executors.kv_budget import HEADROOM, choose_blocks
from rvcompile.runtime.executors.scheduled import ScheduledExecutor
from rvcompile.runtime.model import Model
from rvcompile.sources.model_source import ModelSource
from rvcompile.targets.h100.lower import lower_to_h100
from rvcompile.targets.h100.reference_executor import default_blocks, reference_device

GIB = 1 << 30
OPTS = {"max_context": 128, "prefill_buckets": (8, 32), "max_seqs": 3}
FP8_KV_VS_IR = (0.35, 0.04)  # as test_h100_schedule.FP8_KV_VS_IR (its comment says why)


@pytest.fixture(scope="module")
def schedule() -> KernelSchedule:
    """gemma-4-tiny's h100-fp8 schedule at 4 decode rows and a 2048-token context (no
    weights: the pools' sizes depend only on the shapes)."""
    cfg = get_preset("gemma-4-tiny")
    opts = BuildOptions("h100-fp8", max_seqs=4, prefill_buckets=(16, 64), max_context=2048)
    ir = lower_model(ModelSource(cfg, (), "", {}, None, "tiny"), opts, log=lambda s: None)
    return lower_to_h100(ir, max_seqs=4, prefill_buckets=opts.prefill_buckets).schedule


def _pools_bytes(s: KernelSchedule, blocks: dict[str, int]) -> int:
    return sum(n * s.kv.block_bytes(k) for k, n in blocks.items())


def _fixed(s: KernelSchedule) -> int:
    return s.arena_bytes + HEADROOM + POOL_ALIGN * len(s.kv.pools)


def test_schedule_records_pools_not_block_counts(schedule):
    kinds = {k.name: k for k in schedule.kv.kinds}
    assert set(kinds) == {"full", "sliding"}
    assert {p.kind for p in schedule.kv.pools} == set(kinds)
    for p in schedule.kv.pools:
        assert p.block_bytes % (schedule.kv.block_size * 2) == 0  # bf16 rows
    pool_args = [a for e in schedule.entries.values() for x in e.launches for a in x.args
                 if a.kind == "pool"]
    assert pool_args and {a.value for a in pool_args} == set(range(len(schedule.kv.pools)))


def test_pools_follow_the_fixed_part_aligned_in_order(schedule):
    blocks = {"full": 7, "sliding": 3}
    offsets, end = schedule.pool_offsets(blocks)
    assert offsets[0] >= schedule.arena_bytes
    at = offsets[0]
    for off, p in zip(offsets, schedule.kv.pools, strict=True):
        assert off == at and off % POOL_ALIGN == 0
        at = -(-(off + blocks[p.kind] * p.block_bytes) // POOL_ALIGN) * POOL_ALIGN
    assert end == at
    with pytest.raises(ValueError, match="0 sliding KV blocks; need at least 1"):
        schedule.pool_offsets({"full": 7, "sliding": 0})


def test_default_share_caps_each_kind_at_every_decode_row_whole(schedule):
    """An 80 GiB GPU and a tiny model: both kinds get max_seqs whole tables, no more."""
    got = choose_blocks(schedule, free=80 * GIB, total=80 * GIB, name="a.rvp")
    assert got == {k.name: schedule.max_seqs * k.table_width for k in schedule.kv.kinds}
    # an engine capped at 2 running sequences: 2 tables of each kind
    got = choose_blocks(schedule, free=80 * GIB, total=80 * GIB, name="a.rvp", max_num_seqs=2)
    assert got == {k.name: 2 * k.table_width for k in schedule.kv.kinds}


def test_default_share_splits_evenly_within_the_fraction(schedule):
    """Little memory: the same block count for both kinds (below the sliding kind's cap of 4
    rings), within 0.90 of the total, or of the free memory when less; max_model_len 16 so
    that one sequence needs one block of each kind."""
    per = schedule.kv.block_bytes("full") + schedule.kv.block_bytes("sliding")
    total = int((_fixed(schedule) + 20 * per) / 0.9) + 1
    got = choose_blocks(schedule, free=total, total=total, name="a.rvp", max_model_len=16)
    assert got == {"full": 20, "sliding": 20}
    assert _pools_bytes(schedule, got) <= int(0.9 * total) - _fixed(schedule)
    free = _fixed(schedule) + 10 * per
    used = choose_blocks(schedule, free=free, total=total, name="a.rvp", utilization=1.0,
                         max_model_len=16)
    assert used == {"full": 10, "sliding": 10}


def test_a_capped_kind_leaves_its_share_to_the_other(schedule):
    """The sliding ring is narrow: once it holds max_seqs rings the full kind takes the rest."""
    ring = next(k.table_width for k in schedule.kv.kinds if k.ring)
    cap = schedule.max_seqs * ring
    full_b, slide_b = schedule.kv.block_bytes("full"), schedule.kv.block_bytes("sliding")
    budget = cap * slide_b + (cap + 200) * full_b
    total = _fixed(schedule) + budget
    got = choose_blocks(schedule, free=total, total=total, name="a.rvp", utilization=1.0)
    assert got == {"full": cap + 200, "sliding": cap}


def test_explicit_counts_are_taken_and_the_rest_shared(schedule):
    got = choose_blocks(schedule, free=80 * GIB, total=80 * GIB, name="a.rvp",
                        kv_blocks={"full": 200, "sliding": 50})
    assert got == {"full": 200, "sliding": 50}
    per = schedule.kv.block_bytes("full")
    total = _fixed(schedule) + 20 * schedule.kv.block_bytes("sliding") + 150 * per
    got = choose_blocks(schedule, free=total, total=total, name="a.rvp", utilization=1.0,
                        kv_blocks={"sliding": 20})
    assert got == {"full": 150, "sliding": 20}


@pytest.mark.parametrize("kwargs,message", [
    ({"kv_blocks": {"global": 8}}, "a.rvp: has no KV kind 'global' (kinds: full, sliding)"),
    ({"kv_blocks": {"full": 0}}, "a.rvp: 0 full KV blocks; need at least 1"),
    ({"utilization": 0.0}, "a.rvp: gpu_memory_utilization 0.0: expected a fraction in (0, 1]"),
    ({"utilization": 1.5}, "a.rvp: gpu_memory_utilization 1.5: expected a fraction in (0, 1]"),
    ({"kv_blocks": {"full": 1 << 30}}, "a.rvp: the KV blocks asked for (1073741824 full: "),
])
def test_refusals_name_the_problem_on_one_line(schedule, kwargs, message):
    with pytest.raises(ArtifactError) as e:
        choose_blocks(schedule, free=80 * GIB, total=80 * GIB, name="a.rvp", **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_refused_when_one_longest_sequence_does_not_fit(schedule):
    """Room for the fixed part but not for one 2048-token sequence's blocks of both kinds."""
    total = _fixed(schedule) + 10 * schedule.kv.block_bytes("full")
    with pytest.raises(ArtifactError) as e:
        choose_blocks(schedule, free=total, total=total, name="a.rvp", utilization=1.0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("a.rvp: ")
    assert "cannot hold the arena's fixed part" in msg and "one 2048-token sequence" in msg
    # a shorter max_model_len needs fewer blocks: 16 tokens, one block of each kind
    got = choose_blocks(schedule, free=total, total=total, name="a.rvp", utilization=1.0,
                        max_model_len=16)
    assert got["full"] >= 1 and got["sliding"] >= 1


# ---------------------------------------------------------------- the reference executor

@pytest.fixture(scope="module")
def tiny(oracle_dir, tmp_path_factory):
    _, ckpt = oracle_dir("dense")
    out = tmp_path_factory.mktemp("kvpool") / "dense.rvp"
    build_artifact(str(ckpt), out, BuildOptions("h100-fp8", **OPTS), progress=False,
                   log=lambda s: None)
    return out


def _model(path, kv_blocks=None) -> Model:
    art = Artifact.open(path)
    dev = reference_device(art, kv_blocks)
    return Model(art, ScheduledExecutor(dev.schedule, dev))


def test_engine_kinds_come_from_the_device(tiny):
    m = _model(tiny, {"full": 9, "sliding": 5})
    assert {k.name: k.num_blocks for k in m.executor.kinds.values()} == {"full": 9,
                                                                         "sliding": 5}
    assert {n: p.num_free for n, p in m.engine.kv.pools.items()} == {"full": 9, "sliding": 5}
    s = m.executor.schedule
    assert m.executor.device.mem.size == s.pool_offsets({"full": 9, "sliding": 5})[1]
    d = _model(tiny)  # the reference's default: every decode row a whole context
    assert {k.name: k.num_blocks for k in d.executor.kinds.values()} == default_blocks(s)


def test_reference_refuses_unknown_kind_and_a_pool_below_one_sequence(tiny):
    with pytest.raises(ValueError, match="no KV kind 'global'"):
        _model(tiny, {"global": 4, "full": 8, "sliding": 8})
    with pytest.raises(ValueError, match="cannot hold one sequence of 128 tokens"):
        _model(tiny, {"full": 3, "sliding": 8})  # 128 tokens need 8 full blocks


def test_small_pool_preempts_without_losing_tokens(tiny):
    """Pools of one longest sequence (8 blocks of each kind) for three requests of up to 118
    tokens: the engine preempts and recomputes, and every request's greedy tokens are the ones
    it gets alone with the default pools."""
    prompts = [random_token_ids(n, seed=s).tolist() for n, s in ((40, 1), (50, 2), (60, 3))]
    alone = _model(tiny)
    want = [alone.generate(p, max_tokens=58, ignore_eos=True).token_ids for p in prompts]
    m = _model(tiny, {"full": 8, "sliding": 8})
    eng = m.engine
    for i, p in enumerate(prompts):
        eng.add(Request(str(i), p, 58, ignore_eos=True))
    got: dict[str, list[int]] = {}
    for _ in range(5000):
        if not eng.has_work():
            break
        for o in eng.step():
            got.setdefault(o.id, []).extend(o.token_ids)
    assert [got[str(i)] for i in range(3)] == want
    assert eng.stats().preemptions > 0
    assert all(p.num_free == 8 for p in eng.kv.pools.values())


def test_long_context_decodes_as_the_oracle(oracle_dir, tmp_path):
    """h100-f32 at a 4096-token context (a full table of 256 blocks; the sliding ring of the
    8-token windows): a 3000-token prompt prefilled in 32-row chunks, then 6 greedy tokens
    through the paged decode, equal to the transformers oracle's; the last logits within
    float32 rounding (test_h100_f32.F32_BOUND)."""
    hf, ckpt = oracle_dir("k_eq_v")
    out = tmp_path / "long.rvp"
    build_artifact(str(ckpt), out, BuildOptions("h100-f32", max_context=4096,
                                                prefill_buckets=(8, 32), max_seqs=2),
                   progress=False, log=lambda s: None)
    m = _model(out)
    widths = {k.name: k.table_width for k in m.executor.kinds.values()}
    assert widths["full"] == 256
    prompt = random_token_ids(3000, seed=9)
    got = m.generate(prompt.tolist(), max_tokens=6, ignore_eos=True).token_ids
    assert got == oracle_greedy(hf, prompt, 6)
    tail = prompt.tolist() + got
    logits = m.logits(tail)[-8:]
    want = oracle_logits(hf, np.asarray(tail))[-8:]
    err = float(np.abs(logits - want).max())
    print(f"\n[measured] k_eq_v h100-f32 at 3006 positions vs hf32: max abs {err:.2e}")
    assert err <= 1e-4


def test_long_context_fp8_pools_match_the_ir(oracle_dir, tmp_path):
    """h100-fp8 with the FP8 KV cache at a 4096-token context: 2976 tokens prefilled in 32-row
    chunks through attn_prefill into the paged e4m3 pools (the full table 256 blocks wide, the
    sliding ring reused 100-odd times), then a 32-row logits chunk at positions 2976..3007 that
    reads all of them: within FP8_KV_VS_IR of the IR interpreter on the same IR fed the same
    chunks. Measured: max abs 0.15..0.26, mean abs 0.021..0.030 at every chunk from 0 to 3008,
    no growth with the position."""
    from rvcompile.dtypes import numpy_dtype
    from rvcompile.ir.interpret import ReferenceModel
    from rvcompile.sources.checkpoint import load_model_source
    from rvcompile.targets.h100.lower import layout_weights

    _, ckpt = oracle_dir("k_eq_v")
    opts = BuildOptions("h100-fp8", max_context=4096, prefill_buckets=(8, 32), max_seqs=1,
                        kv_cache="fp8")
    out = tmp_path / "long-fp8.rvp"
    build_artifact(str(ckpt), out, opts, progress=False, log=lambda s: None)
    m = _model(out)
    ex = m.executor
    ids = random_token_ids(3008, seed=21)
    tables = {k.name: list(range(k.table_width)) for k in ex.kinds.values()}
    for start in range(0, 2976, 32):
        ex.prefill(SeqChunk(ids[start:start + 32].tolist(), start, tables))
    got = ex.logits(SeqChunk(ids[2976:].tolist(), 2976, tables))

    ir = lower_model(load_model_source(str(ckpt)), opts, log=lambda s: None)
    stored = np.frombuffer(m.art.buffer("weights"), np.uint8)
    slots, _ = layout_weights(ir)
    weights = {p.name: stored[slots[p.name].offset:][:slots[p.name].nbytes]
               .view(numpy_dtype(p.dtype)).reshape(p.shape) for p in ir.params}
    ref = ReferenceModel(ir, weights)  # in the plan's 32-token steps (its ring caches' size)
    for start in range(0, 2976, 32):
        ref.step(ids[None, start:start + 32], np.array([start]), np.array([32]))
    want = ref.step(ids[None, 2976:], np.array([2976]), np.array([32]))[0]
    err = np.abs(got - want)
    print(f"\n[measured] k_eq_v FP8-KV plan at positions 2976..3007 vs its IR: max abs "
          f"{err.max():.4f} mean abs {err.mean():.5f}")
    assert err.max() <= FP8_KV_VS_IR[0] and err.mean() <= FP8_KV_VS_IR[1]


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_pools_sized_at_load(tiny):
    """On the H100: the default share gives each kind its cap (a tiny model), explicit counts
    are taken as given and the arena is that large, and a share too small is one line."""
    from rvcompile import runtime

    ctx = h100_context()
    m = runtime.load(tiny)
    s = m.executor.schedule
    assert {k.name: k.num_blocks for k in m.executor.kinds.values()} == default_blocks(s)
    assert m.executor.device.arena.nbytes == m.executor.device.nbytes
    del m
    m = runtime.load(tiny, kv_blocks={"full": 8, "sliding": 40})
    assert {k.name: k.num_blocks for k in m.executor.kinds.values()} == {"full": 8,
                                                                         "sliding": 40}
    assert m.executor.device.nbytes == s.pool_offsets({"full": 8, "sliding": 40})[1]
    ids = random_token_ids(20, seed=4).tolist()
    a = m.generate(ids, max_tokens=8, ignore_eos=True).token_ids
    ref = _model(tiny, {"full": 8, "sliding": 40})
    assert a == ref.generate(ids, max_tokens=8, ignore_eos=True).token_ids
    del m
    _, total = ctx.mem_info()
    tiny_share = (s.arena_bytes + HEADROOM) / total  # no room left for any pool
    with pytest.raises(ArtifactError, match=r"cannot hold the arena's fixed part") as e:
        runtime.load(tiny, gpu_memory_utilization=tiny_share)
    assert "\n" not in str(e.value)
