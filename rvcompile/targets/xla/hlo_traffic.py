"""Where a compiled program's bytes go: a per-instruction traffic table from its optimized HLO.

Input: the text of a compiled executable's optimized HLO module (`compiled.as_text()`). Output:
`Traffic`, one row per top-level instruction that moves bytes (fusions, dots, copies, collectives
...; never the fused instructions inside a fusion), each with the bytes it reads, split by what
they are, and the bytes it writes, and the number of times it runs in one call of the program.

Counting, per instruction, as XLA's HloCostAnalysis counts bytes accessed: each operand's bytes
read plus the output's bytes written, with these refinements (the ones XLA makes for fusions): an
operand a fusion only slices (`dynamic-slice`, `slice`, `gather` of it, or a nested fusion that
only slices it) reads the slices' bytes; an operand only updated in place (operand 0 of
`dynamic-update-slice` or `scatter`) reads nothing and the write is the update's bytes; an async
op (`*-start`) writes its output, not the operands its tuple shape repeats, and `slice-start`
reads its slice. Nothing is counted for parameter, constant, tuple,
get-tuple-element, bitcast, while, conditional, call and an async op's `*-done` (the computations
they call are walked instead). A collective TPU runs asynchronously inside other instructions
counts once, at its start (`Row.collective`): copied into libtpu's async collective fusions
(a start fusion, the fusions beside it, a done fusion) or offloaded to a SparseCore (a
`call-start` of a computation holding it). Sizes are logical (elements x dtype size; no tile
padding). Bytes in an on-chip memory space (a layout's `S(n)`, n > 0: TPU VMEM and the like)
are counted and also summed apart as `on_chip`, since they are not HBM traffic.

Runs: the entry computation runs once; a while loop's body runs its trip count times the loop's
own runs (the trip count read from the condition: `counter < N` with the counter's initial value
a constant in the loop's operand tuple, or XLA's `known_trip_count`); each branch of a
conditional is counted as if it ran (an upper bound), and each row records the branches it is
in, by the name of a BRANCHES scope around the conditional (the sampler's, the penalties', the
log-probabilities') or else the conditional's own, so that `total(taken=...)` counts a step that
runs given branches (cost_report.STEP_CASES: a greedy step, a top-k step). A loop whose trip
count depends on the data: the span loop of blockwise attention (lower.attention_blockwise,
named SPAN_LOOP in the metadata) runs `span_loop_trips` times at a stated `context` (every lane
of the step decoding at position context - 1: one trip per `span` blocks of the keys it needs);
any other such loop, or the span loop with no context given, is counted once and listed in
`unknown_trips`. The decode attention kernel (targets/xla/paged_kernel.py, a Mosaic custom
call named PALLAS_DECODE in the metadata) takes whole KV pools as operands but DMAs a few pages
of them: its KV reads are the pages its grid and index maps fetch for lanes decoding at
`context` (every lane at the most pages its table or window holds with no context given), its
other operands and its output whole (`_decode_kernel_row`); what it moves inside VMEM is not
counted, as a fusion's inner reads are not. XLA's TPU cost analysis counts a scan body once;
the table's `once` totals count every instruction once, for comparison with it.

Classes of bytes, by tracing an operand through get-tuple-element, bitcast, copies and loop
carries to the program's parameters, as `jax.export` names them in the HLO metadata
(`args[0]['name']`: the weights; `args[1][...]`: the KV pools; other args: io; a jitted
function's HLO names them by its parameters, given as `roots`):
  weights     weight arrays other than embedding tables
  embeddings  weight arrays named `*embed*` (token and per-layer-input tables)
  kv          KV pools
  io          the program's other arguments (tokens, positions, block tables, ...)
  temps       values computed from weights, embeddings or KV and at least half as large as the
              source they come from (widened or relaid copies, gathered KV): materialized and
              read again
  activations every other computed value (and constants)
A write is classed as kv when the output aliases a KV operand, as temps or activations otherwise
by the rule above.

Whole copies (`Traffic.whole_copies`): a row that writes a temp after reading at least half of
one weight matrix or embedding table (a stacked layer array counts per layer: its bytes over its
leading axis) and writes at least half of what it read, other than an async `copy-start` into
on-chip memory (TPU prefetches small weights into VMEM whole: read once, for their users). Such
an instruction materializes a widened or relaid copy of a whole weight, where a decode step
should read each weight byte once, in the instruction that uses it (TPU: a relayout of a
gathered-from int8 table, a layer's experts sliced out of their stack before a gather; any
target: a convert of a weight ahead of a dot).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from rvcompile.targets.xla.mlp_kernel import STACKED_FIRST
from rvcompile.targets.xla.paged_kernel import (
    BLOCK_TOKENS,
    PALLAS_DECODE_POOLS,
    kernel_slot_pages,
    needed_pages,
)

CLASSES = ("weights", "embeddings", "kv", "io", "temps", "activations")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# TPU's async collective fusion (libtpu's xla_tpu_enable_async_collective_fusion_fuse_*): the
# collective copied into a start fusion, the fusions that run beside it and a done fusion; the
# start fusion, by this name, counts it once (as a SparseCore offload's `call-start` counts the
# collective it calls)
ASYNC_COLLECTIVE_START = "async-collective-start"
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                 "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2,
                 "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                 "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True))
                    + r")\[([\d,]*)\](\{[^}]*\})?")
_MEMSPACE = re.compile(r"S\((\d+)\)")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while",
         "conditional", "call", "copy-done", "after-all", "partition-id", "replica-id",
         "all-reduce-done", "all-gather-done", "collective-permute-done", "send-done",
         "recv-done", "opt-barrier"}
# ops whose output holds operand 0's values (or a part of them): their output keeps its class
_PASS = {"get-tuple-element", "bitcast", "copy", "copy-start", "copy-done", "reshape",
         "transpose", "slice-start", "slice-done", "all-gather-start", "all-gather-done"}
_SLICERS = {"dynamic-slice", "slice", "gather"}
_ARG = re.compile(r"op_name=\"(\w+(?:\[\d+\])?)(?:\[\\*'([^'\\]+)\\*'\])?")
# the named scope of blockwise attention's span loop: blocks a span, window tokens (0: a full
# layer), table width in blocks (lower.attention_blockwise)
SPAN_LOOP = "rvkv_spans_s{span}_w{window}_n{width}"
_SPAN_LOOP = re.compile(r'op_name="[^"]*rvkv_spans_s(\d+)_w(\d+)_n(\d+)/while"')
# the decode attention kernel's named scope (paged_kernel.PALLAS_DECODE): lanes, pages a grid
# step reads per pool, window tokens (0: a full layer), table width in blocks, pools it pages
# (an int8 pool's scale row pool is paged beside it)
_PALLAS_DECODE = re.compile(
    r'op_name="[^"]*rvkv_pallas_b(\d+)_p(\d+)_w(\d+)_n(\d+)_k(\d+)/')
# the named scope of a kernel over stacked layer weights (mlp_kernel.PALLAS_STACKED): the
# stacks' layers, its stacked weight operands
_PALLAS_STACKED = re.compile(r'op_name="[^"]*rvstacked_[a-z]+_n(\d+)_w(\d+)/')
# the named scope of a conditional whose branches a step picks by its requests (the sampler's
# greedy / top-k / sort, penalties, log-probabilities): its rows carry (name, branch) so a
# step's bytes can count the branches it runs (Traffic.total(taken=...))
BRANCHES = "rvbranch_{name}"
_BRANCHES = re.compile(r'op_name="[^"]*rvbranch_(\w+)/')


def span_loop_trips(context: int, span: int, window: int, width: int) -> int:
    """Trips of a span loop when every lane decodes at position `context` - 1: its blocks from
    the first key it needs (0, or `window` keys back) to its own, at most the table's `width`,
    `span` blocks a trip."""
    last = context - 1
    lo = max(last - window + 1, 0) // BLOCK_TOKENS if window else 0
    needed = min(last // BLOCK_TOKENS + 1 - lo, width)
    return -(-needed // span)


@dataclass(frozen=True)
class Instr:
    name: str
    shape: str  # the HLO shape text, layout included
    opcode: str
    operands: tuple[str, ...]
    attrs: str  # everything after the operand list

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%?[\w.\-]+)", self.attrs)
        return m.group(1).lstrip("%") if m else None


@dataclass(frozen=True)
class Computation:
    name: str
    instrs: dict[str, Instr]  # in program order
    root: str
    is_entry: bool


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at `start`."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    closing = set(pairs.values())
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced HLO text: {text[start:start + 80]!r}")


def _parse_instr(line: str) -> tuple[bool, Instr]:
    body = line.strip()
    root = body.startswith("ROOT ")
    body = body.removeprefix("ROOT ")
    name, rest = body.split(" = ", 1)
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op_end = rest.index("(")
    opcode = rest[:op_end]
    close = _balanced(rest, op_end)
    args = rest[op_end + 1:close - 1]
    operands = tuple(m.group(1) for m in re.finditer(r"%([\w.\-]+)", args))
    if opcode in ("constant", "parameter", "iota"):
        operands = ()
    return root, Instr(name.lstrip("%"), shape, opcode, operands, args + rest[close:])


def parse_module(text: str) -> dict[str, Computation]:
    """Computations of an HLO module's text, by name."""
    comps, current, instrs, root, entry = {}, None, {}, "", False
    for line in text.splitlines():
        if current is None:
            m = re.match(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$", line)
            if m:
                current, instrs, root, entry = m.group(2), {}, "", bool(m.group(1))
            continue
        if line.startswith("}"):
            comps[current] = Computation(current, instrs, root, entry)
            current = None
            continue
        if " = " not in line:
            continue
        is_root, ins = _parse_instr(line)
        instrs[ins.name] = ins
        if is_root:
            root = ins.name
    return comps


def shape_bytes(shape: str, on_chip_only: bool = False) -> float:
    """Logical bytes of every array in an HLO shape (a tuple's elements summed)."""
    total = 0.0
    for m in _ARRAY.finditer(shape):
        space = _MEMSPACE.search(m.group(3) or "")
        if on_chip_only and not (space and int(space.group(1)) > 0):
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        total += math.prod(dims) * _DTYPE_BYTES[m.group(1)]
    return total


def _tuple_element(shape: str, index: int) -> str:
    """The shape text of element `index` of a tuple shape."""
    inner, parts, depth, cur = shape[1:-1], [], 0, ""
    for c in inner:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    parts.append(cur)
    parts = [re.sub(r"/\*index=\d+\*/", "", p).strip() for p in parts]
    return parts[index]


@dataclass(frozen=True)
class Row:
    """One instruction that moves bytes; bytes per run, `runs` times per call of the program."""

    computation: str
    name: str
    opcode: str  # "fusion:kLoop", "convolution", ...
    calls: str  # the fused computation, for fusions
    runs: int
    read: dict[str, float]  # class -> bytes read per run
    written: float
    written_class: str
    on_chip: float  # of read + written, bytes in an on-chip memory space
    whole_copy: bool = False  # copies at least half of a weight matrix or table (not a prefetch)
    # the branches of conditionals this instruction runs in, outermost first: (the name of a
    # BRANCHES scope, or the conditional's own name, branch index)
    branches: tuple[tuple[str, int], ...] = ()
    # an async collective fusion's start (ASYNC_COLLECTIVE_START) or a SparseCore call-start:
    # its collective's opcode and output bytes (the message); "" and 0 for every other row
    collective: str = ""
    message: float = 0.0

    def runs_in(self, taken: dict[str, int] | None) -> bool:
        """Whether a step that runs branch taken[name] of each named conditional runs this row
        (conditionals not named in `taken`: every branch counted)."""
        return not taken or all(taken.get(n, i) == i for n, i in self.branches)

    @property
    def bytes(self) -> float:
        return sum(self.read.values()) + self.written


@dataclass(frozen=True)
class Traffic:
    rows: tuple[Row, ...]
    unknown_trips: tuple[str, ...]  # while loops counted once: trip count not readable
    trips: dict[str, int] = field(default_factory=dict)  # while instruction -> trip count
    span_loops: tuple[str, ...] = ()  # of `trips`, the span loops counted at the given context

    def total(self, scaled: bool = True, taken: dict[str, int] | None = None) -> float:
        """Bytes a call moves; `taken`: only the given branches of those conditionals (see
        Row.runs_in), else every branch of every conditional (an upper bound)."""
        return sum(r.bytes * (r.runs if scaled else 1) for r in self.rows if r.runs_in(taken))

    def branch_names(self) -> set[str]:
        """The names of the conditionals whose rows carry their branch (BRANCHES scopes)."""
        return {n for r in self.rows for n, _ in r.branches}

    def by_class(self, scaled: bool = True,
                 taken: dict[str, int] | None = None) -> dict[str, dict[str, float]]:
        """class -> {"read": bytes, "written": bytes}, per call of the program."""
        out = {c: {"read": 0.0, "written": 0.0} for c in CLASSES}
        for r in self.rows:
            if not r.runs_in(taken):
                continue
            k = r.runs if scaled else 1
            for c, b in r.read.items():
                out[c]["read"] += b * k
            out[r.written_class]["written"] += r.written * k
        return out

    def on_chip(self, scaled: bool = True, taken: dict[str, int] | None = None) -> float:
        return sum(r.on_chip * (r.runs if scaled else 1) for r in self.rows if r.runs_in(taken))

    def collectives(self, taken: dict[str, int] | None = None) -> dict[str, dict[str, float]]:
        """op ("all-reduce", "all-gather", ...) -> {"count": runs per call, "bytes": bytes per
        call of their outputs (an all-reduce's message)}; async ops by their `*-start`, an
        async collective fusion by its start (Row.collective); `taken`: only those in the
        given branches (Row.runs_in), else every branch."""
        out: dict[str, dict[str, float]] = {}
        for r in self.rows:
            op = r.collective or r.opcode.removesuffix("-start")
            if not r.runs_in(taken):
                continue
            if op in COLLECTIVES:
                c = out.setdefault(op, {"count": 0, "bytes": 0.0})
                c["count"] += r.runs
                c["bytes"] += (r.message if r.collective else r.written) * r.runs
        return out

    def whole_copies(self) -> tuple[Row, ...]:
        """Instructions that materialize a whole weight matrix or table (see `Row.whole_copy`):
        a decode step should meet each weight byte once, in the instruction that uses it."""
        return tuple(r for r in self.rows if r.whole_copy)


class _Program:
    """The parsed module with what tracing needs: who calls each computation, and how."""

    def __init__(self, comps: dict[str, Computation], roots: tuple[str, str]):
        self.comps, self.roots = comps, roots
        self.entry = next(c for c in comps.values() if c.is_entry)
        self.caller: dict[str, tuple[str, Instr]] = {}  # body/branch -> (computation, instr)
        for c in comps.values():
            for ins in c.instrs.values():
                if ins.opcode == "while":
                    self.caller[ins.attr("body")] = (c.name, ins)
                elif ins.opcode == "conditional":
                    m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                    for b in (m.group(1).split(",") if m else ()):
                        self.caller[b.strip().lstrip("%")] = (c.name, ins)
                    for key in ("true_computation", "false_computation"):
                        if ins.attr(key):
                            self.caller[ins.attr(key)] = (c.name, ins)
                elif ins.opcode == "call":
                    self.caller[ins.attr("to_apply")] = (c.name, ins)
        self._origin: dict[tuple[str, str, tuple[int, ...]], tuple[str, float]] = {}

    def trip_count(self, comp: Computation, loop: Instr) -> int | None:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attrs)
        if m:
            return int(m.group(1))
        cond = self.comps.get(loop.attr("condition"))
        if cond is None:
            return None
        root = cond.instrs[cond.root]
        if root.opcode != "compare" or "direction=LT" not in root.attrs:
            return None
        counter, bound = (cond.instrs.get(o) for o in root.operands)
        if not (counter and bound and bound.opcode == "constant"
                and counter.opcode == "get-tuple-element"):
            return None
        index = int(counter.attr("index"))
        init = self._tuple_operand(comp, loop.operands[0], index)
        while init is not None and init.opcode in ("copy", "bitcast"):
            init = comp.instrs.get(init.operands[0])
        if init is None or init.opcode != "constant":
            return None
        return int(_constant(bound)) - int(_constant(init))

    def _tuple_operand(self, comp: Computation, name: str, index: int) -> Instr | None:
        ins = comp.instrs.get(name)
        if ins is None or ins.opcode != "tuple":
            return None
        return comp.instrs.get(ins.operands[index])

    def origin(self, comp: str, name: str, index: tuple[int, ...] = ()) -> tuple[str, float]:
        """(class, source bytes) of value `name` (element `index` of a tuple) in `comp`."""
        key = (comp, name, index)
        if key not in self._origin:
            self._origin[key] = ("activations", 0.0)  # a cycle is never a source
            self._origin[key] = self._trace(comp, name, index)
        return self._origin[key]

    def _trace(self, comp_name: str, name: str, index: tuple[int, ...]) -> tuple[str, float]:
        comp = self.comps[comp_name]
        ins = comp.instrs[name]
        op = ins.opcode
        if op == "parameter":
            if comp.is_entry:
                cls = _param_class(ins, self.roots)
                if cls in ("weights", "embeddings"):  # one matrix: a stacked array's layer
                    return cls, _matrix_bytes(ins)
                return cls, shape_bytes(ins.shape)
            if comp_name in self.caller:
                parent, call = self.caller[comp_name]
                if call.opcode == "while":
                    return self.origin(parent, call.operands[0], index)
                if call.opcode == "conditional":
                    branch = _branch_index(call, comp_name)
                    if branch is not None and branch + 1 < len(call.operands):
                        return self.origin(parent, call.operands[branch + 1], index)
                if call.opcode == "call":
                    k = int(re.match(r"\s*(\d+)", ins.attrs).group(1))
                    return self.origin(parent, call.operands[k], index)
            return "activations", shape_bytes(ins.shape)
        if op == "get-tuple-element":
            return self.origin(comp_name, ins.operands[0], (int(ins.attr("index")), *index))
        if op == "tuple" and index:
            return self.origin(comp_name, ins.operands[index[0]], index[1:])
        if op == "while" and index:
            return self.origin(comp_name, ins.operands[0], index)
        if op in _PASS and ins.operands:
            return self.origin(comp_name, ins.operands[0], ())
        if op == "fusion" and "output_to_operand_aliasing" in ins.attrs:
            m = re.search(r"output_to_operand_aliasing=\{\{[^}]*\}: \((\d+),", ins.attrs)
            if m:
                cls, src = self.origin(comp_name, ins.operands[int(m.group(1))])
                if cls == "kv":
                    return cls, src
        out = shape_bytes(ins.shape)
        if op in ("fusion", "dynamic-update-slice", "scatter") and len(index) <= 1:
            if index:  # one output of a multi-output fusion
                out = shape_bytes(_tuple_element(ins.shape, index[0]))
            for o in ins.operands:  # a pool updated in place stays the pool
                cls, src = self.origin(comp_name, o)
                if cls == "kv" and src == out:
                    return cls, src
        # a computed value: a temp if it is a large copy of the weights/embeddings/KV it reads
        # (a widened, relaid or sliced copy: at least half the bytes read from that source)
        reads = _access(self.comps, comp, ins)[0]
        best = 0.0
        for k, o in enumerate(ins.operands):
            if self.origin(comp_name, o)[0] in ("weights", "embeddings", "kv"):
                best = max(best, reads.get(k, 0.0))
        if best and out >= best / 2:
            return "temps", out
        return "activations", out


