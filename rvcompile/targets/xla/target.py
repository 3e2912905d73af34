"""The XLA targets (tpu-bf16, tpu-int8, xla-f32, xla-fp8): one lowering (export.py: jax.export
programs for tpu, cuda and cpu) behind four pipelines. Their artifacts run on rvrun's "xla"
runtime. jax loads only when one of them lowers or summarizes precompiled executables.

Options: all of them (`--num-draft-tokens` and `--assistant` with `--tp` and `--topology` too);
`--decode-loop-steps` defaults to 32 steps (or the largest prefill
bucket, if smaller); `--topology` needs tpu among the platforms and libtpu on this machine.
--kv-cache: "int8" (passes/kv_int8) on each; "auto" is int8 beyond INT8_KV_CONTEXT tokens on
all but the exact xla-f32. `--tp N` (N > 1) with `--platforms tpu` exports the KV pools at
fixed block counts, a whole sequence per decode slot (export.fixed_pools: so that decode steps
run the Pallas kernel); rvrun loads such an artifact at those counts only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from rvcompile.artifacts.manifest import Manifest
from rvcompile.ir.graph import ModelIR
from rvcompile.passes import cast_bf16, kv_int8, quantize_fp8, quantize_int8
from rvcompile.progress import Phases
from rvcompile.sources.model_source import CheckpointError
from rvcompile.targets.api import (
    BuildOptions,
    KvRules,
    Log,
    Lowered,
    Pass,
    Summary,
    concat,
    field_line,
)

EMITS = "serialized StableHLO (jax.export) for tpu, cuda and cpu"
DECODE_LOOP_STEPS = 32  # the default steps of one decode_loop call
INT8_KV_CONTEXT = 32768  # "auto": longer contexts store their KV cache as int8
INT8_KV = ("int8", ("kv_int8", kv_int8.run))
LONG_CONTEXT_INT8 = KvRules(encodings=(INT8_KV,), auto="int8", auto_above=INT8_KV_CONTEXT)


@dataclass(frozen=True)
class XlaTarget:
    name: str
    emits: str
    passes: tuple[Pass, ...]
    kv: KvRules
    runtime: str = "xla"
    input_errors: tuple[type[Exception], ...] = ()  # precompile's PrecompileError: a ConfigError

    def check_options(self, opts: BuildOptions) -> BuildOptions:
        if opts.topologies:
            from rvcompile.targets.xla.precompile import check_topology, parse_topology

            if "tpu" not in opts.platforms:
                raise CheckpointError(f"--topology {opts.topologies[0]}: precompiling needs an "
                                      "XLA target exported for tpu (--platforms including tpu)")
            for name in opts.topologies:
                check_topology(parse_topology(name), opts.tp)
        if opts.decode_loop_steps is None:
            return replace(opts, decode_loop_steps=min(DECODE_LOOP_STEPS, opts.chunk))
        return opts

    def lower(self, ir: ModelIR, opts: BuildOptions, log: Log, phases: Phases) -> Lowered:
        from rvcompile.targets.xla.export import fixed_pools, lower_to_xla

        with phases.phase("export StableHLO"):
            lowering = lower_to_xla(ir, max_seqs=opts.max_seqs,
                                    prefill_buckets=opts.prefill_buckets,
                                    platforms=opts.platforms, tp=opts.tp,
                                    decode_loop_steps=opts.decode_loop_steps,
                                    draft_tokens=opts.draft_tokens,
                                    static_pools=fixed_pools(opts.platforms, opts.tp))
        programs_blob, program_index = concat(lowering.programs)
        devices = {"min_devices": opts.tp} if opts.tp > 1 else {}
        sections, precompiled = {"programs": programs_blob}, {}
        if opts.topologies:
            with phases.phase("XLA precompile"):
                sections["executables"], precompiled = _precompile(ir, opts, lowering, log)
        return Lowered(
            tuple(lowering.manifest["platforms"]),
            {"jax": f">={lowering.manifest['jax_version']}", "runtime": self.runtime,
             **devices},
            {"xla": {**lowering.manifest, "programs": program_index,
                     **({"precompiled": precompiled} if precompiled else {})}},
            sections, lowering.weights_nbytes, lowering.slots_by_param)

    def summarize(self, manifest: Manifest, stored: Mapping[str, Any]) -> Summary:
        x = stored["xla"]
        info = {"jax_version": x["jax_version"], "entry_points": x["entry_points"],
                "max_seqs": x["max_seqs"], "max_context": x["max_context"],
                "layer_groups": x["layer_groups"], "precompiled": x.get("precompiled", {}),
                "mesh": x.get("mesh")}
        lines = [field_line(k, info[k])
                 for k in ("jax_version", "entry_points", "max_seqs", "max_context")]
        drafter = _drafter_info(manifest)
        if drafter is not None:
            info["assistant"] = drafter
            lines += _drafter_lines(drafter)
        if x["kv"].get("fixed_blocks"):
            info["fixed_kv_blocks"] = {k: v["default_blocks"] for k, v in x["kv"]["kinds"].items()}
            lines.append(field_line("kv_blocks", "fixed at build: " + ", ".join(
                f"{n} {k}" for k, n in info["fixed_kv_blocks"].items()) + " (rvrun takes no "
                "other)"))
        if info["mesh"]:
            lines += _mesh_lines(info["mesh"])
        if info["precompiled"]:
            lines += _precompiled_lines(info["precompiled"])
        return Summary(info, tuple(lines), tuple(_traffic_lines(info["precompiled"])))


def _precompile(ir: ModelIR, opts: BuildOptions, lowering, log: Log) -> tuple[bytes, dict]:
    """The "executables" section and manifest `xla.precompiled` of opts.topologies."""
    from rvcompile.targets.xla.cost_report import query_per_kv, read_model
    from rvcompile.targets.xla.precompile import parse_topology, precompile_topologies

    return precompile_topologies(tuple(parse_topology(t) for t in opts.topologies),
                                 lowering.programs, lowering.manifest,
                                 query_per_kv=query_per_kv(ir), reads=read_model(ir), log=log)


def _drafter_info(manifest: Manifest) -> dict | None:
    """The speculative entry points and the assistant drafter of a checked manifest, or None."""
    spec, drafter = manifest.xla.speculative, manifest.assistant
    if spec is None:
        return None
    info: dict = {"verify": spec.verify, "draft": spec.draft, "draft_tokens": spec.draft_tokens}
    if drafter is not None:
        info.update(name=drafter.name, model_type=drafter.model_type, origin=drafter.origin,
                    hidden_size=drafter.hidden_size, layers=list(drafter.layer_types),
                    heads=drafter.num_heads, intermediate_size=drafter.intermediate_size,
                    head=(f"centroids {drafter.num_centroids}, top {drafter.top_k}"
                          if drafter.num_centroids else "dense (tied)"),
                    reads=list(spec.reads))
    return info


def _drafter_lines(d: dict) -> list[str]:
    lines = []
    if "name" in d:
        kinds = ", ".join(k.split("_")[0] for k in d["layers"])
        lines.append(field_line("assistant", f"{d['name']} ({d['model_type']}, from "
                                f"{d['origin']}): width {d['hidden_size']}, {len(d['layers'])} "
                                f"layers ({kinds}) reading target layers {d['reads']}, "
                                f"{d['heads']} query heads, MLP {d['intermediate_size']}, head "
                                f"{d['head']}"))
    lines.append(field_line("speculative", f"up to {d['draft_tokens']} drafts: {d['verify']}"
                            + (f", {d['draft']}" if d["draft"] else "")))
    return lines


def _mesh_lines(mesh: dict) -> list[str]:
    """The tensor-parallel mesh: its axis and size, then every split array and its spec."""
    arrays = {**mesh["weights"], **mesh["pools"]}
    split = {k: v for k, v in arrays.items() if any(v)}
    lines = [field_line("mesh", f"{mesh['axis']}={mesh['size']}: {len(split)} of {len(arrays)} "
                                "weight arrays and KV pools split, the rest whole on every "
                                "device")]
    for key, spec in split.items():
        lines.append(f"  {key:40} P({', '.join(repr(a) if a else 'None' for a in spec)})")
    return lines


def _precompiled_lines(sets: dict) -> list[str]:
    """Each topology's executables (what a runtime must match) and its cost estimate."""
    from rvcompile.targets.xla.cost_report import format_report

    lines = ["precompiled:"]
    for name, rec in sets.items():
        size = sum(e["size"] for e in rec["entries"].values())
        lines.append(f"  {name}: {rec['device_kind']} x{len(rec['device_ids'])}, jax "
                     f"{rec['jax']}, jaxlib {rec['jaxlib']}, libtpu {rec['libtpu']}, KV blocks "
                     f"{rec['kv_blocks']}, {len(rec['entries'])} executables "
                     f"({size / 2**20:.1f} MiB)")
        if "cost" in rec:
            lines += format_report(name, rec["cost"])
    return lines


