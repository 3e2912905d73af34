"""The h100 executor's decode loop (ScheduledExecutor.decode_many: decode graphs replayed back
to back, each ending with decode_advance) on the CPU reference device: each step must be bit for
bit the decode call of the same lanes (tokens and the KV pools), greedy and seeded; a lane ends
at its budget or a stop id and the others go on unchanged; decode_advance against its rule; and
the engine, which runs the loop when nobody waits to join, gives the same generations as with
single decode steps. On an H100, the CUDA executor's loop against its own
single decode calls.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from h100_helpers import h100_context, own_tables, reference_executor
from oracle import random_token_ids

from rvcompile import runtime
from rvcompile.artifacts import Artifact
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import LoopLane, Sampling, SeqChunk, decode_loop_steps
from rvcompile.runtime.model import Model

OPTS = {"max_context": 128, "prefill_buckets": (8, 32), "max_seqs": 3}
SAMPLED = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def art(oracle_dir, tmp_path_factory):
    _, ckpt = oracle_dir("k_eq_v")
    out = tmp_path_factory.mktemp("h100-loop") / "k_eq_v.rvp"
    build_artifact(str(ckpt), out, BuildOptions("h100-fp8", **OPTS), progress=False,
                   log=lambda s: None)
    return Artifact.open(out)


def prefilled(art, prompts, sampling, ex=None):
    """An executor (default: the reference one) with each prompt prefilled into its own
    blocks, and each lane's first decode chunk (its sampled token at the prompt's end)."""
    ex = ex or reference_executor(art)
    lanes = []
    for i, p in enumerate(prompts):
        for s in range(0, len(p), ex.max_chunk):
            chunk = SeqChunk(p[s:s + ex.max_chunk], s, own_tables(ex, i), sampling,
                             step=max(0, s + ex.max_chunk - len(p)))
            token = ex.prefill(chunk)
        lanes.append(SeqChunk([token], len(p), own_tables(ex, i), sampling, step=1))
    return ex, lanes


def stepped(ex, lanes, steps):
    """`steps` single decode calls of all the lanes, each fed its last token."""
    out = [[] for _ in lanes]
    for k in range(steps):
        chunks = [dataclasses.replace(c, tokens=[out[i][-1] if out[i] else c.tokens[0]],
                                      start=c.start + k, step=c.step + k)
                  for i, c in enumerate(lanes)]
        for i, token in enumerate(ex.decode(chunks)):
            out[i].append(token)
    return out


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED], ids=["greedy", "seeded"])
def test_loop_equals_single_decode_calls(art, sampling):
    prompts = [random_token_ids(n, seed=s).tolist() for n, s in ((5, 1), (19, 2))]
    a, lanes = prefilled(art, prompts, sampling)
    b, _ = prefilled(art, prompts, sampling)
    steps = 6
    assert decode_loop_steps(a) >= steps
    got = a.decode_many([LoopLane(c, steps, frozenset()) for c in lanes])
    want = stepped(b, lanes, steps)
    assert got == want
    pools = slice(a.schedule.arena_bytes, None)  # placed after the arena's fixed part
    assert np.array_equal(a.device.mem[pools], b.device.mem[pools])  # the KV pools too


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED], ids=["greedy", "seeded"])
def test_gpu_loop_equals_single_decode_calls(art, sampling):
    h100_context()
    prompts = [random_token_ids(n, seed=s).tolist() for n, s in ((5, 1), (19, 2), (30, 3))]
    a, lanes = prefilled(art, prompts, sampling, runtime.load(art.path).executor)
    b, _ = prefilled(art, prompts, sampling, runtime.load(art.path).executor)
    budgets = (9, 4, 9)
    groups = []  # the progressive loop's groups of 2, each read while the next one runs
    got = a.decode_many([LoopLane(c, n, frozenset()) for c, n in zip(lanes, budgets, strict=True)],
                        lambda new: groups.append(new) or True, group=2)
    want = stepped(b, lanes, max(budgets))
    assert got == [w[:n] for w, n in zip(want, budgets, strict=True)]
    assert [[t for g in groups for t in g[i]] for i in range(3)] == got


def test_lanes_end_at_budget_and_stop_ids_alone(art):
    prompts = [random_token_ids(n, seed=s).tolist() for n, s in ((7, 3), (12, 4), (9, 5))]
    ex, lanes = prefilled(art, prompts, SAMPLED)
    free = ex.decode_many([LoopLane(c, 8, frozenset()) for c in lanes])
    ex, lanes = prefilled(art, prompts, SAMPLED)
    stop = free[1][2]
    got = ex.decode_many([LoopLane(lanes[0], 3, frozenset()),
                          LoopLane(lanes[1], 8, frozenset({stop, 5000})),
                          LoopLane(lanes[2], 8, frozenset())])
    assert got[0] == free[0][:3]
    assert got[1] == free[1][:free[1].index(stop) + 1]
    assert got[2] == free[2]  # the rows that ended early did not change it


class LaterDevice:
    """The reference device with read_later, logging what the executor asks of it: each run,
    each read_later (queued behind what ran) and each fetch of one."""

    def __init__(self, device):
        self.device, self.kv_blocks, self.log = device, device.kv_blocks, []

    def write(self, offset, data):
        self.device.write(offset, data)

    def read(self, offset, nbytes):
        return self.device.read(offset, nbytes)

    def run(self, entry):
        self.log.append("run")
        self.device.run(entry)

    def read_later(self, offset, nbytes):
        data = self.device.read(offset, nbytes)  # the reference device ran it already
        n = self.log.count("read") + 1
        self.log.append("read")

        def fetch():
            self.log.append(f"fetch {n}")
            return data
        return fetch


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED], ids=["greedy", "seeded"])
def test_progress_hands_each_group_over_while_the_next_one_runs(art, sampling):
    """Groups of 2 steps: the tokens handed to progress, group by group, are the loop's; each
    group's tokens are fetched only after the next group was launched (and queued a read)."""
    prompts = [random_token_ids(n, seed=s).tolist() for n, s in ((5, 1), (19, 2), (9, 3))]
    a, lanes = prefilled(art, prompts, sampling)
    b, _ = prefilled(art, prompts, sampling)
    b.device = LaterDevice(b.device)
    loop = [LoopLane(c, n, frozenset()) for c, n in zip(lanes, (7, 3, 7), strict=True)]
    want = a.decode_many(loop)
    groups = []
    got = b.decode_many(loop, lambda new: groups.append(new) or True, group=2)
    assert got == want
    assert [[t for g in groups for t in g[i]] for i in range(3)] == want
    assert [len(g[1]) for g in groups] == [2, 1, 0, 0]  # lane 1 ended at its budget of 3
    assert b.device.log == (["run"] * 2 + ["read"]) * 2 + ["fetch 1"] + ["run"] * 2 + [
        "read", "fetch 2"] + ["run", "read", "fetch 3", "fetch 4"]


