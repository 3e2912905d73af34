"""The build driver: model source -> IR -> passes -> target lowering -> one .rvp artifact.

Weights stream: each checkpoint tensor is read, encoded for every ParamSpec derived from it and
written to its slots in the artifact before the next is read, so peak host memory is about one
shard's page cache plus the largest tensor. The artifact appears only when complete (temp file +
rename, via ArtifactWriter).

With an assistant (`--assistant DIR | PRESET`, checkpoint.load_assistant_source), its drafter
joins the IR at the front end (draft_frontend.add_assistant), so the target's passes cast and
quantize it alike, and its tensors stream beside the target's. `draft_tokens` K (the CLI's
`--num-draft-tokens`) sizes the speculative entry points (XLA targets: verify_{B}x{K+1}, and
draft_{B} with an assistant).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rvcompile import __version__
from rvcompile.artifacts import ArtifactHeader, ArtifactWriter
from rvcompile.artifacts.contents import parse_contents
from rvcompile.artifacts.format import canonical_json
from rvcompile.artifacts.kernel_schedule import KERNEL_LAUNCH, Cubin
from rvcompile.artifacts.manifest import parse_manifest
from rvcompile.ir.draft_frontend import add_assistant
from rvcompile.ir.frontend import build_model_ir
from rvcompile.ir.graph import ModelIR, check_model
from rvcompile.model.assistant import AssistantConfig
from rvcompile.passes import (
    cast_bf16,
    fuse_attention,
    fuse_gated_mlp,
    fuse_moe,
    fuse_next_norm,
    fuse_ple,
    fuse_qkv,
    fuse_residual_norm,
    kv_fp8,
    kv_int8,
    quantize_fp8,
    quantize_int8,
)
from rvcompile.passes.weight_math import encode_all
from rvcompile.sources.checkpoint import (
    AssistantSource,
    CheckpointError,
    ModelSource,
    load_assistant_source,
    load_model_source,
)


@dataclass(frozen=True)
class TargetSpec:
    name: str
    passes: tuple[tuple[str, Callable[[ModelIR], ModelIR]], ...]  # the pipeline, in order
    emits: str
    lowering: str = "xla"  # "xla" (targets/xla) or "h100" (targets/h100)


_XLA_EMITS = "serialized StableHLO (jax.export) for tpu, cuda and cpu"
# What the H100 kernels run as one unit, made IR ops after the fusions above; the lowering then
# maps each op to its launches (targets/h100/launches.py).
_H100_BLOCKS = (
    ("fuse_attention", fuse_attention.run),  # q/k/v norms, RoPE, KV writes, attention
    ("fuse_moe", fuse_moe.run),  # router chain, experts, branch sum
    ("fuse_ple", fuse_ple.run),  # per-layer inputs: embed's, each layer's projection
    ("fuse_next_norm", fuse_next_norm.run),  # a residual add's next RMSNORM, across graphs too
)
TARGETS: dict[str, TargetSpec] = {
    "tpu-bf16": TargetSpec("tpu-bf16", (("cast_bf16", cast_bf16.run),),
                           _XLA_EMITS + "; bf16 weights and KV cache"),
    "tpu-int8": TargetSpec("tpu-int8", (
        ("cast_bf16", cast_bf16.run),  # norms stay float32, KV cache bf16
        ("quantize_int8", quantize_int8.run),  # then matrices to int8 + per-row scale
    ), _XLA_EMITS + "; int8 per-channel weights, bf16 KV cache"),
    "xla-f32": TargetSpec("xla-f32", (), _XLA_EMITS + "; float32 everything (exact tests)"),
    "xla-fp8": TargetSpec("xla-fp8", (
        ("cast_bf16", cast_bf16.run),
        ("quantize_fp8", quantize_fp8.run),  # the same FP8 model as h100-fp8, through XLA
    ), _XLA_EMITS + "; FP8 e4m3 per-channel weights, bf16 KV cache (cross-checks h100-fp8)"),
    "h100-fp8": TargetSpec("h100-fp8", (
        ("cast_bf16", cast_bf16.run),  # norms float32, embedding/head and KV cache bf16
        ("quantize_fp8", quantize_fp8.run),  # linears to e4m3 + per-row scale
        ("fuse_residual_norm", fuse_residual_norm.run),
        ("fuse_gated_mlp", fuse_gated_mlp.run),
        ("fuse_qkv", fuse_qkv.run),
        *_H100_BLOCKS,
    ), "a kernel schedule over sm_90a cubins + CUDA-graph decode; FP8 e4m3 per-channel "
       "weights, bf16 KV cache", lowering="h100"),
    "h100-f32": TargetSpec("h100-f32", (
        ("fuse_residual_norm", fuse_residual_norm.run),  # no casts, no quantization
        ("fuse_gated_mlp", fuse_gated_mlp.run),
        ("fuse_qkv", fuse_qkv.run),
        *_H100_BLOCKS,
    ), "the h100-fp8 kernel schedule through the kernels' float32 entries: float32 weights, "
       "activations and KV cache (exact tests)", lowering="h100"),
}


@dataclass(frozen=True)
class BuildOptions:
    target: str
    max_context: int = 2048
    prefill_buckets: tuple[int, ...] = (16, 64, 256)
    slots: int = 4
    platforms: tuple[str, ...] = ("tpu", "cuda", "cpu")  # what the StableHLO is exported for
    dump_ir: str | None = None  # print the IR after this pass ("frontend" or a pass name)
    topologies: tuple[str, ...] = ()  # TPU slices to precompile for, e.g. "v6e:2x2" (libtpu)
    decode_loop_steps: int = 0  # XLA: steps per device-side decode_loop call; 0 = no such entry
    tp: int = 1  # tensor-parallel devices the XLA programs are sharded over (targets/xla/sharding)
    kv_cache: str = "auto"  # "float" (the target's), "int8", "fp8", "auto": kv_cache_choice
    draft_tokens: int = 0  # speculative decoding: most drafts per verify call; 0 = no entries

    def __post_init__(self) -> None:
        """Every option inside its documented range, else a one-line CheckpointError naming the
        CLI option; what depends on the model or the target is checked where that is known."""
        if self.target not in TARGETS:
            raise CheckpointError(f"unknown target {self.target!r} (known: {', '.join(TARGETS)})")
        _check_count("--max-context", self.max_context, 1)
        _check_count("--max-seqs", self.slots, 1)
        if not isinstance(self.prefill_buckets, tuple) or not self.prefill_buckets:
            raise CheckpointError(f"--prefill-buckets {self.prefill_buckets!r}: expected one or "
                                  "more sizes")
        for size in self.prefill_buckets:
            _check_count("--prefill-buckets", size, 1)
        chunk = max(self.prefill_buckets)
        if chunk > self.max_context:
            raise CheckpointError(f"--max-context {self.max_context} must be >= the largest "
                                  f"prefill bucket {chunk}")
        if not self.platforms or set(self.platforms) - set(PLATFORMS):
            raise CheckpointError(f"--platforms {','.join(self.platforms)!r}: expected a comma "
                                  f"list of {', '.join(PLATFORMS)}")
        _check_count("--tp", self.tp, 1)
        # One decode_loop call writes at most one prefill chunk of positions (the sliding ring
        # is sized for that): more steps than the largest bucket would not fit.
        steps = self.decode_loop_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= chunk:
            raise CheckpointError(f"--decode-loop-steps {steps!r}: expected 0 (no loop) to "
                                  f"{chunk}, the largest prefill bucket")
        # A verify call runs a token and its drafts as one chunk of rows.
        drafts = self.draft_tokens
        if isinstance(drafts, bool) or not isinstance(drafts, int) or not 0 <= drafts < chunk:
            raise CheckpointError(f"--num-draft-tokens {drafts!r}: expected 0 (no speculative "
                                  f"entry points) to {chunk - 1}, the largest prefill bucket - 1")
        if drafts and TARGETS[self.target].lowering != "xla":
            raise CheckpointError(f"--num-draft-tokens {drafts}: target {self.target} has no "
                                  "speculative entry points yet (the XLA targets have)")
        if drafts and (self.tp != 1 or self.topologies):
            raise CheckpointError(f"--num-draft-tokens {drafts}: speculative entry points are "
                                  "not built with --tp or --topology yet")
        if self.kv_cache not in KV_CACHE_CHOICES:
            raise CheckpointError(f"--kv-cache {self.kv_cache!r}: expected one of "
                                  f"{', '.join(KV_CACHE_CHOICES)}")


PLATFORMS = ("tpu", "cuda", "cpu")


def _check_count(option: str, value: object, low: int, high: int | None = None) -> None:
    """`value` is an int in [low, high]; CheckpointError naming `option` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
        high is not None and value > high
    ):
        want = f">= {low}" if high is None else f"from {low} to {high}"
        raise CheckpointError(f"{option} {value!r}: expected an integer {want}")


