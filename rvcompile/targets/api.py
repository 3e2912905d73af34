"""The one interface every build target implements, and what flows through it.

A target is a plugin: the build driver (build.py) knows none by name. It looks a target up in
the registry (targets/__init__.py), runs the target's pipeline (`passes`, then the KV pass its
`kv` rules pick) over the front end's IR, and hands the result to `lower`, which returns
everything target-specific the artifact holds (`Lowered`: sections, the manifest's part,
header requirements). `rvcompile inspect` asks the artifact's target to `summarize` that
manifest part. A target never imports another target, nor the runtime: its artifacts are opened
by the runtime kind named in `requirements["runtime"]` (runtime/__init__.py).

Options: `BuildOptions` carries every build option for every target; a target's
`check_options` refuses those it does not support (one line naming the CLI option, before any
work) and fills in its own defaults (a None field).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rvcompile.artifacts.format import PIECE_SIZE
from rvcompile.artifacts.manifest import Manifest
from rvcompile.ir.graph import ModelIR
from rvcompile.progress import Phases
from rvcompile.sources.model_source import CheckpointError

Pass = tuple[str, Callable[[ModelIR], ModelIR]]  # (name for --dump-ir, IR -> IR)
Log = Callable[[str], None]
PLATFORMS = ("tpu", "cuda", "cpu")  # what an artifact header may name
# --kv-cache: "float" is the target's own dtype; each other encoding is a pass (passes/kv_*)
# that a target offers through its KvRules; "auto" lets the target choose by context length.
KV_CACHE_CHOICES = ("auto", "float", "int8", "fp8")


@dataclass(frozen=True)
class BuildOptions:
    """Every build option, as `rvcompile build` takes them; the comment names the CLI option."""

    target: str  # --target: a registered target's name (checked by the registry lookup)
    max_context: int = 2048  # --max-context: KV cache tokens per sequence
    prefill_buckets: tuple[int, ...] = (16, 64, 256)  # --prefill-buckets; the largest = chunk
    max_seqs: int = 4  # --max-seqs: sequences in the decode batch
    platforms: tuple[str, ...] = PLATFORMS  # --platforms: what the artifact runs on
    dump_ir: str | None = None  # --dump-ir: print the IR after "frontend" or a pass name
    topologies: tuple[str, ...] = ()  # --topology: TPU slices to precompile for, e.g. v6e:2x2
    decode_loop_steps: int | None = 0  # --decode-loop-steps; None: the target's default
    tp: int = 1  # --tp: tensor-parallel devices
    kv_cache: str = "auto"  # --kv-cache: one of KV_CACHE_CHOICES
    draft_tokens: int = 0  # --num-draft-tokens: most drafts per verify call; 0: no such entries

    def __post_init__(self) -> None:
        """Every option inside its documented range, else a one-line CheckpointError naming the
        CLI option; what depends on the model or the target is checked where that is known."""
        _check_count("--max-context", self.max_context, 1)
        _check_count("--max-seqs", self.max_seqs, 1)
        if not isinstance(self.prefill_buckets, tuple) or not self.prefill_buckets:
            raise CheckpointError(f"--prefill-buckets {self.prefill_buckets!r}: expected one or "
                                  "more sizes")
        for size in self.prefill_buckets:
            _check_count("--prefill-buckets", size, 1)
        if self.chunk > self.max_context:
            raise CheckpointError(f"--max-context {self.max_context} must be >= the largest "
                                  f"prefill bucket {self.chunk}")
        if not self.platforms or set(self.platforms) - set(PLATFORMS):
            raise CheckpointError(f"--platforms {','.join(self.platforms)!r}: expected a comma "
                                  f"list of {', '.join(PLATFORMS)}")
        _check_count("--tp", self.tp, 1)
        # One decode_loop call writes at most one prefill chunk of positions (the sliding ring
        # is sized for that): more steps than the largest bucket would not fit.
        steps = self.decode_loop_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                                  or not 0 <= steps <= self.chunk):
            raise CheckpointError(f"--decode-loop-steps {steps!r}: expected 0 (no loop) to "
                                  f"{self.chunk}, the largest prefill bucket")
        # A verify call runs a token and its drafts as one chunk of rows.
        drafts = self.draft_tokens
        if isinstance(drafts, bool) or not isinstance(drafts, int) or not 0 <= drafts < self.chunk:
            raise CheckpointError(f"--num-draft-tokens {drafts!r}: expected 0 (no speculative "
                                  f"entry points) to {self.chunk - 1}, the largest prefill bucket "
                                  "- 1")
        if self.kv_cache not in KV_CACHE_CHOICES:
            raise CheckpointError(f"--kv-cache {self.kv_cache!r}: expected one of "
                                  f"{', '.join(KV_CACHE_CHOICES)}")

    @property
    def chunk(self) -> int:
        """The prefill chunk: the largest bucket."""
        return max(self.prefill_buckets)


def _check_count(option: str, value: object, low: int) -> None:
    """`value` is an int >= low; CheckpointError naming `option` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CheckpointError(f"{option} {value!r}: expected an integer >= {low}")


