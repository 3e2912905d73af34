"""Executor for XLA-target artifacts (the executor_api contract): maps weights, allocates the
paged KV pools, deserializes and checks the jax.export programs (programs.py), compiles
them once for the chosen pool sizes (through a persistent cache keyed on the artifact and jax
version; a first start says so, with the time it expects: compile_estimate.py), or loads
executables: those `rvrun prepare` compiled on this machine (prepare.py), or, when the operator
trusts them, those precompiled at build for this machine's topology (precompiled.py). It runs
prefill / decode / logits / decode_many (the device-side decode loop) over sequences' block
tables (prefill and decode also with the sampler's extras: penalties, token masks,
log-probabilities), and, when the artifact has speculative entry points (manifest
xla.speculative), verify and draft (executor_api's speculative contract): the states verify
returns and draft reads, and the draft probabilities draft returns and verify's ratio rule
reads, stay on the device. Makes no policy: the engine drives it. It reads the manifest checked
by artifacts/manifest.py, and the programs checked against it by artifacts/xla_programs.py
before it uploads anything. A failed call that lost the KV pools raises DeviceError.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rvcompile.artifacts import Artifact, ArtifactError, check_platform
from rvcompile.artifacts.manifest import Manifest, XlaManifest, XlaMesh, XlaPool
from rvcompile.artifacts.xla_programs import xla_programs
from rvcompile.dtypes import numpy_dtype
from rvcompile.progress import Phases
from rvcompile.runtime.executor_api import (
    DeviceError,
    Drafted,
    DraftLane,
    KvKind,
    LoadOptions,
    LoadTimes,
    LoopLane,
    Sampled,
    SeqChunk,
    Verified,
)
from rvcompile.runtime.executors import check_limits
from rvcompile.runtime.executors.compile_estimate import compile_estimate
from rvcompile.runtime.executors.precompiled import choose, load_set, this_machine
from rvcompile.runtime.executors.precompiled import load as load_precompiled
from rvcompile.runtime.executors.prepared_cache import find_prepared
from rvcompile.runtime.executors.prepared_cache import prepare_here as prepare_here
from rvcompile.runtime.executors.programs import load_programs

# prepare_here: `rvrun prepare`'s entry, which runtime/prepare.py reaches through this runtime's
# module as runtime.load reaches open_executor (so an h100 host's rvrun never imports jax).

BACKEND_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "tpu": "tpu"}


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


def _cache_dir(art: Artifact) -> Path:
    root = Path(os.environ.get("RVCOMPILE_CACHE", Path.home() / ".cache" / "rvcompile"))
    return root / "xla" / f"{art.sections['programs'].digest[:16]}-jax{jax.__version__}"


def kv_kinds(xla: XlaManifest, blocks: dict[str, int] | None = None,
             fname: str = "") -> dict[str, KvKind]:
    """The artifact's KV kinds with `blocks[kind]` blocks each (default: the manifest's, one
    whole sequence per decode slot). Raises ArtifactError for a kind it lacks, and, when the
    artifact's pools are fixed at build (kv.fixed_blocks: its programs take exactly the default
    counts), for any other count."""
    blocks = blocks or {}
    unknown = set(blocks) - set(xla.kinds)
    if unknown:
        raise ArtifactError(f"{fname}: has no KV kind {sorted(unknown)[0]!r} "
                            f"(kinds: {', '.join(xla.kinds)})")
    fixed = {name: k.default_blocks for name, k in xla.kinds.items()}
    if xla.fixed_blocks and any(int(n) != fixed[name] for name, n in blocks.items()):
        raise ArtifactError(f"{fname}: kv_blocks {dict(blocks)} differ from its KV pools, fixed "
                            f"at build (manifest xla.kv.fixed_blocks) at {fixed}; load it "
                            "without kv_blocks")
    out = {}
    for name, k in xla.kinds.items():
        n = int(blocks.get(name, k.default_blocks))
        if n < 1:
            raise ArtifactError(f"{fname}: {n} {name} KV blocks; need at least 1")
        out[name] = KvKind(name, k.table_width, k.ring, k.window, n)
    return out


def _pool_bytes(p: XlaPool, kinds: dict[str, KvKind]) -> int:
    return (p.layers * kinds[p.kind].num_blocks * int(np.prod(p.block_shape))
            * numpy_dtype(p.dtype).itemsize)


def kv_bytes(xla: XlaManifest, kinds: dict[str, KvKind]) -> int:
    """Device bytes of the KV pools."""
    return sum(_pool_bytes(p, kinds) for p in xla.pools)


def check_fits(art: Artifact, xla: XlaManifest, blocks: dict[str, int] | None = None) -> None:
    """Refuse, before reading any weights, an artifact this machine cannot run: its platform,
    its jax version, or (where the device reports it) free device memory for the weights and
    KV pools of `blocks` blocks per kind."""
    platform = BACKEND_PLATFORM.get(jax.default_backend(), jax.default_backend())
    check_platform(art.header, platform)
    if _version(jax.__version__) < _version(xla.jax_version):
        raise ArtifactError(
            f"{art.path.name}: exported by jax {xla.jax_version}, this machine has jax "
            f"{jax.__version__}; install jax>={xla.jax_version} or rebuild here")
    tp = check_devices(art, xla, platform)
    kinds = kv_kinds(xla, blocks, art.path.name)
    if tp > 1:  # the largest per-device share: split arrays count 1/tp, whole ones in full
        need = _per_device_bytes(xla, kinds)
    else:
        need = sum(w.nbytes for w in xla.weights) + kv_bytes(xla, kinds)
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if need > free:
            raise ArtifactError(
                f"{art.path.name}: needs {need / 2**30:.1f} GiB of device memory for weights "
                f"and KV caches; {jax.devices()[0].device_kind} has {free / 2**30:.1f} GiB free")


def check_devices(art: Artifact, xla: XlaManifest, platform: str) -> int:
    """The artifact's tensor-parallel degree (1 without a mesh); refuses a host with fewer
    local devices. A host with more uses the first `tp`."""
    tp = xla.mesh.size if xla.mesh else 1
    have = len(jax.local_devices())
    if have < tp:
        raise ArtifactError(f"{art.path.name} needs {tp} {platform} devices (tp={tp}); this host "
                            f"has {have}")
    return tp


def _per_device_bytes(xla: XlaManifest, kinds: dict[str, KvKind]) -> int:
    specs, tp = xla.mesh.specs, xla.mesh.size

    def share(key: str, nbytes: int) -> int:
        return nbytes // tp if any(specs[key]) else nbytes

    return (sum(share(w.key, w.nbytes) for w in xla.weights)
            + sum(share(p.key, _pool_bytes(p, kinds)) for p in xla.pools))


def open_executor(art: Artifact, manifest: Manifest, opts: LoadOptions) -> XlaExecutor:
    """An XLA artifact on this machine (runtime.load's entry; `manifest` checked): platform,
    devices, memory and the engine's limits refused before anything compiles; then
    opts.verify's sections re-hashed; then, once opts.checks passed, the executor."""
    xla = manifest.xla
    if opts.gpu_memory_utilization is not None:
        raise ArtifactError(f"{art.path.name}: gpu_memory_utilization sizes the KV pools of h100 "
                            "artifacts; an XLA artifact's take kv_blocks")
    check_fits(art, xla, opts.kv_blocks)
    check_limits(art, kv_kinds(xla, opts.kv_blocks, art.path.name), xla.block_size, xla.max_seqs,
                 xla.max_context, opts)
    t0 = time.perf_counter()
    if opts.verify:  # --no-verify: nothing to re-hash
        with opts.phases.phase("verify", total=sum(art.sections[n].size for n in opts.verify),
                               unit="B"):
            art.verify(opts.verify)
    verify_s = time.perf_counter() - t0
    # runtime.load's text checks ran alongside the machine checks and the re-hash: passed
    # before XlaExecutor uploads or runs anything
    opts.checks.wait()
    ex = XlaExecutor(art, xla, opts.kv_blocks, trust_executables=opts.trust_executables,
                     phases=opts.phases)
    ex.load_times = replace(ex.load_times, verify_s=verify_s,
                            hashed_on="cpu" if "weights" in opts.verify else "")
    return ex


class TpPlacement:
    """Where the artifact's weights and KV pools live: one default device, or, for an artifact
    with a mesh (tensor parallelism), the mesh's shardings over the first `size` local devices."""

    def __init__(self, mesh: XlaMesh | None):
        self.mesh = None
        self.specs: dict[str, tuple] = {}
        if mesh:
            self.mesh = Mesh(np.array(jax.local_devices()[:mesh.size]), (mesh.axis,))
            self.specs = mesh.specs

    def _sharding(self, key: str) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*self.specs[key]))

    def weight(self, key: str, host: np.ndarray) -> jax.Array:
        """Upload a (memory-mapped) array; with a mesh, each device gets only its slice."""
        if self.mesh is None:
            return jax.device_put(host)
        return jax.make_array_from_callback(host.shape, self._sharding(key),
                                            lambda index: host[index])

    def replicated(self, host: np.ndarray) -> jax.Array:
        """A small array every device holds whole (an entry point's non-weight input)."""
        if self.mesh is None:
            return jax.device_put(host)
        return jax.device_put(host, NamedSharding(self.mesh, PartitionSpec()))

    def zeros(self, key: str, shape: tuple[int, ...], dtype) -> jax.Array:
        if self.mesh is None and jax.default_backend() == "cpu":
            # XLA:CPU's memory is the host's: zeros copied in, not a fill program compiled per
            # shape (jnp.zeros: 0.1-0.3 s of a start for the default model's 11 pools)
            return jax.device_put(np.zeros(shape, dtype))
        if self.mesh is None:
            return jnp.zeros(shape, dtype)
        return jnp.zeros(shape, dtype, device=self._sharding(key))


