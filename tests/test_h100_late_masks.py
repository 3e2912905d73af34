"""Late grammar masks on h100 artifacts (executor_api's "Late masks", issue 16): a sampled entry run
in two parts (KernelSchedule.sampler_split / part: the launches before its sample_prepare, then
the sampler), the token masks handed over between them (ScheduledExecutor.decode_late_masks,
prefill_late_masks), so the engine waits for them while the device runs the forward pass.

CPU (the default model's tiny h100-f32 artifact on the reference executor):
- every sampled entry splits at its sampler's first launch, a plain entry does not, and one
  whose forward part reads sample_io does not (its executor then offers no late masks; nor
  does one over a device without run_part);
- the two parts give the one-part entry's tokens, log-probabilities and top ids bit for bit
  (a decode of masked, penalized and free lanes over several steps; a prefill), the forward
  part launched before masks() is asked for and the sampler part after;
- masks() raising reaches the caller and the next call runs as before; a wrong count of masks
  is refused; the grammars' worker failing inside a late decode call ends only its request;
- through the engine, a json_schema request decodes through late calls beside a free one and
  gives the tokens of an engine that waits for its masks first, valid JSON of the schema.
GPU (skips without an H100): the parts on the device give the one-part entry's results bit for
bit and the reference executor's tokens, and masks() is asked for while the device still runs
the forward part; the engine's json_schema requests on the device equal the reference's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from h100_helpers import h100_context, own_tables

from rvcompile import runtime
from rvcompile.artifacts import Artifact
from rvcompile.artifacts.kernel_schedule import SAMPLER_KERNEL, Arg
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.constraints import Constraint
from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import LoopLane, Penalties, SampleExtras, Sampling, SeqChunk
from rvcompile.runtime.executors.scheduled import ScheduledExecutor
from rvcompile.runtime.model import Model
from rvcompile.targets.h100.reference_executor import reference_device

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"
OPTS = {"max_context": 256, "prefill_buckets": (16, 64), "max_seqs": 4}
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"},
                                          "b": {"enum": ["yes", "no"]}},
          "required": ["a", "b"], "additionalProperties": False}


class Recording:
    """A schedule device that records its runs (("run", entry), (part, entry)) in `events`,
    which a test's masks() also writes to; `parts`: offer run_part."""

    def __init__(self, device, events: list, parts: bool = True):
        self.device, self.events = device, events
        self.kv_blocks = device.kv_blocks
        if parts:
            self.run_part = self._run_part

    def write(self, offset: int, data: bytes) -> None:
        self.device.write(offset, data)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.device.read(offset, nbytes)

    def run(self, entry: str) -> None:
        self.events.append(("run", entry))
        self.device.run(entry)

    def _run_part(self, entry: str, part: str) -> None:
        self.events.append((part, entry))
        self.device.run_part(entry, part)


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Artifact:
    out = tmp_path_factory.mktemp("late-masks") / "h.rvp"
    build_artifact(str(MODEL_DIR), out, BuildOptions("h100-f32", **OPTS), progress=False,
                   log=lambda *a: None)
    return Artifact.open(out)


@pytest.fixture(scope="module")
def device(art):
    return reference_device(art)


def recorded(device, parts: bool = True) -> tuple[ScheduledExecutor, list]:
    events: list = []
    return ScheduledExecutor(device.schedule, Recording(device, events, parts)), events


def test_sampled_entries_split_at_the_sampler(device):
    s = device.schedule
    sampled = [n for n in s.entries if n.startswith("sampled_")]
    assert len(sampled) == 5  # decode 1, 2, 4; prefill 16, 64
    for name in sampled:
        launches = s.entries[name].launches
        split = s.sampler_split(name)
        assert launches[split].kernel == SAMPLER_KERNEL
        assert SAMPLER_KERNEL not in [x.kernel for x in launches[:split]]
        assert s.part(name, "forward") + s.part(name, "sampler") == launches
        plain = name.removeprefix("sampled_")
        assert s.sampler_split(plain) is None  # a plain entry has the kernel, not the split
        assert SAMPLER_KERNEL in [x.kernel for x in s.entries[plain].launches]
    with pytest.raises(ValueError, match="has no part 'sampler'"):
        s.part("decode_4", "sampler")
    with pytest.raises(ValueError, match="has no part 'head'"):
        s.part("sampled_decode_4", "head")
    assert recorded(device)[0].late_masks
    assert not recorded(device, parts=False)[0].late_masks