def _constant(ins: Instr) -> float:
    m = re.match(r"\s*\(?\s*(-?[\d.e+]+)", ins.attrs)
    return float(m.group(1)) if m else float("nan")


def _branch_index(call: Instr, branch: str) -> int | None:
    m = re.search(r"branch_computations=\{([^}]*)\}", call.attrs)
    if m:
        names = [b.strip().lstrip("%") for b in m.group(1).split(",")]
        return names.index(branch) if branch in names else None
    return 0 if call.attr("true_computation") == branch else 1


def _case_index(call: Instr, branch: str) -> int:
    """The index of a conditional's branch as jax numbers them: lax.switch's list order, and
    lax.cond's (false, true) (an XLA conditional on a predicate: true_computation is 1)."""
    if call.attr("true_computation"):
        return int(call.attr("true_computation") == branch)
    return _branch_index(call, branch)


_STACKED = re.compile(r"g\d+\.\d+\.")  # a layer group's stacked weight (program.LayoutPlan)


def _matrix_bytes(ins: Instr) -> float:
    """Bytes of one matrix of a weight parameter: a stacked array's (program.LayoutPlan) over its
    layers (the leading axis); infinite for vectors and scalars (norms) and for per-row scales
    (`*.scale`, experts' scales stacked by expert too), which are never counted as whole
    copies."""
    m = _ARG.search(ins.attrs)
    if m and (m.group(2) or "").endswith(".scale"):
        return math.inf
    dims = [int(d) for d in _ARRAY.search(ins.shape).group(2).split(",") if d]
    if m and m.group(2) and _STACKED.match(m.group(2)):
        dims = dims[1:]
    if len([d for d in dims if d > 1]) < 2:
        return math.inf
    return shape_bytes(ins.shape) * math.prod(dims) / math.prod(
        int(d) for d in _ARRAY.search(ins.shape).group(2).split(",") if d)


