"""Executor for h100-fp8 artifacts: cuda-python's driver API and numpy only (no torch, JAX, nvcc,
NVRTC or Triton). Nothing compiles at load.

`check_fits` refuses, before any allocation, an artifact built before its kernels opened with
griddepcontrol.wait (header requirement kernel_launch), and a machine whose GPU is not compute
capability 9.0, whose driver is older than the cubins need, or whose free memory is short of the
arena's fixed part. The KV pools' block counts are chosen then (kv_budget.py: a share of the GPU's
memory, or as asked), before any weight is read. Then: one allocation, the arena's fixed part and
the pools after it (the schedule's pool_offsets); constants uploaded, the rest zeroed; the weights
read from the file once and copied through pinned staging buffers on several streams
(artifacts/stream.py, cuda_upload.py), on a background thread, and checked: on the GPU once
uploaded when the artifact has the piece hash and small pieces (manifest h100.piece_hash,
device_hash.py: the sha256 kernel over every piece, the digests compared with the artifact's), else
each piece hashed on the CPU as it streams (an artifact built before the piece hash, with 256 MiB
pieces); meanwhile this thread loads the cubins (their sha256 and every launch's kernel, argument
sizes and block checked by artifacts/contents.py before), builds every launch's argument block and
launch configuration (programmatic stream serialization on: cuda_driver.py) once, completes a
parameter block for the arena's addresses (tma.py: TMA descriptors encoded, pointers written; the
graphs capture those bytes, and the arena never moves), captures each decode, prefill and verify
entry into a CUDA graph (consecutive kernels joined by programmatic edges), and each sampled
entry's two parts (before the sampler, and the sampler: kernel_schedule.KernelSchedule.part) into
graphs of their own (run_part, for the engine's late grammar masks). runtime.load's text checks run
alongside all of this on a thread of their own (runtime/pending_checks.py). Nothing runs on the
device but the piece hash, not even a graph upload, before every weight piece checked out and those
checks passed; then the graphs are uploaded. A mismatch fails the load with the container's
one-line error (whichever side hashed), a failed check with its own (the upload stops at its next
chunk), the arena and buffers freed. A call writes the io fields with one copy, replays the entry
and copies back only token ids (or the logits the logits entry asks for). `write` and `run`
(`run_part`) return without waiting for the device; `read` waits for everything before it;
`read_later` (the progressive decode loop's token reads) queues its copy into one of two pinned
slots behind what ran, with an event, and waits only for that event when its bytes are asked for.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.kernel_schedule import ENTRY_PARTS, KERNEL_LAUNCH, KernelSchedule
from rvcompile.artifacts.manifest import Manifest, PieceHash
from rvcompile.artifacts.stream import StreamStopped, stream_section
from rvcompile.progress import Phases
from rvcompile.runtime.executor_api import LoadOptions, LoadTimes
from rvcompile.runtime.executors import check_limits, kv_budget, tma
from rvcompile.runtime.executors.cuda_driver import CudaContext, CudaError, pack_args
from rvcompile.runtime.executors.cuda_upload import CudaUploadSink
from rvcompile.runtime.executors.device_hash import (
    check_on_device,
    digest_bytes,
    hashes_on_device,
)
from rvcompile.runtime.executors.kv_budget import HEADROOM
from rvcompile.runtime.executors.scheduled import ScheduledExecutor, schedule_kinds
from rvcompile.runtime.pending_checks import PendingChecks

MAX_STREAM_WORKERS = 16  # threads reading and hashing the weights: enough for PCIe Gen5
DEFAULT_SMEM = 48 << 10
PINNED_STEP = 1 << 20  # the io copy's pinned buffer grows in these steps (sampled calls)


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
        raise ArtifactError(f"{name}: needs {need / 2**30:.1f} GiB of GPU memory (weights, "
                            f"activations) before its KV cache; {ctx.device_name()} has "
                            f"{free / 2**30:.1f} GiB free")


def stream_workers() -> int:
    """Threads that read and hash the weights: one per core this process may use (hashlib
    and preadv release the GIL), at most MAX_STREAM_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_STREAM_WORKERS))


def default_blocks(schedule: KernelSchedule, ctx: CudaContext, name: str) -> dict[str, int]:
    """Each KV kind's blocks by kv_budget's default share of this GPU's memory."""
    free, total = ctx.mem_info()
    return kv_budget.choose_blocks(schedule, free=free, total=total, name=name)


