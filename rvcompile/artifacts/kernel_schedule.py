"""The kernel schedule of an H100 artifact, as stored in its manifest: written by the build
(targets/h100), read by the runtime, so it imports nothing from the compiler.

Everything lives in ONE device allocation, the arena. Its fixed part, `arena_bytes` laid out at
build, holds in order: the packed weights (byte for byte the artifact's "weights" section, uploaded
with one copy), constants (section "constants"), the host-written inputs ("io": one copy per call)
and the activations (reused by liveness). The paged KV pools follow it, sized at LOAD: the runtime
picks each KV kind's block count (from free memory, or as asked) and `pool_offsets` places the
pools, in `kv.pools` order, after the fixed part. A launch's arguments are named after the kernel's
parameters and listed in their order (the H100 target declares each kernel's:
targets/h100/contract.py); pointer arguments are arena byte offsets into the fixed part, but a
pool's base (kind "pool"), which is its index in `kv.pools`. A kernel that takes one large struct by
value (CUTLASS's GEMM) has one argument of kind "params": the name of one of the schedule's
`params_templates` (artifacts/kernel_params.py) and the arena byte offset of each of the template's
roles; the runtime completes the template once per arena address (runtime/executors/tma.py) and
passes the bytes as that parameter.

An entry point is an ordered launch list over `rows` token rows: `decode_{B}` (B sequences, one
token each; captured into a CUDA graph), `prefill_{T}` (T tokens of one sequence, or with
`prefill_packing` the chunks of up to its `seqs` sequences, each sampled: PrefillPacking) and
`logits_{T}` (same, keeping every row's softcapped logits); a schedule built for speculative
decoding (`draft_tokens` K > 0) adds `verify_{R}`: R rows launched exactly as a decode entry's
(each row its own position, block-table row and sampling step, so several rows may be one
sequence's consecutive tokens; a CUDA graph) for verify calls wider than the widest decode
entry, the widest max_seqs * (K + 1). From version 7 a one-GPU schedule also has
`sampled_decode_{B}` and `sampled_prefill_{T}` beside every decode and prefill entry: the same
model, with the sampler's extras (penalties, a token mask, log-probabilities) read from the
`sampler` region (SamplerIo) and the log-probabilities among the outputs. A schedule with an
assistant drafter (version 9) has `draft_{B}` beside every decode_{B}: K drafter steps of B
lanes from io tokens, draft_state and draft_step (the last io fields, which only draft calls
write), returning tokens [K, B], logits and states; its decode and verify entries also return
each row's state [rows, H] (what a draft call starts from). Version 10 adds the speculative
ratio rule: the `ratio` region (RatioIo), where the draft entries leave their logits and
sampling records, and io field ratio_lanes, naming the verify lanes whose tokens the decode and
verify entries rewrite by the rule (targets/h100/ratio.py). With `prefill_packing` a schedule
may have `mixed_{P}_{B}` entries (any version; a reader that predates them refuses their names):
P rows launched as prefill_{P}'s (packed chunks, their S sampled rows), then B lanes launched as
decode_{B}'s, in one call whose linears read the weights once for both; io "last_row" holds
S + B values (the lanes' rows P, P + 1, ... after the S sequences'), out_tokens S + B (a CUDA
graph; no sampler extras, no decode loop). Before a call the
host fills the io fields for the entry's rows: tokens, positions (-1 = padding), seq_len (keys a
row sees), one block-table row per token row and KV kind, the prefill's last real row of each
sequence, the sampling parameters (a prefill's: row i for its i-th sequence); afterwards it reads
`out_tokens` (and `logits`, or the log-probabilities).

`version` is the schedule's own schema version (what the arguments, io fields and entry names mean
to the runtime): readers take MIN_SCHEDULE_VERSION..MAX_SCHEDULE_VERSION, independently of the
container's format version. `prefill_packing` is optional in every version: a schedule without it is
read and run as before, and a reader that predates it refuses a schedule with it at its prefill
entries' out_tokens (one value per packed sequence, not one). `from_json` checks every field before
anything uses it: types and ranges, arena regions in order and inside the arena, every io field,
output and pointer argument inside its region, grid and block dimensions within CUDA's limits, every
launched module in `cubins`, the KV tables wide enough for the context and window, every pool of a
declared kind with a whole number of its dtype's rows per block, every pool argument naming a pool,
and the entry points the runtime calls. That a launch's kernel exists in its cubin with matching
parameters is checked against the cubin bytes (artifacts/cubin.py, artifacts/contents.py).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from rvcompile.artifacts.kernel_params import ParamsTemplate, ParamsTemplateError
from rvcompile.artifacts.schema import FLOAT32_MAX, INT32_MAX, INT32_MIN, At

# (date, version, change); newest last.
SCHEDULE_CHANGELOG: tuple[tuple[str, int, str], ...] = (
    ("2026-11-24", 1, "first versioned schedule (format v3): the layout below, checked field by "
                      "field at load"),
    ("2026-11-24", 2, "launch arguments named: each {name, kind, value}, in the kernel's "
                      "parameter order (the H100 target's kernel contract); version 1's "
                      "positional arguments are no longer read"),
    ("2026-11-24", 3, "slots -> max_seqs (the decode width, as `rvcompile build --max-seqs` "
                      "names it); version 2 is no longer read"),
    ("2026-11-24", 4, "parameter blocks: argument kind 'params' ({template, roles}) and "
                      "`params_templates` (the FP8 tensor-core GEMM); version 3 reads the same"),
    ("2026-11-24", 5, "collective steps among a tensor-parallel rank's launches ({op, src, "
                      "dst, rows, cols}: kernel_schedule.Collective); only the ranks' "
                      "schedules of a --tp build carry version 5, a one-GPU schedule stays at "
                      "version 4 (and reads as before)"),
    ("2026-11-25", 6, "speculative decoding (issue 15): `draft_tokens` K (1..max_chunk - 1; "
                      "rvcompile build --num-draft-tokens) and `verify_{R}` entries, launched as "
                      "decode entries, the widest max_seqs * (K + 1) rows; only schedules built "
                      "with K > 0 carry version 6 (one-GPU or a --tp rank's), the others stay at "
                      "4 or 5 (and read as before)"),
    ("2026-11-25", 7, "KV pools sized at load (issue 14): the arena's fixed part "
                      "(arena_bytes) no longer holds them; kv.pools lists each pool's {kind, "
                      "layer, block_bytes}, placed after the fixed part in that order "
                      "(KernelSchedule.pool_offsets) with the block counts the runtime picks; a "
                      "launch names a pool's base by argument kind 'pool' (its index); kv_offset, "
                      "kv.pool_bytes and each kind's num_blocks are gone. Also the sampler's "
                      "extras (issue 16): `sampler` (SamplerIo: the sample_io region right after "
                      "io) and sampled_decode_{B} / sampled_prefill_{T} beside every decode_{B} / "
                      "prefill_{T}, with outputs logprob, top_ids and top_logprobs after "
                      "out_tokens; and decode_advance ending every decode_{B} over io fields "
                      "loop_budget, loop_step and loop_tokens (the decode loop). What a one-GPU "
                      "build writes, with or without draft_tokens; versions 3..6 are no longer "
                      "read (rebuild the artifact)"),
    ("2026-11-25", 8, "a --tp rank's schedule: version 7 with collective steps (as 5 was) and "
                      "no sampler, with or without draft_tokens"),
    ("2026-11-25", 9, "an assistant drafter (issue 15): version 7 with draft_tokens K and "
                      "`draft_{B}` beside every decode_{B} (K drafter steps; outputs tokens "
                      "[K, B], logits [K * B, V], states [K * B, H]), io fields draft_state "
                      "float32 [max_seqs, H] and draft_step int32 [K, max_seqs] after the "
                      "others, and every decode_{B} and verify_{R} outputs states [rows, H] "
                      "right before out_tokens; only one-GPU schedules with a drafter carry "
                      "version 9, the others stay at 7 or 8 (and read as before)"),
    ("2026-11-25", 10, "the speculative ratio rule on the H100 (issue 15): version 9 with the "
                       "`ratio` region (RatioIo: draft_q float32 [K * max_seqs, V], the draft "
                       "entries' logits output, and draft_dist, their rows' sampling records) "
                       "after sample_io, io field ratio_lanes int32 [max_seqs, 4] before the "
                       "draft fields, and the kernels sample_pick_dist and spec_ratio in the "
                       "decode, verify and draft entries; what a one-GPU build with a drafter "
                       "writes. Version 9 still reads (and runs as before: verify accepts by "
                       "exact match)"),
)
SCHEDULE_VERSION = 7  # what a one-GPU build writes (a sampler; no collectives)
TP_SCHEDULE_VERSION = 8  # what the ranks of a --tp build write (collectives; no sampler)
DRAFTER_SCHEDULE_VERSION = 9  # a one-GPU build with an assistant drafter (draft entries)
RATIO_SCHEDULE_VERSION = 10  # ... whose verify entries also apply the ratio rule (RatioIo)
MIN_SCHEDULE_VERSION = 7
MAX_SCHEDULE_VERSION = RATIO_SCHEDULE_VERSION  # the newest this reader takes
DRAFTER_VERSIONS = (DRAFTER_SCHEDULE_VERSION, RATIO_SCHEDULE_VERSION)

ARG_KINDS = ("ptr", "null", "i32", "i64", "f32", "params", "pool")
# as the kernel receives it; "params": its template's bytes (KernelSchedule.arg_bytes); "pool":
# a pointer, the pool's base
ARG_BYTES = {"ptr": 8, "null": 8, "i32": 4, "i64": 8, "f32": 4, "pool": 8}
POOL_ALIGN = 256  # each pool's base, as the activations' buffers (targets/h100/memory_plan)
# Header requirement "kernel_launch": how the runtime may launch the artifact's kernels.
# "programmatic": every kernel opens with griddepcontrol.wait, so each may be launched with
# programmatic stream serialization (start while its predecessor runs). Artifacts without it
# were built before that and are refused: rebuilding them takes minutes.
KERNEL_LAUNCH = "programmatic"

KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float32")
KV_BYTES = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}
MAX_POOLS = 1024  # two per layer at most
IO_DTYPES = ("int32", "float32")
# The io fields the host writes -> dtype; each holds a value per token row of the widest entry but
# last_row (one value per sequence a prefill call packs: KernelSchedule.prefill_seqs). The KV kinds'
# table fields (int32, a table row per token row) come on top.
IO_FIELDS = {"tokens": "int32", "positions": "int32", "seq_len": "int32", "last_row": "int32",
             "temperature": "float32", "top_k": "int32", "top_p": "float32", "seed": "int32",
             "step": "int32"}
ENTRY_KINDS = ("decode", "prefill", "logits", "verify", "draft", "mixed")


def mixed_shape(name: str) -> tuple[int, int] | None:
    """(P, B) of a mixed entry's name, mixed_P_B; None for another name."""
    m = re.fullmatch(r"mixed_([1-9][0-9]{0,6})_([1-9][0-9]{0,6})", name)
    return (int(m[1]), int(m[2])) if m else None