@dataclass(frozen=True, eq=False)
class XlaState:
    """A Verified.states entry: row `row` of lane `lane` of one verify call's hidden states."""

    rows: jax.Array  # float32 [B, R, H], on the device
    lane: int
    row: int


@dataclass(frozen=True, eq=False)
class XlaDraftProbs:
    """A Drafted.draft_probs entry: lane `lane` of one draft call's draft_probs."""

    rows: jax.Array  # float32 [B, K, V], on the device
    lane: int


class XlaExecutor:
    def __init__(self, art: Artifact, xla: XlaManifest, blocks: dict[str, int] | None = None, *,
                 trust_executables: bool = False, phases: Phases | None = None):
        """`xla`: the artifact's checked manifest part (artifacts/manifest.py); `phases`: where
        the upload and compile show (progress.py; default: nowhere)."""
        phases = phases or Phases("rvrun", "off")
        check_fits(art, xla, blocks)
        self.art = art
        self.max_seqs, self.max_context = xla.max_seqs, xla.max_context
        self.max_chunk, self.prefill_buckets = xla.max_chunk, xla.prefill_buckets
        self.block_size = xla.block_size
        self.decode_loop_steps, self.decode_loop_stops = xla.decode_loop_steps, \
            xla.decode_loop_stops
        self.kinds = kv_kinds(xla, blocks, art.path.name)
        self.sampler = xla.sampler
        self.top_logprobs = xla.sampler.top_logprobs
        self._neutral: dict[int, tuple] = {}  # lanes -> neutral mask and penalty ids, on device
        blocks = {k.name: k.num_blocks for k in self.kinds.values()}
        choice = choose(xla.precompiled, this_machine(), blocks, trusted=trust_executables)
        prepared = find_prepared(art, blocks) if choice.topology is None else None
        loads_executables = choice.topology is not None or bool(prepared and prepared.record)
        t0 = time.perf_counter()
        # What a program may call is checked only where it will be compiled: loaded
        # executables were compiled from programs that passed it (at build, or by `rvrun
        # prepare` from these very bytes: the cache names the artifact's digests).
        exported = xla_programs(art, xla) if loads_executables else load_programs(art, xla)
        programs_s = time.perf_counter() - t0
        platform = BACKEND_PLATFORM.get(jax.default_backend(), jax.default_backend())
        for name, exp in exported.items():
            if platform not in exp.platforms:
                raise ArtifactError(f"{art.path.name}: program {name} was exported for "
                                    f"{', '.join(exp.platforms)}, not {platform}")
        self.speculative = xla.speculative  # None: built without verify/draft entries
        self.max_draft_tokens = xla.speculative.draft_tokens if xla.speculative else 0
        self.has_drafter = bool(xla.speculative and xla.speculative.draft)
        # verify's draft_probs [B, K, V] (its last input but one), and zeros of that shape on
        # the device for calls where no lane has any
        self._draft_probs_shape = (tuple(exported[xla.speculative.verify].in_avals[-2].shape)
                                   if self.has_drafter else None)
        self._no_draft_probs = None
        t0 = time.perf_counter()
        self.placement = TpPlacement(xla.mesh)
        self.weights = {}
        weight_bytes = sum(w.nbytes for w in xla.weights)
        with phases.phase("upload", total=weight_bytes, unit="B") as bar:
            for w in xla.weights:
                self.weights[w.key] = self.placement.weight(w.key, art.array(
                    "weights", w.offset, w.shape, numpy_dtype(w.dtype)))
                bar.advance(w.nbytes)
            self.caches = {
                p.key: self.placement.zeros(p.key, (p.layers, self.kinds[p.kind].num_blocks,
                                                    *p.block_shape), numpy_dtype(p.dtype))
                for p in xla.pools}
        self.upload_s = time.perf_counter() - t0
        jax.config.update("jax_compilation_cache_dir", str(_cache_dir(art)))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        if loads_executables:
            t0 = time.perf_counter()
            with phases.phase("check executables"):
                if choice.topology is not None:
                    self.fns = load_precompiled(art, choice.topology, exported,
                                                jax.local_devices())
                    note = choice.note
                else:
                    try:
                        self.fns = load_set(prepared.record,
                                            prepared.cache.buffer("executables"),
                                            prepared.cache.path.name, art.manifest["xla"],
                                            exported, jax.local_devices())
                    finally:
                        prepared.cache.close()
                    note = f"{prepared.note}; nothing compiled"
            self.compile_s = 0.0  # nothing compiled
            loaded_s = time.perf_counter() - t0
            deferred = self.fns.pending
            self.load_note = (f"{note}, {len(self.fns)} checked in {loaded_s:.2f} s, each "
                              "deserialized on its first use")
            self.load_times = LoadTimes(upload_s=self.upload_s, weight_bytes=weight_bytes,
                                        programs_s=programs_s, compile_s=loaded_s,
                                        deferred=deferred)
            return
        if prepared and prepared.note:
            print(f"[rvrun] {prepared.note}", file=sys.stderr)
        if xla.precompiled or jax.default_backend() == "tpu":
            print(f"[rvrun] {choice.note}", file=sys.stderr)
        # Every entry point updates the pools in place (donated), but draft, which only reads.
        draft = self.speculative and self.speculative.draft
        self.fns = {name: jax.jit(exp.call) if name == draft
                    else jax.jit(exp.call, donate_argnums=(1,)) for name, exp in exported.items()}
        self._phases = phases  # where _warm_up shows the compile
        estimate = compile_estimate(_cache_dir(art), art.sections["programs"].size,
                                    len(exported), f"{platform} / jax {jax.__version__}")
        if estimate.first:
            phases.note(estimate.line())
        self.compile_s = self._warm_up()
        if estimate.first:
            estimate.record(self.compile_s)
        self.load_note = f"XLA compile {self.compile_s:.2f} s"
        self.load_times = LoadTimes(upload_s=self.upload_s, weight_bytes=weight_bytes,
                                    programs_s=programs_s, compile_s=self.compile_s)

    def _warm_up(self) -> float:
        """Compile every entry point now (from the persistent cache when it has them) and keep
        the executables, so no request ever compiles."""
        t0 = time.perf_counter()

        def compile_entry(name: str):
            return fn_by_name[name].lower(self.weights, self.caches,
                                          *self._example_args(name)).compile()

        fn_by_name = dict(self.fns)
        # XLA compiles independent programs concurrently; entry points share nothing.
        with (self._phases.phase("compile", total=len(fn_by_name)) as bar,
              ThreadPoolExecutor(max_workers=len(fn_by_name)) as pool):
            futures = {pool.submit(compile_entry, name): name for name in fn_by_name}
            compiled = {}
            for done in as_completed(futures):
                compiled[futures[done]] = done.result()
                bar.advance(1)
        self.fns = {name: compiled[name] for name in fn_by_name}
        return time.perf_counter() - t0

    def _example_args(self, name: str) -> tuple:
        """Arguments of entry point `name` (after weights and pools), all lanes idle."""
        w, spec = self.max_seqs, self.speculative
        if spec and name == spec.verify:
            return (*self._lane_args(w, self.max_draft_tokens + 1), *_sampling([], w),
                    *self._draft_probs([]))
        if spec and name == spec.draft:
            return (*self._lane_args(w, 1), np.zeros((w, spec.hidden_size), np.float32),
                    *_sampling([], w), np.int32(0))
        kind, size = name.rsplit("_", 1)
        batch, t = (int(size), 1) if kind.startswith("decode") else (1, int(size))
        args = self._lane_args(batch, t)
        if kind != "logits":
            args += _sampling([], batch)
        if kind in ("prefill", "decode"):
            args += self._extras([], batch)
        if kind == "decode_loop":
            args += _loop_limits([], batch, self.decode_loop_stops)
        return args

    def _lane_args(self, batch: int, t: int, lanes=()) -> tuple:
        """tokens [batch,t], start [batch], n_new [batch], tables {kind: [batch, width]}; lanes
        past len(lanes) are idle (n_new 0)."""
        tokens = np.zeros((batch, t), np.int32)
        start = np.zeros(batch, np.int32)
        n_new = np.zeros(batch, np.int32)
        tables = {k.name: np.zeros((batch, k.table_width), np.int32)
                  for k in self.kinds.values()}
        for i, c in enumerate(lanes):
            tokens[i, :len(c.tokens)] = c.tokens
            start[i], n_new[i] = c.start, len(c.tokens)
            for name, table in c.tables.items():
                tables[name][i] = table
        return tokens, start, n_new, tables

    def load_pending(self) -> list[str]:
        """Deserialize now every executable left for its first use (executor_api.load_pending);
        the entries it loaded. ArtifactError (one line) where XLA cannot load one."""
        pending = list(getattr(self.fns, "pending", ()))
        for name in pending:
            self.fns[name]  # noqa: B018 (Executables deserializes on access)
        return pending

    @property
    def deserialized_s(self) -> dict[str, float]:
        """Entry -> seconds XLA took to deserialize its executable on its first call (loaded
        executables: precompiled.Executables); empty when the programs were compiled at load."""
        return dict(getattr(self.fns, "loaded_s", {}))

    def bucket(self, n: int) -> int:
        for b in self.prefill_buckets:
            if n <= b:
                return b
        raise ValueError(f"chunk of {n} tokens exceeds the largest prefill bucket")

    def prefill(self, chunk: SeqChunk) -> int:
        return self.prefill_sampled(chunk).token

    def decode(self, lanes) -> list[int]:
        return [s.token for s in self.decode_sampled(lanes)]

    def prefill_sampled(self, chunk: SeqChunk) -> Sampled:
        b = chunk.rows or self.bucket(len(chunk.tokens))
        if b not in self.prefill_buckets or len(chunk.tokens) > b:
            raise ValueError(f"chunk of {len(chunk.tokens)} tokens in {b} rows; the prefill "
                             f"buckets are {self.prefill_buckets}")
        return self._sampled(f"prefill_{b}", [chunk], 1, b)[0]

    def decode_sampled(self, lanes: Sequence[SeqChunk]) -> list[Sampled]:
        if len(lanes) > self.max_seqs:
            raise ValueError(f"{len(lanes)} decode lanes; the programs take {self.max_seqs}")
        return self._sampled(f"decode_{self.max_seqs}", lanes, self.max_seqs, 1)

    def _sampled(self, name: str, lanes: Sequence[SeqChunk], batch: int,
                 rows: int) -> list[Sampled]:
        """Entry point `name` (prefill or decode) over the lanes; each lane's token, with its
        log-probabilities where its extras ask for them."""
        outs = self._call_all(name, *self._lane_args(batch, rows, lanes),
                              *_sampling(lanes, batch), *self._extras(lanes, batch))
        want = [c.extras.top_logprobs if c.extras else -1 for c in lanes]
        tok = np.asarray(outs[0])
        if max(want, default=-1) < 0:
            return [Sampled(int(t)) for t in tok[:len(lanes)]]
        lp, top_ids, top_lp = (np.asarray(x) for x in outs[1:4])
        return [Sampled(int(tok[i])) if k < 0 else
                Sampled(int(tok[i]), float(lp[i]),
                        tuple(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist(),
                                  strict=True)))
                for i, k in enumerate(want)]

    def _extras(self, lanes: Sequence[SeqChunk], batch: int) -> tuple:
        """mask, pen_ids, pen_counts, presence, frequency, repetition, n_top [batch] of the
        lanes' extras (targets/xla/sampler.py); lanes without them, and idle lanes, neutral.
        The mask and penalty arrays stay on the device while no lane needs them."""
        presence = np.zeros(batch, np.float32)
        frequency = np.zeros(batch, np.float32)
        repetition = np.ones(batch, np.float32)
        n_top = np.zeros(batch, np.int32)
        masks = [i for i, c in enumerate(lanes) if c.extras and c.extras.mask is not None]
        pens = [i for i, c in enumerate(lanes) if c.extras and c.extras.pen_ids is not None]
        mask, pen_ids, pen_counts = self._neutral_extras(batch)
        if masks:
            mask = np.full((batch, self.sampler.mask_words), -1, np.int32)
        if pens:
            pen_ids = np.full((batch, self.sampler.penalty_ids), -1, np.int32)
            pen_counts = np.zeros((batch, self.sampler.penalty_ids), np.int32)
        for i, c in enumerate(lanes):
            e = c.extras
            if e is None:
                continue
            n_top[i] = max(e.top_logprobs, 0)
            p = e.penalties
            presence[i], frequency[i], repetition[i] = p.presence, p.frequency, p.repetition
            if e.mask is not None:
                mask[i] = e.mask
            if e.pen_ids is not None:
                n = len(e.pen_ids)
                pen_ids[i, :n], pen_counts[i, :n] = e.pen_ids, e.pen_counts
        return mask, pen_ids, pen_counts, presence, frequency, repetition, n_top

    def _neutral_extras(self, batch: int) -> tuple:
        if batch not in self._neutral:
            host = (np.full((batch, self.sampler.mask_words), -1, np.int32),
                    np.full((batch, self.sampler.penalty_ids), -1, np.int32),
                    np.zeros((batch, self.sampler.penalty_ids), np.int32))
            self._neutral[batch] = tuple(self.placement.replicated(a) for a in host)
        return self._neutral[batch]

    def decode_many(self, lanes: Sequence[LoopLane]) -> list[list[int]]:
        if len(lanes) > self.max_seqs:
            raise ValueError(f"{len(lanes)} decode lanes; the programs take {self.max_seqs}")
        if not self.decode_loop_steps:
            raise ValueError(f"{self.art.path.name} was built without a decode loop")
        for lane in lanes:
            if not 1 <= lane.budget <= self.decode_loop_steps:
                raise ValueError(f"lane budget {lane.budget}: decode_many runs 1 to "
                                 f"{self.decode_loop_steps} steps")
        w = self.max_seqs
        chunks = [lane.chunk for lane in lanes]
        tok = self._call(f"decode_loop_{w}", *self._lane_args(w, 1, chunks),
                         *_sampling(chunks, w), *_loop_limits(lanes, w, self.decode_loop_stops))
        return [[int(t) for t in row if t >= 0] for row in tok[:len(lanes)]]

    def verify(self, lanes: Sequence[SeqChunk]) -> list[Verified]:
        if not self.max_draft_tokens:
            raise ValueError(f"{self.art.path.name} was built without speculative entry points "
                             "(--num-draft-tokens)")
        w, rows = self.max_seqs, self.max_draft_tokens + 1
        if len(lanes) > w:
            raise ValueError(f"{len(lanes)} verify lanes; the programs take {w}")
        for lane in lanes:
            if not 1 <= len(lane.tokens) <= rows:
                raise ValueError(f"verify lane of {len(lane.tokens)} tokens: a token and 0 to "
                                 f"{self.max_draft_tokens} drafts")
        out = self.fns[self.speculative.verify](
            self.weights, self.caches, *self._lane_args(w, rows, lanes), *_sampling(lanes, w),
            *self._draft_probs(lanes))
        self.caches, tok = out[0], np.asarray(out[1])
        hidden = out[2] if self.has_drafter else None
        return [Verified(tok[i, :len(c.tokens)].tolist(),
                         () if hidden is None else tuple(
                             XlaState(hidden, i, r) for r in range(len(c.tokens))))
                for i, c in enumerate(lanes)]

    def draft(self, lanes: Sequence[DraftLane], n: int) -> list[Drafted]:
        if not self.has_drafter:
            raise ValueError(f"{self.art.path.name} has no assistant drafter (--assistant)")
        w = self.max_seqs
        if len(lanes) > w:
            raise ValueError(f"{len(lanes)} draft lanes; the programs take {w}")
        if not 1 <= n <= self.max_draft_tokens:
            raise ValueError(f"{n} drafts: draft makes 1 to {self.max_draft_tokens}")
        for lane in lanes:
            if len(lane.chunk.tokens) != 1 or not isinstance(lane.state, XlaState):
                raise ValueError("a draft lane is one token and a state from this executor's "
                                 "verify")
        width = self.speculative.hidden_size
        states = [lane.state.rows[lane.state.lane, lane.state.row] for lane in lanes]
        states += [jnp.zeros(width, jnp.float32)] * (w - len(lanes))
        chunks = [lane.chunk for lane in lanes]
        tok, logits, probs, hidden = self.fns[self.speculative.draft](
            self.weights, self.caches, *self._lane_args(w, 1, chunks), jnp.stack(states),
            *_sampling(chunks, w), np.int32(n))
        tok = np.asarray(tok)
        return [Drafted(tok[i, :n].tolist(), logits[i, :n], hidden[i, :n],
                        XlaDraftProbs(probs, i)) for i in range(len(lanes))]

    def _draft_probs(self, lanes: Sequence[SeqChunk]) -> tuple:
        """verify's draft_probs [B, K, V] and draft_lane [B] (an artifact with a drafter): the
        draft call's array the lanes' draft_probs point into (stacked when they come from
        several calls) and each lane's row in it; -1 for a lane without (exact match)."""
        if not self.has_drafter:
            return ()
        w = self.max_seqs
        where = np.full(w, -1, np.int32)
        got = [(i, c.draft_probs) for i, c in enumerate(lanes) if c.draft_probs is not None]
        for _, d in got:
            if not isinstance(d, XlaDraftProbs):
                raise ValueError("a verify lane's draft_probs come from this executor's draft")
        sources = {id(d.rows): d.rows for _, d in got}
        if not sources:
            if self._no_draft_probs is None:
                self._no_draft_probs = self.placement.replicated(
                    np.zeros(self._draft_probs_shape, np.float32))
            return self._no_draft_probs, where
        if len(sources) == 1:
            for i, d in got:
                where[i] = d.lane
            return next(iter(sources.values())), where
        rows = [d.rows[d.lane] for _, d in got]
        for j, (i, _) in enumerate(got):
            where[i] = j
        return jnp.stack(rows + [jnp.zeros_like(rows[0])] * (w - len(rows))), where

    def logits(self, chunk: SeqChunk) -> np.ndarray:
        c = self.max_chunk
        lg = self._call(f"logits_{c}", *self._lane_args(1, c, [chunk]))
        return lg[0, :len(chunk.tokens)]

    def _call(self, name: str, *args) -> np.ndarray:
        """Entry point `name` over the KV pools, which it takes (donated) and gives back; its
        first result on the host. A failure that took the pools with it (deleted, or results
        of a failed computation) raises DeviceError: no later call could run."""
        return np.asarray(self._call_all(name, *args)[0])

    def _call_all(self, name: str, *args) -> list:
        """_call's, but every result after the pools, left on the device."""
        try:
            self.caches, *out = self.fns[name](self.weights, self.caches, *args)
            return out
        except Exception as e:
            if _pools_lost(self.caches):
                raise DeviceError(f"{name} failed and took the KV pools with it: "
                                  f"{type(e).__name__}: {e}") from e
            raise


