"""Speculative decoding (n-gram drafts) on h100 artifacts: `--num-draft-tokens K` builds verify
entries, and ScheduledExecutor.verify runs a lane's token and drafts as rows of one decode-like
call (targets/h100/lower.py), row i sampled at step + i.

CPU (the schedule on the reference device; the embedded default model, models/rv-gemma4-tiny,
on h100-f32 and h100-fp8, K = 3, max_seqs 2: entries decode_1/2, verify_4/8):
- greedy with n-gram speculation gives plain greedy's tokens, 256 of them, through
  Model.generate; drafts are made and accepted (the counts are printed);
- verify of a token and k drafts gives, row by row, the tokens k + 1 sequential decode steps
  give (greedy and seeded sampling; lanes of different lengths in one call, padded to a wider
  entry; a wrong draft changes only the rows after it). What is equal is the tokens: a row's
  logits may differ from the decode step's in the last bits, because the references (like the
  GPU's kernels) compute a linear of 1 row and one of several rows in different summation
  orders (BLAS's GEMV and GEMM on the CPU; gemv_fp8 against gemv_mma_fp8, the head's GEMV
  against its GEMM from 4 rows on the GPU), which moves a token only at a near-tie;
- a seeded sampled request with speculation gives the same tokens on every run, and those of
  the same request without it (exact match at the same RNG steps; the same proviso);
- plain and speculating requests batched in one engine give their solo tokens;
- a --tp 2 build verifies on the CPU's tensor-parallel device too;
- refusals: "assistant" on an artifact without a drafter, "ngram" on one without verify
  entries, schedules whose verify entries do not match their draft_tokens (the assistant
  drafter's: tests/test_h100_assistant.py).
GPU (marked gpu, skipped without one): greedy with n-gram speculation = plain greedy, and
verify = sequential decode, on the CUDA device (h100-fp8 and h100-f32).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
from h100_helpers import (
    assert_greedy_equal_or_tied,
    h100_context,
    own_tables,
    prompt_ids,
    reference_model,
)

from rvcompile import runtime
from rvcompile.artifacts import Artifact
from rvcompile.artifacts.kernel_schedule import (
    SCHEDULE_VERSION,
    TP_SCHEDULE_VERSION,
    KernelSchedule,
)
from rvcompile.artifacts.schema import SchemaError
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import Sampling, SeqChunk, max_draft_tokens
from rvcompile.runtime.request_limits import RequestError
from rvcompile.runtime.speculative import Speculation
from rvcompile.targets.h100.lower import verify_buckets

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"
K = 3
OPTS = {"max_context": 512, "prefill_buckets": (16,), "max_seqs": 2, "draft_tokens": K}
TARGETS = ("h100-f32", "h100-fp8")
N_GREEDY = 256


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def get(target: str, **opts) -> Path:
        key = (target, *sorted(opts.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp("h100spec") / f"{target}.rvp"
            build_artifact(str(MODEL_DIR), out, BuildOptions(target, **{**OPTS, **opts}),
                           progress=False, log=lambda s: None)
            cache[key] = out
        return cache[key]

    return get


def test_verify_buckets():
    assert verify_buckets(2, 0) == ()
    assert verify_buckets(2, 3) == (4, 8)
    assert verify_buckets(1, 3) == (2, 4)
    assert verify_buckets(8, 3) == (16, 32)
    assert verify_buckets(4, 4) == (8, 16, 20)


def test_schedule_records_draft_tokens(built):
    ex = reference_model(built("h100-f32")).executor
    s = ex.schedule
    assert s.draft_tokens == K and s.version == SCHEDULE_VERSION  # one GPU: 7, drafts or not
    assert sorted(n for n in s.entries if n.startswith(("decode_", "verify_"))) == \
        ["decode_1", "decode_2", "verify_4", "verify_8"]
    assert all(s.entries[n].graph for n in ("verify_4", "verify_8"))
    # lowered as decode entries: a query per row through the decode attention, every row
    # sampled
    kernels = {x.kernel for x in s.entries["verify_8"].launches}
    assert any(k.startswith("attn_decode_") for k in kernels)
    assert not any(k.startswith("attn_prefill") for k in kernels)
    assert s.outputs["verify_8.out_tokens"].shape == (8,)
    assert max_draft_tokens(ex) == K and not ex.has_drafter


@pytest.mark.parametrize("target", TARGETS)
def test_greedy_ngram_speculation_is_plain_greedy(built, target):
    m = reference_model(built(target))
    prompt = prompt_ids(m)
    plain = m.generate(prompt, max_tokens=N_GREEDY, ignore_eos=True)
    spec = m.generate(prompt, max_tokens=N_GREEDY, ignore_eos=True, speculative="ngram")
    assert len(plain.token_ids) == N_GREEDY
    assert spec.token_ids == plain.token_ids
    assert 0 < spec.accepted_tokens <= spec.drafted_tokens
    stats = m.engine.stats()
    assert stats.verify_calls > 0 and stats.accepted == spec.accepted_tokens
    print(f"\n[measured] {target}, {N_GREEDY} greedy tokens, n-gram K={K}: accepted "
          f"{spec.accepted_tokens} of {spec.drafted_tokens} drafts in {stats.verify_calls} "
          f"verify calls ({N_GREEDY - 1} tokens after the prefill's: "
          f"{(N_GREEDY - 1) / stats.verify_calls:.2f} a call)")


def sequential(ex, prompt: list[int], seq: int, steps: int, sampling: Sampling) -> list[int]:
    """Sequence `seq`'s prompt prefilled, then `steps` single-lane decode steps: the first
    sampled token and the ones after it."""
    tables = own_tables(ex, seq)
    tok = ex.prefill(SeqChunk(prompt, 0, tables, sampling, 0))
    out = [tok]
    for i in range(steps):
        out.append(ex.decode([SeqChunk([out[-1]], len(prompt) + i, tables, sampling, i + 1)])[0])
    return out


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.9, 40, 0.95, 7)],
                         ids=["greedy", "seeded"])
def test_verify_rows_are_sequential_decode_steps(built, target, sampling):
    ex = reference_model(built(target)).executor
    prompts = [prompt_ids_of(ex, 13, seed=1), prompt_ids_of(ex, 9, seed=2)]
    want = [sequential(ex, p, i, K + 1, sampling) for i, p in enumerate(prompts)]
    # the same prompts again in sequences 0 and 1 (their blocks rewritten), then one verify
    # call: lane 0 its first token and K right drafts, lane 1 its token and one draft (6 rows,
    # verify_8); and lane 0 again with its second draft wrong
    for i, p in enumerate(prompts):
        assert ex.prefill(SeqChunk(p, 0, own_tables(ex, i), sampling, 0)) == want[i][0]
    lanes = [SeqChunk(want[0][:K + 1], len(prompts[0]), own_tables(ex, 0), sampling, 1),
             SeqChunk(want[1][:2], len(prompts[1]), own_tables(ex, 1), sampling, 1)]
    got = ex.verify(lanes)
    assert got[0].tokens == want[0][1:K + 2] and got[0].states == ()
    assert got[1].tokens == want[1][1:3]
    wrong = [*want[0][:2], (want[0][2] + 1) % ex.schedule.vocab_size, *want[0][3:K + 1]]
    got = ex.verify([dataclasses.replace(lanes[0], tokens=wrong)])
    assert got[0].tokens[:2] == want[0][1:3]


def prompt_ids_of(ex, n: int, seed: int) -> list[int]:
    from oracle import random_token_ids

    return [int(t) % ex.schedule.vocab_size for t in random_token_ids(n, seed=seed)]


def test_verify_checks_its_lanes(built):
    ex = reference_model(built("h100-f32")).executor
    tables = own_tables(ex, 0)
    with pytest.raises(ValueError, match="verify lane of 5 tokens: a token and 0 to 3 drafts"):
        ex.verify([SeqChunk([1, 2, 3, 4, 5], 0, tables)])
    with pytest.raises(ValueError, match="3 verify lanes"):
        ex.verify([SeqChunk([1], 0, tables)] * 3)
    with pytest.raises(ValueError, match="draft_probs .the ratio rule. are not taken"):
        ex.verify([SeqChunk([1], 0, tables, draft_probs=object())])
    with pytest.raises(ValueError, match="exceed the context 512"):
        ex.verify([SeqChunk([1, 2], 511, tables)])


@pytest.mark.parametrize("target", TARGETS)
def test_seeded_sampling_keeps_its_tokens(built, target):
    m = reference_model(built(target))
    prompt = prompt_ids(m)
    kw = {"max_tokens": 48, "ignore_eos": True, "temperature": 0.8, "top_k": 40, "seed": 11}
    plain = m.generate(prompt, **kw).token_ids
    runs = [m.generate(prompt, speculative="ngram", num_draft_tokens=2, **kw) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids == plain
    assert runs[0].drafted_tokens > 0


def test_batched_plain_and_speculating_requests_give_solo_tokens(built):
    m = reference_model(built("h100-f32"))
    prompt = prompt_ids(m)
    cases = [("plain", prompt[:20], None, Sampling()),
             ("ngram", prompt[:17], Speculation("ngram"), Sampling()),
             ("seeded", prompt[:22], Speculation("ngram", 2), Sampling(0.7, 20, 1.0, 3))]
    solo = {rid: m.generate(p, max_tokens=64, ignore_eos=True, temperature=s.temperature,
                            top_k=s.top_k, seed=s.seed,
                            speculative=spec and spec.method,
                            num_draft_tokens=spec and spec.num_draft_tokens).token_ids
            for rid, p, spec, s in cases}
    eng = m.engine
    for rid, p, spec, s in cases:
        eng.add(Request(rid, p, 64, s, (), True, speculation=spec))
    got: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            got.setdefault(o.id, []).extend(o.token_ids)
    assert got == solo
    assert eng.stats().kv_used == {k: 0 for k in eng.stats().kv_used}


def test_tensor_parallel_verify(built):
    m = reference_model(built("h100-f32", tp=2))
    ranks = [m.manifest["h100"]["schedule"], *m.manifest["h100"]["tensor_parallel"]["schedules"]]
    assert [(r["version"], r["draft_tokens"]) for r in ranks] == \
        [(TP_SCHEDULE_VERSION, K)] * 2
    prompt = prompt_ids(m)
    plain = m.generate(prompt, max_tokens=48, ignore_eos=True)
    spec = m.generate(prompt, max_tokens=48, ignore_eos=True, speculative="ngram")
    assert spec.token_ids == plain.token_ids and spec.accepted_tokens > 0


def test_refusals(built):
    m = reference_model(built("h100-f32"))
    with pytest.raises(RequestError, match="assistant: the artifact has no assistant drafter"):
        m.generate([2, 5, 6], max_tokens=4, speculative="assistant")
    plain = reference_model(built("h100-f32", draft_tokens=0))
    assert max_draft_tokens(plain.executor) == 0
    # a schedule without drafts has no draft_tokens key
    assert plain.executor.schedule.version == SCHEDULE_VERSION
    assert "draft_tokens" not in plain.manifest["h100"]["schedule"]
    assert not any(n.startswith("verify_") for n in plain.executor.schedule.entries)
    with pytest.raises(RequestError, match="ngram: the artifact has no verify entry"):
        plain.generate([2, 5, 6], max_tokens=4, speculative="ngram")
    with pytest.raises(ValueError, match="built without speculative entry points"):
        plain.executor.verify([SeqChunk([1], 0, own_tables(plain.executor, 0))])


def _set(**kv):
    return lambda s: s.update(kv)


@pytest.mark.parametrize("change,needle", [
    (lambda s: s.pop("draft_tokens"), "has verify entries (rows [4, 8]) but no draft_tokens"),
    (_set(version=6), "kernel schedule version 6; this runtime reads versions 7..10"),
    (_set(draft_tokens=2), "the widest verify entry (max_seqs x 3 rows) must be verify_6 (has "
                           "verify rows [4, 8])"),
    (_set(draft_tokens=16), "draft_tokens: expected an int in [1, 15], got 16"),
], ids=["no-draft-tokens", "old-version", "widest-verify", "too-many-drafts"])
def test_schedule_refuses_mismatched_verify_entries(built, change, needle):
    art = Artifact.open(built("h100-f32"))
    s = copy.deepcopy(art.manifest["h100"]["schedule"])
    KernelSchedule.from_json(s)
    change(s)
    with pytest.raises(SchemaError, match=re.escape(needle)):
        KernelSchedule.from_json(s)


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("target", TARGETS)
def test_gpu_greedy_ngram_speculation_is_plain_greedy(built, target):
    h100_context()
    m = runtime.load(built(target))
    prompt = prompt_ids(m)
    plain = m.generate(prompt, max_tokens=N_GREEDY, ignore_eos=True)
    spec = m.generate(prompt, max_tokens=N_GREEDY, ignore_eos=True, speculative="ngram")
    print(f"\n[measured] GPU {target}: accepted {spec.accepted_tokens} of "
          f"{spec.drafted_tokens} drafts; plain {plain.decode_tok_s:.0f} tok/s, n-gram "
          f"{spec.decode_tok_s:.0f} tok/s")
    if target == "h100-f32":  # each row summed alone (gemv_f32): the same bits in any call
        assert spec.token_ids == plain.token_ids
    else:
        assert_greedy_equal_or_tied(m, prompt, plain.token_ids, spec.token_ids)
    assert spec.accepted_tokens > 0


@pytest.mark.gpu
@pytest.mark.parametrize("target", TARGETS)
def test_gpu_verify_rows_are_sequential_decode_steps(built, target):
    h100_context()
    ex = runtime.load(built(target)).executor
    sampling = Sampling(0.9, 40, 0.95, 7)
    prompt = prompt_ids_of(ex, 13, seed=1)
    want = sequential(ex, prompt, 0, K + 1, sampling)
    assert ex.prefill(SeqChunk(prompt, 0, own_tables(ex, 1), sampling, 0)) == want[0]
    got = ex.verify([SeqChunk(want[:K + 1], len(prompt), own_tables(ex, 1), sampling, 1)])
    assert got[0].tokens == want[1:K + 2]
