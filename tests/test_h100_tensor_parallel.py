"""Tensor parallelism of the H100 plan on the CPU: the schedules of N ranks
(targets/h100/tensor_parallel.py, lower.lower_to_h100_tp) run in lockstep on the reference
executor, collectives with numpy (reference_executor.TensorParallelDevice), against the one-GPU
plan of the same IR and weights (the artifact the normal build writes).

- h100-f32: TP = 2 and 4 (the tiny models' 4 query heads; 2 KV heads, 1 in kv_shared and the
  K=V layers: replicated below one per rank) give TP = 1's logits within float32 rounding
  (the sums' order changes) and its greedy tokens. Measured max abs logit difference over
  2 x 40 tokens (logits up to ~7), TP 2 / TP 4:
      dense 4.1e-06 / 3.3e-06   k_eq_v 4.8e-06 / 4.3e-06   kv_shared 4.4e-06 / 4.8e-06
      ple 5.1e-06 / 4.3e-06     moe 4.9e-06 / 5.2e-06      all 2.0e-05 / 2.0e-05
- h100-fp8: within the FP8 plan's bounds against the oracle (test_h100_schedule.FP8_BOUNDS;
  measured top-1 / mean / max abs, TP 2 and 4 alike: dense 0.756 / 0.138 / 1.48, k_eq_v 0.781 /
  0.113 / 0.85, TP 1's figures) and TP 1's greedy tokens. The FP8 values and per-row scales are
  TP 1's, split; partial sums add in another order (max abs difference from TP 1's logits
  measured 0.0064 / 0.012 on dense).
- the split itself: heads, KV heads, widths and collectives per rank; what does not divide is
  refused naming it.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import agreement_with_oracle, random_token_ids
from test_h100_schedule import FP8_BOUNDS

from rvcompile.artifacts import Artifact
from rvcompile.artifacts.kernel_schedule import Collective
from rvcompile.build import BuildOptions, build_artifact, lower_model
from rvcompile.runtime.executors.scheduled import ScheduledExecutor
from rvcompile.runtime.model import Model
from rvcompile.sources.checkpoint import load_model_source
from rvcompile.targets.h100.layout import layout_weights
from rvcompile.targets.h100.lower import lower_to_h100, lower_to_h100_tp
from rvcompile.targets.h100.reference_executor import (
    ReferenceDevice,
    TensorParallelDevice,
    reference_device,
)
from rvcompile.targets.h100.tensor_parallel import (
    RankSlot,
    Shard,
    TensorParallelError,
    rank_weights,
    shard_ir,
)

OPTS = {"max_context": 128, "prefill_buckets": (8, 32), "max_seqs": 3}
TP_F32_BOUND = 5e-5  # float32 rounding of sums in another order, through 6-8 layers (above)
SEQ = 40


@pytest.fixture(scope="module")
def plans(oracle_dir, tmp_path_factory):
    """(case, target) -> (oracle model, one-GPU Model, function ranks -> the TP Model)."""
    cache = {}

    def get(case: str, target: str):
        if (case, target) not in cache:
            hf, ckpt = oracle_dir(case)
            out = tmp_path_factory.mktemp(f"tp-{case}-{target}") / f"{case}.rvp"
            opts = BuildOptions(target, **OPTS)
            build_artifact(str(ckpt), out, opts, progress=False, log=lambda s: None)
            art = Artifact.open(out)
            ir = lower_model(load_model_source(str(ckpt)), opts, log=lambda s: None)
            one = reference_device(art)
            cache[(case, target)] = (hf, Model(art, ScheduledExecutor(one.schedule, one)),
                                     lambda ranks: tp_model(art, ir, ranks))
        return cache[(case, target)]

    return get


def tp_model(art: Artifact, ir, ranks: int) -> Model:
    """The ranks' schedules of `ir` on the CPU, each rank's weights cut from the artifact's."""
    full_slots, _ = layout_weights(ir)
    specs = ir.param_map()
    devices = []
    for r in lower_to_h100_tp(ir, ranks, max_seqs=OPTS["max_seqs"],
                              prefill_buckets=OPTS["prefill_buckets"]):
        low = r.lowering
        slots = {name: s[0] for name, s in low.slots_by_param.items()}
        weights = rank_weights(art.buffer("weights"), full_slots, specs, slots, r.shards,
                               low.schedule.weights_bytes)
        devices.append(ReferenceDevice(low.schedule, memoryview(weights), low.constants))
    device = TensorParallelDevice(devices)
    return Model(art, ScheduledExecutor(device.schedule, device))


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("case", ["dense", "k_eq_v", "kv_shared", "ple", "moe", "all"])
def test_f32_tp_equals_tp1(plans, case, ranks):
    _, one, tp = plans(case, "h100-f32")
    m = tp(ranks)
    worst = 0.0
    for seed in (11, 12):
        ids = random_token_ids(SEQ, seed=seed).tolist()
        worst = max(worst, float(np.abs(m.logits(ids) - one.logits(ids)).max()))
    print(f"\n[measured] {case} h100-f32 TP {ranks} vs TP 1: max abs {worst:.2e}")
    assert worst <= TP_F32_BOUND
    prompt = random_token_ids(37, seed=3).tolist()  # two chunks, then paged decode
    want = one.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
    assert m.generate(prompt, max_tokens=8, ignore_eos=True).token_ids == want


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("case", ["dense", "k_eq_v"])
def test_fp8_tp_within_bounds(plans, case, ranks):
    hf, one, tp = plans(case, "h100-fp8")
    m = tp(ranks)
    got = agreement_with_oracle(m, hf, seq=SEQ)
    top1, mean, worst = FP8_BOUNDS[case]
    print(f"\n[measured] {case} h100-fp8 TP {ranks} vs oracle: {got}")
    assert got["finite"] and got["top1"] >= top1 and got["mean"] <= mean and got["max"] <= worst
    prompt = random_token_ids(37, seed=3).tolist()
    want = one.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
    assert m.generate(prompt, max_tokens=8, ignore_eos=True).token_ids == want