def test_an_entry_whose_forward_part_reads_sample_io_does_not_split(device):
    s = device.schedule
    name = "sampled_decode_2"
    e = s.entries[name]
    first = e.launches[0]
    at = next(i for i, a in enumerate(first.args) if a.kind == "ptr")
    args = list(first.args)
    args[at] = Arg(args[at].name, "ptr", s.sampler.offset + 8)  # pen_at, say
    changed = dataclasses.replace(e, launches=(dataclasses.replace(first, args=tuple(args)),
                                               *e.launches[1:]))
    s2 = dataclasses.replace(s, entries={**s.entries, name: changed})
    assert s2.sampler_split(name) is None and s2.sampler_split("sampled_decode_4") is not None
    assert not ScheduledExecutor(s2, Recording(device, [])).late_masks


def _mask(rng, words: int, share: float) -> np.ndarray:
    return np.packbits(rng.random(32 * words) < share, bitorder="little").view(np.int32)


def test_the_parts_give_the_one_part_results_bit_for_bit(device):
    """Three lanes (masked with log-probabilities, masked and penalized, free), three decode
    steps, each run late and in one part from the same KV: the same tokens, log-probabilities
    and top ids; the forward part ran before masks() was asked, the sampler part after."""
    ex, events = recorded(device)
    rng = np.random.default_rng(3)
    words = ex.schedule.sampler.mask_words
    prompts = [rng.integers(3, 8000, n).tolist() for n in (7, 12, 20)]
    samplings = [Sampling(1.0, 0, 1.0, 21), Sampling(), Sampling(0.8, 50, 0.9, 22)]
    seqs = [[ex.prefill(SeqChunk(p, 0, own_tables(ex, i), s))]
            for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))]
    for step in range(3):
        masks = [_mask(rng, words, 0.05), _mask(rng, words, 0.5), None]
        counts = np.bincount(seqs[1], minlength=ex.schedule.vocab_size)
        ids = np.flatnonzero(counts).astype(np.int32)
        extras = [SampleExtras(3), SampleExtras(1, Penalties(0.5, 0.8, 1.2), ids,
                                                counts[ids].astype(np.int32)), None]
        lanes = [SeqChunk([seq[-1]], len(p) + step, own_tables(ex, i), s, step + 1, extras=e)
                 for i, (p, seq, s, e) in enumerate(zip(prompts, seqs, samplings, extras,
                                                       strict=True))]

        def given(masks=masks):
            events.append("masks")
            return masks

        del events[:]
        got = ex.decode_late_masks(lanes, given)
        assert events == [("forward", "sampled_decode_4"), "masks",
                          ("sampler", "sampled_decode_4")]
        want = ex.decode_sampled([
            dataclasses.replace(c, extras=dataclasses.replace(c.extras or SampleExtras(),
                                                              mask=m))
            for c, m in zip(lanes, masks, strict=True)])
        assert got == want
        allowed = np.unpackbits(masks[0].view(np.uint8), bitorder="little")
        assert allowed[got[0].token] and got[0].logprob < 0 and len(got[0].top) == 3
        for seq, o in zip(seqs, got, strict=True):
            seq.append(o.token)


def test_a_late_prefill_gives_the_one_part_token(device):
    ex, events = recorded(device)
    rng = np.random.default_rng(4)
    mask = _mask(rng, ex.schedule.sampler.mask_words, 0.02)
    chunk = SeqChunk(rng.integers(3, 8000, 30).tolist(), 0, own_tables(ex, 0),
                     Sampling(1.0, 0, 1.0, 5), extras=SampleExtras(2))
    got = ex.prefill_late_masks(chunk, lambda: [mask])
    assert events == [("forward", "sampled_prefill_64"), ("sampler", "sampled_prefill_64")]
    want = ex.prefill_sampled(dataclasses.replace(
        chunk, extras=SampleExtras(2, mask=mask)))
    assert got == want and np.unpackbits(mask.view(np.uint8), bitorder="little")[got.token]