def _pools_lost(caches: dict[str, jax.Array]) -> bool:
    if any(c.is_deleted() for c in caches.values()):
        return True
    try:
        jax.block_until_ready(list(caches.values()))
    except Exception:  # the arrays hold a failed computation's error
        return True
    return False


def _loop_limits(lanes: Sequence[LoopLane], batch: int,
                 stops: int) -> tuple[np.ndarray, np.ndarray]:
    """stop_ids [batch, stops] (-1 padded), budget [batch]; idle lanes budget 0."""
    stop_ids = np.full((batch, stops), -1, np.int32)
    budget = np.zeros(batch, np.int32)
    for i, lane in enumerate(lanes):
        if len(lane.stop_ids) > stops:
            raise ValueError(f"{len(lane.stop_ids)} stop token ids; decode_loop takes at most "
                             f"{stops}")
        stop_ids[i, :len(lane.stop_ids)] = sorted(lane.stop_ids)
        budget[i] = lane.budget
    return stop_ids, budget


def _sampling(lanes, batch: int) -> tuple[np.ndarray, ...]:
    """temperature, top_k, top_p, seed, step [batch]; idle lanes greedy."""
    temperature = np.zeros(batch, np.float32)
    top_k = np.zeros(batch, np.int32)
    top_p = np.ones(batch, np.float32)
    seed = np.zeros(batch, np.int32)
    step = np.zeros(batch, np.int32)
    for i, c in enumerate(lanes):
        s = c.sampling
        temperature[i], top_k[i], top_p[i], seed[i], step[i] = (
            s.temperature, s.top_k, s.top_p, s.seed, c.step)
    return temperature, top_k, top_p, seed, step