def test_split_and_collectives(oracle_dir):
    """dense at TP 4: 1 query head and 1 KV head per rank (the 2 KV heads each on the 2 ranks
    whose query heads use it), a quarter of q/k/v, gate/up, o and down; per layer one
    all-reduce after attention and one after the MLP, one all-gather of the logits."""
    _, ckpt = oracle_dir("dense")
    ir = lower_model(load_model_source(str(ckpt)), BuildOptions("h100-f32", **OPTS),
                     log=lambda s: None)
    layers = ir.config.num_layers
    for rank in range(4):
        r = shard_ir(ir, 4, rank)
        assert r.plan.vocab == (rank * 256, (rank + 1) * 256)
        assert {c.kv_heads for c in r.ir.caches} == {1}
        assert r.shards["layers.0.self_attn.k_proj.weight"].start == (rank // 2) * 32
        assert r.shards["layers.2.self_attn.q_proj.weight"].start == rank * 64
        assert r.shards["layers.0.mlp.down_proj.weight"].axis == 1
        assert r.ir.param_map()["layers.0.mlp.gate_proj.weight"].shape == (32, 64)
        assert len(r.plan.row_parallel) == 2 * layers
        low = lower_to_h100(r.ir, max_seqs=3, prefill_buckets=(8, 32), tp=r.plan)
        for e in low.schedule.entries.values():
            ops = [x.op for x in e.launches if isinstance(x, Collective)]
            assert ops == ["all_reduce"] * 2 * layers + ["all_gather"], e.name
    one = lower_to_h100(ir, max_seqs=3, prefill_buckets=(8, 32))
    assert not any(isinstance(x, Collective) for e in one.schedule.entries.values()
                   for x in e.launches)


def test_refusals(oracle_dir):
    _, ckpt = oracle_dir("dense")
    ir = lower_model(load_model_source(str(ckpt)), BuildOptions("h100-f32", **OPTS),
                     log=lambda s: None)
    with pytest.raises(TensorParallelError, match="layer 0: query heads 4 does not divide"):
        shard_ir(ir, 3, 0)
    with pytest.raises(TensorParallelError, match="2 KV heads over 8 ranks|query heads"):
        shard_ir(ir, 8, 0)
    with pytest.raises(TensorParallelError, match="rank 2 of 2"):
        shard_ir(ir, 2, 2)


# --- rvcompile build --tp N: one artifact, a schedule per rank --------------------------------

@pytest.mark.parametrize(("target", "ranks"), [("h100-f32", 2), ("h100-fp8", 4)])
def test_built_tp_artifact(plans, oracle_dir, tmp_path, target, ranks):
    """The build writes every rank's schedule and its part of each weight (build._shard_part,
    from the checkpoint): on the reference executor, what the in-memory split gives."""
    _, one, tp = plans("dense", target)
    _, ckpt = oracle_dir("dense")
    out = tmp_path / "tp.rvp"
    build_artifact(str(ckpt), out, BuildOptions(target, **OPTS, tp=ranks), progress=False,
                   log=lambda s: None)
    art = Artifact.open(out)
    tp_ = art.manifest["h100"]["tensor_parallel"]
    assert tp_["ranks"] == ranks and len(tp_["schedules"]) == ranks - 1
    device = reference_device(art)
    assert isinstance(device, TensorParallelDevice)
    built = Model(art, ScheduledExecutor(device.schedule, device))
    ids = random_token_ids(SEQ, seed=11).tolist()
    np.testing.assert_array_equal(built.logits(ids), tp(ranks).logits(ids))
    if target == "h100-f32":
        assert np.abs(built.logits(ids) - one.logits(ids)).max() <= TP_F32_BOUND


def test_tp_artifact_refused_by_one_gpu_runtime(oracle_dir, tmp_path):
    """Checked like any artifact at open (the ranks' schedules, regions and collectives), then
    refused in one line by the one-GPU runtime before any GPU is touched."""
    from rvcompile.artifacts import ArtifactError
    from rvcompile.runtime import load

    _, ckpt = oracle_dir("dense")
    out = tmp_path / "tp2.rvp"
    build_artifact(str(ckpt), out, BuildOptions("h100-fp8", **OPTS, tp=2), progress=False,
                   log=lambda s: None)
    with pytest.raises(ArtifactError) as e:
        load(out)
    assert str(e.value) == ("tp2.rvp: built with --tp 2 (one kernel schedule per GPU, with "
                            "collectives); this runtime drives one GPU: rebuild with --tp 1")


def test_tp_build_refusals(oracle_dir, tmp_path):
    from rvcompile.sources.model_source import CheckpointError

    _, ckpt = oracle_dir("dense")
    with pytest.raises(CheckpointError, match="--tp 3: target h100-fp8 splits over 2, 4, 8"):
        build_artifact(str(ckpt), tmp_path / "x.rvp", BuildOptions("h100-fp8", **OPTS, tp=3),
                       progress=False, log=lambda s: None)
    with pytest.raises(TensorParallelError, match="query heads 4 does not divide over 8"):
        build_artifact(str(ckpt), tmp_path / "x.rvp", BuildOptions("h100-fp8", **OPTS, tp=8),
                       progress=False, log=lambda s: None)
    assert not (tmp_path / "x.rvp").exists()


def _tampered(art: Artifact, change) -> str:
    """The one-line error reading `art`'s manifest after `change` edits a copy of it."""
    import copy

    from rvcompile.artifacts import ArtifactError
    from rvcompile.artifacts.manifest import parse_manifest

    m = copy.deepcopy(art.manifest)
    change(m["h100"])
    with pytest.raises(ArtifactError) as e:
        parse_manifest(art.header, m, {n: s.size for n, s in art.sections.items()}, "t.rvp")
    return str(e.value)


def test_tp_manifest_checked(oracle_dir, tmp_path):
    _, ckpt = oracle_dir("dense")
    out = tmp_path / "tp2.rvp"
    build_artifact(str(ckpt), out, BuildOptions("h100-f32", **OPTS, tp=2), progress=False,
                   log=lambda s: None)
    art = Artifact.open(out)

    def offsets(h):
        h["tensor_parallel"]["weights"][1] += 256

    def lockstep(h):  # rank 1 skips its first collective
        steps = h["tensor_parallel"]["schedules"][0]["entries"]["decode_1"]["launches"]
        steps.remove(next(x for x in steps if "op" in x))

    def alone(h):  # rank 0's schedule as a one-GPU artifact's
        del h["tensor_parallel"]

    def gather(h):
        steps = h["schedule"]["entries"]["decode_1"]["launches"]
        next(x for x in steps if x.get("op") == "all_reduce")["dst"] += 4

    assert "tensor_parallel.weights: expected [0, " in _tampered(art, offsets)
    assert "rank 1's entry points or collectives differ" in _tampered(art, lockstep)
    assert "has collective steps, which only the ranks" in _tampered(art, alone)
    assert "an all-reduce is in place" in _tampered(art, gather)


@pytest.mark.parametrize("shard", [Shard(0, 2, 6), Shard(1, 1, 3)])
def test_shard_part_across_row_blocks(shard):
    """A big tensor reaches the writer in row blocks (build.ROW_BLOCK_BYTES): each block's share
    of a rank's rows or columns lands where the whole part would."""
    from types import SimpleNamespace

    from rvcompile.build import _shard_part

    full = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    want = np.ascontiguousarray(np.take(full, np.arange(shard.start, shard.stop), shard.axis))
    slot = RankSlot(64, want.nbytes, shard)
    ref = SimpleNamespace(origin="t", name="w")
    out = bytearray(64 + want.nbytes)
    for first, stop in ((0, 3), (3, 5), (5, 8)):
        part = _shard_part(ref, 8, slot, first, stop, full[first:stop])
        if part is not None:
            offset, data = part
            out[offset:offset + data.nbytes] = data.tobytes()
    assert bytes(out[64:]) == want.tobytes()