def test_masks_that_fail_reach_the_caller_and_the_next_call_runs(device):
    ex, _ = recorded(device)
    lanes = [SeqChunk([5], 3, own_tables(ex, i), Sampling(), 1, extras=SampleExtras(0))
             for i in range(2)]

    def broken():
        raise RuntimeError("no masks")

    with pytest.raises(RuntimeError, match="no masks"):
        ex.decode_late_masks(lanes, broken)
    with pytest.raises(ValueError, match="1 late masks for 2 lanes"):
        ex.decode_late_masks(lanes, lambda: [None])
    with pytest.raises(ValueError, match="allows no token"):
        ex.decode_late_masks(lanes, lambda: [None, np.zeros(256, np.int32)])
    want = ex.decode_sampled(lanes)
    assert ex.decode_late_masks(lanes, lambda: [None, None]) == want


def _token_mask(words: int, token: int, lane: int) -> np.ndarray:
    """A mask that depends on the token before it (as a grammar's does): about a tenth of the
    vocabulary, drawn from the token and the lane."""
    return _mask(np.random.default_rng(token * 7 + lane), words, 0.1)


def _loop_lanes(ex, prompts, samplings, budgets, stops, first_masks):
    seqs = [ex.prefill(SeqChunk(p, 0, own_tables(ex, i), s))
            for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))]
    lanes = [LoopLane(SeqChunk([t], len(p), own_tables(ex, i), s, 1,
                               extras=None if m is None else SampleExtras(mask=m)), b, st)
             for i, (t, p, s, b, st, m) in enumerate(zip(seqs, prompts, samplings, budgets,
                                                         stops, first_masks, strict=True))]
    return seqs, lanes


def test_the_masked_loop_gives_single_late_calls_tokens(device):
    """Three lanes (two masked, each step's mask drawn from the token before it; one free) of
    budgets 5, 3, 5, the first with a stop id it samples at its second step: decode_many_masked
    gives what one decode_late_masks call per step gives from the same KV (a lane runs until
    its budget; the stopped one's tokens end at its stop id). masks() gets each step's tokens
    once step s + 1's forward part was launched and before its sampler; progress gets them
    after step s + 1's sampler and step s + 2's forward part."""
    ex, events = recorded(device)
    assert ex.masked_loop
    words = ex.schedule.sampler.mask_words
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 8000, n).tolist() for n in (6, 11, 17)]
    samplings = [Sampling(1.0, 0, 1.0, 41), Sampling(0.7, 40, 0.95, 42), Sampling(1.0, 0, 1.0, 43)]
    budgets = [5, 3, 5]
    masked = [True, False, True]
    firsts = [_token_mask(words, 0, i) if masked[i] else None for i in range(3)]

    def stepwise(stops):
        seqs, lanes = _loop_lanes(ex, prompts, samplings, budgets, stops, firsts)
        out, masks = [[] for _ in lanes], list(firsts)
        for step in range(max(budgets)):
            live = [i for i in range(3) if step < budgets[i]]
            chunks = [SeqChunk([out[i][-1] if out[i] else seqs[i]], len(prompts[i]) + step,
                               own_tables(ex, i), samplings[i], step + 1) for i in live]
            got = ex.decode_late_masks(chunks, lambda live=live, masks=masks:
                                       [masks[i] for i in live])
            for i, o in zip(live, got, strict=True):
                out[i].append(o.token)
                masks[i] = _token_mask(words, o.token, i) if masked[i] else None
        return out

    want = stepwise([frozenset()] * 3)
    # the first lane's second token as its stop id: the loop ends its tokens there
    stops = [frozenset([want[0][1]]), frozenset(), frozenset()]
    _, lanes = _loop_lanes(ex, prompts, samplings, budgets, stops, firsts)
    del events[:]
    seen = []

    def masks(new):
        seen.append(new)
        events.append(("masks", len(seen)))
        return [_token_mask(words, t[-1], i) if t and masked[i] else None
                for i, t in enumerate(new)]

    def progress(new):
        events.append(("progress", len(seen)))
        assert new == seen[-1]
        return True

    got = ex.decode_many_masked(lanes, masks, progress)
    assert got == [want[0][:2], want[1], want[2]]
    assert [len([t for t in new if t]) for new in seen] == [3, 3, 2, 1, 1]
    f, m, p = ("forward", "sampled_decode_4"), ("sampler", "sampled_decode_4"), "progress"
    assert events == [f, m, f, ("masks", 1), m, f, (p, 1), ("masks", 2), m, f, (p, 2),
                      ("masks", 3), m, f, (p, 3), ("masks", 4), m, (p, 4), ("masks", 5),
                      (p, 5)]
    # free lanes alone, masks always None: the plain sampled loop, bit for bit
    _, lanes = _loop_lanes(ex, prompts, samplings, budgets, [frozenset()] * 3, [None] * 3)
    plain = ex.decode_many_masked(lanes, lambda new: [None] * 3)
    masked[:] = [False] * 3
    firsts[:] = [None] * 3
    assert plain == stepwise([frozenset()] * 3)