@dataclass(frozen=True)
class BuildReport:
    path: Path
    seconds: float
    weight_bytes: int
    artifact_bytes: int


def check_assistant_options(opts: BuildOptions) -> None:
    """What an assistant needs of the options, before anything is read: XLA entry points for
    at least one draft, and a sliding ring that holds the W + 1 keys a drafter reads behind
    the K stale rows a verify may leave (draft_frontend): K + 2 <= the largest bucket."""
    chunk = max(opts.prefill_buckets)
    if TARGETS[opts.target].lowering != "xla":
        raise CheckpointError(f"--assistant: target {opts.target} has no drafter entry points "
                              "yet (the XLA targets have)")
    if not 1 <= opts.draft_tokens <= chunk - 2:
        raise CheckpointError(f"--num-draft-tokens {opts.draft_tokens}: with --assistant, "
                              f"expected 1 to {chunk - 2} (the largest prefill bucket - 2)")


def lower_model(source: ModelSource, opts: BuildOptions, log=print,
                assistant: AssistantConfig | None = None) -> ModelIR:
    cfg = source.config
    max_context = min(opts.max_context, cfg.max_position_embeddings)
    passes = TARGETS[opts.target].passes
    kv = kv_cache_choice(opts, max_context)
    if kv == "int8":
        passes += (("kv_int8", kv_int8.run),)  # after the casts: the cache dtype is the last word
    if kv == "fp8":
        passes += (("kv_fp8", kv_fp8.run),)  # likewise
    stages = ("frontend", *(name for name, _ in passes))
    if opts.dump_ir is not None and opts.dump_ir not in stages:
        raise CheckpointError(f"--dump-ir {opts.dump_ir!r}: this build has no such stage (it "
                              f"has {', '.join(stages)})")
    if max(opts.prefill_buckets) > max_context:
        raise CheckpointError(f"--prefill-buckets: the largest bucket {max(opts.prefill_buckets)} "
                              f"is above {cfg.name}'s max_position_embeddings {max_context}")
    ir = build_model_ir(cfg, max_context=max_context, max_chunk=max(opts.prefill_buckets))
    if assistant is not None:
        ir = add_assistant(ir, assistant)
    if opts.dump_ir == "frontend":
        log(format_ir(ir))
    for name, run in passes:
        ir = run(ir)
        check_model(ir)
        if opts.dump_ir == name:
            log(format_ir(ir))
    return ir


