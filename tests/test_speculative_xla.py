"""Speculative decoding end to end on xla-f32 (CPU): the embedded default model
(models/rv-gemma4-tiny) built with a random drafter of its shape (`random_drafter`), through
Model.generate, the engine, `rvrun` and `rvrun serve`'s app.

- Greedy with speculation (assistant and n-gram) gives the tokens greedy without it gives, 256
  of them, and those are transformers' own greedy tokens for the checkpoint.
- Seeded sampling with n-gram speculation gives the very tokens it gives without (exact match:
  verify samples row i at the RNG step plain decoding would use: runtime/speculative.py); with
  the assistant (the ratio rule) the same tokens on every run.
- Sampling's distribution with speculation equals the target's: a chi-square two-sample test of
  the first token decided after a round of drafts, on a small effective vocabulary (top_k 4),
  seeds disjoint between the arms. (Checked while writing it: with the acceptance rule replaced
  by "accept every draft" the same test fails with p = 2e-50.)
- verify's ratio rule on the model, with drafts from a q close to the target's p: its token is
  distributed as p, and it keeps more drafts than exact match on the same drafts.
- A batch of plain, assistant and n-gram requests, greedy and sampled, under KV pools small
  enough to preempt, gives each request its solo tokens (a preempted sampled assistant request
  among them).
- rvrun and rvrun serve --speculative and their refusals; /metrics counts drafts.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from cli_output import without_progress
from safetensors.numpy import save_file
from test_speculative_ratio import chi_square_fit, ref_filtered

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.ir.ops import sample_sorted, sampling_uniform
from rvcompile.model.config import AttnKind
from rvcompile.model.presets import _assistant
from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import Sampling, SeqChunk
from rvcompile.runtime.executors.xla import XlaDraftProbs
from rvcompile.runtime.speculative import Speculation
from rvcompile.sources.checkpoint import load_model_source
from rvcompile.sources.random_weights import random_assistant_tensors

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"
K = 3
OPTS = BuildOptions("xla-f32", max_context=320, prefill_buckets=(16,), max_seqs=2,
                    platforms=("cpu",), draft_tokens=K, decode_loop_steps=8)
N_GREEDY = 256


def random_drafter(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """An assistant directory (HF layout) of random weights for the checkpoint in model_dir: 2
    layers of width 64, each with the cache layout of the target layer it reads."""
    target = load_model_source(str(model_dir)).config
    a = _assistant(target, hidden=64, mlp=128, heads=4, layers=2)
    owners = target.layers[:target.num_layers - target.num_kv_shared_layers]
    full = next(s for s in reversed(owners) if s.kind is AttnKind.FULL)  # what layer 1 reads
    a = dataclasses.replace(a, text=dataclasses.replace(a.text, layer_overrides=(
        (1, (("head_dim", full.head_dim), ("num_key_value_heads", full.num_kv_heads))),)))
    a.target_layers(target)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(a.to_hf_dict()))
    save_file({t.name.removeprefix("assistant."): np.ascontiguousarray(t.load())
               for t in random_assistant_tensors(a, seed)}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("spec-default")
    out = tmp / "spec.rvp"
    build_artifact(str(MODEL_DIR), out, OPTS, assistant=str(random_drafter(MODEL_DIR, tmp / "a")),
                   progress=False, log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def model(artifact):
    return runtime.load(artifact)


def prompt_ids(m, n: int = 24) -> list[int]:
    return m.encode((MODEL_DIR / "heldout_sample.txt").read_text()[:400])[:n]


def test_greedy_speculation_is_greedy_and_transformers(model):
    import torch
    from oracle import oracle_greedy
    from transformers import Gemma4ForCausalLM

    prompt = prompt_ids(model)
    runs = {spec: model.generate(prompt, max_tokens=N_GREEDY, ignore_eos=True,
                                 speculative=spec) for spec in (None, "assistant", "ngram")}
    plain = runs[None].token_ids
    assert len(plain) == N_GREEDY
    for spec in ("assistant", "ngram"):
        assert runs[spec].token_ids == plain, spec
        assert runs[spec].drafted_tokens > 0
    hf = Gemma4ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32,
                                           attn_implementation="eager").eval()
    assert oracle_greedy(hf, np.array(prompt), N_GREEDY) == plain
    print(f"\n[measured] {N_GREEDY} greedy tokens: assistant (random) accepted "
          f"{runs['assistant'].accepted_tokens} of {runs['assistant'].drafted_tokens} drafts, "
          f"n-gram {runs['ngram'].accepted_tokens} of {runs['ngram'].drafted_tokens}")


def test_seeded_sampling_keeps_its_tokens(model):
    """n-gram drafts are point masses, verified by exact match: a seeded request keeps the
    tokens it gets without speculation. The assistant's sampled drafts go through the ratio
    rule: other tokens of the same distribution, the same ones on every run."""
    prompt = prompt_ids(model)
    kw = {"max_tokens": 32, "ignore_eos": True, "temperature": 0.8, "top_k": 40, "seed": 11}
    plain = model.generate(prompt, **kw).token_ids
    assert model.generate(prompt, speculative="ngram", num_draft_tokens=2, **kw).token_ids == \
        plain
    runs = [model.generate(prompt, speculative="assistant", num_draft_tokens=2, **kw)
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].drafted_tokens > 0


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of a chi-square test that samples a and b come from one distribution (categories
    with fewer than 10 in both pooled together)."""
    from scipy.stats import chi2_contingency

    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rows = [[a[t] for t in common], [b[t] for t in common]]
    rest = [sum(a.values()) - sum(rows[0]), sum(b.values()) - sum(rows[1])]
    if min(rest) > 0:
        rows = [r + [x] for r, x in zip(rows, rest, strict=True)]
    return float(chi2_contingency(np.array(rows)).pvalue)


