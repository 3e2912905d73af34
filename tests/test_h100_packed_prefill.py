"""Packed prefill (kernel_schedule.PrefillPacking; executor_api, "Packed prefill"): several
sequences' prompt chunks in one prefill call, each chunk's rows bit for bit what its own call
computes, so packing changes no sequence's tokens and no prefix-cache recipe.

On the CPU through the reference executor (each kernel's numpy reference; stub cubins, as in
test_h100_tc_plan.py), on a tiny h100-fp8 build whose prefill entries 64 and 256 run every
linear on the tensor-core GEMM: which schedules pack, chunks alone against packed (their sampled
tokens and every KV pool byte), the engine packing a step's prompts without changing any
request's tokens (also with sampler extras: prefill_packed_sampled), and the refusals. On the
GPU (skipped without one): the same comparison on the real kernels, where the GEMM's tile shape
differs between the entries.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from h100_helpers import (
    bare_engine,
    h100_context,
    own_tables,
    reference_executor,
    run_requests,
)
from oracle import random_token_ids
from stub_cubins import build_h100

from rvcompile.artifacts import Artifact
from rvcompile.artifacts.kernel_schedule import KernelSchedule
from rvcompile.artifacts.schema import SchemaError
from rvcompile.build import BuildOptions, lower_model
from rvcompile.model.presets import get_preset
from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import Penalties, Sampled, SampleExtras, Sampling, SeqChunk
from rvcompile.sources.model_source import ModelSource
from rvcompile.targets.h100 import attn_prefill, lower

OPTS = {"max_context": 512, "prefill_buckets": (8, 64, 256), "max_seqs": 4}
# (prompt length, sampling) of the sequences packed together: chunks of the 64- and 256-row
# entries, sampled (a changed bit of the logits can change a seeded sample) and greedy
SEQS = [(37, Sampling(0.9, 0, 1.0, 11)), (70, Sampling(0.0)), (21, Sampling(1.2, 40, 0.9, 5))]


@pytest.fixture(scope="module")
def art(oracle_dir, tmp_path_factory):
    _, ckpt = oracle_dir("dense")
    path = tmp_path_factory.mktemp("packed") / "tc.rvp"
    build_h100(path, str(ckpt), BuildOptions("h100-fp8", **OPTS), random_weights=False)
    return Artifact.open(path)


def _schedule(art) -> KernelSchedule:
    return reference_executor(art).schedule


def _chunks(executor) -> list[SeqChunk]:
    return [SeqChunk(random_token_ids(n, seed=i).tolist(), 0, own_tables(executor, i), s, 0)
            for i, (n, s) in enumerate(SEQS)]


def _pools(executor) -> bytes:
    """Every KV pool's bytes."""
    offsets, end = executor.schedule.pool_offsets(executor.device.kv_blocks)
    return executor.device.read(offsets[0], end - offsets[0])


def test_the_schedule_packs_from_the_first_gemm_entry(art):
    s = _schedule(art)
    p = s.prefill_packing
    assert p is not None and p.seqs == min(lower.PREFILL_SEQS, OPTS["max_seqs"])
    assert p.min_rows == 64  # prefill_8 runs its linears on gemv_mma_fp8: not packed
    assert p.align in {attn_prefill.tile_tokens(d, g) for d in attn_prefill.HEAD_DIMS
                       for g in attn_prefill.GROUPS}
    assert s.io["last_row"].shape == (p.seqs,)
    assert s.outputs["prefill_64.out_tokens"].shape == (p.seqs,)
    assert KernelSchedule.from_json(json.loads(json.dumps(s.to_json()))).prefill_packing == p


def test_packed_chunks_compute_what_they_compute_alone(art):
    alone, packed = reference_executor(art), reference_executor(art)
    chunks = _chunks(alone)
    want = [alone.prefill(c) for c in chunks]
    assert packed.packed_rows(chunks) <= 256
    got = packed.prefill_packed(chunks)
    assert got == want
    assert _pools(packed) == _pools(alone)
    # and a decode step of all three after it
    lanes = [SeqChunk([t], c.start + len(c.tokens), c.tables, c.sampling, 1)
             for c, t in zip(chunks, want, strict=True)]
    assert packed.decode(lanes) == alone.decode(lanes)