def _param_class(ins: Instr, roots: tuple[str, str]) -> str:
    m = _ARG.search(ins.attrs)
    if not m:
        return "io"
    if m.group(1) == roots[0]:
        return "embeddings" if "embed" in (m.group(2) or "") else "weights"
    return "kv" if m.group(1) == roots[1] else "io"


def _fused_reads(fused: Computation, param_bytes: dict[int, float],
                 comps: dict[str, Computation]) -> tuple[dict, float | None]:
    """Bytes a fusion reads of each operand (slices only where only sliced, also by a nested
    fusion that only slices it; nothing where only updated in place), and the bytes it writes
    when its root updates in place (else None): a dynamic-update-slice, or a scatter whose
    output aliases its operand, writes its update."""
    params = {int(re.match(r"\s*(\d+)", i.attrs).group(1)): i.name
              for i in fused.instrs.values() if i.opcode == "parameter"}
    users: dict[str, list[tuple[Instr, int]]] = {}
    for i in fused.instrs.values():
        for k, o in enumerate(i.operands):
            users.setdefault(o, []).append((i, k))

    def uses(name: str) -> list[tuple[Instr, int]]:
        """Users of `name`, looking through ops that only relayout it (copies, bitcasts, nested
        copy fusions): an element a slice does not take is never read."""
        out = []
        for u, k in users.get(name, []):
            same = shape_bytes(u.shape) == shape_bytes(fused.instrs[name].shape)
            if same and len(u.operands) == 1 and u.opcode in ("copy", "bitcast", "fusion"):
                out += uses(u.name)
            else:
                out.append((u, k))
        return out

    def sliced(u: Instr, k: int, whole: float) -> float | None:
        """Bytes that use `u` reads of its operand `k` if it reads part of it, else None."""
        if k == 0 and u.opcode in _SLICERS:
            return shape_bytes(u.shape)
        if k == 0 and u.opcode in ("dynamic-update-slice", "scatter"):
            return 0.0
        if u.opcode == "fusion" and u.attr("calls") in comps:
            got = _fused_reads(comps[u.attr("calls")], {k: whole}, comps)[0].get(k, whole)
            return got if got < whole else None
        return None

    reads = {}
    for n, pname in params.items():
        whole = param_bytes.get(n, 0.0)
        parts = [sliced(u, k, whole) for u, k in uses(pname)]
        reads[n] = sum(parts) if parts and None not in parts else whole
    root = fused.instrs[fused.root]
    roots = ([fused.instrs[o] for o in root.operands] if root.opcode == "tuple" else [root])
    if all(r.opcode == "dynamic-update-slice" for r in roots):
        return reads, sum(shape_bytes(fused.instrs[r.operands[1]].shape) for r in roots)
    if all(r.opcode == "scatter" and len(r.operands) == 3 for r in roots):
        return reads, sum(shape_bytes(fused.instrs[r.operands[2]].shape) for r in roots)
    return reads, None


