"""The H100 targets (h100-fp8, h100-f32): the fusion pipeline, then one lowering (lower.py: a
kernel schedule in one arena) and nvcc, one sm_90a cubin per kernel module. Their artifacts run
on rvrun's "h100" runtime (cuda-python, no jax).

Options: one GPU (--tp 1), no device-side decode loop, no precompiled topologies, platform cuda
(the default platform list means cuda here). --kv-cache: "fp8" (passes/kv_fp8: e4m3, unit
scale) on h100-fp8; "auto" is the target's own dtype.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any

from rvcompile.artifacts.kernel_schedule import KERNEL_LAUNCH, Cubin
from rvcompile.artifacts.manifest import Manifest
from rvcompile.ir.graph import ModelIR
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
    quantize_fp8,
)
from rvcompile.progress import Phases
from rvcompile.sources.model_source import CheckpointError
from rvcompile.targets.api import (
    PLATFORMS,
    BuildOptions,
    KvRules,
    Log,
    Lowered,
    Pass,
    Summary,
    concat,
    field_line,
)
from rvcompile.targets.h100.layout import LoweringError
from rvcompile.targets.h100.nvcc import NvccError, compile_cubin, min_driver, nvcc_version

ARCH = "sm_90a"
# What the H100 kernels run as one unit, made IR ops after the fusions above; the lowering then
# maps each op to its launches (launches.py).
BLOCKS: tuple[Pass, ...] = (
    ("fuse_attention", fuse_attention.run),  # q/k/v norms, RoPE, KV writes, attention
    ("fuse_moe", fuse_moe.run),  # router chain, experts, branch sum
    ("fuse_ple", fuse_ple.run),  # per-layer inputs: embed's, each layer's projection
    ("fuse_next_norm", fuse_next_norm.run),  # a residual add's next RMSNORM, across graphs too
)
FUSED: tuple[Pass, ...] = (
    ("fuse_residual_norm", fuse_residual_norm.run),
    ("fuse_gated_mlp", fuse_gated_mlp.run),
    ("fuse_qkv", fuse_qkv.run),
    *BLOCKS,
)


@dataclass(frozen=True)
class H100Target:
    name: str
    emits: str
    passes: tuple[Pass, ...]
    kv: KvRules
    runtime: str = "h100"
    input_errors: tuple[type[Exception], ...] = (LoweringError, NvccError)

    def check_options(self, opts: BuildOptions) -> BuildOptions:
        if opts.topologies:
            raise CheckpointError(f"--topology {opts.topologies[0]}: target {self.name} has "
                                  "no precompiled executables (XLA targets exported for tpu)")
        if opts.tp != 1:
            raise CheckpointError(f"target {self.name} runs on one GPU; --tp {opts.tp} is for "
                                  "the XLA targets")
        if opts.draft_tokens:
            raise CheckpointError(f"--num-draft-tokens {opts.draft_tokens}: target {self.name} "
                                  "has no speculative entry points yet (the XLA targets have)")
        if opts.decode_loop_steps:
            raise CheckpointError(f"--decode-loop-steps {opts.decode_loop_steps}: target "
                                  f"{self.name} has no device-side decode loop (XLA targets "
                                  "only)")
        if opts.platforms != ("cuda",) and set(opts.platforms) != set(PLATFORMS):
            raise CheckpointError(f"target {self.name} runs on cuda only, not "
                                  f"{', '.join(opts.platforms)}")
        return replace(opts, decode_loop_steps=0, platforms=("cuda",))

    def lower(self, ir: ModelIR, opts: BuildOptions, log: Log, phases: Phases) -> Lowered:
        from rvcompile.targets.h100.lower import lower_to_h100

        with phases.phase("lower for h100"):
            lowering = lower_to_h100(ir, max_seqs=opts.max_seqs,
                                     prefill_buckets=opts.prefill_buckets)
        # one nvcc a module; cached modules come back at once
        with phases.phase("nvcc", total=len(lowering.modules)) as bar, \
                ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = {m: pool.submit(compile_cubin, m) for m in lowering.modules}
            for done in as_completed(futures.values()):
                done.result()
                bar.advance()
            cubins = {m: f.result() for m, f in futures.items()}
        blob, index = concat(cubins)
        schedule = replace(lowering.schedule, cubins={
            name: Cubin(loc["offset"], loc["size"], hashlib.sha256(cubins[name]).hexdigest())
            for name, loc in index.items()})
        return Lowered(
            ("cuda",),
            {"runtime": self.runtime, "compute_capability": "9.0", "min_driver": min_driver(),
             "arena_bytes": schedule.arena_bytes, "kernel_launch": KERNEL_LAUNCH},
            {"h100": {"schedule": schedule.to_json(), "nvcc": nvcc_version(), "arch": ARCH}},
            {"cubins": blob, "constants": lowering.constants},
            schedule.weights_bytes, lowering.slots_by_param)

    def summarize(self, manifest: Manifest, stored: Mapping[str, Any]) -> Summary:
        h100 = manifest.h100
        s = h100.schedule
        launches = [x for e in s.entries.values() for x in e.launches]
        schedule = {
            "version": s.version, "arena_bytes": s.arena_bytes,
            "regions": {"weights": s.weights_bytes, "constants": s.constants_bytes,
                        "kv": s.kv.pool_bytes, "io": s.io_bytes,
                        "activations": s.arena_bytes - s.io_offset - s.io_bytes},
            "kv": {"block_size": s.kv.block_size, "dtype": s.kv.kv_dtype,
                   "kinds": {k.name: {"table_width": k.table_width, "num_blocks": k.num_blocks,
                                      "window": k.window} for k in s.kv.kinds}},
            "entries": {name: {"rows": e.rows, "graph": e.graph, "launches": len(e.launches)}
                        for name, e in s.entries.items()},
            "launches": len(launches),
            "kernels": len({(x.module, x.kernel) for x in launches}),
            "modules": len(s.cubins),
        }
        info = {"nvcc": h100.nvcc, "arch": h100.arch, "entry_points": sorted(s.entries),
                "max_seqs": s.max_seqs, "max_context": s.max_context, "schedule": schedule}
        lines = [field_line(k, info[k])
                 for k in ("nvcc", "arch", "entry_points", "max_seqs", "max_context")]
        return Summary(info, (*lines, *_schedule_lines(schedule)))


def _schedule_lines(s: dict) -> list[str]:
    """The kernel schedule: arena regions, KV pools, and each entry's launch count."""
    regions = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in s["regions"].items())
    kinds = ", ".join(f"{n} {k['num_blocks']} x {k['table_width']}-wide"
                      + (f" (window {k['window']})" if k["window"] else "")
                      for n, k in s["kv"]["kinds"].items())
    lines = [field_line("schedule", f"version {s['version']}: arena "
                                    f"{s['arena_bytes'] / 2**20:.1f} MiB ({regions} MiB); "
                                    f"{s['launches']} launches of {s['kernels']} kernels from "
                                    f"{s['modules']} cubins"),
             f"  KV {s['kv']['dtype']}, blocks of {s['kv']['block_size']} tokens: {kinds}"]
    for name, e in s["entries"].items():
        lines.append(f"  {name:16} {e['rows']:>5} rows  {e['launches']:>5} launches"
                     f"{'  (CUDA graph)' if e['graph'] else ''}")
    return lines


TARGETS = (
    H100Target("h100-fp8", "a kernel schedule over sm_90a cubins + CUDA-graph decode; FP8 e4m3 "
               "per-channel weights, bf16 KV cache", (
                   ("cast_bf16", cast_bf16.run),  # norms float32, embedding/head, KV cache bf16
                   ("quantize_fp8", quantize_fp8.run),  # linears to e4m3 + per-row scale
                   *FUSED,
               ), KvRules(encodings=(("fp8", ("kv_fp8", kv_fp8.run)),))),
    H100Target("h100-f32", "the h100-fp8 kernel schedule through the kernels' float32 entries: "
               "float32 weights, activations and KV cache (exact tests)",
               FUSED, KvRules()),  # no casts, no quantization
)