def test_progress_can_end_the_loop_after_the_queued_group(art):
    prompts = [random_token_ids(n, seed=s).tolist() for n, s in ((5, 4), (11, 5))]
    a, lanes = prefilled(art, prompts, SAMPLED)
    b, _ = prefilled(art, prompts, SAMPLED)
    loop = [LoopLane(c, 8, frozenset()) for c in lanes]
    want = a.decode_many(loop)
    calls = []
    got = b.decode_many(loop, lambda new: calls.append(new) and False, group=3)
    assert len(calls) == 2 and got == [w[:6] for w in want]  # the group it was given, and one
    with pytest.raises(ValueError, match="group -1"):
        b.decode_many(loop, None, group=-1)


def test_decode_advance_moves_live_lanes_and_logs_the_step():
    from rvcompile.targets.h100.rows import advance

    sampled = np.array([11, 12, 13, 14], np.int32)
    tokens = np.array([1, 2, 3, 4], np.int32)
    positions = np.array([5, 6, -1, 8], np.int32)
    seq_len, step = positions + 1, np.array([0, 1, 2, 3], np.int32)
    budget = np.array([2, 1, 3, 0], np.int32)
    loop_step, history = np.array([1], np.int32), np.full((3, 4), 7, np.int32)
    advance(sampled, tokens, positions, seq_len, step, budget, loop_step, history)
    assert history[1].tolist() == [11, 12, -1, -1] and (history[[0, 2]] == 7).all()
    assert tokens.tolist() == [11, 2, 3, 4]  # lane 0 goes on; lane 1 spent its budget
    assert positions.tolist() == [6, -1, -1, 8] and seq_len.tolist() == [7, 1, 0, 9]
    assert step.tolist() == [1, 1, 2, 3] and budget.tolist() == [1, 0, 3, 0]
    assert loop_step.tolist() == [2]
    advance(sampled, tokens, positions, seq_len, step, budget, np.array([3], np.int32),
            history)  # past the history's rows: nothing logged
    assert (history[[0, 2]] == 7).all()


