"""Golden H100 kernel schedules: refactors of the IR, the passes or the H100 lowering must not
change what the build emits. Each case lowers one model's IR (shape only: lowering needs no
weights) through its target's pipeline (build.lower_model) and `lower_to_h100`, and hashes
everything the build takes from the lowering: the schedule's JSON (every launch, geometry and
argument, the io fields, the KV layout, the outputs), the constants' bytes, every weight's
slot and the kernel modules. The hashes in h100_golden_schedules.json were written at commit
f9c3679, before the fusion passes took the lowering's pattern matching over, and rewritten when
the schedule became version 2 (named arguments), after checking that every case still made the
same launches (module, kernel, geometry, argument kinds and values, in order) and the same
everything else; and again for the rename slots -> max_seqs (schedule version 3), every case's
dump differing by that rename alone; and again when the tied head from 4 rows on (decode_4, logits
entries) moved from gemv_bf16 onto the bf16 tensor-core GEMM (module gemm_fp8_tc.cu renamed
gemm_tc.cu): every case's dump differing only in those head launches, the module's name, and the
offsets after the constants, which grew by the GEMM's all-ones scale vector; and again when the
prefill entries became CUDA graphs too: every case's dump differing only in its prefill entries'
"graph" flags, false -> true; and again when every decode entry gained a last launch,
decode_advance (the decode loop), over three new io fields (loop_budget, loop_step, loop_tokens),
every offset after the io moving by their size; and again for the sampler's extras (the
sampled_decode_{B} / sampled_prefill_{T} entries and the sample_io region before the
activations), after checking in every case that the plain entries keep the same launches
(module, kernel, geometry, argument names, kinds and values, activation pointers and
parameter-block roles taken relative to the activations' start), io fields, KV layout and
constants; and again when the KV pools moved out of the arena's fixed part
to be sized at load (schedule version 7): in every case each pointer into the old KV region
became a "pool" argument naming the pool at that offset, every offset past the region moved
down by its size, the kinds lost num_blocks and kv.pools was added, and nothing else changed
(checked case by case against dumps at the base commit). The drafter cases (MODEL+assistant)
were added with the H100 assistant drafter (issue 15), the other cases' hashes unchanged, and
rewritten for the ratio rule (schedule version 10), after checking that in each of them the
launches differ only in sample_pick -> sample_pick_dist (every decode, verify and draft entry)
and a spec_ratio after it (decode_{B >= 2} and verify_{R}), with the io field ratio_lanes and
the ratio region added; the other cases' hashes unchanged. And again for packed prefill (issue
14, kernel_schedule.PrefillPacking): in every case the row select became select_rows_*
(argument row -> rows, a new S), and nothing else changed where the schedule does not pack
(float32, MoE, gemma-4-tiny); where it packs, every entry's launches are the same (kernel,
geometry, argument kinds and non-pointer values) but the prefill entries' head from the select
on (S rows: select, the head's product, the sampler), io last_row holds S values and the prefill
entries' outputs S rows (checked case by case against dumps at 976a14d). And again when the
K=V layers' decode attention moved onto tensor cores: in every case each attn_decode_keqv_*
launch of a bf16/e4m3 plan became the attn_decode_tc_keqv_* of the same name (module
attn_prefill.cu, 32 * D / 128 threads, attn_prefill's two-stage shared memory) with the same
grid and arguments, and nothing else changed (checked case by case against dumps at 407a661).
And again when a split of one (grid x = 1) began writing the combine's result itself: in every
case each split launch gained the arguments out and out_bf16 (null where a combine follows), a
one-split launch took the combine's out / out_bf16 with null partials and its combine was
dropped, and every other launch kept its kernel, geometry, argument names, kinds and non-pointer
values, all else equal (checked case by case against dumps at 8f3f372).
And again when every sampled_decode_{B} gained a last launch, decode_advance (the masked decode
loop, issue 16): in every case each sampled_decode_{B}'s launches are its old ones and a
decode_advance after them, and nothing else changed (checked case by case against dumps at
501bf52: 162 entries over the 54 cases).
And again when the prefill attention took q into shared memory and four row groups at every head
dim (issue 14): in 35 cases every attn_prefill_* launch (5,110) has a larger shared memory (the q
tile) and, at head dim 512, 512 threads and half the grid's tiles (8 tokens a CTA at group 8);
each new geometry is attn_prefill.geometry's, the launches' other fields, every other launch and
everything else are unchanged (checked case by case against dumps at 78e7c4b).
And again when gemv_mma_fp8 took 8-warp CTAs from 5 token rows (issue 14): in 19 cases 3,416
gemv_mma_fp8_* launches changed entry, grid, block and shared memory only, each new launch equal
to gemv_mma_fp8.launch_geometry of its M, N, K; every other launch and everything else are
unchanged (checked case by case against dumps at 1ce10ec).
And again when the full K=V layers at head dim 512 (groups 8 and 16, quarter-rotary rope) took
attn_decode.cu's K=V tensor-core entries (issue 14): in 13 cases 733 attn_decode_tc_keqv_d512_*
launches (module attn_prefill.cu, 99,840 bytes of dynamic shared memory) became the
attn_decode_keqv_mma_d512_* of the same group and pool dtype (module attn_decode.cu, no dynamic
shared memory) with the same grid, block and arguments; every other launch and everything else
are unchanged (checked case by case against dumps at 621a986).
And again when the FP8 GEMMs' inputs written by a norm or gelu_mul came quantized from that
launch (issue 14): in 35 cases 9,198 quant_fp8_rows_bf16 launches are gone, each launch that
wrote those rows became its _q twin (6,027 residual_rmsnorm -> residual_rmsnorm_q and 105
rmsnorm_bf16 -> rmsnorm_bf16_q, same geometry; 3,066 gelu_mul -> gelu_mul_q, a CTA of 1024
threads per row), every other launch keeps its kernel and order, and nothing else but the
arena's size changed (checked case by case against dumps at 766854e).
And again when the small-batch GEMVs whose rows a norm or gelu_mul writes moved onto
gemv_mma_fp8's f16-row entries (issue 14): in 35 cases 18,984 gemv_mma_fp8_* launches (2 to 16
rows) became the gemv_mma_f16_* of the same bucket, warps and split (same grid, block, shared
memory and arguments, q_scale added after x), each launch writing their rows its _q twin (12,344
residual_rmsnorm, 312 rmsnorm_bf16, 6,328 gelu_mul), 464 other launches moved pointers only, and
nothing else but the arena's size changed (checked case by case against dumps at c45d922).
And again when decode-kind entries took the FP8 GEMM from 9 rows, the GEMM its 64 x 64 tile for
narrow outputs at few rows, and o's input the f16-row GEMV with the attention output's bound
(issue 14): in 35 cases, launch by launch against dumps at 4baa4d2, 6,254 gemv_mma_fp8_* launches
(o's input, 2 to 16 rows) became the gemv_mma_f16_* of the same bucket, warps, split, grid,
block and shared memory (q_scale added, a constant), 11,019 gemm_fp8_tc_64x128 launches became
gemm_fp8_tc_64x64 (and 3,618 GEMM launches changed their parameter block only), the three
drafter cases' verify_16 entries replaced their GEMV launches by the GEMM and a quant_fp8_rows
before each o (608 -> 668 launches in the 31B's), 135,499 other launches moved pointers only;
the constants (the bounds), offsets after them and the parameter templates changed with them.

Models: the tiny presets (every feature; a toy 31B), the default model (models/rv-gemma4-tiny:
PLE, K=V, KV sharing), and the released E2B, E4B (PLE), 12B, 26B-A4B (MoE) and 31B (K=V full
layers). Targets: h100-fp8, h100-f32, and h100-fp8 with the FP8 KV cache. Two plans each: the
build's defaults-like (max_seqs 4, buckets 16 / 64, 2048 tokens) and an odd one (max_seqs 3, buckets
1 / 5 / 40, 512 tokens: single-row prefill, GEMM rows, the MoE sort, a ring shorter than some
windows).

`python tests/test_h100_golden_schedules.py write` rewrites the hashes (only for a change that
is meant to change the schedules: say why in the commit); `... dump DIR` writes each case's
canonical JSON to DIR, to diff a failing case against a dump made at the base commit.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from rvcompile.build import BuildOptions, lower_model
from rvcompile.model.presets import get_assistant_preset, get_preset
from rvcompile.sources.checkpoint import read_config
from rvcompile.sources.model_source import ModelSource

GOLDEN = Path(__file__).with_name("h100_golden_schedules.json")
MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"
MODELS = ("gemma-4-tiny", "gemma-4-tiny-dense", "rv-gemma4-tiny", "gemma-4-E2B", "gemma-4-E4B",
          "gemma-4-12B", "gemma-4-26B-A4B", "gemma-4-31B")
TARGETS = (("h100-fp8", "float"), ("h100-f32", "float"), ("h100-fp8", "fp8"))
PLANS = {"a": {"max_seqs": 4, "prefill_buckets": (16, 64), "max_context": 2048},
         "b": {"max_seqs": 3, "prefill_buckets": (1, 5, 40), "max_context": 512}}
# With an assistant drafter (MODEL+assistant: the preset's, 3 draft tokens): the draft entries
# and the decode / verify entries' states and ratio rule (schedule version 10); the dense and
# centroid heads.
DRAFTERS = ("gemma-4-tiny", "gemma-4-tiny-dense", "gemma-4-31B")
CASES = [f"{m}:{t}:{kv}:{p}" for m in MODELS for t, kv in TARGETS for p in PLANS] + [
    f"{m}+assistant:{t}:float:a" for m in DRAFTERS for t in ("h100-fp8", "h100-f32")]
DRAFT_TOKENS = 3


def _config(model: str):
    return read_config(MODEL_DIR) if model == "rv-gemma4-tiny" else get_preset(model)


def canonical(case: str) -> dict:
    """Everything the build takes from lower_to_h100 for `case`, as plain JSON data."""
    from rvcompile.targets.h100.lower import lower_to_h100

    model, target, kv, plan = case.split(":")
    model, drafter = model.removesuffix("+assistant"), model.endswith("+assistant")
    cfg = _config(model)
    source = ModelSource(cfg, (), "", {}, None, model)  # shape only: no tensors are read
    drafts = DRAFT_TOKENS if drafter else 0
    opts = BuildOptions(target, kv_cache=kv, draft_tokens=drafts, **PLANS[plan])
    assistant = get_assistant_preset(f"{model}-assistant") if drafter else None
    ir = lower_model(source, opts, log=lambda s: None, assistant=assistant)
    low = lower_to_h100(ir, max_seqs=opts.max_seqs, prefill_buckets=opts.prefill_buckets,
                        draft_tokens=drafts)
    return {
        "schedule": low.schedule.to_json(),
        "constants_sha256": hashlib.sha256(low.constants).hexdigest(),
        "weights": {name: [[s.offset, s.nbytes] for s in slots]
                    for name, slots in sorted(low.slots_by_param.items())},
        "modules": list(low.modules),
    }


def digest(data: dict) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("case", CASES)
def test_schedule_unchanged(case: str) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert digest(canonical(case)) == golden[case], (
        f"{case}: the H100 schedule changed; `python {__file__} dump DIR` here and at the base "
        "commit, then diff the case's JSON")


def test_every_case_has_a_golden_hash() -> None:
    assert sorted(json.loads(GOLDEN.read_text())) == sorted(CASES)


def main(argv: list[str]) -> None:
    if argv[:1] == ["write"]:
        hashes = {case: digest(canonical(case)) for case in CASES}
        GOLDEN.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    elif argv[:1] == ["dump"] and len(argv) == 2:
        out = Path(argv[1])
        out.mkdir(parents=True, exist_ok=True)
        for case in CASES:
            (out / f"{case.replace(':', '_')}.json").write_text(
                json.dumps(canonical(case), sort_keys=True, indent=1))
    else:
        raise SystemExit(f"usage: python {sys.argv[0]} write | dump DIR")


if __name__ == "__main__":
    main(sys.argv[1:])
