"""The h100-fp8 target's plan on the CPU: its kernel schedule run by the reference executor (each
kernel's numpy reference applied to the launch's arguments in a numpy arena), through the
normal build path, against the transformers oracle and against itself.

Measured against the oracle (4 sequences x 40 tokens; top-1 agreement, mean and max abs logit
error; oracle logits std 1.24), with the bounds asserted in FP8_BOUNDS:
    dense      0.756  0.138  1.48   (prefill through attn_prefill; the per-row decode path
    k_eq_v     0.781  0.113  0.85    measured 0.750 / 0.787 / 0.787 top-1, the same errors
    kv_shared  0.781  0.130  1.45    within 0.02)
    ple        0.731  0.120  1.04   (oracle logits std 1.21)
With the FP8 KV cache (--kv-cache fp8: e4m3 pools, unit scale), FP8_KV_BOUNDS:
    k_eq_v     0.756  0.129  1.00
    kv_shared  0.756  0.143  1.57
This is FP8 itself, not the plan: the IR interpreter on the same FP8 IR lands within 0.05 max /
0.008 mean of the schedule (the kernels round q to bf16), and tpu-int8 on "dense" measures
0.925 / 0.035 / 0.37 (e4m3 keeps 3 mantissa bits; per-row int8 about 7 for typical weights).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from h100_helpers import decode_three_together, gemm_quantizer, reference_executor
from oracle import agreement_with_oracle, random_token_ids

from rvcompile.artifacts import Artifact
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.ir import ops
from rvcompile.runtime.model import Model
from rvcompile.sources.model_source import CheckpointError
from rvcompile.targets.h100 import memory_plan
from rvcompile.targets.h100.lower import decode_buckets

OPTS = {"max_context": 128, "prefill_buckets": (8, 32), "max_seqs": 3}
SEQ = 40

# case -> (min top-1 agreement, max mean abs error, max max abs error); measured figures above.
FP8_BOUNDS = {
    "dense": (0.70, 0.18, 2.0),
    "k_eq_v": (0.70, 0.18, 2.0),
    "kv_shared": (0.70, 0.18, 2.0),
    "ple": (0.70, 0.18, 2.0),
}


@pytest.fixture(scope="session")
def h100_model(oracle_dir, tmp_path_factory):
    cache = {}

    def get(case: str, kv_cache: str = "float"):
        if (case, kv_cache) not in cache:
            hf, ckpt = oracle_dir(case)
            out = tmp_path_factory.mktemp(f"h100-{case}-{kv_cache}") / f"{case}.rvp"
            build_artifact(str(ckpt), out, BuildOptions("h100-fp8", **OPTS, kv_cache=kv_cache),
                           progress=False, log=lambda s: None)
            art = Artifact.open(out)
            cache[(case, kv_cache)] = (hf, Model(art, reference_executor(art)))
        return cache[(case, kv_cache)]

    return get


@pytest.mark.parametrize("case", list(FP8_BOUNDS))
def test_fp8_plan_close_to_oracle(h100_model, case):
    hf, m = h100_model(case)
    a = agreement_with_oracle(m, hf, SEQ)
    assert a["finite"]
    print(f"\n[measured] {case} h100-fp8 (reference executor): top-1 {a['top1']:.3f} "
          f"mean abs {a['mean']:.4f} max abs {a['max']:.3f} "
          f"(oracle logits std {a['ref_std']:.2f})")
    min_top1, max_mean, max_max = FP8_BOUNDS[case]
    assert a["top1"] >= min_top1
    assert a["mean"] <= max_mean
    assert a["max"] <= max_max


@pytest.mark.parametrize("case", ["k_eq_v", "kv_shared"])
def test_decode_path_agrees_with_logits_path(h100_model, case):
    """Greedy tokens from chunked prefill + graph-style decode (paged KV, sliding rings wrapped)
    equal the argmax of the teacher-forced logits entry over the same tokens."""
    _, m = h100_model(case)
    prompt = random_token_ids(37, seed=3).tolist()  # 37 > the 32-token chunk; window is 8
    got = m.generate(prompt, max_tokens=12, ignore_eos=True).token_ids
    teacher = m.logits(prompt + got).argmax(-1)
    assert got == teacher[len(prompt) - 1:-1].tolist()


def test_batched_decode_equals_single(h100_model):
    """Three sequences decoded together (bucket 3 of decode_1/2/3) give each one's own tokens."""
    _, m = h100_model("k_eq_v")
    together, solo = decode_three_together(m)
    assert together == solo


