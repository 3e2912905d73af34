"""The build driver: model source -> IR -> passes -> target lowering -> one .rvp artifact.

It knows no target by name: `opts.target` is looked up in the registry (targets/__init__.py),
whose target checks the options, carries the pipeline and KV rules as data and lowers the IR to
what the artifact stores (targets/api.py). What every artifact has (header, model config, text
sections, weights) is written here.

Weights stream: each checkpoint tensor is read, encoded for every ParamSpec derived from it and
written to its slots in the artifact before the next is read, a large one in row blocks of
ROW_BLOCK_BYTES, so peak host memory does not grow with the model (docs/DEPLOY.md measures
it). The artifact appears only when complete (temp file + rename, via ArtifactWriter).

With an assistant (`--assistant DIR | PRESET`, checkpoint.load_assistant_source), its drafter
joins the IR at the front end (draft_frontend.add_assistant), so the target's pipeline casts and
quantizes it alike, and its tensors stream beside the target's. `opts.draft_tokens` K (the
CLI's `--num-draft-tokens`) sizes the speculative entry points of the targets that have them
(the XLA targets: verify_{max_seqs}x{K+1}, and draft_{max_seqs} with an assistant; the h100
targets: verify_{R} entries, no assistant).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from rvcompile import __version__
from rvcompile.artifacts import ArtifactHeader, ArtifactWriter
from rvcompile.artifacts.contents import parse_contents
from rvcompile.artifacts.format import canonical_json
from rvcompile.artifacts.manifest import parse_manifest
from rvcompile.ir.draft_frontend import add_assistant
from rvcompile.ir.frontend import build_model_ir
from rvcompile.ir.graph import ModelIR, check_model
from rvcompile.model.assistant import AssistantConfig
from rvcompile.passes.weight_math import encode_all
from rvcompile.progress import Phases
from rvcompile.sources.checkpoint import (
    load_assistant_source,
    load_model_source,
    read_chat_template_file,
)
from rvcompile.sources.model_source import AssistantSource, CheckpointError, ModelSource
from rvcompile.targets import get_target, registry
from rvcompile.targets.api import KV_CACHE_CHOICES, BuildOptions, Target

__all__ = ["KV_CACHE_CHOICES", "BuildOptions", "BuildReport", "build_artifact",
           "check_assistant_options", "format_ir", "kv_cache_choice", "lower_model", "prepare"]


@dataclass(frozen=True)
class BuildReport:
    path: Path
    seconds: float
    weight_bytes: int
    artifact_bytes: int


def prepare(opts: BuildOptions) -> tuple[Target, BuildOptions]:
    """The target `opts` names and the options as it takes them (its defaults filled in), once
    it has refused any it lacks: the first step of every build, before any work."""
    target = get_target(opts.target)
    return target, target.check_options(opts)


def check_assistant_options(opts: BuildOptions) -> None:
    """What an assistant needs of the options, before anything is read: at least one draft
    (the target refuses speculative entry points it lacks), and a sliding ring that holds the
    W + 1 keys a drafter reads behind the K stale rows a verify may leave (draft_frontend):
    K + 2 <= the largest bucket."""
    if not 1 <= opts.draft_tokens <= opts.chunk - 2:
        raise CheckpointError(f"--num-draft-tokens {opts.draft_tokens}: with --assistant, "
                              f"expected 1 to {opts.chunk - 2} (the largest prefill bucket - 2)")


def lower_model(source: ModelSource, opts: BuildOptions, log=print,
                assistant: AssistantConfig | None = None) -> ModelIR:
    """The front end's IR of `source` (with `assistant`'s drafter) after the target's pipeline
    and its KV cache pass."""
    target, opts = prepare(opts)
    cfg = source.config
    max_context = min(opts.max_context, cfg.max_position_embeddings)
    passes = target.passes
    kv = target.kv.pass_for(kv_cache_choice(opts, max_context))
    if kv is not None:
        passes += (kv,)
    stages = ("frontend", *(name for name, _ in passes))
    if opts.dump_ir is not None and opts.dump_ir not in stages:
        raise CheckpointError(f"--dump-ir {opts.dump_ir!r}: this build has no such stage (it "
                              f"has {', '.join(stages)})")
    if opts.chunk > max_context:
        raise CheckpointError(f"--prefill-buckets: the largest bucket {opts.chunk} is above "
                              f"{cfg.name}'s max_position_embeddings {max_context}")
    ir = build_model_ir(cfg, max_context=max_context, max_chunk=opts.chunk)
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


def kv_cache_choice(opts: BuildOptions, max_context: int) -> str:
    """"float", or the KV cache encoding `opts.kv_cache` asks for at `max_context` ("auto":
    what the target's KvRules pick). "float" is the target's own dtype (bf16, or float32 for
    the exact targets); a target without the encoding asked for refuses it."""
    target = get_target(opts.target)
    if opts.kv_cache == "auto":
        return target.kv.resolve_auto(max_context)
    if opts.kv_cache not in target.kv.choices():
        having = [t.name for t in registry().values() if opts.kv_cache in t.kv.choices()]
        raise CheckpointError(f"--kv-cache {opts.kv_cache}: target {target.name} has no "
                              f"{opts.kv_cache} KV cache (targets with one: "
                              f"{', '.join(having) or 'none'})")
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
                   assistant: str | None = None, chat_template: Path | None = None,
                   progress: bool = True, log=print, provenance=None) -> BuildReport:
    """`random_ranges`: with random_weights, what each tensor is drawn from (a
    random_weights.RangeRule; default what `--random-weights` draws); the manifest names it.
    `assistant`: an assistant directory or preset whose drafter joins the artifact (random
    weights with `random_weights`, like the target's). `chat_template`: a Jinja file that sets
    or replaces the model's chat template (checked to render in the runtime's sandbox first).
    `progress`: show the phases on stderr (progress.Phases: a bar on a terminal, else one `log`
    line per finished phase). `provenance`: a function of the manifest, once the rest of it is
    known, to the manifest's "provenance" record (the recipe, toolchain and input digests,
    provenance.build_recipe); None: no record."""
    t0 = time.perf_counter()
    phases = Phases("rvcompile", Phases.mode_for(progress), write=log)
    template = None if chat_template is None else read_chat_template_file(chat_template)
    target, opts = prepare(opts)
    if assistant is not None:
        check_assistant_options(opts)
    with phases.phase("read"):
        source = load_model_source(model, weights=weights, random_weights=random_weights,
                                   seed=seed, random_ranges=random_ranges)
        drafter: AssistantSource | None = None
        if assistant is not None:
            drafter = load_assistant_source(assistant, source.config,
                                            random_weights=random_weights, seed=seed,
                                            random_ranges=random_ranges)
    if template is not None:
        source = replace(source, chat_template=template)
    with phases.phase("passes"):
        ir = lower_model(source, opts, log, drafter and drafter.config)
    if opts.max_context > ir.max_context:  # lower_model clamps it to the model's positions
        log(f"rvcompile: warning: --max-context {opts.max_context} is above "
            f"{source.config.name}'s max_position_embeddings {ir.max_context}: building for "
            f"{ir.max_context} tokens")
    lowered = target.lower(ir, opts, log, phases)  # its phases: lower or export, nvcc, precompile
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
    if provenance is not None:
        manifest["provenance"] = provenance(manifest)
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
    with ArtifactWriter(out, header, piece_size=lowered.piece_size) as w:
        w.reserve("weights", lowered.weights_nbytes)
        for name, data in {**lowered.sections, **text_sections}.items():
            w.add(name, data)
        _stream_weights(w, tensors, specs_by_source, lowered.slots_by_param, phases)
        _zero_fill_gaps(w, lowered.slots_by_param, lowered.weights_nbytes)
        size = w.size()
        with phases.phase("hash", total=size, unit="B") as p:
            w.commit(manifest, on_hashed=p.advance)
    return BuildReport(out, time.perf_counter() - t0, lowered.weights_nbytes, out.stat().st_size)


# Tensors above this many float32 bytes are read, encoded and written in row blocks of about
# this size (every ParamSpec.derive works row by row), so a build's peak memory is a few blocks
# whatever the model: E4B's per-layer embedding table alone is 11 GB as float32.
ROW_BLOCK_BYTES = 256 << 20


def _stream_weights(w: ArtifactWriter, tensors, specs_by_source, slots_by_param,
                    phases: Phases) -> None:
    total = sum(t.numel * 4 for t in tensors)
    with phases.phase("quantize + write weights", total=total, unit="B") as bar:
        for ref in tensors:
            derives = {p.name: p.derive for p in specs_by_source.get(ref.name, ())}
            rows = math.prod(ref.shape[:-1])
            for first, stop, block in _blocks(ref, rows):
                # a pre-quantized FP8 tensor's block stays as stored
                for name, enc in encode_all(derives, block).items():
                    for slot in slots_by_param[name]:
                        if getattr(slot, "shard", None) is not None:
                            part = _shard_part(ref, rows, slot, first, stop, enc)
                            if part is not None:
                                w.write("weights", *part)
                            continue
                        offset = _block_offset(ref, rows, slot, first, stop, enc.nbytes)
                        w.write("weights", offset, np.ascontiguousarray(enc))
                del block
                bar.advance(ref.numel * 4 * (stop - first) // max(1, rows))


def _blocks(ref, rows: int):
    """(first row, stop row, what load_stored gives for those rows) covering `ref` seen as
    [rows, shape[-1]]: the whole tensor at once when it is small or its source reads only whole
    tensors."""
    if ref.rows is None or len(ref.shape) < 2 or ref.numel * 4 <= ROW_BLOCK_BYTES:
        yield 0, rows, ref.load_stored()
        return
    step = max(1, ROW_BLOCK_BYTES // (4 * ref.shape[-1]))
    for first in range(0, rows, step):
        stop = min(rows, first + step)
        yield first, stop, ref.rows(first, stop)


def _block_offset(ref, rows: int, slot, first: int, stop: int, nbytes: int) -> int:
    """Where rows [first, stop) of a param stored in `slot` go, their encoding being `nbytes`
    long: every derivation keeps the source's row order, so a row takes slot.nbytes / rows."""
    row_bytes = slot.nbytes // max(1, rows)
    if row_bytes * max(1, rows) != slot.nbytes or nbytes != (stop - first) * row_bytes:
        raise CheckpointError(f"{ref.origin}: tensor {ref.name} encodes to {nbytes} bytes for "
                              f"rows {first}-{stop} of {rows}, layout expects {slot.nbytes} "
                              "for all of them")
    return slot.offset + first * row_bytes


