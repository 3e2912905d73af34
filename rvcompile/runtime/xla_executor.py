"""Executor for XLA-target artifacts: maps weights, deserializes the jax.export programs,
compiles them once (through a persistent cache keyed on the artifact and jax version) and runs
prefill / decode / logits over KV-cache slots. Makes no policy: Model drives it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from rvcompile.artifacts import Artifact, ArtifactError, check_platform
from rvcompile.dtypes import numpy_dtype

BACKEND_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "tpu": "tpu"}


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


def _cache_dir(art: Artifact) -> Path:
    root = Path(os.environ.get("RVCOMPILE_CACHE", Path.home() / ".cache" / "rvcompile"))
    return root / "xla" / f"{art.sections['programs'].sha256[:16]}-jax{jax.__version__}"


def check_fits(art: Artifact) -> None:
    """Refuse, before reading any weights, an artifact this machine cannot run: its platform,
    its jax version, or (where the device reports it) free device memory."""
    m = art.manifest["xla"]
    platform = BACKEND_PLATFORM.get(jax.default_backend(), jax.default_backend())
    check_platform(art.header, platform)
    if _version(jax.__version__) < _version(m["jax_version"]):
        raise ArtifactError(
            f"{art.path.name}: exported by jax {m['jax_version']}, this machine has jax "
            f"{jax.__version__}; install jax>={m['jax_version']} or rebuild here")
    need = sum(a["nbytes"] for a in m["weights"]) + sum(
        int(np.prod(c["shape"])) * numpy_dtype(c["dtype"]).itemsize
        for c in m["caches"])
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if need > free:
            raise ArtifactError(
                f"{art.path.name}: needs {need / 2**30:.1f} GiB of device memory for weights "
                f"and KV caches; {jax.devices()[0].device_kind} has {free / 2**30:.1f} GiB free")


class XlaExecutor:
    def __init__(self, art: Artifact):
        check_fits(art)
        self.art = art
        m = art.manifest["xla"]
        self.slots, self.max_context = m["slots"], m["max_context"]
        self.max_chunk, self.buckets = m["max_chunk"], tuple(m["prefill_buckets"])
        t0 = time.perf_counter()
        self.weights = {a["key"]: jax.device_put(
            art.array("weights", a["offset"], tuple(a["shape"]), numpy_dtype(a["dtype"])))
            for a in m["weights"]}
        self.caches = {c["key"]: jnp.zeros(c["shape"], numpy_dtype(c["dtype"]))
                       for c in m["caches"]}
        self.upload_s = time.perf_counter() - t0
        jax.config.update("jax_compilation_cache_dir", str(_cache_dir(art)))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        blob = art.buffer("programs")
        self.fns = {}
        for name, loc in m["programs"].items():
            exp = export.deserialize(bytearray(blob[loc["offset"]:loc["offset"] + loc["size"]]))
            self.fns[name] = jax.jit(exp.call, donate_argnums=(1,))
        self.compile_s = self._warm_up()

    def _warm_up(self) -> float:
        """Compile every entry point now (from the persistent cache when it has them) and keep
        the executables, so no request ever compiles."""
        t0 = time.perf_counter()

        def compile_entry(name: str):
            kind, size = name.rsplit("_", 1)
            args = self._dummy_args(kind, int(size))
            return fn_by_name[name].lower(self.weights, self.caches, *args).compile()

        fn_by_name = dict(self.fns)
        # XLA compiles independent programs concurrently; entry points share nothing.
        with ThreadPoolExecutor(max_workers=len(fn_by_name)) as pool:
            self.fns = dict(zip(fn_by_name, pool.map(compile_entry, fn_by_name), strict=True))
        return time.perf_counter() - t0

    def _dummy_args(self, kind: str, size: int):
        i32 = np.int32
        one = np.zeros(1, i32)
        if kind == "prefill":
            return (np.zeros((1, size), i32), i32(0), one, one, *self._sampling(1))
        if kind == "decode":
            z = np.zeros(size, i32)
            return (np.zeros((size, 1), i32), z, z, *self._sampling(size))
        return (np.zeros((1, size), i32), i32(0), one, one)

    @staticmethod
    def _sampling(n: int, temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0):
        return (np.full(n, temperature, np.float32), np.full(n, top_k, np.int32),
                np.full(n, top_p, np.float32), np.full(n, seed, np.int32),
                np.full(n, step, np.int32))

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"chunk of {n} tokens exceeds the largest prefill bucket")

    def prefill(self, slot: int, tokens: np.ndarray, start: int, sampling) -> int:
        b = self.bucket(len(tokens))
        padded = np.zeros((1, b), np.int32)
        padded[0, :len(tokens)] = tokens
        self.caches, tok = self.fns[f"prefill_{b}"](
            self.weights, self.caches, padded, np.int32(slot), np.array([start], np.int32),
            np.array([len(tokens)], np.int32), *sampling)
        return int(tok[0])

    def decode(self, tokens: np.ndarray, start: np.ndarray, active: np.ndarray,
               sampling) -> np.ndarray:
        self.caches, tok = self.fns[f"decode_{self.slots}"](
            self.weights, self.caches, tokens.reshape(self.slots, 1).astype(np.int32),
            start.astype(np.int32), active.astype(np.int32), *sampling)
        return np.asarray(tok)

    def logits(self, slot: int, tokens: np.ndarray, start: int) -> np.ndarray:
        padded = np.zeros((1, self.max_chunk), np.int32)
        padded[0, :len(tokens)] = tokens
        self.caches, lg = self.fns[f"logits_{self.max_chunk}"](
            self.weights, self.caches, padded, np.int32(slot), np.array([start], np.int32),
            np.array([len(tokens)], np.int32))
        return np.asarray(lg)[0, :len(tokens)]