def test_decode_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(4) == (1, 2, 4)
    assert decode_buckets(6) == (1, 2, 4, 6)


def test_memory_plan_reuses_and_never_overlaps_live_buffers():
    rng = np.random.default_rng(0)
    uses = [tuple(rng.choice(40, size=3, replace=False)) for _ in range(120)]
    sizes = {b: int(rng.integers(1, 5000)) for b in range(40)}
    lives = memory_plan.lifetimes(uses, sizes)
    offsets, total = memory_plan.plan(lives)
    memory_plan.check(lives, offsets)
    assert all(o % memory_plan.ALIGN == 0 for o in offsets.values())
    assert total < sum(memory_plan.align(s) for s in sizes.values())
    # a chain of short-lived buffers shares one slot
    chain = memory_plan.lifetimes([(i, i + 1) for i in range(10)], {i: 1000 for i in range(11)})
    offsets, total = memory_plan.plan(chain)
    assert total == 2 * memory_plan.align(1000)


def test_memory_plan_check_catches_overlap():
    lives = [memory_plan.Lifetime(0, 512, 0, 3), memory_plan.Lifetime(1, 512, 2, 5)]
    with pytest.raises(AssertionError):
        memory_plan.check(lives, {0: 0, 1: 256})


def test_seeded_sampling_follows_the_sample_reference(h100_model):
    """Sampled tokens are the IR's SAMPLE of each position's logits at (seed, step = tokens so
    far); the same seed repeats, another seed differs, top_k = 1 is greedy."""
    _, m = h100_model("k_eq_v")
    prompt = random_token_ids(21, seed=8).tolist()
    kw = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 1234, "max_tokens": 12,
          "ignore_eos": True}
    got = m.generate(prompt, **kw).token_ids
    assert m.generate(prompt, **kw).token_ids == got
    assert m.generate(prompt, **{**kw, "seed": 99}).token_ids != got
    logits = m.logits(prompt + got)[len(prompt) - 1:-1]  # already softcapped
    n = len(got)
    want = ops.ref_sample(None, logits, np.full(n, 0.8, np.float32), np.full(n, 50, np.int32),
                          np.full(n, 0.9, np.float32), np.full(n, 1234, np.int32),
                          np.arange(n, dtype=np.int32))
    assert got == want.tolist()
    greedy = m.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
    assert m.generate(prompt, **{**kw, "top_k": 1, "max_tokens": 8}).token_ids == greedy