KV_CACHE_CHOICES = ("auto", "float", "int8", "fp8")
INT8_KV_CONTEXT = 32768  # "auto": XLA targets but xla-f32 store longer contexts' KV as int8


def kv_cache_choice(opts: BuildOptions, max_context: int) -> str:
    """"float", "int8" or "fp8": the KV cache `opts.kv_cache` asks for at `max_context`.
    "float" is the target's own (bf16, or float32 for the exact targets). "int8" (values + a
    float32 scale per token and KV head, passes/kv_int8) exists on the XLA targets, "fp8"
    (unscaled e4m3, passes/kv_fp8) on h100-fp8. "auto" is int8 beyond INT8_KV_CONTEXT tokens on
    the XLA targets other than the exact xla-f32, else float."""
    xla = TARGETS[opts.target].lowering == "xla"
    if opts.kv_cache == "int8" and not xla:
        raise CheckpointError(f"--kv-cache int8: target {opts.target} has no int8 KV cache; "
                              "int8 caches are for the XLA targets")
    if opts.kv_cache == "fp8" and opts.target != "h100-fp8":
        raise CheckpointError(f"--kv-cache fp8: target {opts.target} has no FP8 KV cache "
                              "(only h100-fp8 does)")
    if opts.kv_cache == "auto":
        long = max_context > INT8_KV_CONTEXT
        return "int8" if xla and opts.target != "xla-f32" and long else "float"
    return opts.kv_cache