@dataclass(frozen=True)
class KvRules:
    """A target's --kv-cache choices besides "float" (its own dtype), and what "auto" means."""

    # (--kv-cache choice, the pass that stores the cache so), run after the pipeline: the
    # cache dtype is the last word
    encodings: tuple[tuple[str, Pass], ...] = ()
    auto: str = "float"  # what "auto" picks beyond auto_above tokens of context
    auto_above: int = 0  # "auto" is "float" at or below this many tokens

    def choices(self) -> tuple[str, ...]:
        return ("float", *(choice for choice, _ in self.encodings))

    def pass_for(self, choice: str) -> Pass | None:
        """The pass that stores the KV cache as `choice`; None for "float"."""
        return next((p for c, p in self.encodings if c == choice), None)

    def resolve_auto(self, max_context: int) -> str:
        return self.auto if max_context > self.auto_above else "float"


@dataclass(frozen=True)
class Lowered:
    """What a target's lowering hands the artifact writer."""

    platforms: tuple[str, ...]  # the header's
    requirements: dict  # the header's; "runtime" names the runtime kind that opens it
    manifest: dict  # the target's part of the manifest, merged at the top level
    sections: dict[str, bytes]  # besides "weights" and the text sections
    weights_nbytes: int
    # param name -> [slot with .offset, .nbytes] in "weights"; a slot with a .shard (h100 --tp:
    # tensor_parallel.Shard) holds that part of the param (rows or columns), else all of it
    slots_by_param: dict
    # bytes per hashed piece of every section (the header's piece_size): h100 artifacts hash in
    # small pieces, one GPU thread each, so the runtime checks its uploads on the device
    piece_size: int = PIECE_SIZE


@dataclass(frozen=True)
class Summary:
    """What `rvcompile inspect` shows of the target's part of an artifact."""

    info: dict[str, Any]  # merged into `inspect --json`
    lines: tuple[str, ...]  # printed by `inspect`, after the header's fields
    cost_lines: tuple[str, ...] = ()  # what `inspect --cost` adds; () if the target has none


def field_line(key: str, value: object) -> str:
    """One `key  value` line of `inspect`, aligned like its header fields."""
    return f"{key:17} {value}"


class Target(Protocol):
    name: str  # what --target names and the artifact header records
    emits: str  # one line for `rvcompile targets`
    runtime: str  # the runtime kind its artifacts need (requirements["runtime"])
    passes: tuple[Pass, ...]  # the pipeline after the front end, in order
    kv: KvRules
    input_errors: tuple[type[Exception], ...]  # what lower raises for input it refuses

    def check_options(self, opts: BuildOptions) -> BuildOptions:
        """Refuse (CheckpointError, one line naming the option) what this target lacks, before
        any work; return `opts` with this target's defaults in its None fields."""
        ...

    def lower(self, ir: ModelIR, opts: BuildOptions, log: Log, phases: Phases) -> Lowered:
        """The IR after the pipeline, as what the artifact stores; each step of it that takes
        time (lowering, nvcc, export, XLA precompile) is a phase of `phases`."""
        ...

    def summarize(self, manifest: Manifest, stored: Mapping[str, Any]) -> Summary:
        """What `inspect` shows of an artifact this target built: `manifest` as
        artifacts.manifest.read_manifest checked it, `stored` the same manifest's JSON (for
        fields shown as stored)."""
        ...


def concat(blobs: dict[str, bytes]) -> tuple[bytes, dict[str, dict[str, int]]]:
    """One section of `blobs` in name order, and each one's {offset, size} in it."""
    index, parts, offset = {}, [], 0
    for name in sorted(blobs):
        index[name] = {"offset": offset, "size": len(blobs[name])}
        parts.append(blobs[name])
        offset += len(blobs[name])
    return b"".join(parts), index