@pytest.mark.parametrize("preset,layers", [("gemma-4-31B", 60), ("gemma-4-12B", None)])
def test_released_models_lower(preset, layers):
    """The released dense models lower (no weights needed): per layer exactly QKV GEMV, qkv_post,
    attention, combine, o GEMV, residual norm, gate||up GEMV, gelu_mul, down GEMV, residual
    norm; the arena fits an 80 GB H100. Decode's linears are one-row FP8 GEMVs (the 31B's all
    the tensor-core GEMV); the 64-row prefill's each a per-token quantization and the
    tensor-core GEMM with its parameter block, its e4m3 rows from quant_fp8_rows or from the
    _q twin of the launch writing the rows."""
    from rvcompile.build import lower_model
    from rvcompile.sources.checkpoint import load_model_source
    from rvcompile.targets.h100.lower import lower_to_h100

    source = load_model_source(preset, random_weights=True)
    ir = lower_model(source, BuildOptions("h100-fp8", max_context=2048, prefill_buckets=(16, 64)),
                     log=lambda s: None)
    s = lower_to_h100(ir, max_seqs=4, prefill_buckets=(16, 64)).schedule
    n = len(source.config.layers)
    assert layers in (None, n)
    decode = s.entries["decode_1"].launches
    # embed + first norm, 10 per layer, head GEMV, 3 sampling kernels, decode_advance
    assert len(decode) == 2 + 10 * n + 5
    assert decode[-1].kernel == "decode_advance"
    assert s.arena_bytes < 75e9
    layer = [x.kernel for x in decode[2:12]]
    assert {"qkv_post", "gelu_mul"} <= set(layer)
    # one-row linears on gemv_fp8 (measured faster in the 31B's decode_1 graph), more on the MMA's
    # f16-row entries: q/k/v, gate||up and down (their inputs' writers have _q twins) and o (the
    # attention output's bound as its q_scale)
    assert [k for k in layer if k.startswith("gemv")] == ["gemv_fp8_rowscale"] * 4
    two = [x.kernel.rsplit("_w", 1)[0] for x in s.entries["decode_2"].launches[2:12]
           if x.kernel.startswith("gemv")]
    assert two == ["gemv_mma_f16_m8"] * 4
    prefill = s.entries["prefill_64"].launches
    gemms = [i for i, x in enumerate(prefill) if x.kernel.startswith("gemm_fp8_tc")]
    assert len(gemms) == 4 * n
    # the head over the rows packed sequences sample (kernel_schedule.PrefillPacking: 4 here)
    assert [x.kernel for x in prefill if x.kernel.startswith("gemm_bf16_tc")] == \
        ["gemm_bf16_tc_64x256"]
    writers = []
    for i in gemms:
        (arg,) = prefill[i].args
        assert (arg.name, arg.kind) == ("params", "params")
        assert set(arg.value.roles) == set(s.params_templates[arg.value.template].roles)
        writers.append(gemm_quantizer(prefill, i).kernel)
    # the attention output quantized by quant_fp8_rows; the rows the norms and gelu_mul write by
    # their _q twins (the first QKV's by rmsnorm_bf16_q, the others' and gate||up's by the
    # residual norms)
    assert Counter(writers) == {"quant_fp8_rows_bf16": n, "rmsnorm_bf16_q": 1,
                                "residual_rmsnorm_q": 2 * n - 1, "gelu_mul_q": n}
    assert s.entries["decode_1"].graph and s.entries["prefill_64"].graph
    assert not any(e.graph for name, e in s.entries.items() if name.startswith("logits_"))


# ---------------------------------------------------------------- FP8 KV cache (--kv-cache fp8)

# case -> (min top-1, max mean abs, max max abs) against the oracle, FP8 weights and e4m3 KV;
# measured figures in the module docstring. k_eq_v covers K=V full and plain sliding pools,
# kv_shared layers that read their producer's e4m3 pool.
FP8_KV_BOUNDS = {
    "k_eq_v": (0.70, 0.18, 2.0),
    "kv_shared": (0.70, 0.18, 2.0),
}
# The FP8-KV plan against its own IR (32 tokens, k_eq_v): (max abs, mean abs) logit error;
# measured 0.240 / 0.0257. Larger than bf16 KV's ~0.05 / 0.008 (module docstring): the plan's
# small differences upstream (q rounded to bf16, sum order) move a few percent of the K/V values
# across an e4m3 rounding boundary (step 1/16 relative), and each such value then differs by a
# whole step.
FP8_KV_VS_IR = (0.35, 0.04)