N_SAMPLES = 160


def sample_third_tokens(model, prompt, speculation, seeds) -> Counter:
    """The third generated token of one 4-token request per seed (with the assistant, the first
    token decided after a round of drafts), all queued at once (the engine batches them)."""
    eng = model.engine
    for seed in seeds:
        eng.add(Request(f"d{seed}", prompt, 4, Sampling(1.0, 4, 1.0, seed), (), True,
                        speculation=speculation))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.id, []).extend(o.token_ids)
    return Counter(tokens[2] for tokens in out.values())


def test_sampling_distribution_with_speculation_is_the_targets(model):
    prompt = prompt_ids(model, 8)
    plain = sample_third_tokens(model, prompt, None, range(N_SAMPLES))
    spec = sample_third_tokens(model, prompt, Speculation("assistant", K),
                               range(N_SAMPLES, 2 * N_SAMPLES))
    p = chi_square_p(plain, spec)
    print(f"\n[measured] third-token distribution, {N_SAMPLES} samples each: "
          f"{len(plain)} / {len(spec)} distinct tokens, chi-square p = {p:.3f}")
    assert p > 1e-3


N_RATIO, TOP_K, NOISE = 200, 8, 1.0


def test_ratio_rule_on_the_model(artifact, model):
    """verify's ratio rule on the default model against exact match, on the same drafts: after
    a prompt, the target's sampling distribution p (temperature 1, top_k 8: a small effective
    vocabulary) and one draft per seed from q, the target's logits plus noise (a drafter that
    is close but not equal), sampled the drafter's way (the sampler's rule and uniform at the
    verify row's step). The rule's token is distributed as p (chi-square against p itself),
    as is the target's own sample, and the rule keeps more drafts. The executor runs on blocks
    taken from the (idle) engine's pools and given back, never committed."""
    ex, kv = model.executor, model.engine.kv
    prompt = prompt_ids(model, 8)
    held = [kv.empty() for _ in range(2)]
    assert all(kv.ensure(seq, 0, len(prompt) + 2) for seq in held)
    try:
        kept, fit, summin = _ratio_against_exact(ex, [kv.tables(seq) for seq in held], prompt)
    finally:
        for seq in held:
            kv.free(seq)
    print(f"\n[measured] one draft per seed, {N_RATIO} seeds (q = target logits + N(0, "
          f"{NOISE}), T 1, top_k {TOP_K}): drafts kept by the ratio rule {kept['ratio']:.3f}, "
          f"by exact match {kept['exact']:.3f} (sum min(p, q) = {summin:.3f}); chi-square "
          f"against p: ratio rule p = {fit['ratio']:.3f}, exact match p = {fit['exact']:.3f}")
    assert fit["ratio"] > 1e-3 and fit["exact"] > 1e-3
    # the ratio rule keeps a draft with probability sum min(p, q) (within 4 standard errors)
    assert abs(kept["ratio"] - summin) < 4 * np.sqrt(summin * (1 - summin) / N_RATIO)
    assert kept["ratio"] > kept["exact"] + 0.05


def _ratio_against_exact(ex, tables: list[dict], prompt: list[int]):
    """test_ratio_rule_on_the_model's rounds: (drafts kept per rule, chi-square p-value of its
    tokens against p per rule, sum min(p, q))."""
    x = [ex.prefill(SeqChunk(prompt, 0, t)) for t in tables][0]
    logits = ex.logits(SeqChunk([x], len(prompt), tables[0]))[0]
    p = ref_filtered(logits, 1.0, TOP_K, 1.0)
    g = (logits + np.random.default_rng(5).normal(0, NOISE, logits.shape)).astype(np.float32)
    q = np.zeros((ex.max_seqs, K, len(g)), np.float32)
    q[:, 0] = ref_filtered(g, 1.0, TOP_K, 1.0)
    rows = jnp.asarray(q)
    seeds = np.arange(N_RATIO, dtype=np.int32)
    drafts = [sample_sorted(g, 1.0, TOP_K, 1.0, sampling_uniform(s, 1)) for s in seeds]
    tokens: dict[str, list[int]] = {"ratio": [], "exact": []}
    for s, d in zip(seeds, drafts, strict=True):  # lane 0 by the ratio rule, lane 1 exactly
        lanes = [SeqChunk([x, d], len(prompt), tables[j], Sampling(1.0, TOP_K, 1.0, int(s)),
                          step=1, draft_probs=XlaDraftProbs(rows, 0) if j == 0 else None)
                 for j in range(2)]
        ratio, exact = ex.verify(lanes)
        tokens["ratio"].append(ratio.tokens[0])
        tokens["exact"].append(exact.tokens[0])
    kept = {rule: float(np.mean([t == d for t, d in zip(out, drafts, strict=True)]))
            for rule, out in tokens.items()}
    fit = {rule: chi_square_fit(np.bincount(out, minlength=len(p)), p)
           for rule, out in tokens.items()}
    return kept, fit, float(np.minimum(p, q[0, 0]).sum())