def test_artifacts_without_decode_advance_offer_no_loop(art):
    from rvcompile.runtime.executors.scheduled import ScheduledExecutor

    ex = reference_executor(art)
    io = {k: v for k, v in ex.schedule.io.items() if not k.startswith("loop_")}
    old = ScheduledExecutor(dataclasses.replace(ex.schedule, io=io), ex.device)
    assert decode_loop_steps(old) == 0 and decode_loop_steps(ex) > 0
    with pytest.raises(ValueError, match="built before the decode loop"):
        old.decode_many([])


def test_bad_loop_lanes_are_refused(art):
    ex, lanes = prefilled(art, [[1, 2, 3]], Sampling())
    with pytest.raises(ValueError, match="lane budget 0"):
        ex.decode_many([LoopLane(lanes[0], 0, frozenset())])
    with pytest.raises(ValueError, match="stop token ids"):
        ex.decode_many([LoopLane(lanes[0], 2, frozenset(range(ex.decode_loop_stops + 1)))])


def test_bad_block_tables_are_refused(art):
    """Every lane's tables are checked in one go (stacked once a call): short, ragged, negative
    and out-of-pool tables get the one-line refusal, not numpy's error or a device read."""
    ex, lanes = prefilled(art, [[1, 2, 3], [4, 5]], Sampling())
    kind = next(iter(ex.kinds.values()))
    good = lanes[1].tables[kind.name]
    bad = {"short": list(good)[:-1], "negative": [-1] * len(good),
           "beyond the pool": [kind.num_blocks] * len(good)}
    for table in bad.values():
        lane = dataclasses.replace(lanes[1], tables={**lanes[1].tables, kind.name: table})
        with pytest.raises(ValueError, match=f"block table for {kind.name!r} must hold"):
            ex.decode([lanes[0], lane])
    ragged = dataclasses.replace(lanes[1], tables={**lanes[1].tables,
                                                   kind.name: [[0, 1]] * len(good)})
    with pytest.raises(ValueError, match="must hold"):
        ex.decode([lanes[0], ragged])


def _engine_tokens(art, executor, loop: bool, stream: bool = False):
    """Three requests through an engine over `executor` (with its decode loop or without):
    each one's tokens, the engine's steps, and how many outputs came while a call ran."""
    prompts = [random_token_ids(n, seed=s).tolist() for n, s in ((6, 8), (21, 9), (13, 10))]
    samplings = [Sampling(), SAMPLED, dataclasses.replace(SAMPLED, seed=11)]
    if not loop:
        executor.decode_loop_steps = 0
    eng = Model(art, executor).engine
    for i, (p, s) in enumerate(zip(prompts, samplings, strict=True)):
        eng.add(Request(f"r{i}", p, 40, s, ignore_eos=True, stream=stream))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    delivered = []

    def take(outs):
        delivered.extend(outs)
        for out in outs:
            tokens[out.id] += out.token_ids

    while eng.has_work():
        for out in eng.step(deliver=take):
            assert out.finish_reason != "error", out.error
            tokens[out.id] += out.token_ids
    assert all(out.finish_reason != "error" for out in delivered)
    return list(tokens.values()), eng.steps, len(delivered)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_engine_with_the_loop_gives_what_single_steps_give(art, stream):
    """Through the progressive loop (its outputs delivered while calls run), streamed or not:
    the tokens of single decode steps."""
    looped, loop_steps, delivered = _engine_tokens(art, reference_executor(art), True, stream)
    single, single_steps, _ = _engine_tokens(art, reference_executor(art), False)
    assert looped == single
    assert loop_steps < single_steps and delivered  # the loop ran, handing tokens over


@pytest.mark.gpu
def test_gpu_engine_with_the_loop_gives_what_single_steps_give(art):
    """The same on the CUDA device: its read_later reads each group's tokens behind the next."""
    h100_context()
    looped, loop_steps, delivered = _engine_tokens(art, runtime.load(art.path).executor, True,
                                                   stream=True)
    single, single_steps, _ = _engine_tokens(art, runtime.load(art.path).executor, False)
    assert looped == single
    assert loop_steps < single_steps and delivered
