"""rvrun's runtime: `load(path)` checks and maps an artifact and returns a Model whose API
(generate, generate_stream, logits) is the same whatever target built it. The executor comes
from the module of the artifact's runtime kind (RUNTIMES), which alone reads that kind's part of
the manifest, checks the machine and drives its devices; this module imports none of them."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.contents import check_cubins, content_sections, read_texts
from rvcompile.artifacts.manifest import Manifest, read_manifest
from rvcompile.artifacts.signature import TrustedKey, load_trusted_key
from rvcompile.progress import Phases
from rvcompile.runtime.executor_api import Executor, LoadOptions
from rvcompile.runtime.load_report import LoadReport
from rvcompile.runtime.model import GenerationResult, Model
from rvcompile.runtime.pending_checks import PendingChecks

__all__ = ["load", "Model", "GenerationResult", "ArtifactError", "LoadReport", "RUNTIMES"]

# Runtime kind (an artifact's requirements["runtime"]) -> the module that opens its artifacts
# with `open_executor(art, manifest, LoadOptions) -> Executor`. The install extra of the same
# name brings what that module imports.
RUNTIMES = {
    "xla": "rvcompile.runtime.executors.xla",
    "h100": "rvcompile.runtime.executors.h100",
}
# The runtime kinds whose module also has `begin(art) -> Future`: what its load waits on longest
# that depends on nothing in the artifact (h100: the GPU's context), started on a thread of its
# own as soon as the file is open, alongside the checks; open_executor takes its result
# (LoadOptions.begun). Their modules are imported then, so keep them light (not jax).
BEGIN = frozenset({"h100"})


def load(path: str | os.PathLike[str], *, verify: bool = True,
         kv_blocks: dict[str, int] | None = None, max_num_seqs: int | None = None,
         max_model_len: int | None = None,
         trusted_keys: Sequence[TrustedKey | str | os.PathLike[str]] | None = None,
         trust_executables: bool = False, phases: Phases | None = None,
         gpu_memory_utilization: float | None = None,
         prefill_budget: int | None = None) -> Model:
    """Open `path` and check it, then load it on this machine. Raises ArtifactError with a
    one-line message when the file is damaged or does not fit.

    Order: with `trusted_keys` (TrustedKeys or PEM public key files), a valid signature by one
    of them, before anything past the header block and digest table is read (see
    rvcompile.artifacts.signature; the sections are then verified against the signed digests,
    so `verify=False` is refused with it); the header and the manifest's schema
    (artifacts/manifest.py); with `verify`, the sha256 of the small sections, which are then
    parsed (artifacts/contents.py): an h100 artifact's cubins against its schedule here, the
    tokenizer, generation config and chat template on a thread of their own (pending_checks.py)
    alongside everything after, which decides nothing they could change; then this machine
    (platform, devices, memory: refused before any weight is read); then, with `verify`, the
    sha256 of every other section; then the executor, which waits for the texts' checks before
    it runs anything on the device. Whatever fails meanwhile, a failed text check is the
    load's error, as when it ran first; the executor frees what it allocated.
    `kv_blocks` sizes the KV pools by kind (default: for XLA artifacts a whole sequence per
    decode slot, the only size an XLA artifact whose pools were fixed at build takes: manifest
    xla.kv.fixed_blocks, tensor-parallel builds for TPU alone; for h100 artifacts
    `gpu_memory_utilization`, a fraction of the GPU's total memory, default 0.90, holds the
    arena and the pools: runtime/executors/kv_budget.py; XLA artifacts refuse it);
    `max_num_seqs` and `max_model_len` cap the engine (default: the
    artifact's); `prefill_budget`: prompt tokens the engine prefills per step (default: one
    chunk, the artifact's max_chunk; runtime/scheduler.py).
    `trust_executables`: load the artifact's precompiled XLA executables, which XLA runs
    unchecked like a program (runtime/executors/precompiled.py), so only from a file one of
    `trusted_keys` signed; by default the StableHLO is compiled. `phases` (progress.py): what
    the load shows of its phases ("open", "check", then the executor's verify, upload, compile
    or graph capture); default: nothing. The model's `load_report` says what each cost."""
    with _collector_paused():
        return _load(path, verify=verify, kv_blocks=kv_blocks, max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len, trusted_keys=trusted_keys,
                     trust_executables=trust_executables, phases=phases,
                     gpu_memory_utilization=gpu_memory_utilization,
                     prefill_budget=prefill_budget)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a load runs, as it was after. A load makes
    mostly objects that live as long as the process (jax's import alone about 100k), which the
    collector would otherwise walk again and again: some 200 collections, 0.10-0.15 s of a
    1 s load of the default model on the CPU. Reference counting still frees whatever a load
    drops; only cycles wait for the next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load(path: str | os.PathLike[str], *, verify: bool, kv_blocks: dict[str, int] | None,
          max_num_seqs: int | None, max_model_len: int | None,
          trusted_keys: Sequence[TrustedKey | str | os.PathLike[str]] | None,
          trust_executables: bool, phases: Phases | None,
          gpu_memory_utilization: float | None, prefill_budget: int | None) -> Model:
    """load's body, with the garbage collector paused."""
    phases = phases or Phases("rvrun", "off")
    if trust_executables and trusted_keys is None:
        raise ArtifactError(f"{Path(path).name}: trust_executables needs trusted_keys: XLA runs "
                            "an executable unchecked, so only a signer you trust may supply one")
    keys = None
    if trusted_keys is not None:
        if not verify:
            raise ArtifactError(f"{Path(path).name}: trusted_keys needs verify: a signature "
                                "vouches for the sections only through their digests")
        keys = [k if isinstance(k, TrustedKey) else load_trusted_key(k) for k in trusted_keys]
    t0, cpu0 = time.perf_counter(), time.process_time()
    with phases.phase("open"):
        art = Artifact.open(Path(path), trusted_keys=keys)
    t1 = time.perf_counter()
    checks = PendingChecks()
    try:
        begun = _begin(art)
        t_begun = time.perf_counter()
        with phases.phase("check"):
            manifest = read_manifest(art)
            small = content_sections(manifest)
            if verify:
                art.verify(small)
            # the text sections parsed on a thread of their own, alongside everything after;
            # the cubins (which the executor loads) checked here, before it
            checks = PendingChecks.start(read_texts, art, manifest)
            check_cubins(art, manifest)
        t2 = time.perf_counter()
        rest = tuple(name for name in art.sections if name not in small) if verify else ()
        module = runtime_module(art, manifest)
        t3 = time.perf_counter()
        executor = module.open_executor(art, manifest, LoadOptions(
            verify=rest, kv_blocks=kv_blocks, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, trust_executables=trust_executables,
            gpu_memory_utilization=gpu_memory_utilization, phases=phases, checks=checks,
            begun=begun))
        contents = checks.result()  # the executor waited for it before running anything
        report = LoadReport(art.path.name, manifest.runtime, t1 - t0, t2 - t_begun,
                            t3 - t2 + t_begun - t1,
                            executor.load_times, time.perf_counter() - t0,
                            time.process_time() - cpu0, checks.seconds, checks.waited_s)
        return Model(art, executor, contents=contents, max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len, load_report=report,
                     prefill_budget=prefill_budget)
    except BaseException as e:
        first = checks.error()  # waited for first: its thread reads the artifact's mapping
        art.close()
        # the checks that ran alongside fail the load with their own error, whatever else
        # failed meanwhile: the error a load that ran them first would have raised
        if isinstance(e, Exception) and first is not None and first is not e:
            raise first from None
        raise


def _begin(art: Artifact) -> Future | None:
    """The `begin(art)` of the runtime `art`'s header names, if it is one of BEGIN (the header is
    checked with the manifest, after: begin uses nothing of the artifact), else None. None too
    when that runtime's dependencies are missing: runtime_module says so after the checks."""
    kind = art.header.requirements.get("runtime")
    if not isinstance(kind, str) or kind not in BEGIN:
        return None
    try:
        module = importlib.import_module(RUNTIMES[kind])
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "rvcompile":
            raise
        return None
    return module.begin(art)


def open_executor(art: Artifact, manifest: Manifest, opts: LoadOptions) -> Executor:
    """The executor of the runtime kind `art` requires (one of RUNTIMES: the manifest's schema
    admits no other), from the module RUNTIMES names (runtime_module)."""
    return runtime_module(art, manifest).open_executor(art, manifest, opts)


def runtime_module(art: Artifact, manifest: Manifest):
    """The module of RUNTIMES for `art`, imported only now: an h100 host never imports jax.
    ArtifactError when that module's dependencies are not installed, naming the extra that
    brings them."""
    kind = manifest.runtime
    try:
        module = importlib.import_module(RUNTIMES[kind])
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "rvcompile":
            raise
        raise ArtifactError(f"{art.path.name}: the {kind} runtime needs {e.name}, which is not "
                            f"installed (pip install 'rvcompile[{kind}]')") from None
    return module