def test_a_masked_loop_is_refused_where_it_cannot_run(device):
    """No masked loop without entry parts, or where a sampled decode entry lacks its
    decode_advance (an artifact built before it); lanes with log-probabilities or penalties
    are refused; masks() raising reaches the caller, a wrong count of masks is refused, and
    the next call runs as before: unmasked, the plain loop's tokens."""
    ex, _ = recorded(device)
    assert not recorded(device, parts=False)[0].masked_loop
    s = device.schedule
    e = s.entries["sampled_decode_2"]
    older = dataclasses.replace(s, entries={**s.entries, "sampled_decode_2": dataclasses.replace(
        e, launches=e.launches[:-1])})
    old_ex = ScheduledExecutor(older, Recording(device, []))
    assert old_ex.late_masks and not old_ex.masked_loop
    _, lanes = _loop_lanes(ex, [[5, 6, 7], [8, 9]], [Sampling()] * 2, [3, 3],
                           [frozenset()] * 2, [None, None])
    with pytest.raises(ValueError, match="offers no masked decode loop"):
        old_ex.decode_many_masked(lanes, lambda new: [None, None])
    with_logprobs = [dataclasses.replace(lanes[0], chunk=dataclasses.replace(
        lanes[0].chunk, extras=SampleExtras(2))), lanes[1]]
    with pytest.raises(ValueError, match="a token mask only"):
        ex.decode_many_masked(with_logprobs, lambda new: [None, None])

    def broken(new):
        raise RuntimeError("no masks")

    with pytest.raises(RuntimeError, match="no masks"):
        ex.decode_many_masked(lanes, broken)
    with pytest.raises(ValueError, match="1 masks for 2 lanes"):
        ex.decode_many_masked(lanes, lambda new: [None])
    # neutral extras sample what the plain loop samples
    assert ex.decode_many_masked(lanes, lambda new: [None, None]) == ex.decode_many(lanes)