def format_ir(ir: ModelIR) -> str:
    lines = [f"# {ir.config.name} after {', '.join(ir.notes) or 'frontend'}"]
    for g in ir.graphs():
        lines.append(f"graph {g.name}:")
        for i, n in enumerate(g.nodes):
            attrs = "" if n.attrs is None else f" {n.attrs}"
            lines.append(f"  %{i} = {n.op.value}({', '.join(f'%{j}' for j in n.inputs)})"
                         f" : {n.dtype}{list(n.shape)}{attrs}")
        lines.append(f"  return {dict(g.outputs)}")
    return "\n".join(lines)


def build_artifact(model: str, out: Path, opts: BuildOptions, *, weights: Path | None = None,
                   random_weights: bool = False, seed: int = 0, random_ranges=None,
                   assistant: str | None = None, progress: bool = True,
                   log=print) -> BuildReport:
    """`random_ranges`: with random_weights, what each tensor is drawn from (a
    random_weights.RangeRule; default what `--random-weights` draws); the manifest names it.
    `assistant`: an assistant directory or preset whose drafter joins the artifact (random
    weights with `random_weights`, like the target's)."""
    t0 = time.perf_counter()
    _check_topologies(opts)
    if assistant is not None:
        check_assistant_options(opts)
    source = load_model_source(model, weights=weights, random_weights=random_weights, seed=seed,
                               random_ranges=random_ranges)
    drafter: AssistantSource | None = None
    if assistant is not None:
        drafter = load_assistant_source(assistant, source.config, random_weights=random_weights,
                                        seed=seed, random_ranges=random_ranges)
    ir = lower_model(source, opts, log, drafter and drafter.config)
    if opts.max_context > ir.max_context:  # lower_model clamps it to the model's positions
        log(f"rvcompile: warning: --max-context {opts.max_context} is above "
            f"{source.config.name}'s max_position_embeddings {ir.max_context}: building for "
            f"{ir.max_context} tokens")
    if TARGETS[opts.target].lowering == "h100":
        lowered = _lower_h100(ir, opts)
    else:
        lowered = _lower_xla(ir, opts, log)
    header = ArtifactHeader(compiler_version=__version__, target=opts.target,
                            platforms=lowered.platforms, requirements=lowered.requirements)
    text_sections = {
        "tokenizer": source.tokenizer_json.encode(),
        "generation_config": json.dumps(source.generation_config, sort_keys=True).encode(),
        "chat_template": (source.chat_template or "").encode(),
    }
    manifest = {
        "model": {"name": source.config.name, "config": source.config.to_hf_dict(),
                  "origin": Path(source.origin).name if "/" in source.origin else source.origin},
        "target": opts.target,
        "compiler_version": __version__,
        "passes": list(ir.notes),
        **lowered.manifest,
        "random_weights": (None if not random_weights else {"seed": seed} if random_ranges is None
                           else {"seed": seed, "ranges": random_ranges.__name__}),
    }
    tensors = source.tensors
    if drafter is not None:
        manifest["assistant"] = {"name": drafter.config.name,
                                 "config": drafter.config.to_hf_dict(),
                                 "origin": Path(drafter.origin).name}
        tensors += drafter.tensors
    specs_by_source: dict[str, list] = {}
    for p in ir.params:
        specs_by_source.setdefault(p.source, []).append(p)
    missing = set(specs_by_source) - {t.name for t in tensors}
    if missing:
        raise CheckpointError(f"{source.origin}: no tensor {sorted(missing)[0]!r} in the weights")
    out = Path(out)
    # What every reader checks, on what is about to be written: no build writes an artifact
    # that its runtime would refuse.
    sizes = {"weights": lowered.weights_nbytes,
             **{name: len(data) for name, data in {**lowered.sections, **text_sections}.items()}}
    checked = parse_manifest(header, json.loads(canonical_json(manifest)), sizes, out.name)
    parse_contents(checked, {**lowered.sections, **text_sections}, out.name)
    with ArtifactWriter(out, header) as w:
        w.reserve("weights", lowered.weights_nbytes)
        for name, data in {**lowered.sections, **text_sections}.items():
            w.add(name, data)
        _stream_weights(w, tensors, specs_by_source, lowered.slots_by_param, progress)
        _zero_fill_gaps(w, lowered.slots_by_param, lowered.weights_nbytes)
        w.commit(manifest)
    return BuildReport(out, time.perf_counter() - t0, lowered.weights_nbytes, out.stat().st_size)