# the draft entries' io fields (version 9): float32 [max_seqs, H] and int32 [K, max_seqs]
DRAFT_IO_FIELDS = {"draft_state": "float32", "draft_step": "int32"}
# version 10: the ratio rule's lanes, int32 [max_seqs, RATIO_LANE_WORDS] ({row0, n, q_at,
# q_stride} per verify lane: targets/h100/ratio.py), before the draft fields (every call writes
# it: zeros, no lane by the rule, but in a verify call that asks)
RATIO_LANES_FIELD = "ratio_lanes"
RATIO_LANE_WORDS = 4
# the ratio region's fields: the drafter's logits and records [K * max_seqs, ...]
RATIO_FIELDS = {"draft_q": "float32", "draft_dist": "int32"}
RATIO_DIST_WORDS = 6  # int32 words of a record: uint64 {cut, S, s0}
SAMPLED = "sampled_"  # the sampled entries' prefix: sampled_decode_{B}, sampled_prefill_{T}
# The sample_io fields in their order, each one value per decode lane (max_seqs) but the pool
# (int32 [max_seqs * (mask_words + 2 * penalty_ids)]), which comes last: the host writes io,
# these and the used prefix of the pool with one copy.
SAMPLE_IO_FIELDS = {"presence": "float32", "frequency": "float32", "repetition": "float32",
                    "n_top": "int32", "mask_at": "int32", "pen_at": "int32", "pen_n": "int32",
                    "pool": "int32"}