@pytest.mark.parametrize("case", list(FP8_KV_BOUNDS))
def test_fp8_kv_plan_close_to_oracle(h100_model, case):
    hf, m = h100_model(case, "fp8")
    a = agreement_with_oracle(m, hf, SEQ)
    assert a["finite"]
    print(f"\n[measured] {case} h100-fp8, FP8 KV (reference executor): top-1 {a['top1']:.3f} "
          f"mean abs {a['mean']:.4f} max abs {a['max']:.3f}")
    min_top1, max_mean, max_max = FP8_KV_BOUNDS[case]
    assert a["top1"] >= min_top1
    assert a["mean"] <= max_mean
    assert a["max"] <= max_max


def test_fp8_kv_schedule_halves_the_pools_and_matches_its_ir(h100_model, oracle_dir):
    """The FP8-KV schedule: e4m3 pools of half the bytes, every qkv_post / attention launch an
    _fp8 entry; its logits (reference executor) = the IR interpreter's on the same IR (caches
    e4m3 through KV_WRITE's rounding) within the kernels' own rounding (q to bf16, sum order);
    greedy decode through the e4m3 pools = the teacher-forced argmax."""
    from rvcompile.build import lower_model
    from rvcompile.dtypes import numpy_dtype
    from rvcompile.ir.interpret import ReferenceModel
    from rvcompile.sources.checkpoint import load_model_source
    from rvcompile.targets.h100.lower import layout_weights

    _, m8 = h100_model("k_eq_v", "fp8")
    _, m16 = h100_model("k_eq_v")
    s8, s16 = m8.executor.schedule, m16.executor.schedule
    assert (s8.kv.kv_dtype, s16.kv.kv_dtype) == ("float8_e4m3fn", "bfloat16")
    assert [2 * p.block_bytes for p in s8.kv.pools] == [p.block_bytes for p in s16.kv.pools]
    attn = [x.kernel for e in s8.entries.values() for x in e.launches
            if x.kernel.startswith(("attn_decode_d", "attn_decode_keqv", "attn_prefill",
                                    "qkv_post"))]
    assert attn and all(k.endswith("_fp8") for k in attn)

    ir = lower_model(load_model_source(str(oracle_dir("k_eq_v")[1])),
                     BuildOptions("h100-fp8", **OPTS, kv_cache="fp8"), log=lambda s: None)
    assert {c.dtype for c in ir.caches} == {"float8_e4m3fn"}
    stored = np.frombuffer(m8.art.buffer("weights"), np.uint8)
    slots, _ = layout_weights(ir)
    weights = {p.name: stored[slots[p.name].offset:][:slots[p.name].nbytes]
               .view(numpy_dtype(p.dtype)).reshape(p.shape) for p in ir.params}
    ids = random_token_ids(32, seed=5)
    got = m8.logits(ids.tolist())
    want = ReferenceModel(ir, weights).step(ids[None], np.array([0]), np.array([len(ids)]))[0]
    err = np.abs(got - want)
    print(f"\n[measured] k_eq_v FP8-KV plan vs its IR: max abs {err.max():.4f} "
          f"mean abs {err.mean():.5f}")
    assert err.max() <= FP8_KV_VS_IR[0] and err.mean() <= FP8_KV_VS_IR[1]
    prompt = random_token_ids(37, seed=3).tolist()
    got_tokens = m8.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
    teacher = m8.logits(prompt + got_tokens).argmax(-1)
    assert got_tokens == teacher[len(prompt) - 1:-1].tolist()


def test_fp8_kv_refused_off_h100(oracle_dir, tmp_path):
    _, ckpt = oracle_dir("dense")
    out = tmp_path / "x.rvp"
    with pytest.raises(CheckpointError, match="--kv-cache fp8: target xla-f32 has no fp8 KV"):
        build_artifact(str(ckpt), out, BuildOptions("xla-f32", **OPTS, kv_cache="fp8"),
                       progress=False, log=lambda s: None)
    with pytest.raises(CheckpointError, match="--kv-cache 'e5m2': expected one of"):
        build_artifact(str(ckpt), out, BuildOptions("h100-fp8", **OPTS, kv_cache="e5m2"),
                       progress=False, log=lambda s: None)
    assert not out.exists()