@dataclass(frozen=True)
class _Lowered:
    """What a target lowering hands the writer."""

    platforms: tuple[str, ...]
    requirements: dict
    manifest: dict  # the target's part of the manifest
    sections: dict[str, bytes]  # besides weights and the text sections
    weights_nbytes: int
    slots_by_param: dict  # param name -> [slot with .offset, .nbytes]


def _check_topologies(opts: BuildOptions) -> None:
    """Refuse, before any work, topologies this build cannot precompile for."""
    if not opts.topologies:
        return
    from rvcompile.targets.xla.precompile import check_topology, parse_topology

    if TARGETS[opts.target].lowering != "xla" or "tpu" not in opts.platforms:
        raise CheckpointError(f"--topology {opts.topologies[0]}: precompiling needs an XLA target "
                              "exported for tpu (--platforms including tpu)")
    for name in opts.topologies:
        check_topology(parse_topology(name), opts.tp)


def _precompile(ir: ModelIR, opts: BuildOptions, lowering, log) -> tuple[bytes, dict]:
    """The "executables" section and manifest `xla.precompiled` of opts.topologies."""
    from rvcompile.targets.xla.cost_report import query_per_kv, read_model
    from rvcompile.targets.xla.precompile import parse_topology, precompile_topologies

    return precompile_topologies(tuple(parse_topology(t) for t in opts.topologies),
                                 lowering.programs, lowering.manifest,
                                 query_per_kv=query_per_kv(ir), reads=read_model(ir), log=log)


def _lower_xla(ir: ModelIR, opts: BuildOptions, log=print) -> _Lowered:
    from rvcompile.targets.xla.export import lower_to_xla

    lowering = lower_to_xla(ir, slots=opts.slots, prefill_buckets=opts.prefill_buckets,
                            platforms=opts.platforms, tp=opts.tp,
                            decode_loop_steps=opts.decode_loop_steps,
                            draft_tokens=opts.draft_tokens)
    programs_blob, program_index = _concat(lowering.programs)
    devices = {"min_devices": opts.tp} if opts.tp > 1 else {}
    sections, precompiled = {"programs": programs_blob}, {}
    if opts.topologies:
        sections["executables"], precompiled = _precompile(ir, opts, lowering, log)
    return _Lowered(
        tuple(lowering.manifest["platforms"]),
        {"jax": f">={lowering.manifest['jax_version']}", "runtime": "xla", **devices},
        {"xla": {**lowering.manifest, "programs": program_index,
                 **({"precompiled": precompiled} if precompiled else {})}},
        sections, lowering.weights_nbytes, lowering.slots_by_param)


