"""The CPU side of `runtime.load`'s check phase on a realistic manifest, without its weights
(issue 18): a 31B artifact is 32 GB, but what `check` reads is its manifest (the kernel
schedule: every launch of every entry), its small sections (tokenizer, generation config, chat
template) and its cubins, all of which the build makes before it reads a weight. This script
makes them as `rvcompile build PRESET --random-weights` would (the IR lowered without weights,
the cubins from nvcc's cache), then times what `runtime.load` does with them before the GPU:
the manifest's JSON parsed (Artifact.open), the manifest checked (read_manifest), the small
sections hashed (Artifact.verify), the cubins checked against the schedule (check_cubins): the
part of `check` that runs before the GPU is touched; then the text sections parsed (read_texts:
tokenizer and its vocabulary, generation config, template), which `runtime.load` runs on a
thread of its own alongside the executor's load; each best of `--runs` in CPU seconds
(`--wall`: wall seconds); `--profile` adds cProfile's top entries.

`--alongside-gib N`: what running the text check alongside costs a weight stream on this
machine: an N GiB section (random bytes, in a temporary file, read from the page cache) streamed
and hashed as the h100 load streams its weights (artifacts/stream.py, one worker per core, 16 MiB
chunks, a sink that copies nothing), alone, then the text check alone, then both at once (wall
seconds, each of `--runs`). The `tokenizers` parser holds Python's GIL, so the stream's threads
stall while it runs: "both" near "stream + check" means no overlap.

    python benchmarks/load_check.py [--preset gemma-4-31B] [--target h100-fp8] [--runs 3]
        [--profile 25] [--wall] [--alongside-gib 1]
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from rvcompile import __version__
from rvcompile.artifacts import Artifact, ArtifactWriter
from rvcompile.artifacts.contents import parse_cubins, parse_texts
from rvcompile.artifacts.format import ArtifactHeader, canonical_json
from rvcompile.artifacts.manifest import parse_manifest
from rvcompile.artifacts.stream import stream_section
from rvcompile.build import lower_model, prepare
from rvcompile.progress import Phases
from rvcompile.sources.checkpoint import load_model_source
from rvcompile.targets.api import BuildOptions


def make(preset: str, target: str) -> tuple[ArtifactHeader, bytes, dict[str, bytes], dict]:
    """(header, manifest JSON text, small sections, section sizes) as the build makes them."""
    tgt, opts = prepare(BuildOptions(target))
    source = load_model_source(preset, random_weights=True)
    ir = lower_model(source, opts, log=lambda s: None)
    lowered = tgt.lower(ir, opts, lambda s: None, Phases("bench", "off"))
    header = ArtifactHeader(compiler_version=__version__, target=target,
                            platforms=lowered.platforms, requirements=lowered.requirements)
    sections = {
        **lowered.sections,
        "tokenizer": source.tokenizer_json.encode(),
        "generation_config": json.dumps(source.generation_config, sort_keys=True).encode(),
        "chat_template": (source.chat_template or "").encode(),
    }
    manifest = {
        "model": {"name": source.config.name, "config": source.config.to_hf_dict(),
                  "origin": source.origin},
        "target": target, "compiler_version": __version__, "passes": list(ir.notes),
        **lowered.manifest, "random_weights": {"seed": 0},
    }
    sizes = {"weights": lowered.weights_nbytes, **{n: len(d) for n, d in sections.items()}}
    return header, canonical_json(manifest), sections, sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gemma-4-31B")
    ap.add_argument("--target", default="h100-fp8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N entries")
    ap.add_argument("--alongside-gib", type=float, default=0,
                    help="also time the text check alongside a stream of this many GiB")
    ap.add_argument("--wall", action="store_true",
                    help="wall seconds (default: this process's CPU seconds, which other work on "
                         "a shared machine disturbs less; the check runs on one thread)")
    args = ap.parse_args()
    clock = time.perf_counter if args.wall else time.process_time
    header, text, sections, sizes = make(args.preset, args.target)
    small = ("tokenizer", "generation_config", "chat_template", "cubins")

    def once() -> dict[str, float]:
        t = [clock()]
        doc = json.loads(text)
        t.append(clock())
        manifest = parse_manifest(header, doc, sizes, "bench.rvp")
        t.append(clock())
        for name in small:
            hashlib.sha256(sections[name]).digest()
        t.append(clock())
        parse_cubins(manifest, sections["cubins"], "bench.rvp")
        t.append(clock())
        parse_texts(manifest, sections, "bench.rvp")
        t.append(clock())
        names = ("manifest json", "read_manifest", "verify small", "check_cubins",
                 "read_texts (alongside)")
        return {n: b - a for n, a, b in zip(names, t[:-1], t[1:], strict=True)}

    runs = [once() for _ in range(args.runs)]
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    launches = sum(len(e.launches) for e in parse_manifest(
        header, json.loads(text), sizes, "bench.rvp").h100.schedule.entries.values())
    print(f"{args.preset} {args.target}: manifest {len(text) / 1e6:.1f} MB, {launches} launches, "
          f"cubins {len(sections['cubins']) / 1e6:.1f} MB, tokenizer "
          f"{len(sections['tokenizer']) / 1e6:.1f} MB")
    first = sum(v for k, v in best.items() if "alongside" not in k)
    print(" | ".join(f"{k} {v:.3f}" for k, v in best.items())
          + f" | total {sum(best.values()):.3f} s, before the GPU {first:.3f} s "
          f"({'wall' if args.wall else 'CPU'}, best of {args.runs})")
    if args.profile:
        prof = cProfile.Profile(clock)
        prof.runcall(once)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    if args.alongside_gib:
        manifest = parse_manifest(header, json.loads(text), sizes, "bench.rvp")
        alongside(manifest, sections, args.alongside_gib, args.runs)


class _NoCopySink:
    """artifacts/stream.py's Sink that delivers nothing: the stream is its reads and hashes."""

    chunk_bytes = 16 << 20

    def __init__(self, workers: int):
        self.buffers = [[bytearray(self.chunk_bytes) for _ in range(2)] for _ in range(workers)]

    def staging(self, worker: int, k: int) -> memoryview:
        return memoryview(self.buffers[worker][k])

    def reusable(self, worker: int, k: int) -> None:
        pass

    def deliver(self, worker: int, k: int, offset: int, size: int) -> None:
        pass

    def finish(self) -> None:
        pass