TARGETS = (
    XlaTarget("tpu-bf16", EMITS + "; bf16 weights and KV cache",
              (("cast_bf16", cast_bf16.run),), LONG_CONTEXT_INT8),
    XlaTarget("tpu-int8", EMITS + "; int8 per-channel weights, bf16 KV cache", (
        ("cast_bf16", cast_bf16.run),  # norms stay float32, KV cache bf16
        ("quantize_int8", quantize_int8.run),  # then matrices to int8 + per-row scale
    ), LONG_CONTEXT_INT8),
    XlaTarget("xla-f32", EMITS + "; float32 everything (exact tests)", (),
              KvRules(encodings=(INT8_KV,))),  # exact: int8 only when asked for
    XlaTarget("xla-fp8", EMITS + "; FP8 e4m3 per-channel weights, bf16 KV cache (cross-checks "
              "h100-fp8)", (
                  ("cast_bf16", cast_bf16.run),
                  ("quantize_fp8", quantize_fp8.run),  # the same FP8 model as h100-fp8
              ), LONG_CONTEXT_INT8),
)


def _traffic_lines(sets: dict) -> list[str]:
    """`inspect --cost`: each precompiled topology's traffic table, or why there is none."""
    from rvcompile.targets.xla.cost_report import format_traffic

    if not sets:
        return ["traffic:          none (no precompiled topology: build with --topology)"]
    lines = ["traffic:"]
    for name, rec in sets.items():
        t = (rec.get("cost") or {}).get("traffic")
        lines += (format_traffic(name, t) if t is not None else
                  [f"  {name}: no traffic table (built before rvcompile recorded one)"])
    return lines
