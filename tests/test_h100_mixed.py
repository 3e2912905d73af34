"""Mixed calls (executor_api, "Mixed calls"; kernel_schedule's mixed_{P}_{B} entries): packed
prompt chunks and a step's decode lanes in one call, each computing bit for bit what its own
call (prefill_packed, decode) computes, so mixing changes no token and no KV byte.

On the CPU through the reference executor (each kernel's numpy reference; stub cubins, as in
test_h100_packed_prefill.py), on a tiny h100-fp8 build of 64 lanes, whose decode_64 runs its
linears on the tensor-core GEMM: which schedules mix, a mixed call against the two calls it
replaces (tokens and every KV pool byte), the engine mixing without changing any request's
tokens, and the refusals. On the GPU (skipped without one): the same comparison on the real
kernels.
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
from rvcompile.build import BuildOptions
from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import Sampling, SeqChunk
from rvcompile.targets.h100 import lower

OPTS = {"max_context": 256, "prefill_buckets": (8, 64, 256), "max_seqs": 64}
# prompts packed into the mixed call: chunks of the 64- and 256-row entries, sampled and greedy
SEQS = [(37, Sampling(0.9, 0, 1.0, 11)), (70, Sampling(0.0)), (21, Sampling(1.2, 40, 0.9, 5))]
LANES = 40  # decode lanes beside them: decode_64's width, padded


@pytest.fixture(scope="module")
def art(oracle_dir, tmp_path_factory):
    _, ckpt = oracle_dir("dense")
    path = tmp_path_factory.mktemp("mixed") / "tc.rvp"
    build_h100(path, str(ckpt), BuildOptions("h100-fp8", **OPTS), random_weights=False)
    return Artifact.open(path)


def _chunks(executor) -> list[SeqChunk]:
    return [SeqChunk(random_token_ids(n, seed=i).tolist(), 0, own_tables(executor, i), s, 0)
            for i, (n, s) in enumerate(SEQS)]


def _lanes(executor, n: int = LANES) -> list[SeqChunk]:
    """n decode lanes at different positions over their own (zeroed) blocks, half sampled."""
    rng = np.random.default_rng(7)
    return [SeqChunk([int(rng.integers(0, executor.schedule.vocab_size))], 3 + i,
                     own_tables(executor, len(SEQS) + i),
                     Sampling(0.8, 0, 1.0, 100 + i) if i % 2 else Sampling(0.0), 3 + i)
            for i in range(n)]


def _pools(executor) -> bytes:
    offsets, end = executor.schedule.pool_offsets(executor.device.kv_blocks)
    return executor.device.read(offsets[0], end - offsets[0])


def test_the_schedule_mixes_the_packed_entries_with_the_tensor_core_widths(art):
    s = reference_executor(art).schedule
    p = s.prefill_packing
    # decode_1..8 run the GEMVs (launches.DECODE_GEMV_MAX_ROWS), decode_16..64 the GEMM
    assert s.mixed_shapes == tuple((p, b) for p in (64, 256) for b in (16, 32, 64))
    assert s.entries["mixed_64_64"].rows == 128 and s.entries["mixed_64_64"].graph
    assert s.io["last_row"].shape == (p.seqs + 64,)
    assert s.outputs["mixed_256_64.out_tokens"].shape == (p.seqs + 64,)
    assert s.outputs["prefill_64.out_tokens"].shape == (p.seqs,)
    assert KernelSchedule.from_json(json.loads(json.dumps(s.to_json()))).mixed_shapes == \
        s.mixed_shapes


def test_a_mixed_call_computes_what_its_two_calls_compute(art):
    apart, mixed = reference_executor(art), reference_executor(art)
    chunks, lanes = _chunks(apart), _lanes(apart)
    want = apart.prefill_packed(chunks), apart.decode(lanes)
    assert mixed.mixes(chunks, len(lanes))
    assert mixed.prefill_decode(chunks, lanes) == want
    assert _pools(mixed) == _pools(apart)
    # one chunk alone, in the 64-row mixed entry, beside 61 lanes (the pools hold 64 sequences)
    a, b = reference_executor(art), reference_executor(art)
    lanes = _lanes(a, 61)
    assert b.prefill_decode(chunks[:1], lanes) == ([a.prefill(chunks[0])], a.decode(lanes))
    assert _pools(a) == _pools(b)


def test_calls_no_mixed_entry_takes_are_refused(art):
    ex = reference_executor(art)
    chunks, lanes = _chunks(ex), _lanes(ex)
    small = SeqChunk([1, 2, 3], 0, own_tables(ex, 60), Sampling(), 0, 8)
    assert not ex.mixes(chunks, 8)  # decode_8 runs the GEMVs: no mixed entry
    assert not ex.mixes([chunks[0], small], LANES)
    assert not ex.mixes(chunks, 0)
    with pytest.raises(ValueError, match="no mixed entry takes 3 chunks .* and 8 lanes"):
        ex.prefill_decode(chunks, lanes[:8])
    with pytest.raises(ValueError, match="exactly one token"):
        ex.prefill_decode(chunks, [dataclasses.replace(lanes[0], tokens=[1, 2]), *lanes[1:]])




def test_the_engine_mixes_and_gives_every_request_the_same_tokens(art):
    """48 requests arriving together: once more than 32 sequences decode while prompts wait,
    the last prefill pack of a step rides along the decode call; the tokens are those of the
    same engine that never mixes."""
    requests = [Request(f"r{i}", random_token_ids(12 + i % 9, seed=i).tolist(), 6,
                        Sampling(0.7, 0, 1.0, i) if i % 3 else Sampling(0.0), ignore_eos=True)
                for i in range(48)]
    apart = reference_executor(art)
    apart.prefill_decode = None  # an executor without mixed calls (executor_api.mixes_decode)
    eng_apart = bare_engine(apart)
    want = run_requests(eng_apart, requests)
    eng = bare_engine(reference_executor(art))
    assert run_requests(eng, requests) == want
    assert eng.stats().mixed_calls >= 1 and eng_apart.stats().mixed_calls == 0
    assert eng.stats().steps <= eng_apart.stats().steps


def test_mixed_entries_are_checked_where_they_are_read(art):
    d = json.loads(json.dumps(reference_executor(art).schedule.to_json()))
    for name, rename in [("mixed_64_64", "mixed_8_120"),  # prefill_8 is below min_rows
                         ("mixed_64_64", "mixed_32_96"),  # no prefill_32
                         ("mixed_64_64", "mixed_96_32")]:  # no decode entry of 32 + 64 lanes
        bad = json.loads(json.dumps(d))
        e = bad["entries"].pop(name)
        e["name"] = rename
        bad["entries"][rename] = e
        with pytest.raises(SchemaError, match=f"{rename}.*mixed entry needs") as err:
            KernelSchedule.from_json(bad)
        assert "\n" not in str(err.value)
    bad = json.loads(json.dumps(d))
    bad["entries"]["mixed_64_64"]["rows"] = 64
    with pytest.raises(SchemaError, match="mixed_64_64 must be named mixed_64_64 with 128 rows"):
        KernelSchedule.from_json(bad)
    for rename, says in [("mixed_0_64", "named decode_N"), ("mixed_64", "named decode_N"),
                         ("mixed_64_64_1", "named decode_N"),
                         ("mixed_9999999_64", "mixed_9999999_64.rows: expected an int")]:
        bad = json.loads(json.dumps(d))
        bad["entries"][rename] = dict(bad["entries"].pop("mixed_64_64"), name=rename)
        if rename == "mixed_9999999_64":
            bad["entries"][rename]["rows"] = 9999999 + 64
        with pytest.raises(SchemaError, match=says) as err:
            KernelSchedule.from_json(bad)
        assert "\n" not in str(err.value)
    for rows in ("128", -128, float("nan"), None):
        bad = json.loads(json.dumps(d))
        bad["entries"]["mixed_64_64"]["rows"] = rows
        with pytest.raises(SchemaError, match="mixed_64_64.*rows") as err:
            KernelSchedule.from_json(bad)
        assert "\n" not in str(err.value)
    bad = json.loads(json.dumps(d))
    del bad["prefill_packing"]
    with pytest.raises(SchemaError, match="mixed entry needs prefill_packing"):
        KernelSchedule.from_json(bad)


def test_which_schedules_mix():
    """mixed_shapes: every packed prefill entry with every decode width past the FP8 GEMV's
    rows; none without packing (the float32 plan, MoE, one sequence)."""
    assert lower.mixed_shapes((8, 64), (16, 64, 256), 256) == tuple(
        (p, b) for p in (64, 256) for b in (16, 32, 64, 128, 256))
    assert lower.mixed_shapes((8, 64), (16, 64), 8) == ()
    assert lower.mixed_shapes(None, (16, 64), 256) == ()


def test_the_check_benchmark_refuses_bad_arguments_in_one_line(tmp_path):
    """benchmarks/h100_mixed_check.py: bad flags and an unreadable artifact exit 2 with one
    error line (after argparse's usage, for a value of the wrong type), never a traceback,
    before any GPU is needed."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "h100_mixed_check.py"
    for args, says in [(["--lanes", "x"], "--lanes"), (["--lanes", "0,64"], "--lanes"),
                       (["--prompts", "-1"], "--prompts"), (["--context", "nan"], "--context"),
                       ([], "cannot open")]:
        r = subprocess.run([sys.executable, str(script), str(tmp_path / "none.rvp"), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert says in last and "Traceback" not in r.stderr, (args, r.stderr)


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_a_mixed_call_computes_what_its_two_calls_compute(oracle_dir, tmp_path):
    """On the real kernels (the GEMM's tile shape differs between 64, 128 and 256 rows)."""
    from rvcompile.build import build_artifact
    from rvcompile.runtime.executors.h100 import CudaScheduleDevice
    from rvcompile.runtime.executors.scheduled import ScheduledExecutor

    ctx = h100_context()
    _, ckpt = oracle_dir("dense")
    build_artifact(str(ckpt), tmp_path / "a.rvp", BuildOptions("h100-fp8", **OPTS),
                   progress=False, log=lambda s: None)
    a = Artifact.open(tmp_path / "a.rvp")
    schedule = reference_executor(a).schedule

    def executor():
        device = CudaScheduleDevice(a, schedule, ctx, kv_blocks={
            k.name: 72 * k.table_width for k in schedule.kv.kinds})
        return ScheduledExecutor(schedule, device)

    for n_lanes, n_chunks in ((LANES, 3), (61, 1)):
        apart, mixed = executor(), executor()
        chunks, lanes = _chunks(apart)[:n_chunks], _lanes(apart, n_lanes)
        want = apart.prefill_packed(chunks), apart.decode(lanes)
        assert mixed.prefill_decode(chunks, lanes) == want
        assert _pools(mixed) == _pools(apart)