EXPORTED = ("args[0]", "args[1]")  # the weights' and the pools' argument, as jax.export names them


def traffic(hlo_text: str, roots: tuple[str, str] = EXPORTED,
            context: int | None = None) -> Traffic:
    """The traffic table of an optimized HLO module (see the module docstring); `roots`: the
    names of the weights' and the KV pools' arguments in the HLO metadata (a jitted function's
    own parameter names, e.g. ("weights", "pools")); `context`: the tokens every lane holds
    after the step, which sets the span loops' trips (None: counted once, as unknown)."""
    prog = _Program(parse_module(hlo_text), roots)
    rows, unknown, trips, spans = [], [], {}, []

    def walk(comp: Computation, runs: int, branches: tuple[tuple[str, int], ...] = ()) -> None:
        for ins in comp.instrs.values():
            if ins.opcode == "while":
                n = prog.trip_count(comp, ins)
                span = _SPAN_LOOP.search(ins.attrs)
                if n is None and span and context is not None:
                    n = span_loop_trips(context, *map(int, span.groups()))
                    spans.append(ins.name)
                if n is None:
                    unknown.append(ins.name)
                trips[ins.name] = n if n is not None else 1
                walk(prog.comps[ins.attr("body")], runs * trips[ins.name], branches)
                continue
            if ins.opcode in ("conditional", "call"):
                named = _BRANCHES.search(ins.attrs)
                for callee, (_, c) in prog.caller.items():
                    if c is ins:
                        inner = branches
                        if ins.opcode == "conditional":
                            label = named.group(1) if named else ins.name
                            inner = (*branches, (label, _case_index(ins, callee)))
                        walk(prog.comps[callee], runs, inner)
                continue
            if ins.opcode in _FREE or ins.opcode.endswith("-done"):
                continue
            row = _row(prog, comp, ins, runs)
            kernel = _PALLAS_DECODE.search(ins.attrs) if ins.opcode == "custom-call" else None
            if kernel:
                row = _decode_kernel_row(prog, comp, ins, row, *map(int, kernel.groups()),
                                          context)
            stacked = _PALLAS_STACKED.search(ins.attrs) if ins.opcode == "custom-call" else None
            if stacked:
                row = _stacked_kernel_row(prog, comp, ins, row, *map(int, stacked.groups()))
            rows.append(dataclasses.replace(row, branches=branches))

    walk(prog.entry, 1)
    return Traffic(tuple(rows), tuple(unknown), trips, tuple(spans))