def _run(m: Model, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        m.engine.add(r)
    outs: dict[str, list[int]] = {r.id: [] for r in requests}
    while m.engine.has_work():
        for o in m.engine.step():
            assert o.finish_reason != "error", o.error
            outs[o.id] += o.token_ids
    return outs


def test_the_engine_decodes_json_schema_requests_through_late_calls(art, device):
    """Two json_schema requests and a free one, sampled, side by side through the engine on an
    executor with the masked decode loop, on one whose decode calls take masks late (no
    masked loop) and on one whose device runs no parts (masks made before each call): the
    same tokens, the constrained outputs JSON of the schema; the first ran masked loop calls,
    the second late calls in two parts."""
    pytest.importorskip("llguidance")
    loop, _ = recorded(device)
    late, events = recorded(device)
    late.masked_loop = False
    before, _ = recorded(device, parts=False)
    loops = []
    run_loop = loop.decode_many_masked
    loop.decode_many_masked = lambda *a: loops.append(len(a[0])) or run_loop(*a)
    got = {}
    for name, ex in (("loop", loop), ("late", late), ("before", before)):
        m = Model(art, ex)
        prompt = m.encode("In the beginning God created")
        got[name] = _run(m, [Request(f"json{i}", prompt, 40, Sampling(1.0, 0, 1.0, 40 + i),
                                     constraint=Constraint.json_schema(SCHEMA))
                             for i in range(2)]
                         + [Request("free", prompt, 8, Sampling(1.0, 0, 1.0, 9))])
        if name != "before":
            assert m.engine.stats().mask_late_wait_s > 0
            for i in range(2):
                assert set(json.loads(m.decode(got[name][f"json{i}"]))) == {"a", "b"}
    assert got["loop"] == got["late"] == got["before"]
    assert loops and max(loops) == 3
    forward = [e for e in events if e[0] == "forward" and e[1].startswith("sampled_decode")]
    assert len(forward) > 5


@pytest.mark.parametrize("loop", [False, True])
def test_a_mask_job_failing_between_the_parts_ends_only_its_request(art, device, monkeypatch,
                                                                    break_mask_jobs, loop):
    """The grammars' worker fails inside a late decode call (after its forward part ran; with
    the masked loop, as the loop call starts): the json_schema request ends with the error
    after its first token, the free one beside it gets the tokens it gets alone, and the
    engine then serves a json_schema request whole."""
    pytest.importorskip("llguidance")
    ex, events = recorded(device)
    if not loop:
        ex.masked_loop = False  # an executor without it: its decode calls take masks late
    m = Model(art, ex)
    prompt = m.encode("In the beginning God created")
    free = Request("free", prompt, 6, Sampling(1.0, 0, 1.0, 9))
    alone = _run(m, [free])["free"]
    break_mask_jobs()
    m.engine.add(Request("json", prompt, 40, Sampling(1.0, 0, 1.0, 40),
                         constraint=Constraint.json_schema(SCHEMA)))
    m.engine.add(free)
    outs: dict[str, list] = {"json": [], "free": []}
    while m.engine.has_work():
        for o in m.engine.step():
            outs[o.id].append(o)
    assert [o.finished for o in outs["json"]] == [False, True]
    assert outs["json"][-1].finish_reason == "error"
    assert "llguidance broke" in outs["json"][-1].error
    assert [t for o in outs["free"] for t in o.token_ids] == alone
    assert (("forward", "sampled_decode_2") in events) != loop
    monkeypatch.undo()
    got = _run(m, [Request("json", prompt, 40, Sampling(1.0, 0, 1.0, 40),
                           constraint=Constraint.json_schema(SCHEMA))])["json"]
    assert set(json.loads(m.decode(got))) == {"a", "b"}
    assert m.engine.stats().kv_used == {k: 0 for k in ex.kinds}


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_late_masks_on_the_device(art, device):
    """The tiny artifact on the GPU: six late decode steps of a masked, a penalized and a free
    lane equal the one-part entry's results bit for bit and the reference executor's tokens
    (the existing sampled-decode test's tolerance for log-probabilities); masks() was asked for
    while the device still ran the forward part at least once; then the engine's json_schema
    requests give the reference executor's tokens."""
    ctx = h100_context()
    gpu = runtime.load(art.path)
    ex, ref = gpu.executor, ScheduledExecutor(device.schedule, device)
    assert ex.late_masks
    dev = ex.device
    rng = np.random.default_rng(11)
    words = ex.schedule.sampler.mask_words
    prompts = [rng.integers(3, 8000, n).tolist() for n in (9, 15, 31)]
    samplings = [Sampling(1.0, 0, 1.0, 31), Sampling(), Sampling(0.8, 50, 0.9, 32)]
    seqs = {}
    for name, x in (("gpu", ex), ("ref", ref)):
        seqs[name] = [[x.prefill(SeqChunk(p, 0, own_tables(x, i), s))]
                      for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))]
    busy = []
    for step in range(6):
        masks = [_mask(rng, words, 0.05), _mask(rng, words, 0.5), None]
        outs = {}
        for name, x in (("gpu", ex), ("ref", ref)):
            counts = np.bincount(seqs[name][1], minlength=ex.schedule.vocab_size)
            ids = np.flatnonzero(counts).astype(np.int32)
            extras = [SampleExtras(3), SampleExtras(1, Penalties(0.5, 0.8, 1.2), ids,
                                                    counts[ids].astype(np.int32)), None]
            lanes = [SeqChunk([seq[-1]], len(p) + step, own_tables(x, i), s, step + 1,
                              extras=e)
                     for i, (p, seq, s, e) in enumerate(zip(prompts, seqs[name], samplings,
                                                           extras, strict=True))]

            def given(masks=masks, x=x):
                if x is ex:  # CUDA_ERROR_NOT_READY: the stream still runs the forward part
                    busy.append(int(ctx.cu.cuStreamQuery(dev.stream)[0]) != 0)
                return masks

            outs[name] = x.decode_late_masks(lanes, given)
            if x is ex:
                one_part = x.decode_sampled([
                    dataclasses.replace(c, extras=dataclasses.replace(
                        c.extras or SampleExtras(), mask=m))
                    for c, m in zip(lanes, masks, strict=True)])
                assert outs[name] == one_part
        assert [o.token for o in outs["gpu"]] == [o.token for o in outs["ref"]]
        for a, b in zip(outs["gpu"][:2], outs["ref"][:2], strict=True):
            assert abs(a.logprob - b.logprob) < 2e-5
        for name in seqs:
            for seq, o in zip(seqs[name], outs[name], strict=True):
                seq.append(o.token)
    assert any(busy)
    pytest.importorskip("llguidance")
    prompt = gpu.encode("In the beginning God created")
    requests = [Request(f"j{i}", prompt, 40, Sampling(1.0, 0, 1.0, 50 + i),
                        constraint=Constraint.json_schema(SCHEMA)) for i in range(3)]
    want = _run(Model(art, ScheduledExecutor(device.schedule, device)), requests)
    assert _run(gpu, requests) == want
    assert gpu.engine.stats().mask_late_wait_s > 0


