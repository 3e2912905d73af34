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
from rvcompile.runtime.executor_api import Penalties, SampleExtras, Sampling, SeqChunk
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
    """A json_schema request and a free one, sampled, side by side through the engine on an
    executor whose device runs parts and on one whose device does not (masks made before each
    call): the same tokens, the constrained output JSON of the schema; the decode calls of the
    first went in two parts."""
    pytest.importorskip("llguidance")
    late, events = recorded(device)
    before, _ = recorded(device, parts=False)
    got = {}
    for name, ex in (("late", late), ("before", before)):
        m = Model(art, ex)
        prompt = m.encode("In the beginning God created")
        got[name] = _run(m, [Request("json", prompt, 40, Sampling(1.0, 0, 1.0, 40),
                                     constraint=Constraint.json_schema(SCHEMA)),
                             Request("free", prompt, 8, Sampling(1.0, 0, 1.0, 9))])
        if name == "late":
            assert m.engine.stats().mask_late_wait_s > 0
            assert set(json.loads(m.decode(got[name]["json"]))) == {"a", "b"}
    assert got["late"] == got["before"]
    forward = [e for e in events if e[0] == "forward" and e[1].startswith("sampled_decode")]
    assert len(forward) > 5


def test_a_mask_job_failing_between_the_parts_ends_only_its_request(art, device, monkeypatch,
                                                                    break_mask_jobs):
    """The grammars' worker fails inside a late decode call (after its forward part ran): the
    json_schema request ends with the error after its first token, the free one beside it gets
    the tokens it gets alone, and the engine then serves a json_schema request whole."""
    pytest.importorskip("llguidance")
    ex, events = recorded(device)
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
    assert ("forward", "sampled_decode_2") in events
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