def alongside(manifest, sections: dict[str, bytes], gib: float, runs: int) -> None:
    """--alongside-gib: the stream alone, the text check alone, both at once (wall seconds)."""
    workers = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stream.rvp"
        data = np.random.default_rng(0).integers(0, 256, int(gib * 2**30), dtype=np.uint8)
        with ArtifactWriter(path, ArtifactHeader("0", "h100", ("cuda",)),
                            piece_size=256 << 20) as w:
            w.add("weights", data)
            w.commit({})
        del data

        def check() -> float:
            t0 = time.perf_counter()
            parse_texts(manifest, sections, "bench.rvp")
            return time.perf_counter() - t0

        with Artifact.open(path) as art:
            stream_section(art, "weights", _NoCopySink(workers), workers=workers)  # cached
            for _ in range(runs):
                t0 = time.perf_counter()
                stream_section(art, "weights", _NoCopySink(workers), workers=workers)
                alone = time.perf_counter() - t0
                check_s = check()
                with ThreadPoolExecutor(1) as pool:
                    t0 = time.perf_counter()
                    checking = pool.submit(check)
                    stats = stream_section(art, "weights", _NoCopySink(workers),
                                           workers=workers)
                    both_check = checking.result()
                    both = time.perf_counter() - t0
                print(f"{gib:g} GiB stream ({workers} workers) alone {alone:.3f} s | text check "
                      f"alone {check_s:.3f} s | sum {alone + check_s:.3f} s | both at once "
                      f"{both:.3f} s (stream {stats.wall_s:.3f}, check {both_check:.3f})")


if __name__ == "__main__":
    main()