def test_a_chunk_computes_the_same_in_a_wider_entry(art):
    """The promise packing rests on: a chunk of prefill_64 run in prefill_256 (SeqChunk.rows)
    writes the same KV and samples the same token."""
    a, b = reference_executor(art), reference_executor(art)
    c = _chunks(a)[0]
    assert a.prefill(c) == b.prefill(dataclasses.replace(c, rows=256))
    assert _pools(a) == _pools(b)


def _extras(executor) -> list[SampleExtras | None]:
    """A mask with log-probabilities, penalties with log-probabilities, and none (SEQS')."""
    rng = np.random.default_rng(6)
    words = executor.schedule.sampler.mask_words
    mask = np.packbits(rng.random(32 * words) < 0.2, bitorder="little").view(np.int32)
    ids = np.array([3, 17, 40], np.int32)
    return [SampleExtras(2, mask=mask),
            SampleExtras(1, Penalties(0.5, 0.3, 1.3), ids, np.array([1, 2, 0], np.int32)),
            None]


def test_packed_sampled_chunks_give_what_they_give_alone(art):
    """prefill_packed_sampled (issue 16: constrained or log-probability prompts pack too):
    each chunk's token, log-probability and top ones as prefill_sampled gives it alone, the
    same KV bytes; the chunk without extras samples what prefill gives it."""
    alone, packed = reference_executor(art), reference_executor(art)
    assert packed.packs_sampled
    chunks = [dataclasses.replace(c, extras=e)
              for c, e in zip(_chunks(alone), _extras(alone), strict=True)]
    want = [alone.prefill_sampled(c) if c.extras else Sampled(alone.prefill(c)) for c in chunks]
    got = packed.prefill_packed_sampled(chunks)
    assert got == want and len(got[0].top) == 2 and got[2].logprob is None
    assert np.unpackbits(chunks[0].extras.mask.view(np.uint8), bitorder="little")[got[0].token]
    assert _pools(packed) == _pools(alone)


def test_bad_packs_are_refused(art):
    ex = reference_executor(art)
    chunks = _chunks(ex)
    small = SeqChunk([1, 2, 3], 0, own_tables(ex, 3), Sampling(), 0, 8)
    with pytest.raises(ValueError, match="entries of at least 64 rows"):
        ex.packed_rows([chunks[0], small])
    with pytest.raises(ValueError, match="a packed prefill takes 1..4"):
        ex.packed_rows([*chunks, *chunks])
    with pytest.raises(ValueError, match="the largest prefill entry has 256"):
        ex.prefill_packed([*chunks, dataclasses.replace(chunks[1], tables=own_tables(ex, 3))])


@pytest.mark.parametrize("extras", [False, True])
def test_the_engine_packs_prompts_and_gives_every_request_its_own_tokens(art, extras):
    """The step's prompts in one packed call, each request the tokens it gets alone; with
    `extras`, beside a plain request one asking for log-probabilities and one with penalties
    (their prompts pack through prefill_packed_sampled)."""
    requests = [Request(f"r{i}", random_token_ids(n, seed=i).tolist(), 5, s, ignore_eos=True,
                        logprobs=2 if extras and i == 0 else None,
                        penalties=Penalties(0.4, 0.2, 1.2) if extras and i == 1
                        else Penalties())
                for i, (n, s) in enumerate(SEQS)]
    each = {}
    for r in requests:
        each |= run_requests(bare_engine(reference_executor(art)), [r])
    eng = bare_engine(reference_executor(art), prefill_budget=256)
    assert run_requests(eng, requests) == each
    assert eng.stats().packed_prefills >= 1


def test_prefill_packing_is_checked_where_it_is_read(art):
    d = json.loads(json.dumps(_schedule(art).to_json()))
    d["prefill_packing"] = {"seqs": 4, "align": 16, "min_rows": 32}
    with pytest.raises(SchemaError, match="min_rows.*not a prefill entry"):
        KernelSchedule.from_json(d)
    for bad, field in [({"seqs": 9, "align": 16, "min_rows": 64}, "seqs"),
                       ({"seqs": 4, "align": -1, "min_rows": 64}, "align"),
                       ({"seqs": 4, "align": 1e9, "min_rows": 64}, "align"),
                       ({"seqs": "4", "align": 16, "min_rows": 64}, "seqs"),
                       ({"seqs": 4, "align": float("nan"), "min_rows": 64}, "align"),
                       ({"seqs": 4, "align": 16}, "min_rows"),
                       ([4, 16, 64], "prefill_packing")]:
        d["prefill_packing"] = bad
        with pytest.raises(SchemaError, match=field) as e:
            KernelSchedule.from_json(d)
        assert "\n" not in str(e.value)  # one line, naming the field


