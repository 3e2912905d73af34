"""Executor for h100-fp8 artifacts: cuda-python's driver API and numpy only (no torch, JAX, nvcc,
NVRTC or Triton). Nothing compiles at load.

`check_fits` refuses, before any allocation, an artifact built before its kernels opened with
griddepcontrol.wait (header requirement kernel_launch), and a machine whose GPU is not compute
capability 9.0, whose driver is older than the cubins need, or whose free memory is short of the
arena. Then: one arena allocation; weights streamed from the mapped artifact through two pinned
staging buffers (disk reads overlap the copies); constants uploaded, the rest zeroed; cubins
loaded (their sha256 and every launch's kernel, argument sizes and block checked by
artifacts/contents.py before); every launch's argument block and launch configuration
(programmatic stream serialization on: cuda_driver.py) built once, a parameter block completed
for the arena's addresses (tma.py: TMA descriptors encoded, pointers written; the graphs capture
those bytes, and the arena never moves); each decode entry captured
into a CUDA graph, consecutive kernels joined by programmatic edges. A call writes the io fields
with one copy, replays the entry and copies back only token ids (or the logits the logits entry
asks for).
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.kernel_schedule import KERNEL_LAUNCH, KernelSchedule
from rvcompile.artifacts.manifest import Manifest
from rvcompile.progress import Phases
from rvcompile.runtime.executor_api import LoadOptions
from rvcompile.runtime.executors import check_limits, tma
from rvcompile.runtime.executors.cuda_driver import CudaContext, CudaError, pack_args
from rvcompile.runtime.executors.scheduled import ScheduledExecutor, schedule_kinds

STAGING_BYTES = 64 << 20
DEFAULT_SMEM = 48 << 10
HEADROOM = 256 << 20  # driver and module memory beyond the arena


def check_fits(art: Artifact, ctx: CudaContext) -> None:
    req = art.header.requirements
    name = art.path.name
    if req.get("kernel_launch") != KERNEL_LAUNCH:
        raise ArtifactError(f"{name}: built before its kernels waited on their predecessors "
                            "(programmatic dependent launch); rebuild it with this rvcompile")
    want = tuple(int(x) for x in str(req.get("compute_capability", "9.0")).split("."))
    if ctx.compute_capability != want:
        raise ArtifactError(
            f"{name}: built for compute capability {want[0]}.{want[1]} (sm_90a cubins); this "
            f"GPU ({ctx.device_name()}) is {ctx.compute_capability[0]}."
            f"{ctx.compute_capability[1]}")
    driver = ctx.driver_version()
    if driver < int(req["min_driver"]):
        raise ArtifactError(f"{name}: needs a CUDA driver for CUDA {req['min_driver'] // 1000}."
                            f"{req['min_driver'] % 1000 // 10} or newer; this one supports "
                            f"{driver // 1000}.{driver % 1000 // 10}")
    free, _ = ctx.mem_info()
    need = int(req["arena_bytes"]) + HEADROOM
    if need > free:
        raise ArtifactError(f"{name}: needs {need / 2**30:.1f} GiB of GPU memory (weights, KV "
                            f"cache, activations); {ctx.device_name()} has "
                            f"{free / 2**30:.1f} GiB free")


class CudaScheduleDevice:
    def __init__(self, art: Artifact, schedule: KernelSchedule, ctx: CudaContext,
                 phases: Phases | None = None):
        phases = phases or Phases("rvrun", "off")
        self.ctx, self.schedule = ctx, schedule
        self.stream = ctx.stream()
        t0 = time.perf_counter()
        with phases.phase("upload"):
            self.arena = ctx.alloc(schedule.arena_bytes)
            base = self.arena.ptr
            ctx.memset_range(base + schedule.weights_bytes,
                             schedule.arena_bytes - schedule.weights_bytes, self.stream)
            self._upload(art.buffer("weights"), base)
            consts = np.frombuffer(bytes(art.buffer("constants")), np.uint8)
            if consts.size:
                ctx.copy_to_device(base + schedule.constants_offset, consts.copy(), 0)
            ctx.synchronize()
        self.upload_s = time.perf_counter() - t0
        self.functions = self._load_cubins(art)
        self.entries = {name: self._prepare(e) for name, e in schedule.entries.items()}
        self.io_host = ctx.alloc_pinned(schedule.io_bytes)
        # token ids come back every step through pinned memory; logits (rare) need not
        self.out_host = ctx.alloc_pinned(max(4 * f.shape[0] for name, f in schedule.outputs.items()
                                             if name.endswith(".out_tokens")))
        with phases.phase("graph capture"):
            self.graphs = {name: ctx.capture(self.stream, lambda n=name: self._launch_all(n))
                           for name, e in schedule.entries.items() if e.graph}
            ctx.synchronize()

    def _upload(self, weights: memoryview, base: int) -> None:
        """Two pinned buffers: fill one from the mapped file while the other is copying."""
        ctx, n = self.ctx, len(weights)
        src = np.frombuffer(weights, np.uint8)
        staging = [ctx.alloc_pinned(STAGING_BYTES) for _ in range(2)]
        done = [ctx.event(), ctx.event()]
        used = [False, False]
        try:
            for i, off in enumerate(range(0, n, STAGING_BYTES)):
                k = i % 2
                if used[k]:
                    ctx.event_synchronize(done[k])
                size = min(STAGING_BYTES, n - off)
                staging[k][:size] = src[off:off + size]
                ctx.copy_to_device(base + off, staging[k][:size], self.stream)
                ctx.record(done[k], self.stream)
                used[k] = True
            ctx.stream_synchronize(self.stream)
        finally:
            for buf in staging:
                ctx.free_pinned(buf)

    def _load_cubins(self, art: Artifact) -> dict[tuple[str, str], object]:
        """The launched kernels, from cubins whose sha256 and kernel signatures
        artifacts/contents.py has checked against the schedule."""
        blob = art.buffer("cubins")
        kernels: dict[str, set[str]] = {}
        for e in self.schedule.entries.values():
            for x in e.launches:
                kernels.setdefault(x.module, set()).add(x.kernel)
        out = {}
        for module, names in kernels.items():
            c = self.schedule.cubins[module]
            mod = self.ctx.load_module(bytes(blob[c.offset:c.offset + c.size]))
            for kernel in names:
                out[(module, kernel)] = self.ctx.get_function(mod, kernel)
        return out

    def _prepare(self, entry):
        base = self.arena.ptr
        prepared = []
        for x in entry.launches:
            fn = self.functions[(x.module, x.kernel)]
            if x.smem > DEFAULT_SMEM:
                self.ctx.set_max_dynamic_smem(fn, x.smem)
            args = []
            for a in x.args:
                if a.kind == "ptr":
                    args.append(ctypes.c_uint64(base + int(a.value)))
                elif a.kind == "null":
                    args.append(ctypes.c_uint64(0))
                elif a.kind == "i32":
                    args.append(ctypes.c_int32(int(a.value)))
                elif a.kind == "i64":
                    args.append(ctypes.c_int64(int(a.value)))
                elif a.kind == "params":
                    template = self.schedule.params_templates[a.value.template]
                    block = tma.fill(self.ctx.cu, template,
                                     {role: base + off for role, off in a.value.roles.items()})
                    args.append(tma.KernelParams(block).arg)
                else:  # "f32": the schedule's schema admits no other kind
                    args.append(ctypes.c_float(float(a.value)))
            config = self.ctx.launch_config(x.grid, x.block, x.smem, self.stream)
            prepared.append((fn, config, pack_args(args)))
        return prepared

    def _launch_all(self, name: str) -> None:
        for fn, config, packed in self.entries[name]:
            self.ctx.launch_configured(fn, config, packed)

    # -- ScheduleDevice

    def write(self, offset: int, data: bytes) -> None:
        n = len(data)
        self.io_host[:n] = np.frombuffer(data, np.uint8)
        self.ctx.copy_to_device(self.arena.ptr + offset, self.io_host[:n], self.stream)

    def read(self, offset: int, nbytes: int) -> bytes:
        host = self.out_host if nbytes <= self.out_host.nbytes else np.empty(nbytes, np.uint8)
        self.ctx.copy_to_host(host[:nbytes], self.arena.ptr + offset, self.stream)
        self.ctx.stream_synchronize(self.stream)
        return host[:nbytes].tobytes()

    def run(self, entry: str) -> None:
        if entry in self.graphs:
            self.ctx.graph_launch(self.graphs[entry], self.stream)
        else:
            self._launch_all(entry)


def open_executor(art: Artifact, manifest: Manifest, opts: LoadOptions) -> ScheduledExecutor:
    """An h100 artifact on this machine (runtime.load's entry; `manifest` checked): the engine's
    limits, then this GPU, refused before any weight is read; then opts.verify's sections
    re-hashed; then the executor."""
    schedule = manifest.h100.schedule
    if opts.kv_blocks:
        raise ArtifactError(f"{art.path.name}: the KV pools of h100 artifacts are sized at "
                            "build; kv_blocks applies to XLA artifacts")
    check_limits(art, schedule_kinds(schedule), schedule.kv.block_size, schedule.max_seqs,
                 schedule.max_context, opts)
    ctx = open_context(art)
    if opts.verify:  # --no-verify: nothing to re-hash
        with opts.phases.phase("verify", total=sum(art.sections[n].size for n in opts.verify),
                               unit="B"):
            art.verify(opts.verify)
    return h100_executor(art, schedule, ctx, opts.phases)


def open_context(art: Artifact) -> CudaContext:
    """The GPU's context, once check_fits has accepted this machine."""
    try:
        ctx = CudaContext()
    except CudaError as e:
        raise ArtifactError(f"{art.path.name}: needs an NVIDIA H100 (CUDA): {e}") from None
    check_fits(art, ctx)
    return ctx


def h100_executor(art: Artifact, schedule: KernelSchedule, ctx: CudaContext,
                  phases: Phases | None = None) -> ScheduledExecutor:
    """`schedule`: the artifact's, as artifacts/manifest.py checked it (and contents.py its
    cubins); `phases`: where the upload and graph capture show (default: nowhere)."""
    t0 = time.perf_counter()
    device = CudaScheduleDevice(art, schedule, ctx, phases)
    ex = ScheduledExecutor(schedule, device)
    ex.upload_s, ex.load_s = device.upload_s, time.perf_counter() - t0
    ex.load_note = f"weights uploaded in {ex.upload_s:.2f} s; nothing compiled"
    return ex
