"""The kernel schedule of an H100 artifact, as stored in its manifest: written by the build
(targets/h100), read by the runtime, so it imports nothing from the compiler.

Everything lives in ONE device allocation, the arena. Regions, in order: the packed weights
(byte for byte the artifact's "weights" section, uploaded with one copy), constants (section
"constants"), the paged KV pools, the host-written inputs ("io": one copy per call) and the
activations (reused by liveness). A launch's pointer arguments are arena byte offsets.

An entry point is an ordered launch list over `rows` token rows: `decode_{B}` (B sequences, one
token each; captured into a CUDA graph), `prefill_{T}` (T tokens of one sequence) and
`logits_{T}` (same, keeping every row's softcapped logits). Before a call the host fills the io
fields for the entry's rows: tokens, positions (-1 = padding), seq_len (keys a row sees), one
block-table row per token row and KV kind, the prefill's last real row, the sampling
parameters; afterwards it reads `out_tokens` (and `logits`).

A launch either passes `args` (scalars and arena pointers, one kernel parameter each) or, for a
kernel that takes one large struct by value (CUTLASS's GEMM), `params`: the name of one of the
schedule's `params_templates` (artifacts/kernel_params.py) and the arena byte offset of each of
the template's roles. The runtime completes the template once per arena address (runtime/tma.py)
and passes the bytes as the kernel's one parameter; `args` is then empty.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rvcompile.artifacts.kernel_params import ParamsTemplate

ARG_KINDS = ("ptr", "null", "i32", "i64", "f32")
# Header requirement "kernel_launch": how the runtime may launch the artifact's kernels.
# "programmatic": every kernel opens with griddepcontrol.wait, so each may be launched with
# programmatic stream serialization (start while its predecessor runs). Artifacts without it
# were built before that and are refused: rebuilding them takes minutes.
KERNEL_LAUNCH = "programmatic"


@dataclass(frozen=True)
class Arg:
    kind: str  # one of ARG_KINDS; "ptr": value is an arena byte offset
    value: int | float = 0


@dataclass(frozen=True)
class ParamsBlock:
    """A by-value parameter block: which template, and where each of its roles lives."""

    template: str  # a key of KernelSchedule.params_templates
    roles: dict[str, int]  # role -> arena byte offset of that buffer


@dataclass(frozen=True)
class Launch:
    module: str  # the cubin (kernel source stem) holding `kernel`
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: tuple[Arg, ...]
    params: ParamsBlock | None = None  # instead of args (module docstring)


@dataclass(frozen=True)
class Field:
    """A host-visible array in the arena."""

    offset: int
    dtype: str  # "int32" or "float32"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class EntryPoint:
    name: str
    rows: int
    graph: bool  # captured into a CUDA graph at load (decode); prefill runs eagerly
    launches: tuple[Launch, ...]


@dataclass(frozen=True)
class KvKindLayout:
    """Layers sharing one block table per sequence and one block id space (their pools)."""

    name: str  # "full" or "sliding"
    io_field: str  # the io field holding one table row per token row
    table_width: int
    ring: bool  # sliding: entry j % table_width holds logical block j
    window: int  # tokens; 0 for full attention
    num_blocks: int  # blocks in each pool of this kind


@dataclass(frozen=True)
class KvLayout:
    block_size: int  # tokens per block
    pool_bytes: int  # all layers' pools together
    kv_dtype: str  # "bfloat16", "float8_e4m3fn" (build --kv-cache fp8: e4m3, no scale) or
    #                "float32" (h100-f32)
    kinds: tuple[KvKindLayout, ...]


@dataclass(frozen=True)
class KernelSchedule:
    arena_bytes: int
    weights_bytes: int  # [0, weights_bytes): the weights section
    constants_offset: int
    constants_bytes: int
    kv_offset: int
    io_offset: int
    io_bytes: int
    slots: int  # rows of the widest decode entry; the pools hold this many full sequences
    max_context: int
    max_chunk: int
    vocab_size: int
    kv: KvLayout
    io: dict[str, Field]
    outputs: dict[str, Field]  # out_tokens, logits
    entries: dict[str, EntryPoint]
    cubins: dict[str, dict[str, int | str]]  # module -> {offset, size, sha256} in "cubins"
    # the parameter blocks launches name in `params`, by name
    params_templates: dict[str, ParamsTemplate] = field(default_factory=dict)

    def to_json(self) -> dict:
        """asdict, without the parameter-block fields where no launch has one (a schedule
        without them reads the same)."""
        d = asdict(self)
        for e in d["entries"].values():
            for x in e["launches"]:
                if x["params"] is None:
                    del x["params"]
        del d["params_templates"]
        if self.params_templates:
            d["params_templates"] = {k: t.to_json() for k, t in self.params_templates.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> KernelSchedule:
        def launch(x: dict) -> Launch:
            p = x.get("params")
            return Launch(x["module"], x["kernel"], tuple(x["grid"]), tuple(x["block"]),
                          x["smem"], tuple(Arg(a["kind"], a["value"]) for a in x["args"]),
                          None if p is None else ParamsBlock(p["template"], dict(p["roles"])))

        def field(x: dict) -> Field:
            return Field(x["offset"], x["dtype"], tuple(x["shape"]))

        return cls(
            **{k: d[k] for k in ("arena_bytes", "weights_bytes", "constants_offset",
                                 "constants_bytes", "kv_offset", "io_offset", "io_bytes",
                                 "slots", "max_context", "max_chunk", "vocab_size")},
            kv=KvLayout(d["kv"]["block_size"], d["kv"]["pool_bytes"], d["kv"]["kv_dtype"],
                        tuple(KvKindLayout(**k) for k in d["kv"]["kinds"])),
            io={k: field(v) for k, v in d["io"].items()},
            outputs={k: field(v) for k, v in d["outputs"].items()},
            entries={k: EntryPoint(e["name"], e["rows"], e["graph"],
                                   tuple(launch(x) for x in e["launches"]))
                     for k, e in d["entries"].items()},
            cubins=d["cubins"],
            params_templates={k: ParamsTemplate.from_json(t)
                              for k, t in d.get("params_templates", {}).items()},
        )