def test_mixed_batch_with_preemption_gives_solo_tokens(artifact, model):
    """Plain, assistant and n-gram requests, greedy and seeded, two at a time in one engine whose
    full-attention pool holds 16 blocks of 16 tokens (a 200-token sequence needs 13; two of these
    need 18): they run in the same steps and preempt each other, the newer of two running ones
    (the seeded assistant requests among them: their tokens depend on their drafts, so a
    preempted one must recompute and draft on exactly as it would have)."""
    small = runtime.load(artifact, kv_blocks={"full": 16}, max_model_len=200)
    prompt = prompt_ids(model)
    cases = []
    for i, spec in enumerate([None, "assistant", "ngram", "assistant"]):
        sampling = {"temperature": 0.7, "top_k": 20, "seed": i} if i % 2 else {}
        cases.append((f"r{i}", prompt[:12 + i], spec, sampling))
    solo = {rid: model.generate(p, max_tokens=120, ignore_eos=True, speculative=spec,
                                **s).token_ids
            for rid, p, spec, s in cases}
    eng = small.engine
    for rid, p, spec, s in cases:
        eng.add(Request(rid, p, 120, Sampling(s.get("temperature", 0.0), s.get("top_k", 0),
                                              1.0, s.get("seed", 0)), (), True,
                        speculation=Speculation(spec) if spec else None))
    got: dict[str, list[int]] = {}
    preempted: set[str] = set()
    while eng.has_work():
        for o in eng.step():
            got.setdefault(o.id, []).extend(o.token_ids)
        preempted |= {s.id for s in eng.scheduler.waiting if s.preemptions}
    for rid, *_ in cases:
        assert got[rid] == solo[rid], rid
    assert preempted & {"r1", "r3"}, preempted
    stats = eng.stats()
    assert stats.preemptions > 0 and stats.drafted > 0
    assert stats.kv_used == {k: 0 for k in stats.kv_used}


def run_rvrun(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from rvcompile.runtime.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=600)


def test_rvrun_speculative(artifact, model):
    text = "And when he had opened the seventh seal"
    base = ["--prompt", text, "--max-tokens", "24", "--ignore-eos", "--no-verify"]
    want = model.generate(text, max_tokens=24, ignore_eos=True).text
    p = run_rvrun(str(artifact), *base, "--speculative", "ngram", "--num-draft-tokens", "2")
    assert p.returncode == 0, p.stderr
    assert p.stdout == want + "\n" and "ngram: " in p.stderr and "drafts accepted" in p.stderr
    for args, needle in [
        (["--speculative", "medusa"], "--speculative: expected one of assistant, ngram"),
        (["--num-draft-tokens", "2"], "--num-draft-tokens: only with speculative"),
        (["--speculative", "ngram", "--num-draft-tokens", "0"], "must be at least 1"),
        (["--speculative", "ngram", "--num-draft-tokens", "4"],  # past the artifact's 3
         "--num-draft-tokens: must be 1 to 3"),
    ]:
        p = run_rvrun(str(artifact), *base, *args)
        lines = without_progress(p.stderr)
        assert p.returncode == 2 and len(lines) == 1 and needle in lines[0], p.stderr
    serve = ["serve", str(artifact), "--port", "0", "--no-verify"]
    for args, needle in [(["--speculative", "medusa"], "--speculative: expected one of"),
                         (["--speculative", "ngram", "--num-draft-tokens", "4"],
                          "--num-draft-tokens: must be 1 to 3")]:
        p = run_rvrun(*serve, *args)
        lines = without_progress(p.stderr)
        assert p.returncode == 2 and len(lines) == 1 and needle in lines[0], p.stderr


def test_serve_counts_drafts_in_metrics(model):
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from rvcompile.runtime.serve.server import ServeOptions, create_app

    want = model.generate("And the angel said", max_tokens=40, ignore_eos=True).text
    app = create_app(model, ServeOptions("m", 8, Speculation("ngram", K)))
    with TestClient(app) as client:  # its engine thread now runs model.engine
        r = client.post("/v1/completions", json={"model": "m", "prompt": "And the angel said",
                                                 "max_tokens": 40, "temperature": 0,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        metrics = {s.name: s.value for f in text_string_to_metric_families(
            client.get("/metrics").text) for s in f.samples}
    assert metrics["rvrun_spec_draft_tokens_total"] > 0
    assert 0 <= metrics["rvrun_spec_accepted_tokens_total"] <= \
        metrics["rvrun_spec_draft_tokens_total"]
    assert metrics["rvrun_spec_verify_calls_total"] > 0