# The kernel a sampled entry's sampler starts with (targets/h100/sample.py launches it right
# after the head's logits). What comes before it is the forward pass and head, which read no
# sample_io: the runtime may run a sampled entry in two parts, writing sample_io in between
# (KernelSchedule.sampler_split; the engine's late grammar masks).
SAMPLER_KERNEL = "sample_prepare"
# The kernel that ends every decode_{B} (the decode loop: targets/h100/rows.py) and, in schedules
# built since 2026-11-29, every sampled_decode_{B} (in its sampler part: the runtime's masked
# decode loop, which a schedule without it does not offer)
ADVANCE_KERNEL = "decode_advance"
ENTRY_PARTS = ("forward", "sampler")  # the two parts of a sampled entry, in the order they run
# the sampled entries' outputs after out_tokens, side by side in this order (one read)
SAMPLED_OUTPUTS = ("out_tokens", "logprob", "top_ids", "top_logprobs")
MAX_TOP_LOGPROBS = 32  # what the sample_logprobs kernel returns at most
# CUDA's limits (compute capability 9.0): grid x, y, z; block x, y, z and threads; dynamic
# shared memory a block may opt into.
MAX_GRID = (INT32_MAX, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS = 1024
MAX_SMEM = 227 << 10
MAX_BYTES = 1 << 50  # any size or offset beyond a petabyte is damage, not a model
MAX_ROWS = 1 << 20
MAX_ARGS = 256  # arguments of one launch
_ARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_KERNEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ParamsBlock:
    """The value of a "params" argument: which template, and where each of its roles lives."""

    template: str  # a key of KernelSchedule.params_templates
    roles: dict[str, int]  # each of the template's roles -> arena byte offset of its buffer


@dataclass(frozen=True)
class Arg:
    """One kernel argument; a launch lists them in the kernel's parameter order."""

    name: str  # the kernel's parameter name (a C identifier), unique in its launch
    kind: str  # one of ARG_KINDS; "ptr": value is an arena byte offset; "null": a null pointer;
    #            "pool": value is an index into kv.pools, the argument that pool's base address
    value: int | float | ParamsBlock = 0


@dataclass(frozen=True)
class Launch:
    module: str  # the cubin (kernel source stem) holding `kernel`
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: tuple[Arg, ...]


@dataclass(frozen=True)
class Collective:
    """A collective step of one rank of a tensor-parallel schedule, between launches: every rank
    reaches the same steps in the same order. "all_reduce": the float32 [rows, cols] at `src`
    summed over the ranks, into `dst` (the same offset: in place). "all_gather": each rank's
    float32 [rows, cols] at `src` side by side as column blocks in rank order, into the
    [rows, ranks * cols] at `dst` (the logits before sampling)."""

    op: str  # one of COLLECTIVE_OPS
    src: int  # arena byte offsets
    dst: int
    rows: int
    cols: int


COLLECTIVE_OPS = ("all_reduce", "all_gather")


@dataclass(frozen=True)
class Field:
    """A host-visible array in the arena."""

    offset: int
    dtype: str  # "int32" or "float32"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)


@dataclass(frozen=True)
class SamplerIo:
    """The inputs of the sampled entries (version 7): a region right after io (one copy writes
    both), the fields of SAMPLE_IO_FIELDS in that order. Per decode lane: presence, frequency
    and repetition (float32; neutral 0, 0, 1), n_top (-1: no log-probabilities; 0..K: the
    token's and the K likeliest), mask_at (the pool word where the lane's mask of mask_words
    words starts, bit j of word w allowing token 32 w + j; -1: no mask), pen_at and pen_n (the
    pool word where its (id, count) penalty pairs start, each id once, and how many: at most
    penalty_ids)."""

    offset: int  # = io_offset + io_bytes
    nbytes: int
    top_logprobs: int  # K: the top log-probabilities the sampled entries return per row
    penalty_ids: int  # P: most penalty pairs per lane, min(max_context, vocab_size)
    mask_words: int  # W: int32 words of a lane's token mask, vocab_size / 32
    fields: dict[str, Field]


@dataclass(frozen=True)
class PrefillPacking:
    """Prompt chunks of several sequences in one prefill call (issue 14): each prefill entry
    samples `seqs` rows, the io "last_row" [seqs] naming each packed sequence's last row (-1:
    none) and the sampling fields' rows 0..seqs-1 its sampling; a sequence's rows start at a
    multiple of `align` rows (the prefill attention's tile: its rows share one block-table row)
    and its chunk is one the scheduler would run in an entry of at least `min_rows` rows. The
    lowering promises (and the GPU tests check) that such a chunk's rows compute bit for bit the
    same in any prefill entry of at least min_rows rows, alone or packed, so packing changes no
    sequence's recipe (runtime/executor_api.py, "Reproducibility")."""

    seqs: int  # S >= 2
    align: int  # rows
    min_rows: int  # a prefill entry's rows


@dataclass(frozen=True)
class RatioIo:
    """What the drafter leaves for verify's ratio rule (version 10): a region after io and
    sample_io that only the draft entries write and the decode and verify entries read, so it
    holds the last draft call's until the next one. draft_q float32 [K * max_seqs, V]: the
    logits draft_{B} sampled from, row i * B + b its step i of lane b (the entry's "logits"
    output); draft_dist int32 [K * max_seqs, 6]: each row's sampling record (uint64 {cut, S,
    s0}: targets/h100/ratio.py)."""

    offset: int
    nbytes: int
    fields: dict[str, Field]


@dataclass(frozen=True)
class EntryPoint:
    name: str
    rows: int
    graph: bool  # captured into a CUDA graph at load (decode); prefill runs eagerly
    launches: tuple[Launch | Collective, ...]  # collectives only in a tensor-parallel rank's


@dataclass(frozen=True)
class KvKindLayout:
    """Layers sharing one block table per sequence and one block id space (their pools)."""

    name: str  # "full" or "sliding"
    io_field: str  # the io field holding one table row per token row
    table_width: int
    ring: bool  # sliding: entry j % table_width holds logical block j
    window: int  # tokens; 0 for full attention


@dataclass(frozen=True)
class KvPool:
    """One cache-owning layer's K, V or K=V pool: as many blocks as its kind gets at load."""

    kind: str  # the KvKindLayout whose block ids index it
    layer: int  # the layer that owns it (for people reading the schedule; kernels get the base)
    block_bytes: int  # one block: block_size tokens x KV heads x head dim x the dtype's bytes


@dataclass(frozen=True)
class KvLayout:
    block_size: int  # tokens per block
    kv_dtype: str  # "bfloat16", "float8_e4m3fn" (build --kv-cache fp8: e4m3, no scale) or
    #                "float32" (h100-f32)
    kinds: tuple[KvKindLayout, ...]
    pools: tuple[KvPool, ...]  # in arena order after the fixed part; "pool" arguments index it

    def block_bytes(self, kind: str) -> int:
        """Bytes one block id of `kind` stands for: its block in every pool of that kind."""
        return sum(p.block_bytes for p in self.pools if p.kind == kind)


@dataclass(frozen=True)
class Cubin:
    """Where a module's cubin sits in the "cubins" section."""

    offset: int
    size: int
    sha256: str  # hex, of the cubin bytes


@dataclass(frozen=True)
class KernelSchedule:
    arena_bytes: int  # the fixed part: weights, constants, io, activations (the pools follow)
    weights_bytes: int  # [0, weights_bytes): the weights section
    constants_offset: int
    constants_bytes: int
    io_offset: int
    io_bytes: int
    max_seqs: int  # rows of the widest decode entry
    max_context: int
    max_chunk: int
    vocab_size: int
    kv: KvLayout
    io: dict[str, Field]
    outputs: dict[str, Field]  # "{entry}.out_tokens", "{entry}.logits"
    entries: dict[str, EntryPoint]
    cubins: dict[str, Cubin]  # module -> its place in section "cubins"
    version: int = field(default=SCHEDULE_VERSION)
    # the parameter blocks "params" arguments name, by name (absent from the JSON when none)
    params_templates: dict[str, ParamsTemplate] = field(default_factory=dict)
    # most drafts one verify call checks (verify_{R} entries); 0: none, absent from
    # the JSON
    draft_tokens: int = 0
    sampler: SamplerIo | None = None  # the sampled entries' inputs (version 7, one GPU)
    ratio: RatioIo | None = None  # the drafter's distributions for the ratio rule (version 10)
    # several sequences' prompt chunks per prefill call; None (absent from the JSON): one
    prefill_packing: PrefillPacking | None = None

    @property
    def prefill_seqs(self) -> int:
        """Rows each prefill entry samples (and io "last_row" values it reads)."""
        return self.prefill_packing.seqs if self.prefill_packing else 1

    @property
    def mixed_shapes(self) -> tuple[tuple[int, int], ...]:
        """(P, B) of every mixed entry, sorted."""
        return tuple(sorted(filter(None, map(mixed_shape, self.entries))))

    def to_json(self) -> dict:
        d = {f.name: _plain(getattr(self, f.name)) for f in fields(self)
             if f.name != "params_templates"}
        if self.prefill_packing is None:
            del d["prefill_packing"]
        if not self.draft_tokens:
            del d["draft_tokens"]
        if self.sampler is None:
            del d["sampler"]
        if self.ratio is None:
            del d["ratio"]
        if self.params_templates:
            d["params_templates"] = {k: t.to_json() for k, t in self.params_templates.items()}
        return d

    @property
    def has_drafter(self) -> bool:
        """An assistant drafter's draft entries (version 9 or 10)."""
        return self.version in DRAFTER_VERSIONS

    def pool_offsets(self, blocks: dict[str, int]) -> tuple[tuple[int, ...], int]:
        """(each pool's arena byte offset, in kv.pools order; the whole arena's bytes) when each
        pool holds blocks[its kind] blocks: the pools one after another after the fixed part,
        each POOL_ALIGN-aligned. ValueError for a kind without a count of at least 1."""
        offsets, end = [], _align(self.arena_bytes)
        for p in self.kv.pools:
            n = blocks.get(p.kind, 0)
            if type(n) is not int or n < 1:
                raise ValueError(f"{n!r} {p.kind} KV blocks; need at least 1")
            offsets.append(end)
            end = _align(end + n * p.block_bytes)
        return tuple(offsets), end

    def sampler_split(self, name: str) -> int | None:
        """Where sampled entry `name` may be cut in two (its forward part, then its sampler):
        the index of its first SAMPLER_KERNEL launch, when no launch before that takes an
        address in sample_io (so sample_io may be written between the parts); None for an
        entry without one, or that reads sample_io earlier."""
        entry = self.entries.get(name)
        if entry is None or self.sampler is None or not name.startswith(SAMPLED):
            return None
        kernels = [x.kernel if isinstance(x, Launch) else None for x in entry.launches]
        if SAMPLER_KERNEL not in kernels:
            return None
        split = kernels.index(SAMPLER_KERNEL)
        lo, hi = self.sampler.offset, self.sampler.offset + self.sampler.nbytes
        for x in entry.launches[:split]:
            if any(lo <= at < hi for at in _addresses(x)):
                return None
        return split

    def part(self, name: str, part: str) -> tuple[Launch | Collective, ...]:
        """The launches of one part of sampled entry `name` (sampler_split): "forward", those
        before the sampler, or "sampler", the rest. ValueError where it has no split."""
        split = self.sampler_split(name)
        if split is None or part not in ENTRY_PARTS:
            raise ValueError(f"entry {name!r} has no part {part!r} (a sampled entry has "
                             f"{' and '.join(ENTRY_PARTS)})")
        launches = self.entries[name].launches
        return launches[:split] if part == "forward" else launches[split:]

    def arg_bytes(self, a: Arg) -> int:
        """The bytes the kernel receives for argument `a`."""
        if a.kind == "params":
            return len(self.params_templates[a.value.template].template)
        return ARG_BYTES[a.kind]

    @classmethod
    def from_json(cls, d: Any, path: str = "schedule") -> KernelSchedule:
        """The schedule `d` (parsed JSON) describes; SchemaError naming the first bad field,
        under `path`."""
        return _parse(At(d, path))


_ATOMS = (int, float, str, bool, type(None))


def _plain(x: Any) -> Any:
    """dataclasses.asdict's conversion of x (dataclasses to dicts, recursively; tuples, lists
    and dicts rebuilt of their converted items; anything else deep-copied), without asdict's
    deepcopy of every number and string: to_json of a 31B schedule spent most of its time
    there."""
    if type(x) in _ATOMS:
        return x
    if is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in fields(x)}
    if type(x) in (tuple, list):
        return type(x)(_plain(v) for v in x)
    if type(x) is dict:
        return {_plain(k): _plain(v) for k, v in x.items()}
    return copy.deepcopy(x)


