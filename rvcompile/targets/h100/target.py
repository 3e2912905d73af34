"""The H100 targets (h100-fp8, h100-f32): the fusion pipeline, then one lowering (lower.py: a
kernel schedule in one arena) and nvcc, one sm_90a cubin per kernel module. Their artifacts run
on rvrun's "h100" runtime (cuda-python, no jax).

Options: one GPU (--tp 1) or tensor parallel over 2, 4 or 8 (--tp N: one schedule per rank,
tensor_parallel.py; the one-GPU runtime refuses those, the CPU reference runs them), no
device-side decode loop, no precompiled topologies, platform cuda (the default platform list
means cuda here). --kv-cache: "fp8" (passes/kv_fp8: e4m3, unit
scale) on h100-fp8; "auto" is the target's own dtype. --num-draft-tokens K: verify entries for
speculative decoding (lower.py); with --assistant also the drafter's draft entries (draft.py,
one GPU only: --assistant with --tp N is refused).

Every h100 artifact also carries the piece hash's cubin (sha256.py), named by manifest
h100.piece_hash, and is hashed in pieces of piece_hash.DEVICE_PIECE_SIZE, so the runtime checks
its weights on the GPU once they are uploaded (artifacts/piece_hash.py).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any

from rvcompile.artifacts.kernel_schedule import KERNEL_LAUNCH, Collective, Cubin, Launch
from rvcompile.artifacts.manifest import Manifest
from rvcompile.artifacts.piece_hash import DEVICE_PIECE_SIZE
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
from rvcompile.targets.h100 import sha256
from rvcompile.targets.h100.layout import LoweringError
from rvcompile.targets.h100.nvcc import NvccError, compile_cubin, min_driver, nvcc_version
from rvcompile.targets.h100.tensor_parallel import RankSlot, TensorParallelError

ARCH = "sm_90a"
PIECE_HASH = {"module": sha256.SOURCE, "kernel": sha256.ENTRY}  # manifest h100.piece_hash
TP_RANKS = (1, 2, 4, 8)  # --tp: GPUs of one host
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
    input_errors: tuple[type[Exception], ...] = (LoweringError, NvccError, TensorParallelError)

    def check_options(self, opts: BuildOptions) -> BuildOptions:
        if opts.topologies:
            raise CheckpointError(f"--topology {opts.topologies[0]}: target {self.name} has "
                                  "no precompiled executables (XLA targets exported for tpu)")
        if opts.tp not in TP_RANKS:
            raise CheckpointError(f"--tp {opts.tp}: target {self.name} splits over "
                                  f"{', '.join(map(str, TP_RANKS[1:]))} GPUs of one host, or "
                                  "runs on one (--tp 1)")
        if opts.decode_loop_steps:
            raise CheckpointError(f"--decode-loop-steps {opts.decode_loop_steps}: target "
                                  f"{self.name} has no device-side decode loop (XLA targets "
                                  "only)")
        if opts.platforms != ("cuda",) and set(opts.platforms) != set(PLATFORMS):
            raise CheckpointError(f"target {self.name} runs on cuda only, not "
                                  f"{', '.join(opts.platforms)}")
        return replace(opts, decode_loop_steps=0, platforms=("cuda",))

    def lower(self, ir: ModelIR, opts: BuildOptions, log: Log, phases: Phases) -> Lowered:
        from rvcompile.targets.h100.lower import lower_to_h100, lower_to_h100_tp

        if ir.assistant is not None and opts.tp != 1:
            raise LoweringError(f"--assistant with --tp {opts.tp}: target {self.name} drafts "
                                "on one GPU only (--tp 1)")
        with phases.phase("lower for h100"):
            if opts.tp == 1:
                ranks = None
                lowering = lower_to_h100(ir, max_seqs=opts.max_seqs,
                                         prefill_buckets=opts.prefill_buckets,
                                         draft_tokens=opts.draft_tokens)
                modules = lowering.modules
            else:
                ranks = lower_to_h100_tp(ir, opts.tp, max_seqs=opts.max_seqs,
                                         prefill_buckets=opts.prefill_buckets,
                                         draft_tokens=opts.draft_tokens)
                modules = tuple(sorted({m for r in ranks for m in r.lowering.modules}))
        modules = (*modules, sha256.SOURCE)  # launched by the runtime's load, not the schedule
        # one nvcc a module; cached modules come back at once
        with phases.phase("nvcc", total=len(modules)) as bar, \
                ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = {m: pool.submit(compile_cubin, m) for m in modules}
            for done in as_completed(futures.values()):
                done.result()
                bar.advance()
            cubins = {m: f.result() for m, f in futures.items()}
        blob, index = concat(cubins)
        placed = {name: Cubin(loc["offset"], loc["size"], hashlib.sha256(cubins[name]).hexdigest())
                  for name, loc in index.items()}
        if ranks is None:
            schedule = replace(lowering.schedule, cubins=placed)
            return Lowered(("cuda",), self.requirements(schedule.arena_bytes),
                           {"h100": {"schedule": schedule.to_json(), "nvcc": nvcc_version(),
                                     "arch": ARCH, "piece_hash": PIECE_HASH}},
                           {"cubins": blob, "constants": lowering.constants},
                           schedule.weights_bytes, lowering.slots_by_param, DEVICE_PIECE_SIZE)
        return self.lowered_tp(ranks, placed, blob)

    def requirements(self, arena_bytes: int) -> dict:
        return {"runtime": self.runtime, "compute_capability": "9.0", "min_driver": min_driver(),
                "arena_bytes": arena_bytes, "kernel_launch": KERNEL_LAUNCH}

    def lowered_tp(self, ranks, cubins: dict[str, Cubin], blob: bytes) -> Lowered:
        """A --tp build: every rank's schedule, its weights and constants regions one after
        another in their sections; a split weight's slot says which part of the weight it
        holds (build._stream_weights writes that part)."""
        schedules = [replace(r.lowering.schedule, cubins=cubins) for r in ranks]
        slots: dict[str, list[RankSlot]] = {}
        weights, constants, w_end = [], [], 0
        for r, x in zip(ranks, schedules, strict=True):
            weights.append(w_end)
            constants.append(sum(len(q.lowering.constants) for q in ranks[:len(constants)]))
            for name, (slot,) in r.lowering.slots_by_param.items():
                slots.setdefault(name, []).append(
                    RankSlot(w_end + slot.offset, slot.nbytes, r.shards.get(name)))
            w_end += x.weights_bytes
        h100 = {"schedule": schedules[0].to_json(), "nvcc": nvcc_version(), "arch": ARCH,
                "piece_hash": PIECE_HASH,
                "tensor_parallel": {"ranks": len(ranks),
                                    "schedules": [x.to_json() for x in schedules[1:]],
                                    "weights": weights, "constants": constants}}
        return Lowered(("cuda",), self.requirements(max(x.arena_bytes for x in schedules)),
                       {"h100": h100},
                       {"cubins": blob,
                        "constants": b"".join(r.lowering.constants for r in ranks)},
                       w_end, slots, DEVICE_PIECE_SIZE)

    def summarize(self, manifest: Manifest, stored: Mapping[str, Any]) -> Summary:
        h100 = manifest.h100
        s = h100.schedule
        launches = [x for e in s.entries.values() for x in e.launches if isinstance(x, Launch)]
        schedule = {
            "version": s.version, "arena_bytes": s.arena_bytes,
            "regions": {"weights": s.weights_bytes, "constants": s.constants_bytes,
                        "io": s.io_bytes,
                        "sample_io": s.sampler.nbytes if s.sampler else 0,
                        "activations": s.arena_bytes - s.io_offset - s.io_bytes
                        - (s.sampler.nbytes if s.sampler else 0)},
            "kv": {"block_size": s.kv.block_size, "dtype": s.kv.kv_dtype,
                   "kinds": {k.name: {"table_width": k.table_width,
                                      "block_bytes": s.kv.block_bytes(k.name),
                                      "window": k.window} for k in s.kv.kinds}},
            "entries": {name: {"rows": e.rows, "graph": e.graph, "launches": len(e.launches)}
                        for name, e in s.entries.items()},
            "launches": len(launches),
            "kernels": len({(x.module, x.kernel) for x in launches}),
            "modules": len(s.cubins),
        }
        info = {"nvcc": h100.nvcc, "arch": h100.arch, "entry_points": sorted(s.entries),
                "max_seqs": s.max_seqs, "max_context": s.max_context, "schedule": schedule}
        keys = ["nvcc", "arch", "entry_points", "max_seqs", "max_context"]
        if s.draft_tokens:
            info["draft_tokens"] = s.draft_tokens
            keys.append("draft_tokens")
        d = manifest.assistant
        if d is not None:
            info["assistant"] = {
                "name": d.name, "model_type": d.model_type, "origin": d.origin,
                "hidden_size": d.hidden_size, "layers": list(d.layer_types),
                "heads": d.num_heads, "intermediate_size": d.intermediate_size,
                "draft": sorted(n for n in s.entries if n.startswith("draft_"))}
        tp = h100.tensor_parallel
        if tp is not None:  # the schedule shown is rank 0's
            steps = [x for e in s.entries.values() for x in e.launches
                     if isinstance(x, Collective)]
            info["tensor_parallel"] = {
                "ranks": tp.ranks, "weights_bytes": [x.weights_bytes for x in tp.schedules],
                "collectives": len(steps)}
            keys.append("tensor_parallel")
        ph = h100.piece_hash
        # which side checks the weights' pieces at load (device_hash.py)
        info["piece_hash"] = (f"{ph.module}:{ph.kernel} (the GPU hashes the weights' pieces)"
                              if ph else "none (the CPU hashes the weights' pieces)")
        keys.append("piece_hash")
        lines = [field_line(k, info[k]) for k in keys]
        if d is not None:
            a = info["assistant"]
            kinds = ", ".join(k.split("_")[0] for k in a["layers"])
            lines.append(field_line("assistant", f"{a['name']} ({a['model_type']}, from "
                                    f"{a['origin']}): width {a['hidden_size']}, "
                                    f"{len(a['layers'])} layers ({kinds}), {a['heads']} query "
                                    f"heads, MLP {a['intermediate_size']}; entries "
                                    f"{', '.join(a['draft'])}"))
        return Summary(info, (*lines, *_schedule_lines(schedule)))


def _schedule_lines(s: dict) -> list[str]:
    """The kernel schedule: arena regions, KV pools, and each entry's launch count."""
    regions = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in s["regions"].items())
    kinds = ", ".join(f"{n} {k['table_width']}-wide tables, {k['block_bytes'] / 2**10:.0f} KiB "
                      "a block" + (f" (window {k['window']})" if k["window"] else "")
                      for n, k in s["kv"]["kinds"].items())
    lines = [field_line("schedule", f"version {s['version']}: arena "
                                    f"{s['arena_bytes'] / 2**20:.1f} MiB ({regions} MiB); "
                                    f"{s['launches']} launches of {s['kernels']} kernels from "
                                    f"{s['modules']} cubins"),
             f"  KV {s['kv']['dtype']}, blocks of {s['kv']['block_size']} tokens (pools sized "
             f"at load, after the arena): {kinds}"]
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