class CudaScheduleDevice:
    def __init__(self, art: Artifact, schedule: KernelSchedule, ctx: CudaContext,
                 phases: Phases | None = None, *, check_weights: bool = False,
                 kv_blocks: dict[str, int] | None = None,
                 checks: PendingChecks | None = None, piece_hash: PieceHash | None = None):
        """Allocates, uploads and prepares everything; `check_weights`: check every piece of
        the weights (runtime.load's verify), failing before anything runs: with `piece_hash`
        (the manifest's) and pieces small enough (device_hash.hashes_on_device) on the GPU once
        uploaded, else on the CPU as they stream;
        `kv_blocks`: each KV kind's pool blocks (default: default_blocks); `checks`:
        runtime.load's checks running alongside, waited for before anything runs (their
        failure stops the upload at its next chunk). On any failure what was allocated is
        freed before the error propagates."""
        phases = phases or Phases("rvrun", "off")
        self.checks = checks or PendingChecks()
        self.ctx, self.schedule = ctx, schedule
        self.kv_blocks = dict(kv_blocks or default_blocks(schedule, ctx, art.path.name))
        try:
            self.pool_offsets, self.nbytes = schedule.pool_offsets(self.kv_blocks)
        except ValueError as e:
            raise ArtifactError(f"{art.path.name}: {e}") from None
        self.stream = ctx.stream()
        self.arena = self.io_host = self.out_host = None
        # read_later's two pinned slots and their events, and how many reads were made
        self.later_host: list[np.ndarray] = []
        self.later_events: list = []
        self.later_made = 0
        self.modules: list = []  # loaded cubins, unloaded again if the load fails
        self.graphs: dict[str | tuple[str, str], object] = {}  # by entry, or (entry, part)
        try:
            self._load(art, phases, check_weights, piece_hash)
        except BaseException:
            self._free()
            raise

    def _load(self, art: Artifact, phases: Phases, check_weights: bool,
              piece_hash: PieceHash | None) -> None:
        """The weights stream to the device (artifacts/stream.py through cuda_upload.py) on a
        background thread, which then checks them on the GPU (device_hash.py) when it can,
        while this one loads the cubins, prepares the launches and captures the graphs: capture
        needs the arena's addresses, not its contents. Nothing runs on the device but the piece
        hash (not even a graph upload) until the background thread returned, i.e. every piece
        checked out, and runtime.load's checks passed."""
        ctx, schedule = self.ctx, self.schedule
        clock = time.perf_counter
        t_start = clock()
        self.arena = ctx.alloc(self.nbytes)
        base = self.arena.ptr
        section = art.sections["weights"]
        weights = section.size
        on_gpu = (check_weights and piece_hash is not None and hashes_on_device(section)
                  and digest_bytes(section) > 0)
        ctx.memset_range(base + schedule.weights_bytes, self.nbytes - schedule.weights_bytes,
                         self.stream)
        consts = np.frombuffer(bytes(art.buffer("constants")), np.uint8)
        if consts.size:
            ctx.copy_to_device(base + schedule.constants_offset, consts.copy(), self.stream)
        ctx.stream_synchronize(self.stream)  # before the capture starts on this stream
        workers = stream_workers()
        sink = CudaUploadSink(ctx, base, workers)
        times: dict[str, float] = {"arena_s": clock() - t_start}
        halt = threading.Event()  # this thread failed: the stream stops at its next chunk
        # the piece hash's kernel, digests and stream (on_gpu), made and freed on this thread:
        # not on the background one while this one captures
        hash_kernel = digests = hash_stream = None

        def stop() -> bool:
            return halt.is_set() or self.checks.failed()

        def upload_and_check():
            """(the stream's stats, seconds of the check on the GPU)"""
            stats = stream_section(art, "weights", sink, workers=workers,
                                   check=check_weights and not on_gpu, stop=stop)
            if not on_gpu:
                return stats, 0.0
            t0 = clock()
            ctx.make_current()
            check_on_device(ctx, hash_kernel, section, base, digests, hash_stream,
                            art.path.name)
            return stats, clock() - t0

        try:
            if on_gpu:
                hash_kernel = self._load_kernel(art, piece_hash.module, piece_hash.kernel)
                digests = ctx.alloc(digest_bytes(section))
                hash_stream = ctx.stream(non_blocking=True)  # copies' and capture's apart
            with (phases.phase("upload", total=weights, unit="B") as bar,
                  ThreadPoolExecutor(1, thread_name_prefix="rvrun-upload") as background):
                t_stream = clock()
                streaming = background.submit(upload_and_check)
                try:
                    t0 = clock()
                    self.functions = self._load_cubins(art)
                    self.entries = {name: self._prepare(e)
                                    for name, e in schedule.entries.items()}
                    self.io_host = ctx.alloc_pinned(schedule.io_bytes)
                    # token ids (with a drafter, verify's states and the tokens after them:
                    # one read) come back every step through pinned memory; logits and a
                    # draft's states (rare) need not
                    self.out_host = ctx.alloc_pinned(max(
                        f.nbytes + (4 * f.shape[0] if name.endswith(".states") else 0)
                        for name, f in schedule.outputs.items()
                        if name.endswith((".out_tokens", ".tokens"))
                        or (name.endswith(".states") and not name.startswith("draft_"))))
                    history = schedule.io.get("loop_tokens")
                    if history is not None:  # the decode loop's token reads (read_later)
                        self.later_host = [ctx.alloc_pinned(history.nbytes) for _ in range(2)]
                        self.later_events = [ctx.event_without_timing() for _ in range(2)]
                    t1 = clock()
                    for name, e in schedule.entries.items():
                        if self.checks.failed():  # the upload stops too: fail now
                            break
                        if e.graph:
                            self.graphs[name] = ctx.capture(
                                self.stream, lambda n=name: self._launch_all(n),
                                thread_local=True)
                        if e.graph and schedule.sampler_split(name) is not None:
                            self._capture_parts(name)
                    times.update(cubin_load_s=t1 - t0, graph_capture_s=clock() - t1)
                except BaseException:
                    halt.set()  # the stream stops at its next chunk
                    try:
                        streaming.result()  # a corrupt piece found meanwhile wins, as before
                    except StreamStopped:
                        pass  # stopped for this error
                    raise
                # raises a mismatch, or StreamStopped: checks failed
                stats, gpu_hash_s = streaming.result()
                t_streamed = clock()
                self.checks.wait()  # raises their error; the stream stopped early then
                times["checks_during_upload_s"] = max(
                    0.0, min(self.checks.ended_at, t_streamed) - t_stream)
                bar.advance(weights)
                bar.info = (f"{weights / 1e9:.2f} GB at {stats.gb_s:.1f} GB/s"
                            + (", sha256 checked on the GPU" if on_gpu
                               else ", sha256 checked" if check_weights else ""))
            t2 = clock()
            for g in self.graphs.values():  # ready to launch; nothing runs yet
                ctx.graph_upload(g, self.stream)
            ctx.stream_synchronize(self.stream)
            t3 = clock()
        finally:
            sink.close()
            if hash_stream is not None:
                ctx.stream_synchronize(hash_stream)
                ctx.destroy_stream(hash_stream)
            if digests is not None:
                ctx.free(digests)
        ctx.synchronize()
        times.update(warm_up_s=t3 - t2, finish_s=clock() - t3)
        self.upload_s = clock() - t_start
        self.stream_stats = stats
        self.load_times = LoadTimes(
            upload_s=stats.wall_s, weight_bytes=weights, streamed=True,
            hashed_on="gpu" if on_gpu else "cpu" if check_weights else "",
            gpu_hash_s=gpu_hash_s, threads=stats.workers, read_s=stats.read_s,
            hash_s=stats.hash_s, overlapped=("cubin load", "graph capture"), **times)

    def _free(self) -> None:
        """After a failed load: the graphs, modules, arena and pinned buffers go back (a failed
        call may have left the context unusable; what cannot be freed then goes with the
        process)."""
        for g in self.graphs.values():
            self.ctx.destroy_graph(g)
        for mod in self.modules:
            self.ctx.unload_module(mod)
        for host in (self.io_host, self.out_host, *self.later_host):
            if host is not None:
                self.ctx.free_pinned(host)
        for ev in self.later_events:
            self.ctx.destroy_event(ev)
        if self.arena is not None:
            self.ctx.free(self.arena)
        self.arena = self.io_host = self.out_host = None
        self.later_host, self.later_events = [], []
        self.graphs, self.modules = {}, []

    def _load_module(self, blob, module: str):
        """Module `module` of the cubins section `blob` (checked by artifacts/contents.py),
        kept in self.modules to be unloaded with the others."""
        c = self.schedule.cubins[module]
        mod = self.ctx.load_module(bytes(blob[c.offset:c.offset + c.size]))
        self.modules.append(mod)
        return mod

    def _load_kernel(self, art: Artifact, module: str, kernel: str):
        """One kernel of the artifact's cubins (the piece hash: no launch names it)."""
        return self.ctx.get_function(self._load_module(art.buffer("cubins"), module), kernel)

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
            mod = self._load_module(blob, module)
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
                elif a.kind == "pool":
                    args.append(ctypes.c_uint64(base + self.pool_offsets[a.value]))
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

    def _capture_parts(self, name: str) -> None:
        """A sampled entry's two parts (run_part) as graphs of their own, beside its whole one:
        the whole one keeps the programmatic edge between the head and the sampler."""
        for part in ENTRY_PARTS:
            self.graphs[(name, part)] = self.ctx.capture(
                self.stream, lambda p=part: self._launch_part(name, p), thread_local=True)

    def _launch_part(self, name: str, part: str) -> None:
        n = len(self.schedule.part(name, part))  # raises for an entry or part without a split
        prepared = self.entries[name]
        for fn, config, packed in prepared[:n] if part == "forward" else prepared[-n:]:
            self.ctx.launch_configured(fn, config, packed)

    # -- ScheduleDevice

    def write(self, offset: int, data: bytes) -> None:
        """Copy `data` to arena `offset`, in the io region or after it (sample_io), without
        waiting: it is staged in pinned memory at its place relative to the io region, so a
        write between the two parts of a split entry (run_part) never overwrites bytes that
        the copy before it may still be reading."""
        at = offset - self.schedule.io_offset
        if at < 0:
            raise ValueError(f"a write at arena byte {offset}, before the io region")
        end = at + len(data)
        if end > self.io_host.nbytes:  # a sampled call's extras: the pinned buffer grows once
            # on the engine's thread, not the one that loaded the model: launches and copies
            # name their stream, but host allocations need the context bound to the thread
            self.ctx.make_current()
            self.ctx.stream_synchronize(self.stream)  # no copy still reads the old one
            self.ctx.free_pinned(self.io_host)
            self.io_host = None
            self.io_host = self.ctx.alloc_pinned(-(-end // PINNED_STEP) * PINNED_STEP)
        self.io_host[at:end] = np.frombuffer(data, np.uint8)
        self.ctx.copy_to_device(self.arena.ptr + offset, self.io_host[at:end], self.stream)

    def read(self, offset: int, nbytes: int) -> bytes:
        host = self.out_host if nbytes <= self.out_host.nbytes else np.empty(nbytes, np.uint8)
        self.ctx.copy_to_host(host[:nbytes], self.arena.ptr + offset, self.stream)
        self.ctx.stream_synchronize(self.stream)
        return host[:nbytes].tobytes()

    def read_later(self, offset: int, nbytes: int):
        """Queue a copy of `nbytes` at arena `offset` behind everything launched so far and
        return a function that waits for that copy alone and returns the bytes (scheduled.py's
        progressive decode loop). Two slots take turns: a read's bytes must be fetched before
        the next read but one is made (RuntimeError otherwise)."""
        if not self.later_host or nbytes > self.later_host[0].nbytes:
            raise ValueError(f"read_later of {nbytes} bytes: its slots hold "
                             f"{self.later_host[0].nbytes if self.later_host else 0}")
        made = self.later_made
        self.later_made += 1
        host, ev = self.later_host[made % 2], self.later_events[made % 2]
        self.ctx.copy_to_host(host[:nbytes], self.arena.ptr + offset, self.stream)
        self.ctx.record(ev, self.stream)

        def fetch() -> bytes:
            if self.later_made - made > 2:
                raise RuntimeError("read_later: a read's slot was reused before it was fetched")
            self.ctx.event_synchronize(ev)
            return host[:nbytes].tobytes()
        return fetch

    def run(self, entry: str) -> None:
        """Launch the entry (its graph) and return at once: the next read waits for it."""
        if entry in self.graphs:
            self.ctx.graph_launch(self.graphs[entry], self.stream)
        else:
            self._launch_all(entry)

    def run_part(self, entry: str, part: str) -> None:
        """Launch one part of a sampled entry (kernel_schedule.KernelSchedule.part), its graph
        where the entry has one, and return at once, as run does."""
        graph = self.graphs.get((entry, part))
        if graph is not None:
            self.ctx.graph_launch(graph, self.stream)
        else:
            self._launch_part(entry, part)


def open_executor(art: Artifact, manifest: Manifest, opts: LoadOptions) -> ScheduledExecutor:
    """An h100 artifact on this machine (runtime.load's entry; `manifest` checked): the engine's
    limits, then this GPU, refused before any weight is read; then opts.verify's sections but
    the weights re-hashed; then the executor, which hashes the weights as it uploads them
    (when opts.verify has them) and runs nothing before they checked out."""
    schedule = manifest.h100.schedule
    tp = manifest.h100.tensor_parallel
    if tp is not None:
        raise ArtifactError(f"{art.path.name}: built with --tp {tp.ranks} (one kernel schedule "
                            f"per GPU, with collectives); this runtime drives one GPU: rebuild "
                            "with --tp 1")
    t0 = time.perf_counter()
    ctx = open_context(art, opts.begun)
    context_s = time.perf_counter() - t0
    free, total = ctx.mem_info()
    blocks = kv_budget.choose_blocks(
        schedule, free=free, total=total, name=art.path.name,
        utilization=opts.gpu_memory_utilization, kv_blocks=opts.kv_blocks,
        max_num_seqs=opts.max_num_seqs, max_model_len=opts.max_model_len)
    check_limits(art, schedule_kinds(schedule, blocks), schedule.kv.block_size,
                 schedule.max_seqs, schedule.max_context, opts)
    before = tuple(n for n in opts.verify if n != "weights")
    t0 = time.perf_counter()
    if before:
        with opts.phases.phase("verify", total=sum(art.sections[n].size for n in before),
                               unit="B"):
            art.verify(before)
    verify_s = time.perf_counter() - t0
    ex = h100_executor(art, schedule, ctx, opts.phases, check_weights="weights" in opts.verify,
                       kv_blocks=blocks, checks=opts.checks, piece_hash=manifest.h100.piece_hash)
    opened_s = opts.begun.result()[1] if opts.begun is not None else context_s
    ex.load_times = replace(ex.load_times, context_s=context_s, context_open_s=opened_s,
                            verify_s=verify_s)
    return ex


def begin(art: Artifact) -> Future:
    """The GPU's context opened on a thread of its own, which runtime.load starts as soon as
    the file is open: cuInit and the primary context take a while in the driver, which releases
    the GIL, so the manifest and the cubins are checked meanwhile. Nothing about the artifact
    is used, and nothing runs on the device. Its result, (context, seconds), is open_executor's
    (opts.begun), whose open_context raises its error there, after those checks."""

    def timed() -> tuple[CudaContext, float]:
        t0 = time.perf_counter()
        return CudaContext(), time.perf_counter() - t0

    pool = ThreadPoolExecutor(1, thread_name_prefix="rvrun-context")
    future = pool.submit(timed)
    pool.shutdown(wait=False)  # its one thread ends with the context open
    return future


def open_context(art: Artifact, begun: Future | None = None) -> CudaContext:
    """The GPU's context (`begun`'s, or opened now), once check_fits has accepted this
    machine, current on the calling thread."""
    try:
        ctx = begun.result()[0] if begun is not None else CudaContext()
    except CudaError as e:
        raise ArtifactError(f"{art.path.name}: needs an NVIDIA H100 (CUDA): {e}") from None
    ctx.make_current()  # begun's was made current on its own thread
    check_fits(art, ctx)
    return ctx


def h100_executor(art: Artifact, schedule: KernelSchedule, ctx: CudaContext,
                  phases: Phases | None = None, *, check_weights: bool = False,
                  kv_blocks: dict[str, int] | None = None,
                  checks: PendingChecks | None = None,
                  piece_hash: PieceHash | None = None) -> ScheduledExecutor:
    """`schedule`: the artifact's, as artifacts/manifest.py checked it (and contents.py its
    cubins); `phases`: where the upload and graph capture show (default: nowhere);
    `check_weights`: check the weights' pieces (on the GPU with `piece_hash`, the manifest's,
    when their pieces are small enough; else on the CPU as they stream); `kv_blocks`: the
    pools' blocks by kind; `checks`: runtime.load's checks still running
    (CudaScheduleDevice)."""
    t0 = time.perf_counter()
    device = CudaScheduleDevice(art, schedule, ctx, phases, check_weights=check_weights,
                                kv_blocks=kv_blocks, checks=checks, piece_hash=piece_hash)
    ex = ScheduledExecutor(schedule, device)
    ex.upload_s, ex.load_s = device.upload_s, time.perf_counter() - t0
    ex.load_times = device.load_times
    stats, times = device.stream_stats, device.load_times
    ex.load_note = (f"weights {stats.bytes / 1e9:.2f} GB uploaded in {stats.wall_s:.2f} s "
                    f"({stats.gb_s:.1f} GB/s"
                    + (f", sha256 checked on the GPU in {times.gpu_hash_s:.3f} s"
                       if times.hashed_on == "gpu"
                       else ", sha256 checked while streaming" if times.checked else "")
                    + "); nothing compiled; KV pools "
                    + ", ".join(f"{n} {k}" for k, n in device.kv_blocks.items())
                    + f" blocks ({(device.nbytes - schedule.arena_bytes) / 2**30:.2f} GiB)")
    return ex