def _access(comps: dict[str, Computation], comp: Computation,
            ins: Instr) -> tuple[dict[int, float], float]:
    """(bytes read of each operand, bytes written) of one instruction."""
    nbytes = {k: shape_bytes(_operand_shape(comp, o)) for k, o in enumerate(ins.operands)}
    written = shape_bytes(ins.shape)
    if ins.opcode == "fusion":
        reads, in_place = _fused_reads(comps[ins.attr("calls")], nbytes, comps)
        return reads, (in_place if in_place is not None else written)
    if ins.opcode in _SLICERS:
        return {**nbytes, 0: written}, written
    if ins.opcode == "dynamic-update-slice":
        return {**nbytes, 0: 0.0}, nbytes.get(1, 0.0)
    if ins.opcode == "scatter" and len(ins.operands) == 3:  # in place, as XLA emits it
        return {**nbytes, 0: 0.0}, nbytes.get(2, 0.0)
    if ins.opcode == "copy-start":  # (destination, source, context)
        return nbytes, shape_bytes(_tuple_element(ins.shape, 0))
    if ins.opcode.endswith("-start") and ins.shape.startswith("("):
        # an async op's shape is (operands, output, context...): it writes the output
        out = shape_bytes(_tuple_element(ins.shape, 1))
        return ({0: out} if ins.opcode == "slice-start" else nbytes), out
    return nbytes, written


