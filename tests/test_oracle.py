"""Artifacts against the transformers oracle, through the normal path: an oracle checkpoint
directory -> build_artifact -> rvcompile.runtime.load -> Model.logits / generate.

- xla-f32, every oracle case: logits at every position within 1e-4 of transformers float32 over
  40 tokens (past the sliding window 8 and across the 32-token prefill chunk); 32 greedy tokens
  equal to transformers' `generate`; prefill-then-decode agreeing with one long forward.
  Measured max abs logit error on the test's 40-token sequence (transformers float32 itself
  differs from float64 by as much; with the oracle's earlier, worse-conditioned weights all
  three columns were 1e-4..9e-4, see tests/oracle.py):
      case       ours - hf32   ours - hf64   hf32 - hf64
      dense        6.1e-06       5.7e-06       5.6e-06
      k_eq_v       6.7e-06       7.2e-06       7.3e-06
      kv_shared    1.1e-05       1.0e-05       1.1e-05
      ple          8.5e-06       8.2e-06       7.1e-06
      moe          6.4e-06       6.5e-06       4.8e-06
      all          1.9e-05       1.7e-05       1.6e-05
- tpu-bf16 / tpu-int8 ("dense" and "all"): top-1 agreement and abs logit error against the
  oracle, with bounds set from measured figures (comments at QUANT_BOUNDS).
- Seeded sampling: reproducible, seed-dependent, top_k=1 == greedy, top-k respected, stop
  strings cut the text and end generation with finish_reason "stop".
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import (
    ORACLE_CASES,
    agreement_with_oracle,
    oracle_greedy,
    oracle_logits,
    random_token_ids,
)

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact

CASES = list(ORACLE_CASES)
BUCKETS = (8, 32)
OPTS = {"max_context": 128, "prefill_buckets": BUCKETS, "max_seqs": 2}
SEQ = 40  # > window 8 and > the 32-token chunk: chunked prefill crosses a chunk boundary
PROMPT = 12
N_NEW = 32  # 12 + 32 = 44 positions: past the sliding layers' ring of 8 + 32 - 1 = 39
F32_BOUND = 1e-4


@pytest.fixture(scope="session")
def artifact(oracle_dir, tmp_path_factory):
    """`(case, target) -> (hf_model, runtime Model)`, each artifact built and loaded once."""
    cache = {}

    def get(case: str, target: str):
        if (case, target) not in cache:
            hf, ckpt = oracle_dir(case)
            out = tmp_path_factory.mktemp(f"rvp-{case}-{target}") / f"{case}.rvp"
            build_artifact(str(ckpt), out, BuildOptions(target, **OPTS), progress=False,
                           log=lambda s: None)
            cache[(case, target)] = (hf, runtime.load(out))
        return cache[(case, target)]

    return get


def _report(msg: str) -> None:
    print(f"\n[measured] {msg}")  # shown with -s


# ---------------------------------------------------------------------------------------------
# xla-f32: exact


@pytest.mark.parametrize("case", CASES)
def test_f32_logits_match_oracle(artifact, case):
    hf, m = artifact(case, "xla-f32")
    assert SEQ > hf.config.sliding_window and SEQ > max(BUCKETS)
    ids = random_token_ids(SEQ, seed=21)
    ours = m.logits(ids)
    ref = oracle_logits(hf, ids)
    assert ours.shape == ref.shape == (SEQ, hf.config.vocab_size)
    assert ours.dtype == np.float32
    err = np.abs(ours - ref)
    _report(f"{case} xla-f32 vs hf32: max abs {err.max():.2e} (worst position "
            f"{int(err.max(-1).argmax())})")
    assert err.max() <= F32_BOUND, f"{case}: max abs logit error {err.max():.3g}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("case", CASES)
def test_f32_greedy_matches_oracle(artifact, case):
    hf, m = artifact(case, "xla-f32")
    prompt = random_token_ids(PROMPT, seed=22)
    res = m.generate(prompt.tolist(), max_tokens=N_NEW, ignore_eos=True)
    assert res.token_ids == oracle_greedy(hf, prompt, N_NEW)
    assert res.finish_reason == "length"
    assert res.prompt_tokens == PROMPT


@pytest.mark.parametrize("case", CASES)
def test_f32_greedy_after_chunked_prefill(artifact, case):
    """A 40-token prompt is prefilled as 32 + 8 (the second chunk in the 8-token bucket)."""
    hf, m = artifact(case, "xla-f32")
    prompt = random_token_ids(SEQ, seed=23)
    res = m.generate(prompt.tolist(), max_tokens=16, ignore_eos=True)
    assert res.token_ids == oracle_greedy(hf, prompt, 16)


@pytest.mark.parametrize("case", CASES)
def test_f32_decode_equals_one_long_prefill(artifact, case):
    """Greedy tokens from prefill + decode steps are the argmax of one teacher-forced forward
    over [prompt + generated], and that forward matches the oracle too."""
    hf, m = artifact(case, "xla-f32")
    prompt = random_token_ids(PROMPT, seed=24).tolist()
    gen = m.generate(prompt, max_tokens=N_NEW, ignore_eos=True).token_ids
    full = prompt + gen
    lg = m.logits(full)
    assert lg.shape[0] == len(full)
    assert lg[PROMPT - 1:-1].argmax(-1).tolist() == gen
    ref = oracle_logits(hf, np.array(full))
    assert np.abs(lg - ref).max() <= F32_BOUND


@pytest.mark.parametrize("case", CASES)
def test_oracle_float32_is_well_conditioned(oracle_dir, case):
    """The 1e-4 bound above needs room: transformers float32 must itself sit well within it of
    transformers float64 (it was 1e-4..8e-4 before tests/oracle.py conditioned its weights)."""
    import copy

    import torch

    hf, _ = oracle_dir(case)
    hf64 = copy.deepcopy(hf).double()
    for module in hf64.modules():  # MoE: grouped_mm has no float64 kernel; the eager loop does
        if hasattr(module, "config"):
            module.config._experts_implementation = "eager"
    ids = random_token_ids(SEQ, seed=21)
    with torch.no_grad():
        ref64 = hf64(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits[0].numpy()
    err = np.abs(oracle_logits(hf, ids).astype(np.float64) - ref64).max()
    _report(f"{case} hf32 vs hf64: max abs {err:.2e}")
    assert err <= F32_BOUND / 3


# ---------------------------------------------------------------------------------------------
# tpu-bf16 / tpu-int8: close


# (case, target) -> (min top-1 agreement, max mean abs error, max max abs error), over 4
# sequences of 40 tokens (160 positions). Measured (top-1, mean, max), oracle logits std ~1.2
# (dense) / ~1.8 (all):
#   dense bf16  0.969  0.013  0.15      dense int8  0.925  0.035  0.37
#   all   bf16  0.975  0.039  3.5       all   int8  0.77   0.19   4.7
# "all" has MoE: where two experts nearly tie, bf16/int8 rounding swaps the top-2 choice and
# that position's logits jump (seen: router gaps < 2e-4 at every spike), so its max error is
# only bounded loosely; without MoE the errors are smooth.
QUANT_BOUNDS = {
    ("dense", "tpu-bf16"): (0.92, 0.03, 0.4),
    ("dense", "tpu-int8"): (0.85, 0.08, 1.0),
    ("all", "tpu-bf16"): (0.90, 0.10, 8.0),
    ("all", "tpu-int8"): (0.65, 0.35, 10.0),
}


@pytest.mark.parametrize("case,target", list(QUANT_BOUNDS))
def test_quantized_logits_close_to_oracle(artifact, case, target):
    hf, m = artifact(case, target)
    a = agreement_with_oracle(m, hf, SEQ)
    assert a["finite"]
    _report(f"{case} {target}: top-1 {a['top1']:.3f} mean abs {a['mean']:.4f} "
            f"max abs {a['max']:.3f} (oracle logits std {a['ref_std']:.2f})")
    min_top1, max_mean, max_max = QUANT_BOUNDS[(case, target)]
    assert a["top1"] >= min_top1
    assert a["mean"] <= max_mean
    assert a["max"] <= max_max


def test_quantized_greedy_tracks_oracle_start(artifact):
    """bf16 greedy decoding of the dense model follows the oracle for its first tokens."""
    hf, m = artifact("dense", "tpu-bf16")
    prompt = random_token_ids(PROMPT, seed=25)
    ours = m.generate(prompt.tolist(), max_tokens=8, ignore_eos=True).token_ids
    ref = oracle_greedy(hf, prompt, 8)
    assert ours[:4] == ref[:4]


# ---------------------------------------------------------------------------------------------
# Sampling (on the xla-f32 "all" artifact)

SAMPLING = {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "max_tokens": 16,
            "ignore_eos": True}


@pytest.fixture(scope="module")
def all_f32(artifact):
    return artifact("all", "xla-f32")[1]


def test_same_seed_same_tokens(all_f32):
    prompt = random_token_ids(PROMPT, seed=26).tolist()
    a = all_f32.generate(prompt, seed=7, **SAMPLING)
    b = all_f32.generate(prompt, seed=7, **SAMPLING)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert a.text == b.text


def test_different_seeds_differ(all_f32):
    prompt = random_token_ids(PROMPT, seed=26).tolist()
    runs = {tuple(all_f32.generate(prompt, seed=s, **SAMPLING).token_ids) for s in (7, 8, 9)}
    assert len(runs) == 3
    greedy = tuple(all_f32.generate(prompt, max_tokens=16, ignore_eos=True).token_ids)
    assert greedy not in runs  # temperature 1 over ~1000 tokens does not retrace greedy


def test_top_k_1_is_greedy(all_f32):
    prompt = random_token_ids(PROMPT, seed=27).tolist()
    greedy = all_f32.generate(prompt, max_tokens=16, ignore_eos=True)
    for seed in (1, 2):
        sampled = all_f32.generate(prompt, temperature=1.5, top_k=1, seed=seed, max_tokens=16,
                                   ignore_eos=True)
        assert sampled.token_ids == greedy.token_ids


def test_sampled_tokens_respect_top_k(all_f32):
    prompt = random_token_ids(PROMPT, seed=28).tolist()
    gen = all_f32.generate(prompt, temperature=2.0, top_k=3, seed=5, max_tokens=16,
                           ignore_eos=True).token_ids
    lg = all_f32.logits(prompt + gen)[PROMPT - 1:-1]
    ranks = [int((row > row[tok]).sum()) for row, tok in zip(lg, gen, strict=True)]
    assert max(ranks) < 3
    assert max(ranks) > 0  # temperature 2: not every pick is the top one


def test_stop_string(all_f32):
    prompt = random_token_ids(PROMPT, seed=29).tolist()
    full = all_f32.generate(prompt, max_tokens=24, ignore_eos=True)
    assert full.finish_reason == "length"
    # A stop string: the decoded text of a token in the middle (an "<unused_N>" placeholder, or
    # any ASCII piece) that did not occur earlier in the text.
    stop = None
    for i in range(6, 20):
        piece = all_f32.decode([full.token_ids[i]])
        head = all_f32.decode(full.token_ids[:i])
        if piece.isascii() and len(piece) >= 3 and piece not in head and head == full.text[
                :len(head)]:
            stop, cut = piece, len(head)
            break
    assert stop is not None, full.text
    res = all_f32.generate(prompt, max_tokens=24, ignore_eos=True, stop=[stop])
    assert res.finish_reason == "stop"
    assert res.text == full.text[:cut]
    assert stop not in res.text
    assert res.token_ids == full.token_ids[:len(res.token_ids)]
    assert len(res.token_ids) < 24
    streamed = "".join(all_f32.generate_stream(prompt, max_tokens=24, ignore_eos=True,
                                               stop=[stop]))
    assert streamed == res.text
    assert all_f32.last_result.finish_reason == "stop"