def _addresses(x: Launch | Collective) -> list[int]:
    """The arena byte offsets a launch or collective step takes (pointers, a parameter block's
    roles, a collective's source and destination)."""
    if isinstance(x, Collective):
        return [x.src, x.dst]
    out = []
    for a in x.args:
        if a.kind == "ptr":
            out.append(int(a.value))
        elif a.kind == "params":
            out += a.value.roles.values()
    return out


def _align(n: int) -> int:
    return -(-n // POOL_ALIGN) * POOL_ALIGN


def _parse(s: At) -> KernelSchedule:
    version = s.get("version")
    if version is None:
        s.fail("has no version: built before schedules were versioned; rebuild the artifact")
    v = version.int()
    if not MIN_SCHEDULE_VERSION <= v <= MAX_SCHEDULE_VERSION:
        version.fail(f"kernel schedule version {v}; this runtime reads versions "
                     f"{MIN_SCHEDULE_VERSION}..{MAX_SCHEDULE_VERSION} (rebuild the artifact, or "
                     "upgrade rvcompile)")
    n = {k: s[k].int(1 if k == "arena_bytes" else 0, MAX_BYTES) for k in (
        "arena_bytes", "weights_bytes", "constants_offset", "constants_bytes", "io_offset",
        "io_bytes")}
    max_seqs = s["max_seqs"].int(1, MAX_ROWS)
    max_context = s["max_context"].int(1, MAX_ROWS * 64)
    max_chunk = s["max_chunk"].int(1, max_context)
    vocab = s["vocab_size"].int(1, INT32_MAX)
    kv = _kv(s["kv"], max_context, max_chunk)
    # The fixed part's regions in order, each inside it (the activations after io).
    regions = [("weights", 0, n["weights_bytes"]),
               ("constants", n["constants_offset"], n["constants_bytes"]),
               ("io", n["io_offset"], n["io_bytes"])]
    end = 0
    for name, offset, size in regions:
        if offset < end:
            s.fail(f"arena region {name} starts at byte {offset}, inside the previous region "
                   f"(which ends at {end})")
        end = offset + size
    if end > n["arena_bytes"]:
        s.fail(f"arena regions end at byte {end}, past arena_bytes {n['arena_bytes']}")
    io_region = (n["io_offset"], n["io_offset"] + n["io_bytes"])
    drafts = _draft_tokens(s, max_chunk)
    packing = _prefill_packing(s, max_seqs, max_chunk)
    seqs = packing.seqs if packing else 1
    sampler = _sampler(s, v, io_region[1], n["arena_bytes"], max_seqs, max_context, vocab)
    arena = (0, n["arena_bytes"])
    cubins = {}
    for name, c in s["cubins"].members(256).items():
        if not re.fullmatch(r"[A-Za-z0-9_]{1,64}\.cu", name):
            c.fail("a module is named after its kernel source, like head.cu")
        cubins[name] = Cubin(c["offset"].int(0, MAX_BYTES), c["size"].int(1, MAX_BYTES),
                             c["sha256"].sha256())
    templates = _templates(s.get("params_templates"))
    entries = {name: _entry(e, name, cubins, n["arena_bytes"], len(kv.pools), templates, v)
               for name, e in s["entries"].members().items()}
    rows = {kind: sorted(e.rows for e in entries.values() if e.name.startswith(kind + "_"))
            for kind in ENTRY_KINDS}
    _need(s["entries"], rows["decode"], max_seqs, "decode", "the widest decode entry")
    _need(s["entries"], rows["prefill"], max_chunk, "prefill", "the largest prefill entry")
    _need(s["entries"], rows["logits"], max_chunk, "logits", "the logits entry")
    if packing and packing.min_rows not in rows["prefill"]:
        s["prefill_packing"]["min_rows"].fail(f"{packing.min_rows} is not a prefill entry's "
                                              f"rows ({rows['prefill']})")
    if drafts:
        _need(s["entries"], rows["verify"], max_seqs * (drafts + 1), "verify",
              f"the widest verify entry (max_seqs x {drafts + 1} rows)")
    elif rows["verify"]:
        s["entries"].fail(f"has verify entries (rows {rows['verify']}) but no draft_tokens")
    lanes = _mixed(s["entries"], entries, packing, rows)
    max_rows = max(e.rows for e in entries.values())
    tables = {k.io_field: k.table_width for k in kv.kinds}
    io_at = s["io"]
    io = {name: _field(f, io_region) for name, f in io_at.members().items()}
    for name, dtype in [*IO_FIELDS.items(), *((t, "int32") for t in tables)]:
        if name not in io:
            io_at.fail(f"missing required io field {name!r}")
        f = io[name]
        rows_needed = seqs + lanes if name == "last_row" else max_rows
        per_row = (tables[name],) if name in tables else ()
        if f.dtype != dtype or f.shape[0] < rows_needed or f.shape[1:] != per_row:
            io_at[name].fail(f"expected {dtype} of shape {[rows_needed, *per_row]} (or more "
                             f"rows), got {f.dtype} {list(f.shape)}")
    _sampled_entries(s["entries"], entries, sampler is not None)
    hidden = _drafter(s, io, v, rows, drafts, max_seqs)
    ratio = _ratio(s, io, v, sampler, n["arena_bytes"], drafts, max_seqs, vocab)
    outputs_at = s["outputs"]
    outputs = {name: _field(f, arena) for name, f in outputs_at.members().items()}
    for e in entries.values():
        sampled = e.name.startswith(SAMPLED)
        kind = e.name.removeprefix(SAMPLED).split("_")[0]
        m = e.rows if kind in ("decode", "verify") else seqs
        if kind == "mixed":
            m = seqs + mixed_shape(e.name)[1]
        want = ([("logits", "float32", (e.rows, vocab))] if kind == "logits"
                else [("out_tokens", "int32", (m,))])
        if kind == "draft":
            want = [("tokens", "int32", (drafts, e.rows)),  # [step, lane]; rows step * B + lane:
                    ("logits", "float32", (drafts * e.rows, vocab)),
                    ("states", "float32", (drafts * e.rows, hidden))]
        elif hidden and kind in ("decode", "verify") and not sampled:
            want.insert(0, ("states", "float32", (e.rows, hidden)))  # then out_tokens
        if sampled:
            k = sampler.top_logprobs
            want += [("logprob", "float32", (m,)), ("top_ids", "int32", (m, k)),
                     ("top_logprobs", "float32", (m, k))]
        end = None
        for out, dtype, shape in want:
            name = f"{e.name}.{out}"
            if name not in outputs:
                outputs_at.fail(f"missing output {name!r} of entry {e.name}")
            f = outputs[name]
            if f.dtype != dtype or f.shape != shape:
                outputs_at[name].fail(f"expected {dtype} of shape {list(shape)}, got "
                                      f"{f.dtype} {list(f.shape)}")
            if end is not None and f.offset != end and kind != "draft":
                outputs_at[name].fail(f"must follow {e.name}'s previous output at byte {end} "
                                      f"({', '.join(x for x, _, _ in want)} side by side)")
            if ratio and kind == "draft" and out == "logits" \
                    and f.offset != ratio.fields["draft_q"].offset:
                outputs_at[name].fail(f"must be the ratio region's draft_q (byte "
                                      f"{ratio.fields['draft_q'].offset}), which verify reads")
            end = f.offset + f.nbytes
    return KernelSchedule(
        arena_bytes=n["arena_bytes"], weights_bytes=n["weights_bytes"],
        constants_offset=n["constants_offset"], constants_bytes=n["constants_bytes"],
        io_offset=n["io_offset"], io_bytes=n["io_bytes"],
        max_seqs=max_seqs, max_context=max_context, max_chunk=max_chunk, vocab_size=vocab, kv=kv,
        io=io, outputs=outputs, entries=entries, cubins=cubins, version=v,
        params_templates=templates, draft_tokens=drafts, sampler=sampler, ratio=ratio,
        prefill_packing=packing)


def _ratio(s: At, io: dict[str, Field], version: int, sampler: SamplerIo | None,
           arena_bytes: int, drafts: int, max_seqs: int, vocab: int) -> RatioIo | None:
    """A version 10 schedule's ratio region and io field (none in other versions): after
    sample_io and inside the arena, its fields inside it, ratio_lanes before the draft io
    fields (which only draft calls write)."""
    at = s.get("ratio")
    if version != RATIO_SCHEDULE_VERSION:
        if at is not None or RATIO_LANES_FIELD in io:
            s.fail(f"has the ratio rule's region or io field but version {version} (they are "
                   f"version {RATIO_SCHEDULE_VERSION}'s)")
        return None
    if at is None:
        s.fail(f"a version {version} schedule has a ratio region (the drafter's distributions)")
    lanes = io.get(RATIO_LANES_FIELD)
    if lanes is None:
        s["io"].fail(f"missing the ratio rule's io field {RATIO_LANES_FIELD!r}")
    if lanes.dtype != "int32" or lanes.shape != (max_seqs, RATIO_LANE_WORDS):
        s["io"][RATIO_LANES_FIELD].fail(f"expected int32 of shape [{max_seqs}, "
                                        f"{RATIO_LANE_WORDS}], got {lanes.dtype} "
                                        f"{list(lanes.shape)}")
    if lanes.offset + lanes.nbytes > io["draft_state"].offset:
        s["io"][RATIO_LANES_FIELD].fail("must come before the draft io fields (every call "
                                        "writes it)")
    offset = at["offset"].int(0, MAX_BYTES)
    nbytes = at["nbytes"].int(1, MAX_BYTES)
    start = sampler.offset + sampler.nbytes
    if offset < start or offset + nbytes > arena_bytes:
        at.fail(f"the region [{offset}, {offset + nbytes}) must start after sample_io "
                f"({start}) and end inside the arena ({arena_bytes})")
    fields_at = at["fields"]
    fields = {name: _field(f, (offset, offset + nbytes))
              for name, f in fields_at.members().items()}
    if sorted(fields) != sorted(RATIO_FIELDS):
        fields_at.fail(f"expected the fields {', '.join(RATIO_FIELDS)}, got "
                       f"{', '.join(fields)}")
    rows = drafts * max_seqs
    for name, (dtype, shape) in {"draft_q": ("float32", (rows, vocab)),
                                 "draft_dist": ("int32", (rows, RATIO_DIST_WORDS))}.items():
        f = fields[name]
        if f.dtype != dtype or f.shape != shape:
            fields_at[name].fail(f"expected {dtype} of shape {list(shape)}, got {f.dtype} "
                                 f"{list(f.shape)}")
    q, dist = fields["draft_q"], fields["draft_dist"]
    if q.offset < dist.offset + dist.nbytes and dist.offset < q.offset + q.nbytes:
        fields_at.fail("draft_q and draft_dist overlap")
    return RatioIo(offset, nbytes, fields)


def _mixed(at: At, entries: dict[str, EntryPoint], packing: PrefillPacking | None,
           rows: dict[str, list[int]]) -> int:
    """Checks the mixed entries (mixed_P_B: a packed prefill_P's rows, then decode_B's lanes;
    only with prefill_packing, P of a prefill entry from min_rows, B of a decode entry) and
    returns the most lanes one has (0: none)."""
    shapes = [mixed_shape(name) for name in entries if name.startswith("mixed_")]
    for p, b in shapes:
        if packing is None or p not in rows["prefill"] or p < packing.min_rows \
                or b not in rows["decode"]:
            at[f"mixed_{p}_{b}"].fail(
                "a mixed entry needs prefill_packing, a prefill entry of its P rows (from "
                "min_rows on) and a decode entry of its B lanes")
    return max((b for _, b in shapes), default=0)


def _prefill_packing(s: At, max_seqs: int, max_chunk: int) -> PrefillPacking | None:
    """The schedule's prefill_packing: absent (None), or seqs 2..max_seqs, align 1..max_chunk
    and min_rows (checked against the prefill entries by the caller)."""
    at = s.get("prefill_packing")
    if at is None:
        return None
    if max_seqs < 2:
        at.fail("packs prefill chunks of several sequences, but max_seqs is 1")
    return PrefillPacking(at["seqs"].int(2, max_seqs), at["align"].int(1, max_chunk),
                          at["min_rows"].int(1, max_chunk))


def _drafter(s: At, io: dict[str, Field], version: int, rows: dict[str, list[int]],
             drafts: int, max_seqs: int) -> int:
    """A version 9 or 10 schedule's drafter: draft_{B} beside every decode_{B} (and none in
    other versions), draft_tokens, and the draft io fields; returns the state width H (0:
    none)."""
    if version not in DRAFTER_VERSIONS:
        if rows["draft"]:
            s["entries"].fail(f"has draft entries (rows {rows['draft']}) but version {version} "
                              f"(a drafter's schedule is version {DRAFTER_SCHEDULE_VERSION})")
        return 0
    if not drafts:
        s.fail(f"a version {version} schedule (a drafter's) has draft_tokens")
    if rows["draft"] != rows["decode"]:
        s["entries"].fail(f"draft entries of rows {rows['draft']}: one beside each decode "
                          f"entry (rows {rows['decode']})")
    for name in DRAFT_IO_FIELDS:
        if name not in io:
            s["io"].fail(f"missing the drafter's io field {name!r}")
    state, step = io["draft_state"], io["draft_step"]
    hidden = state.shape[1] if len(state.shape) == 2 else 0
    if state.dtype != "float32" or state.shape != (max_seqs, hidden) or not hidden:
        s["io"]["draft_state"].fail(f"expected float32 of shape [{max_seqs}, H], got "
                                    f"{state.dtype} {list(state.shape)}")
    if step.dtype != "int32" or step.shape != (drafts, max_seqs):
        s["io"]["draft_step"].fail(f"expected int32 of shape [{drafts}, {max_seqs}], got "
                                   f"{step.dtype} {list(step.shape)}")
    return hidden


def _draft_tokens(s: At, max_chunk: int) -> int:
    """The schedule's draft_tokens: absent (0), or 1..max_chunk - 1 (a token and its drafts are
    one verify lane's rows, at most a prefill chunk's)."""
    at = s.get("draft_tokens")
    return 0 if at is None else at.int(1, max_chunk - 1)


def _sampler(s: At, version: int, io_end: int, arena_bytes: int, max_seqs: int,
             max_context: int, vocab: int) -> SamplerIo | None:
    """The sampled entries' inputs: required in a one-GPU schedule (SCHEDULE_VERSION), absent
    from a tensor-parallel rank's (TP_SCHEDULE_VERSION: collectives, no sampler)."""
    at = s.get("sampler")
    if version == TP_SCHEDULE_VERSION:
        if at is not None:
            at.fail(f"a version {version} schedule (a tensor-parallel rank's) has no sampler")
        return None
    if at is None:
        s.fail(f"a version {version} schedule has a sampler (the sampled entries' inputs)")
    offset = at["offset"].int(0, MAX_BYTES)
    nbytes = at["nbytes"].int(1, MAX_BYTES)
    if offset != io_end or offset + nbytes > arena_bytes:
        at.fail(f"the region [{offset}, {offset + nbytes}) must start where io ends ({io_end}) "
                f"and end inside the arena ({arena_bytes})")
    top = at["top_logprobs"].int(1, MAX_TOP_LOGPROBS)
    pen = at["penalty_ids"].int(1, INT32_MAX)
    if pen != min(max_context, vocab):
        at["penalty_ids"].fail(f"{pen}, not min(max_context, vocab_size) = "
                               f"{min(max_context, vocab)}")
    words = at["mask_words"].int(1, INT32_MAX)
    if vocab % 32 or words != vocab // 32:
        at["mask_words"].fail(f"{words}, not vocab_size / 32 ({vocab} / 32)")
    fields_at = at["fields"]
    fields = {name: _field(f, (offset, offset + nbytes))
              for name, f in fields_at.members().items()}
    if sorted(fields) != sorted(SAMPLE_IO_FIELDS):
        fields_at.fail(f"expected the fields {', '.join(SAMPLE_IO_FIELDS)}, got "
                       f"{', '.join(fields)}")
    end = offset
    for name, dtype in SAMPLE_IO_FIELDS.items():
        f = fields[name]
        shape = (max_seqs * (words + 2 * pen),) if name == "pool" else (max_seqs,)
        if f.dtype != dtype or f.shape != shape:
            fields_at[name].fail(f"expected {dtype} of shape {list(shape)}, got {f.dtype} "
                                 f"{list(f.shape)}")
        if f.offset < end:
            fields_at[name].fail(f"starts at byte {f.offset}, inside the field before it "
                                 f"({', '.join(SAMPLE_IO_FIELDS)} in that order)")
        end = f.offset + f.nbytes
    if end != offset + nbytes:
        fields_at["pool"].fail("the pool must end the region (the host writes a prefix)")
    return SamplerIo(offset, nbytes, top, pen, words, fields)


def _sampled_entries(at: At, entries: dict[str, EntryPoint], sampler: bool) -> None:
    """With a sampler, a sampled_decode_{B} / sampled_prefill_{T} beside every decode_{B} /
    prefill_{T} (and no other); without, none."""
    names = set(entries)
    sampled = {n for n in names if n.startswith(SAMPLED)}
    want = {SAMPLED + n for n in names if n.startswith(("decode_", "prefill_"))} if sampler \
        else set()
    for name in sorted(sampled ^ want):
        if name not in sampled:
            at.fail(f"lacks entry {name!r} (a sampled entry beside each decode and prefill "
                    "entry)")
        at.fail(f"has entry {name!r} " + ("without its plain entry" if sampler else
                                           "but no sampler (version 7 has both)"))
    for name in sorted(sampled):
        plain = entries[name.removeprefix(SAMPLED)]
        if entries[name].rows != plain.rows or entries[name].graph != plain.graph:
            at[name].fail(f"must have the rows and graph flag of {plain.name}")


def _templates(at: At | None) -> dict[str, ParamsTemplate]:
    out = {}
    for name, t in (at.members(4096) if at is not None else {}).items():
        if not _ARG_NAME.fullmatch(name):
            t.fail("a template is named like a C identifier")
        try:
            out[name] = ParamsTemplate.from_json(t.obj())
        except ParamsTemplateError as e:
            t.fail(str(e))
    return out


def min_table_width(ring: bool, window: int, block: int, max_context: int,
                    max_chunk: int) -> int:
    """Block-table entries a sequence needs: a full table spans the context; a ring the window
    behind a chunk's first token plus the chunk, and a block of slack, unless that is more than
    the context (as both targets lay them out)."""
    full = -(-max_context // block)
    return min(full, -(-(window + max_chunk - 1) // block) + 1) if ring else full


def _need(at: At, rows: list[int], want: int, kind: str, what: str) -> None:
    if not rows or rows[-1] != want:
        at.fail(f"{what} must be {kind}_{want} (has {kind} rows {rows})")


def _kv(at: At, max_context: int, max_chunk: int) -> KvLayout:
    block = at["block_size"].int(1, 1 << 16)
    kinds = []
    for k in at["kinds"].items(1, 2):
        name = k["name"].str(("full", "sliding"))
        ring = k["ring"].bool()
        width = k["table_width"].int(1, MAX_ROWS)
        window = k["window"].int(*((1, max_context * 64) if ring else (0, 0)))
        if ring != (name == "sliding"):
            k["ring"].fail(f"the {name} kind {'must not' if ring else 'must'} be a ring")
        need = min_table_width(ring, window, block, max_context, max_chunk)
        if width < need:
            k["table_width"].fail(f"{width} blocks of {block} tokens cannot hold the "
                                  f"{'window and a chunk' if ring else 'context'}; need {need}")
        kinds.append(KvKindLayout(name, k["io_field"].str(pattern=r"table_\w+"), width, ring,
                                  window))
    if len({k.name for k in kinds}) != len(kinds) or len({k.io_field for k in kinds}) != len(kinds):
        at["kinds"].fail("names a KV kind or io field twice")
    dtype = at["kv_dtype"].str(KV_DTYPES)
    row = block * KV_BYTES[dtype]  # a block holds whole rows of its tokens' values
    names = tuple(k.name for k in kinds)
    pools = []
    for p in at["pools"].items(1, MAX_POOLS):
        nbytes = p["block_bytes"].int(row, MAX_BYTES >> 20)
        if nbytes % row:
            p["block_bytes"].fail(f"{nbytes} is not a whole number of rows of {block} "
                                  f"{dtype} tokens ({row} bytes each)")
        pools.append(KvPool(p["kind"].str(names), p["layer"].int(0, MAX_ROWS), nbytes))
    unused = [k for k in names if not any(p.kind == k for p in pools)]
    if unused:
        at["pools"].fail(f"no pool of KV kind {unused[0]!r}")
    return KvLayout(block, dtype, tuple(kinds), tuple(pools))


def _field(at: At, region: tuple[int, int]) -> Field:
    shape = tuple(d.int(1, MAX_ROWS * 1024) for d in at["shape"].items(1, 2))
    f = Field(at["offset"].int(0, MAX_BYTES), at["dtype"].str(IO_DTYPES), shape)
    if f.offset < region[0] or f.offset + f.nbytes > region[1]:
        at.fail(f"bytes [{f.offset}, {f.offset + f.nbytes}) fall outside their region "
                f"[{region[0]}, {region[1]})")
    return f


def _entry(at: At, key: str, cubins: dict[str, Cubin], arena_bytes: int, pools: int,
           templates: dict[str, ParamsTemplate], version: int) -> EntryPoint:
    m = re.fullmatch(r"(?:sampled_(?=decode|prefill))?(decode|prefill|logits|verify|draft)_"
                     r"([1-9][0-9]{0,6})", key)
    mixed = mixed_shape(key)
    if not (m or mixed):
        at.fail("an entry point is named decode_N, prefill_N, logits_N, verify_N, draft_N, "
                "sampled_decode_N, sampled_prefill_N or mixed_P_B")
    want = sum(mixed) if mixed else int(m[2])
    name = at["name"].str()
    rows = at["rows"].int(1, MAX_ROWS)
    if name != key or rows != want:
        at.fail(f"entry {key} must be named {key} with {want} rows, not {name!r} with {rows}")
    ranges = {"ptr": (0, arena_bytes - 1), "null": (0, 0), "pool": (0, pools - 1),
              "i32": (INT32_MIN, INT32_MAX),
              "i64": (-(1 << 63), (1 << 63) - 1), "f32": (-FLOAT32_MAX, FLOAT32_MAX)}
    names: set[str] = set()  # argument names already checked
    kernels: set[str] = set()  # kernel names already checked
    launches = tuple(_collective(x, arena_bytes) if version == TP_SCHEDULE_VERSION
                     and isinstance(x.value, dict) and "op" in x.value
                     else _launch(x, cubins, ranges, names, kernels, templates)
                     for x in at["launches"].items(1))
    return EntryPoint(name, rows, at["graph"].bool(), launches)


def _collective(at: At, arena_bytes: int) -> Collective:
    """A collective step: its float32 [rows, cols] source inside the arena, and its destination
    at least as large (an all-gather's holds every rank's; the manifest checks the rank count)."""
    op = at["op"].str()
    if op not in COLLECTIVE_OPS:
        at["op"].fail(f"expected one of {', '.join(COLLECTIVE_OPS)}")
    rows, cols = at["rows"].int(1, MAX_ROWS), at["cols"].int(1, INT32_MAX)
    nbytes = 4 * rows * cols
    src, dst = at["src"].int(0, arena_bytes - nbytes), at["dst"].int(0, arena_bytes - nbytes)
    if op == "all_reduce" and src != dst:
        at["dst"].fail("an all-reduce is in place: dst == src")
    return Collective(op, src, dst, rows, cols)


def _launch(at: At, cubins: dict[str, Cubin], ranges: dict[str, tuple],
            names: set[str], kernels: set[str],
            templates: dict[str, ParamsTemplate]) -> Launch:
    """`ranges`: each argument kind's allowed values (pointers inside the arena); `names` and
    `kernels`: the argument and kernel names known to be well formed; `templates`: the
    parameter blocks by name. A schedule holds thousands of launches, so a well-formed one is
    checked directly on the JSON values (_plain_launch); the first that is not goes through At,
    which names what is wrong."""
    plain = _plain_launch(at.value, cubins, kernels)
    if plain is not None:
        return Launch(*plain, _args(at["args"], ranges, names, templates))
    module = at["module"].str()
    if module not in cubins:
        at["module"].fail(f"launches module {module!r}, which has no cubin in the artifact")
    grid = tuple(d.int(1, hi) for d, hi in zip(at["grid"].items(3, 3), MAX_GRID, strict=True))
    block = tuple(d.int(1, hi) for d, hi in zip(at["block"].items(3, 3), MAX_BLOCK, strict=True))
    if math.prod(block) > MAX_THREADS:
        at["block"].fail(f"{math.prod(block)} threads per block; CUDA allows {MAX_THREADS}")
    return Launch(module, at["kernel"].str(pattern=_KERNEL_NAME.pattern), grid, block,
                  at["smem"].int(0, MAX_SMEM), _args(at["args"], ranges, names, templates))


def _plain_launch(x: Any, cubins: dict[str, Cubin], kernels: set[str]) -> tuple | None:
    """(module, kernel, grid, block, smem) of launch `x` when every one of them passes the
    checks _launch makes through At; None otherwise (At then finds what is wrong)."""
    if type(x) is not dict:
        return None
    module, kernel, smem = x.get("module"), x.get("kernel"), x.get("smem")
    grid, block = x.get("grid"), x.get("block")
    if type(module) is not str or module not in cubins or type(kernel) is not str:
        return None
    if kernel not in kernels:
        if len(kernel) > 4096 or not _KERNEL_NAME.fullmatch(kernel):
            return None
        kernels.add(kernel)
    if type(smem) is not int or not 0 <= smem <= MAX_SMEM:
        return None
    dims = []
    for d, limits in ((grid, MAX_GRID), (block, MAX_BLOCK)):
        if type(d) is not list or len(d) != 3:
            return None
        for v, hi in zip(d, limits, strict=True):
            if type(v) is not int or not 1 <= v <= hi:
                return None
        dims.append((d[0], d[1], d[2]))
    if dims[1][0] * dims[1][1] * dims[1][2] > MAX_THREADS:
        return None
    return module, kernel, dims[0], dims[1], smem


def _args(at: At, ranges: dict[str, tuple], names: set[str],
          templates: dict[str, ParamsTemplate]) -> tuple[Arg, ...]:
    """A launch's arguments. Schedules hold hundreds of thousands, so well-formed ones are
    checked directly on the JSON values; the first that is not goes through At, which names
    what is wrong."""
    values = at.value
    if isinstance(values, list) and len(values) <= MAX_ARGS:
        args = []
        for a in values:
            if type(a) is not dict or len(a) != 3:
                break
            name, kind, value = a.get("name"), a.get("kind"), a.get("value")
            if type(name) is not str:
                break
            if name not in names:
                if not _ARG_NAME.fullmatch(name):
                    break
                names.add(name)
            if type(kind) is not str:
                break
            if kind == "params":
                value = _plain_block(value, ranges["ptr"], templates)
                if value is None:
                    break
            elif kind in ranges:
                lo, hi = ranges[kind]
                plain = type(value) is int or (kind == "f32" and type(value) is float
                                               and math.isfinite(value))
                if not plain or not lo <= value <= hi:
                    break
            else:
                break
            args.append(Arg(name, kind, value))
        else:
            if len({a.name for a in args}) == len(args):
                return tuple(args)
    args = []
    seen = set()
    for a in at.items(0, MAX_ARGS):
        extra = sorted(set(a.obj()) - {"name", "kind", "value"})
        if extra:
            a.fail(f"unknown key {extra[0]!r} (an argument is {{name, kind, value}})")
        name = a["name"].str(pattern=_ARG_NAME.pattern)
        if name in seen:
            a["name"].fail(f"argument {name!r} appears twice in the launch")
        seen.add(name)
        kind = a["kind"].str(ARG_KINDS)
        value = a["value"]
        if kind == "params":
            args.append(Arg(name, kind, _block(value, ranges["ptr"], templates)))
            continue
        args.append(Arg(name, kind, value.number(*ranges[kind]) if kind == "f32"
                        else value.int(*ranges[kind])))
    return tuple(args)


def _plain_block(v: Any, ptr: tuple[int, int],
                 templates: dict[str, ParamsTemplate]) -> ParamsBlock | None:
    """The ParamsBlock of a "params" argument's value `v` when it passes every check _block
    makes; None otherwise (_block then names what is wrong)."""
    if type(v) is not dict or len(v) != 2:
        return None
    name, roles = v.get("template"), v.get("roles")
    template = templates.get(name) if type(name) is str else None
    if template is None or type(roles) is not dict or len(roles) > 64:
        return None
    lo, hi = ptr
    for offset in roles.values():
        if type(offset) is not int or not lo <= offset <= hi:
            return None
    if sorted(roles) != sorted(template.roles):
        return None
    return ParamsBlock(name, dict(roles))


def _block(at: At, ptr: tuple[int, int], templates: dict[str, ParamsTemplate]) -> ParamsBlock:
    """A "params" argument: one of `templates` by name and an arena offset for each of its
    roles."""
    extra = sorted(set(at.obj()) - {"template", "roles"})
    if extra:
        at.fail(f"unknown key {extra[0]!r} (a parameter block is {{template, roles}})")
    name = at["template"].str(tuple(templates) or ("(none)",))
    roles = {role: v.int(*ptr) for role, v in at["roles"].members(64).items()}
    if sorted(roles) != sorted(templates[name].roles):
        at["roles"].fail(f"roles {sorted(roles)}; template {name} has "
                         f"{sorted(templates[name].roles)}")
    return ParamsBlock(name, roles)