def _shard_part(ref, rows: int, slot, first: int, stop: int, enc: np.ndarray):
    """(offset, bytes) of a tensor-parallel rank's part of rows [first, stop) of a param, the
    slot holding rows [start, stop) of it (shard axis 0) or those columns of every row (axis
    1); None when the block has none of its rows."""
    sh = slot.shard
    if sh.axis == 0:
        lo, hi = max(first, sh.start), min(stop, sh.stop)
        if lo >= hi:
            return None
        part = enc[lo - first:hi - first]
        row_bytes, at = slot.nbytes // (sh.stop - sh.start), lo - sh.start
    else:
        part = enc[:, sh.start:sh.stop]
        row_bytes, at = slot.nbytes // max(1, rows), first
    part = np.ascontiguousarray(part)
    if part.nbytes != (len(part) if part.ndim else 1) * row_bytes:
        raise CheckpointError(f"{ref.origin}: tensor {ref.name}: a rank's part of rows "
                              f"{first}-{stop} encodes to {part.nbytes} bytes, layout expects "
                              f"{row_bytes} a row")
    return slot.offset + at * row_bytes, part


def _zero_fill_gaps(w: ArtifactWriter, slots_by_param, total: int) -> None:
    """Alignment gaps between arrays must be written too (the writer checks full coverage)."""
    spans = sorted((s.offset, s.offset + s.nbytes) for slots in slots_by_param.values()
                   for s in slots)
    end = 0
    for start, stop in [*spans, (total, total)]:
        if start > end:
            w.write("weights", end, bytes(start - end))
        end = max(end, stop)