def _row(prog: _Program, comp: Computation, ins: Instr, runs: int) -> Row:
    shapes = [_operand_shape(comp, o) for o in ins.operands]
    reads, written = _access(prog.comps, comp, ins)
    calls = (ins.attr("calls") or "") if ins.opcode == "fusion" else ""
    read = {c: 0.0 for c in CLASSES}
    on_chip, whole = 0.0, False
    for k, b in reads.items():
        cls, matrix = prog.origin(comp.name, ins.operands[k])
        read[cls] += b
        # at least half of one weight matrix (a stacked array's layer) or table read, and at
        # least half as many bytes written: a widened or relaid copy of the whole thing
        whole |= cls in ("weights", "embeddings") and b >= matrix / 2 and written >= b / 2
        if b and shape_bytes(shapes[k], on_chip_only=True):
            on_chip += b
    if shape_bytes(ins.shape, on_chip_only=True):
        on_chip += written
    out_class = prog.origin(comp.name, ins.name)[0]
    if out_class in ("weights", "embeddings"):
        out_class = "temps"  # a copy of (part of) a weight array
    elif out_class not in ("kv", "temps"):
        out_class = "activations"
    kind = ins.attr("kind") if ins.opcode == "fusion" else None
    # an async prefetch into on-chip memory (TPU VMEM) reads the weight once, for its users
    prefetch = ins.opcode == "copy-start" and shape_bytes(_tuple_element(ins.shape, 0), True)
    started = (calls if ins.name.startswith(ASYNC_COLLECTIVE_START)
               else ins.attr("to_apply") if ins.opcode == "call-start" else None)
    inner = next((i for i in prog.comps[started].instrs.values() if i.opcode in COLLECTIVES),
                 None) if started else None
    return Row(comp.name, ins.name, f"fusion:{kind}" if kind else ins.opcode, calls, runs,
               {c: b for c, b in read.items() if b}, written, out_class, on_chip,
               whole and not prefetch and out_class == "temps",
               collective=inner.opcode if inner else "",
               message=shape_bytes(inner.shape) if inner else 0.0)