def test_without_packing_prefill_calls_take_one_sequence(art):
    ex = reference_executor(art)
    ex.prefill_packing = None
    with pytest.raises(ValueError, match="one sequence a call"):
        ex.prefill_packed(_chunks(ex))
    eng = bare_engine(ex, prefill_budget=256)
    run_requests(eng, [Request(f"r{i}", random_token_ids(n, seed=i).tolist(), 2, s, ignore_eos=True)
               for i, (n, s) in enumerate(SEQS)])
    assert eng.stats().packed_prefills == 0


def _ir(preset: str, target: str, layers: int | None = None):
    cfg = get_preset(preset)
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers, layer_kinds=cfg.layer_kinds[:layers])
    opts = BuildOptions(target, max_seqs=4, prefill_buckets=(16, 64), max_context=256)
    return lower_model(ModelSource(cfg, (), "", {}, None, "tiny"), opts, log=lambda s: None)


def test_no_packing_where_a_row_would_depend_on_the_call():
    """packing_rows: the fp8 plan packs from its first GEMM entry; not the float32 plan (its
    GEMV's split depends on the rows), a MoE model (rows grouped by expert), one sequence, or
    buckets that all run on the GEMV."""
    fp8 = _ir("gemma-4-31B", "h100-fp8", 6)
    assert lower.packing_rows(fp8, 4, (16, 64, 128), None) == (4, 64)
    assert lower.packing_rows(fp8, 16, (16, 64), None) == (lower.PREFILL_SEQS, 64)
    assert lower.packing_rows(fp8, 1, (16, 64), None) is None
    assert lower.packing_rows(fp8, 4, (8, 32), None) is None
    assert lower.packing_rows(_ir("gemma-4-31B", "h100-f32", 6), 4, (16, 64), None) is None
    assert lower.packing_rows(_ir("gemma-4-26B-A4B", "h100-fp8", 6), 4, (16, 64), None) is None


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_packed_and_wider_entries_compute_bit_for_bit_the_same(oracle_dir, tmp_path):
    """On the real kernels (the GEMM's tile shape changes between 64 and 256 rows): chunks
    alone, the first in a wider entry, and all packed give the same tokens and KV bytes."""
    from rvcompile.build import build_artifact
    from rvcompile.runtime.executors.h100 import CudaScheduleDevice
    from rvcompile.runtime.executors.scheduled import ScheduledExecutor

    ctx = h100_context()
    _, ckpt = oracle_dir("dense")
    build_artifact(str(ckpt), tmp_path / "a.rvp", BuildOptions("h100-fp8", **OPTS),
                   progress=False, log=lambda s: None)
    a = Artifact.open(tmp_path / "a.rvp")
    schedule = _schedule(a)

    def executor():
        device = CudaScheduleDevice(a, schedule, ctx, kv_blocks={
            k.name: 16 * k.table_width for k in schedule.kv.kinds})
        return ScheduledExecutor(schedule, device)

    alone, wider, packed = executor(), executor(), executor()
    chunks = _chunks(alone)
    want = [alone.prefill(c) for c in chunks]
    assert [wider.prefill(dataclasses.replace(c, rows=256)) for c in chunks] == want
    assert _pools(wider) == _pools(alone)
    assert packed.prefill_packed(chunks) == want
    assert _pools(packed) == _pools(alone)
    # with extras (prefill_packed_sampled), against each chunk's prefill_sampled alone
    alone, packed = executor(), executor()
    chunks = [dataclasses.replace(c, extras=e)
              for c, e in zip(_chunks(alone), _extras(alone), strict=True)]
    want = [alone.prefill_sampled(c) if c.extras else Sampled(alone.prefill(c)) for c in chunks]
    got = packed.prefill_packed_sampled(chunks)
    assert [g.token for g in got] == [w.token for w in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprob == w.logprob and g.top == w.top
    assert _pools(packed) == _pools(alone)