@pytest.mark.gpu
def test_the_masked_loop_on_the_device(art, device):
    """decode_many_masked on the GPU (two masked lanes, each step's mask drawn from the token
    before it, and a free one; budgets 8, 5, 8) gives the reference executor's tokens; masks()
    was asked for while the device still ran the next step's forward part at least once."""
    ctx = h100_context()
    gpu = runtime.load(art.path)
    ex, ref = gpu.executor, ScheduledExecutor(device.schedule, device)
    assert ex.masked_loop
    words = ex.schedule.sampler.mask_words
    rng = np.random.default_rng(12)
    prompts = [rng.integers(3, 8000, n).tolist() for n in (9, 23, 40)]
    samplings = [Sampling(1.0, 0, 1.0, 61), Sampling(), Sampling(0.8, 50, 0.9, 62)]
    masked = [True, False, True]
    firsts = [_token_mask(words, 0, i) if masked[i] else None for i in range(3)]
    got, busy = {}, []
    for name, x in (("gpu", ex), ("ref", ref)):
        _, lanes = _loop_lanes(x, prompts, samplings, [8, 5, 8], [frozenset()] * 3, firsts)

        def masks(new, x=x):
            if x is ex:  # CUDA_ERROR_NOT_READY: the stream still runs
                busy.append(int(ctx.cu.cuStreamQuery(ex.device.stream)[0]) != 0)
            return [_token_mask(words, t[-1], i) if t and masked[i] else None
                    for i, t in enumerate(new)]

        got[name] = x.decode_many_masked(lanes, masks)
    assert got["gpu"] == got["ref"] and [len(t) for t in got["gpu"]] == [8, 5, 8]
    assert any(busy)