def _decode_kernel_row(prog: _Program, comp: Computation, ins: Instr, row: Row, lanes: int,
                       pages: int, window: int, width: int, pools: int,
                       context: int | None) -> Row:
    """The decode kernel's custom call (paged_kernel.py), whose operands include whole KV pools
    [n, blocks, 16, K * D] (and scale row pools [n, blocks, 1, S]) it reads a few pages of:
    its page-slot operands (from PALLAS_DECODE_POOLS on, `pages` of them for each of its
    `pools` pools, by the kernel's operand order) read, for each of `lanes` lanes, the pages
    their slot DMAs (`kernel_slot_pages`) at the lanes' `needed_pages`, of one block's bytes
    each, as KV. Its
    other operands (block table, positions, query; a K=V layer's k_norm weight and
    frequencies) and its output count whole, as the kernel reads and writes them once. Bytes in
    on-chip memory (a pool XLA placed in VMEM) are summed apart as for any row."""
    needed = needed_pages(context, window, width)
    slots = range(PALLAS_DECODE_POOLS, PALLAS_DECODE_POOLS + pools * pages)
    if len(ins.operands) < slots.stop:
        raise ValueError(f"{ins.name}: {len(ins.operands)} operands, expected at least "
                         f"{slots.stop} ({PALLAS_DECODE_POOLS} before the pools, {pages} page "
                         f"slots of each of {pools} pools)")
    read = {c: 0.0 for c in CLASSES}
    on_chip = shape_bytes(ins.shape, on_chip_only=True)
    for k, o in enumerate(ins.operands):
        shape = _operand_shape(comp, o)
        if k in slots:
            dims = [int(d) for d in _ARRAY.search(shape).group(2).split(",") if d]
            page = shape_bytes(shape) / (dims[0] * dims[1])  # one block of one layer
            cls = "kv"
            b = lanes * kernel_slot_pages(needed, (k - slots.start) % pages, pages) * page
        else:
            cls, b = prog.origin(comp.name, o)[0], shape_bytes(shape)
        read[cls] += b
        if shape_bytes(shape, on_chip_only=True):
            on_chip += b
    return dataclasses.replace(row, read={c: b for c, b in read.items() if b}, on_chip=on_chip)


def _stacked_kernel_row(prog: _Program, comp: Computation, ins: Instr, row: Row, layers: int,
                        weights: int) -> Row:
    """A kernel's custom call over stacked layer weights (mlp_kernel.py, proj_kernel.py),
    whose `weights` weight operands from STACKED_FIRST on are the layer scan's stacks of
    `layers` layers, of which its grid DMAs one layer's tiles once: each counts its bytes /
    `layers`. Its other operands and its outputs count whole, as for any row."""
    read = {c: 0.0 for c in CLASSES}
    on_chip = shape_bytes(ins.shape, on_chip_only=True)
    stacked = range(STACKED_FIRST, STACKED_FIRST + weights)
    for k, o in enumerate(ins.operands):
        shape = _operand_shape(comp, o)
        b = shape_bytes(shape) / (layers if k in stacked else 1)
        read[prog.origin(comp.name, o)[0]] += b
        if shape_bytes(shape, on_chip_only=True):
            on_chip += b
    return dataclasses.replace(row, read={c: b for c, b in read.items() if b}, on_chip=on_chip)


def _operand_shape(comp: Computation, name: str) -> str:
    ins = comp.instrs.get(name)
    return ins.shape if ins is not None else ""