def _lower_h100(ir: ModelIR, opts: BuildOptions) -> _Lowered:
    from dataclasses import replace

    from rvcompile.targets.h100.lower import lower_to_h100
    from rvcompile.targets.h100.nvcc import compile_cubin, min_driver, nvcc_version

    if opts.tp != 1:
        raise CheckpointError(f"target {opts.target} runs on one GPU; --tp {opts.tp} is for the "
                              "XLA targets")
    if opts.decode_loop_steps:
        raise CheckpointError(f"--decode-loop-steps {opts.decode_loop_steps}: target "
                              f"{opts.target} has no device-side decode loop (XLA targets only)")
    if opts.platforms != ("cuda",) and set(opts.platforms) != set(BuildOptions.platforms):
        raise CheckpointError(f"target {opts.target} runs on cuda only, not "
                              f"{', '.join(opts.platforms)}")
    lowering = lower_to_h100(ir, slots=opts.slots, prefill_buckets=opts.prefill_buckets)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one nvcc per module
        cubins = dict(zip(lowering.modules, pool.map(compile_cubin, lowering.modules),
                          strict=True))
    blob, index = _concat(cubins)
    schedule = replace(lowering.schedule, cubins={
        name: Cubin(loc["offset"], loc["size"], hashlib.sha256(cubins[name]).hexdigest())
        for name, loc in index.items()})
    return _Lowered(
        ("cuda",),
        {"runtime": "h100", "compute_capability": "9.0", "min_driver": min_driver(),
         "arena_bytes": schedule.arena_bytes, "kernel_launch": KERNEL_LAUNCH},
        {"h100": {"schedule": schedule.to_json(), "nvcc": nvcc_version(), "arch": "sm_90a"}},
        {"cubins": blob, "constants": lowering.constants},
        schedule.weights_bytes, lowering.slots_by_param)


def _concat(blobs: dict[str, bytes]) -> tuple[bytes, dict[str, dict[str, int]]]:
    index, parts, offset = {}, [], 0
    for name in sorted(blobs):
        index[name] = {"offset": offset, "size": len(blobs[name])}
        parts.append(blobs[name])
        offset += len(blobs[name])
    return b"".join(parts), index


def _stream_weights(w: ArtifactWriter, tensors, specs_by_source, slots_by_param,
                    progress: bool) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TransferSpeedColumn

    total = sum(t.numel * 4 for t in tensors)
    with Progress(TextColumn("weights"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TransferSpeedColumn(), disable=not progress, transient=True) as bar:
        task = bar.add_task("weights", total=total)
        for ref in tensors:
            arr = ref.load_stored()  # a pre-quantized FP8 tensor stays as stored
            specs = specs_by_source.get(ref.name, ())
            for name, enc in encode_all({p.name: p.derive for p in specs}, arr).items():
                for slot in slots_by_param[name]:
                    if enc.nbytes != slot.nbytes:
                        raise CheckpointError(f"{ref.origin}: tensor {ref.name} encodes to "
                                              f"{enc.nbytes} bytes, layout expects {slot.nbytes}")
                    w.write("weights", slot.offset, np.ascontiguousarray(enc))
            del arr
            bar.advance(task, ref.numel * 4)


def _zero_fill_gaps(w: ArtifactWriter, slots_by_param, total: int) -> None:
    """Alignment gaps between arrays must be written too (the writer checks full coverage)."""
    spans = sorted((s.offset, s.offset + s.nbytes) for slots in slots_by_param.values()
                   for s in slots)
    end = 0
    for start, stop in [*spans, (total, total)]:
        if start > end:
            w.write("weights", end, bytes(start - end))
        end = max(end, stop)
