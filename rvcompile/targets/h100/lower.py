"""Lower a fused, FP8-quantized ModelIR to the H100 kernel schedule (artifacts.kernel_schedule).

Input: the IR after the fusion passes, quantized (cast_bf16 + quantize_fp8: h100-fp8) or all
float32 (h100-f32). Entries follow the dtypes the IR carries: with every matrix float32 the plan
keeps activations, the values linears read and the KV pools float32 (the `_f32` entries, each
linear a float32 GEMV per 4 rows, prefill attention through the decode kernel a row each), else
linears read bf16 copies and FP8 weights. Each graph is walked in node
order and every node becomes kernel launches over symbolic pointers (`Ref`); an attention
cluster (q/k/v slices, norms, RoPE, KV writes, cache positions, attention) is recognised as a
whole and becomes qkv_post, then split-KV attention + combine for decode, or for a chunk of
more than one row (prefill, logits) the flash-style attn_prefill. A residual + post-norm is
emitted as `residual_rmsnorm`, and the RMSNorm that reads its result (the next pre-norm, across
layer boundaries too) is folded into the same launch. Whatever has no kernel stops the build
with a `LoweringError` naming the op and graph.

Then the layout: weights packed (the members of a fused GEMV adjacent, so one launch reads
them), constants, paged KV pools (per cache-owning layer: `slots * blocks` blocks of 16
tokens; sliding layers a ring of window + chunk - 1 tokens rounded up to blocks; K=V layers one
pool of normalised bases; KV-shared layers read their producer's; bf16, or e4m3 (half the
bytes) when the IR's caches are, in an FP8-KV build, or float32 in a float32 build), the io
fields and the activations, planned per entry by liveness (memory_plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rvcompile.artifacts.kernel_schedule import (
    Arg,
    EntryPoint,
    Field,
    KernelSchedule,
    KvKindLayout,
    KvLayout,
    Launch,
)
from rvcompile.config import LayerSpec
from rvcompile.dtypes import numpy_dtype
from rvcompile.ir import ops
from rvcompile.ir.graph import Graph, ModelIR, Node, resolve_param
from rvcompile.ir.ops import Op
from rvcompile.targets.h100 import (
    attn_decode,
    attn_prefill,
    gelu_mul,
    gemm_fp8w,
    gemv_bf16,
    gemv_f32,
    gemv_fp8,
    head,
    memory_plan,
    moe,
    norms,
    ple,
    qkv_post,
    rows,
    sample,
)

SM_COUNT = 132  # H100 SXM; split counts and persistent grids are sized for it
BLOCK = attn_decode.BLOCK


class LoweringError(ValueError):
    """The IR holds something the H100 kernels do not implement; the message names it."""


@dataclass(frozen=True)
class Ref:
    """A pointer before layout: a region, a key inside it, a byte offset from there."""

    region: str  # "weights", "const", "kv", "io", "act"
    key: object
    offset: int = 0

    def at(self, nbytes: int) -> Ref:
        return Ref(self.region, self.key, self.offset + nbytes)


@dataclass(frozen=True)
class _Launch:
    module: str
    kernel: str
    geometry: gemv_fp8.Launch
    args: tuple  # Ref | ("i32", v) | ("f32", v) | None (null pointer)


@dataclass
class _Val:
    """An activation [rows, cols]: its float32 value and/or the copy linears read (`lin`: bf16 in
    a quantized plan; in a float32 plan float32, usually the same buffer)."""

    cols: int
    f32: Ref | None = None
    lin: Ref | None = None


@dataclass(frozen=True)
class _Gelu:
    """GELU_TANH of a GEMV output, computed by the kernel that consumes it."""

    x: _Val


@dataclass(frozen=True)
class _PleGated:
    """gelu_tanh(gate) * ple[:, :, layer]: the per-layer input, computed inside ple_project."""

    gate: _Val
    layer: int


@dataclass
class _Pending:
    """A residual_rmsnorm (launch `index`) whose "next norm" weight and output are open."""

    index: int


@dataclass
class WeightSlot:
    offset: int
    nbytes: int


@dataclass(frozen=True)
class H100Lowering:
    schedule: KernelSchedule
    constants: bytes
    slots_by_param: dict[str, list[WeightSlot]]
    modules: tuple[str, ...]  # kernel sources the schedule launches


def _i32(v) -> tuple:
    return ("i32", int(v))


def _f32(v) -> tuple:
    return ("f32", float(v))


# ---------------------------------------------------------------- weights and constants

def _fused_groups(ir: ModelIR) -> list[list[str]]:
    """Per layer, the weight names each MULTI_LINEAR / GATED_LINEAR reads in one launch:
    [values..., scales...] in the order the kernel expects them."""
    groups = []
    for li, spec in enumerate(ir.config.layers):
        g = ir.layers[ir.layer_template[li]]
        for n in g.nodes:
            if n.op in (Op.MULTI_LINEAR, Op.GATED_LINEAR):
                names = [resolve_param(g.nodes[i].attrs.name, spec) for i in n.inputs[1:]]
                groups.append(names)
    return groups


def layout_weights(ir: ModelIR) -> tuple[dict[str, WeightSlot], int]:
    """Offsets of every stored weight; a fused group's values are adjacent, and so are its
    scales, each run 256-byte aligned."""
    specs = ir.param_map()

    def nbytes(name: str) -> int:
        s = specs[name]
        return int(np.prod(s.shape)) * numpy_dtype(s.dtype).itemsize

    slots: dict[str, WeightSlot] = {}
    offset = 0
    for group in _fused_groups(ir):
        half = len(group) // 2
        for run in (group[:half], group[half:]):
            offset = memory_plan.align(offset)
            for name in run:
                if name in slots:
                    raise LoweringError(f"weight {name} is in two fused groups")
                slots[name] = WeightSlot(offset, nbytes(name))
                offset += nbytes(name)
    for p in ir.params:
        if p.name not in slots:
            offset = memory_plan.align(offset)
            slots[p.name] = WeightSlot(offset, nbytes(p.name))
            offset += nbytes(p.name)
    return slots, memory_plan.align(offset)


class _Constants:
    def __init__(self):
        self.blobs: list[bytes] = []
        self.offsets: dict[bytes, int] = {}
        self.size = 0

    def add(self, values: np.ndarray) -> Ref:
        b = np.ascontiguousarray(values, np.float32).tobytes()
        if b not in self.offsets:
            self.offsets[b] = self.size
            self.blobs.append(b + bytes(memory_plan.align(len(b)) - len(b)))
            self.size += memory_plan.align(len(b))
        return Ref("const", 0, self.offsets[b])

    def data(self) -> bytes:
        return b"".join(self.blobs)


# ---------------------------------------------------------------- the KV pools and io

@dataclass(frozen=True)
class _Pool:
    layer: int  # the owning layer
    names: tuple[str, ...]  # ("cache_k", "cache_v") or ("cache_kv",)
    ring: bool
    kv_heads: int
    head_dim: int
    table_width: int
    dtype: str  # "bfloat16", "float8_e4m3fn" (an FP8-KV build) or "float32" (h100-f32)


KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float32")


def _pools(ir: ModelIR) -> tuple[dict[int, _Pool], int, int]:
    """(pool per owning layer, full-layer table width, sliding-layer ring width). The ring
    holds every block a step can touch: the window behind a chunk's first query plus the chunk,
    and one more so a block can be swapped in while its predecessor is still read."""
    full = -(-ir.max_context // BLOCK)
    windows = [ir.config.layers[c.layer].window for c in ir.caches if c.ring]
    ring = min(full, -(-(max(windows) + ir.max_chunk - 1) // BLOCK) + 1) if windows else 1
    pools = {}
    for c in ir.caches:
        if c.dtype not in KV_DTYPES:
            raise LoweringError(f"layer {c.layer}: KV cache dtype {c.dtype}; the H100 kernels "
                                "keep bf16 (cast_bf16), e4m3 (kv_fp8) or float32 caches")
        pools[c.layer] = _Pool(c.layer, c.names, c.ring, c.kv_heads, c.head_dim,
                               ring if c.ring else full, c.dtype)
    if len({p.dtype for p in pools.values()}) > 1:
        raise LoweringError("KV caches of different dtypes; one schedule keeps one")
    return pools, full, ring


def _io_fields(max_rows: int, full: int, ring: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {
        "tokens": ("int32", (max_rows,)),
        "positions": ("int32", (max_rows,)),
        "seq_len": ("int32", (max_rows,)),
        "last_row": ("int32", (1,)),
        "table_full": ("int32", (max_rows, full)),
        "table_ring": ("int32", (max_rows, ring)),
        "temperature": ("float32", (max_rows,)),
        "top_k": ("int32", (max_rows,)),
        "top_p": ("float32", (max_rows,)),
        "seed": ("int32", (max_rows,)),
        "step": ("int32", (max_rows,)),
    }


def float32_activations(ir: ModelIR) -> bool:
    """Whether the plan keeps activations float32: every matrix of the IR (linears, tables) is
    float32, as in a build without cast_bf16 and quantize_fp8. Else linears read bf16 copies."""
    return all(p.dtype == "float32" for p in ir.params if len(p.shape) >= 2)


# ---------------------------------------------------------------- one entry point

class _EntryLowering:
    """Walks embed, every layer, head and sampler for one entry point of `rows` token rows."""

    def __init__(self, ir: ModelIR, kind: str, rows: int, consts: _Constants,
                 pools: dict[int, _Pool]):
        self.ir, self.kind, self.m = ir, kind, rows
        self.consts, self.pools = consts, pools
        self.cfg = ir.config
        self.specs = ir.param_map()
        self.f32 = float32_activations(ir)
        self.lin_size = 4 if self.f32 else 2  # bytes per element of the copies linears read
        self.clustered = {id(g): _attention_cluster_nodes(g) | _moe_cluster_nodes(g)
                          for g in ir.graphs()}
        self.ple_embed = _trace_ple_embed(ir.embed) if ir.config.ple else None
        if self.ple_embed is not None:
            self.clustered[id(ir.embed)] |= self.ple_embed.consumed
        self.ple: Ref | None = None  # [rows, L, P] f32, the embed graph's per-layer inputs
        self.launches: list[_Launch] = []
        self.sizes: dict[int, int] = {}
        self.pending: _Pending | None = None
        self.softcap: float | None = None
        self.h = self.buffer(rows * self.cfg.hidden_size * 4)  # the residual stream, f32
        self.outputs: dict[str, tuple[Ref, str, tuple[int, ...]]] = {}

    def buffer(self, nbytes: int) -> Ref:
        key = len(self.sizes)
        self.sizes[key] = nbytes
        return Ref("act", key)

    def emit(self, module: str, kernel: str, geometry, *args) -> int:
        self.launches.append(_Launch(module, kernel, geometry, tuple(args)))
        return len(self.launches) - 1

    # -- graph walk

    def run(self) -> None:
        self.ple = self.walk(self.ir.embed, None).get("ple")
        for li, spec in enumerate(self.cfg.layers):
            self.walk(self.ir.layers[self.ir.layer_template[li]], spec)
        logits = self.walk(self.ir.head, None)["logits"]
        self.close_pending()
        self.walk(self.ir.sampler, None, {"logits": logits})

    def walk(self, g: Graph, spec: LayerSpec | None, inputs: dict | None = None) -> dict:
        """Lower g; its outputs' values by name."""
        env: dict[int, object] = {}
        clustered = self.clustered[id(g)]
        for idx, n in enumerate(g.nodes):
            if idx in clustered:
                continue
            if n.op == Op.ARG and inputs and n.attrs.name in inputs:
                env[idx] = inputs[n.attrs.name]
                continue
            try:
                env[idx] = self.node(g, idx, n, env, spec)
            except LoweringError as e:
                raise LoweringError(f"graph {g.name}, node %{idx} ({n.op.value}): {e}") from None
        return {name: env.get(i) for name, i in g.outputs}

    def param(self, g: Graph, idx: int, spec: LayerSpec | None) -> str:
        name = g.nodes[idx].attrs.name
        return resolve_param(name, spec) if spec is not None else name

    def node(self, g: Graph, idx: int, n: Node, env, spec):
        op = n.op
        if op == Op.ARG:
            return {"h": _Val(self.cfg.hidden_size, f32=self.h)}.get(n.attrs.name,
                                                                      ("arg", n.attrs.name))
        if op == Op.PARAM:
            return ("param", self.param(g, idx, spec))
        if op == Op.EMBED:
            return self.embed(g, n, spec)
        if self.ple_embed is not None and g is self.ir.embed and idx == self.ple_embed.out:
            return self.per_layer_inputs(g, env)
        if op == Op.GELU_TANH:
            x = env[n.inputs[0]]
            if not (isinstance(x, _Val) and x.f32 is not None):
                raise LoweringError("gelu_tanh of a value with no float32 copy")
            return _Gelu(x)
        if op == Op.MUL:
            return self.ple_gated(g, n, env, spec)
        if op == Op.RMSNORM:
            return self.rmsnorm(g, n, env, spec)
        if op == Op.MOE:
            return self.moe(g, idx, env, spec)
        if op == Op.RESIDUAL_RMSNORM and g.nodes[n.inputs[1]].op == Op.MOE:
            return self.moe_branch_sum(g, n, env, spec)
        if op == Op.RESIDUAL_RMSNORM:
            return self.residual(g, n, env, spec)
        if op in (Op.LINEAR, Op.MULTI_LINEAR):
            return self.linear(g, n, env, spec)
        if op == Op.GATED_LINEAR:
            return self.gated(g, n, env, spec)
        if op == Op.ATTENTION:
            return self.attention(g, idx, env, spec)
        if op == Op.RESHAPE:
            src = env[n.inputs[0]]
            if not isinstance(src, _Val):
                raise LoweringError("reshape of a non-activation")
            return _Val(int(n.shape[-1]) if n.shape[-1] != "T" else src.cols, src.f32, src.lin)
        if op == Op.SOFTCAP:
            self.softcap = n.attrs.cap
            return self.softcapped(env[n.inputs[0]])
        if op == Op.SAMPLE:
            return self.sample(env[n.inputs[0]])
        raise LoweringError(f"no H100 kernel implements {op.value!r}")

    # -- ops

    def embed(self, g: Graph, n: Node, spec):
        table = self.param_name(g, n.inputs[0], spec)
        ids = g.nodes[n.inputs[1]]
        if ids.op != Op.ARG or ids.attrs.name != "tokens":
            raise LoweringError("embedding ids other than the step's tokens")
        dtype = self.specs[table].dtype
        hdim = self.cfg.hidden_size
        if dtype == "bfloat16":
            self.emit(head.SOURCE, head.EMBED_BF16_ENTRY, head.embed_geometry(self.m, hdim, False),
                      Ref("weights", table), Ref("io", "tokens"), _f32(n.attrs.multiplier),
                      self.h, _i32(hdim))
        elif dtype == "float32":
            self.emit(head.SOURCE, head.EMBED_F32_ENTRY,
                      head.embed_geometry(self.m, hdim, False, f32=True), Ref("weights", table),
                      Ref("io", "tokens"), _f32(n.attrs.multiplier), self.h, _i32(hdim))
        elif dtype == "float8_e4m3fn":
            self.emit(head.SOURCE, head.EMBED_FP8_ENTRY, head.embed_geometry(self.m, hdim, True),
                      Ref("weights", table), Ref("weights", f"{table}.scale"),
                      Ref("io", "tokens"), _f32(n.attrs.multiplier), self.h, _i32(hdim))
        else:
            raise LoweringError(f"embedding table dtype {dtype}")
        return _Val(hdim, f32=self.h)

    def param_name(self, g: Graph, idx: int, spec) -> str:
        if g.nodes[idx].op != Op.PARAM:
            raise LoweringError("expected a weight")
        return self.param(g, idx, spec)

    def rmsnorm(self, g: Graph, n: Node, env, spec):
        x = env[n.inputs[0]]
        if not isinstance(x, _Val) or x.f32 is None or len(n.shape) != 3:
            raise LoweringError("rmsnorm over something other than a float32 [B, T, H] value")
        if len(n.inputs) < 2:
            raise LoweringError("rmsnorm without a weight outside attention")
        w = Ref("weights", self.param_name(g, n.inputs[1], spec))
        hdim = x.cols
        y = self.buffer(self.m * hdim * self.lin_size)
        if self.pending is not None and x.f32 == self.h:
            self.fill_pending(w, y)
        else:
            entry = norms.RMSNORM_F32_ENTRY if self.f32 else norms.RMSNORM_ENTRY
            self.emit(norms.SOURCE, entry, norms.launch_geometry(self.m, hdim),
                      x.f32, w, y, _i32(hdim), _f32(n.attrs.eps))
        return _Val(hdim, f32=y if self.f32 else None, lin=y)

    def residual(self, g: Graph, n: Node, env, spec):
        h, x = env[n.inputs[0]], env[n.inputs[1]]
        if not (isinstance(h, _Val) and h.f32 == self.h):
            raise LoweringError("residual add into something other than the residual stream")
        if not (isinstance(x, _Val) and x.f32 is not None):
            raise LoweringError("residual add of a value with no float32 copy")
        self.close_pending()
        hdim = self.cfg.hidden_size
        w_post = Ref("weights", self.param_name(g, n.inputs[2], spec))
        scalar = (Ref("weights", self.param_name(g, n.inputs[3], spec)) if len(n.inputs) > 3
                  else self.consts.add(np.ones(1)))
        args = [self.h, x.f32, w_post, scalar, None, None, _i32(hdim), _f32(n.attrs.eps)]
        entry = norms.RESIDUAL_F32_ENTRY if self.f32 else norms.RESIDUAL_ENTRY
        index = self.emit(norms.SOURCE, entry, norms.launch_geometry(self.m, hdim), *args)
        self.pending = _Pending(index)
        return _Val(hdim, f32=self.h)

    def close_pending(self) -> None:
        """The launch always writes a normed copy; with no next norm to fold, it goes to a
        scratch buffer through a weight of ones."""
        if self.pending is not None:
            hdim = self.cfg.hidden_size
            self.fill_pending(self.consts.add(np.ones(hdim)),
                              self.buffer(self.m * hdim * self.lin_size))

    def fill_pending(self, w_next: Ref, y: Ref) -> None:
        launch = self.launches[self.pending.index]
        args = list(launch.args)
        args[4], args[5] = w_next, y
        self.launches[self.pending.index] = _Launch(launch.module, launch.kernel,
                                                    launch.geometry, tuple(args))
        self.pending = None

    def gemv(self, x: Ref, w: Ref, scale: Ref | None, y: Ref, rows: int, n: int, k: int) -> None:
        """y[rows, n] = x[rows, k] (bf16) @ W^T: the streaming GEMV up to its MAX_ROWS rows, the
        tensor-core GEMM beyond (FP8 weights); the bf16 head GEMV in groups of MAX_ROWS. Float32
        weights (x float32 too): the float32 GEMV in groups of MAX_ROWS."""
        if self.specs[w.key].dtype == "float32":
            for r0 in range(0, rows, gemv_f32.MAX_ROWS):
                r = min(gemv_f32.MAX_ROWS, rows - r0)
                self.emit(gemv_f32.SOURCE, gemv_f32.ENTRY,
                          gemv_f32.launch_geometry(r, n, k, SM_COUNT), w, x.at(r0 * k * 4),
                          y.at(r0 * n * 4), _i32(r), _i32(n), _i32(k))
            return
        if scale is not None and rows > gemv_fp8.MAX_ROWS:
            g = gemm_fp8w.launch_geometry(rows, n, k, SM_COUNT)
            self.emit(gemm_fp8w.SOURCE, g.entry, gemv_fp8.Launch(g.grid, g.block, g.smem), w,
                      scale, x, y, _i32(rows), _i32(n), _i32(k))
            return
        step = gemv_fp8.MAX_ROWS
        for r0 in range(0, rows, step):
            r = min(step, rows - r0)
            xr, yr = x.at(r0 * k * 2), y.at(r0 * n * 4)
            if scale is None:
                self.emit(gemv_bf16.SOURCE, gemv_bf16.ENTRY,
                          gemv_bf16.launch_geometry(r, n, k, SM_COUNT), w, xr, yr, _i32(r),
                          _i32(n), _i32(k))
            else:
                self.emit(gemv_fp8.SOURCE, gemv_fp8.ENTRY,
                          gemv_fp8.launch_geometry(r, n, k, SM_COUNT), w, scale, xr, yr, _i32(r),
                          _i32(n), _i32(k))

    def linear_weights(self, g: Graph, n: Node, spec, count: int):
        names = [self.param_name(g, i, spec) for i in n.inputs[1:]]
        values, scales = names[:count], names[count:]
        dtypes = {self.specs[v].dtype for v in values}
        if dtypes == {"float8_e4m3fn"} and len(scales) == count:
            return values, scales
        if dtypes == {"bfloat16"} and not scales and count == 1:
            return values, []
        if dtypes == {"float32"} and not scales:
            return values, []
        raise LoweringError(f"linear weights of dtype {sorted(dtypes)}: the H100 GEMVs take "
                            "FP8 with per-row scales (or the bf16 tied head), or float32")

    def linear(self, g: Graph, n: Node, env, spec):
        x = env[n.inputs[0]]
        if isinstance(x, _PleGated):
            return self.ple_project(g, n, x, spec)
        self.residual_lin(x)
        if not (isinstance(x, _Val) and x.lin is not None):
            raise LoweringError("linear input has no copy for the GEMV (bf16 or float32)")
        count = n.attrs.count if n.op == Op.MULTI_LINEAR else 1
        values, scales = self.linear_weights(g, n, spec, count)
        rows_out = sum(self.specs[v].shape[0] for v in values)
        k = self.specs[values[0]].shape[1]
        x_ref, rows = x.lin, self.m
        if g is self.ir.head and self.kind == "prefill":
            x_ref, rows = self.select_last_row(x.lin, k), 1
        y = self.buffer(rows * rows_out * 4)
        self.gemv(x_ref, Ref("weights", values[0]),
                  Ref("weights", scales[0]) if scales else None, y, rows, rows_out, k)
        return _Val(rows_out, f32=y)

    def residual_lin(self, x) -> None:
        """Give the residual stream read by a LINEAR (the per-layer gate, the per-layer model
        projection of the embedding) its copy for the GEMV: in a float32 plan h itself; else
        bf16, which the pending residual launch writes instead of a normed copy, or (after the
        embedding) a cast."""
        if not (isinstance(x, _Val) and x.f32 == self.h and x.lin is None):
            return
        if self.f32:
            x.lin = self.h
            return
        hdim = self.cfg.hidden_size
        x.lin = self.buffer(self.m * hdim * 2)
        if self.pending is None:
            self.emit(ple.SOURCE, ple.TO_BF16_ENTRY, ple.to_bf16_geometry(self.m * hdim),
                      self.h, x.lin, ("i64", self.m * hdim))
            return
        launch = self.launches[self.pending.index]
        if launch.kernel != norms.RESIDUAL_ENTRY:
            raise LoweringError(f"a bf16 copy of h after {launch.kernel}")
        args = (*launch.args[:4], x.lin, *launch.args[6:])  # w_next and y -> the copy
        self.launches[self.pending.index] = _Launch(
            ple.SOURCE, ple.RESIDUAL_COPY_ENTRY, ple.residual_copy_geometry(self.m, hdim), args)
        self.pending = None

    # -- per-layer inputs (PLE)

    def per_layer_inputs(self, g: Graph, env) -> Ref:
        """The embed graph's `ple` [rows, L, P]: one launch from the model projection's output
        and the per-layer table."""
        c = self.ple_embed
        ctx = env[c.projection]
        table = self.param_name(g, c.table, None)
        entry = {"bfloat16": ple.COMBINE_ENTRY,
                 "float32": ple.COMBINE_F32_ENTRY}.get(self.specs[table].dtype)
        if entry is None:
            raise LoweringError(f"per-layer embedding table dtype {self.specs[table].dtype}; "
                                "ple_combine gathers bf16 or float32 rows")
        layers, p = self.cfg.num_layers, self.cfg.hidden_size_per_layer_input
        out = self.buffer(self.m * layers * p * 4)
        self.emit(ple.SOURCE, entry, ple.combine_geometry(self.m, layers, p),
                  ctx.f32, Ref("weights", table), Ref("io", "tokens"),
                  Ref("weights", self.param_name(g, c.norm_weight, None)), out,
                  _f32(c.ctx_scale), _f32(c.tok_mult), _f32(c.out_scale), _f32(c.eps),
                  _i32(self.m), _i32(layers), _i32(p))
        return out

    def ple_gated(self, g: Graph, n: Node, env, spec):
        gelu, other = env[n.inputs[0]], env[n.inputs[1]]
        if not (isinstance(gelu, _Gelu) and other == ("arg", "ple") and self.ple is not None):
            raise LoweringError("the only MUL with an H100 kernel is gelu_tanh(gate) * ple "
                                "(layer_scalar is folded into residual_rmsnorm)")
        return _PleGated(gelu.x, spec.index)

    def ple_project(self, g: Graph, n: Node, x: _PleGated, spec):
        values, scales = self.linear_weights(g, n, spec, 1)
        hdim, p = self.specs[values[0]].shape
        y = self.buffer(self.m * hdim * 4)
        if self.specs[values[0]].dtype == "float32":
            self.emit(ple.SOURCE, ple.PROJECT_F32_ENTRY,
                      ple.project_geometry(self.m, hdim, p, SM_COUNT, f32=True), x.gate.f32,
                      self.ple, _i32(x.layer), _i32(self.cfg.num_layers),
                      Ref("weights", values[0]), y, _i32(self.m), _i32(hdim), _i32(p))
            return _Val(hdim, f32=y)
        if not scales:
            raise LoweringError("the per-layer projection needs FP8 or float32 weights")
        if ple.use_gemm(self.m, p):
            gated = self.buffer(self.m * p * 2)
            self.emit(ple.SOURCE, ple.GELU_MUL_ENTRY, ple.gelu_mul_geometry(self.m, p),
                      x.gate.f32, self.ple, _i32(x.layer), _i32(self.cfg.num_layers), gated,
                      _i32(self.m), _i32(p))
            self.gemv(gated, Ref("weights", values[0]), Ref("weights", scales[0]), y, self.m,
                      hdim, p)
            return _Val(hdim, f32=y)
        self.emit(ple.SOURCE, ple.PROJECT_ENTRY, ple.project_geometry(self.m, hdim, p, SM_COUNT),
                  x.gate.f32, self.ple, _i32(x.layer), _i32(self.cfg.num_layers),
                  Ref("weights", values[0]), Ref("weights", scales[0]), y, _i32(self.m),
                  _i32(hdim), _i32(p))
        return _Val(hdim, f32=y)

    def select_last_row(self, x: Ref, hdim: int) -> Ref:
        out = self.buffer(hdim * self.lin_size)
        entry = rows.SELECT_F32_ENTRY if self.f32 else rows.SELECT_ENTRY
        self.emit(rows.SOURCE, entry, rows.select_geometry(hdim), x, Ref("io", "last_row"), out,
                  _i32(hdim))
        return out

    def gated(self, g: Graph, n: Node, env, spec):
        x = env[n.inputs[0]]
        if not (isinstance(x, _Val) and x.lin is not None):
            raise LoweringError("gated linear input has no copy for the GEMV (bf16 or float32)")
        values, scales = self.linear_weights(g, n, spec, 2)
        f32 = self.specs[values[0]].dtype == "float32"
        if not (scales or f32):
            raise LoweringError("gated linear needs FP8 or float32 weights")
        inter, k = self.specs[values[0]].shape
        gu = self.buffer(self.m * 2 * inter * 4)
        self.gemv(x.lin, Ref("weights", values[0]), Ref("weights", scales[0]) if scales else None,
                  gu, self.m, 2 * inter, k)
        out = self.buffer(self.m * inter * (4 if f32 else 2))
        self.emit(gelu_mul.SOURCE, gelu_mul.F32_ENTRY if f32 else gelu_mul.ENTRY,
                  gelu_mul.launch_geometry(self.m, inter), gu, out, _i32(inter))
        return _Val(inter, f32=out if f32 else None, lin=out)

    # -- mixture of experts

    def moe(self, g: Graph, idx: int, env, spec):
        """The router chain and the MOE node: both norms of the residual in one launch, the
        router GEMV (bf16), the top-k route, then the experts: per row up to moe.MAX_ROWS rows,
        grouped by expert beyond. The expert ids stay on the device."""
        t = _trace_moe(g, idx)
        r = env[t.residual]
        if not (isinstance(r, _Val) and r.f32 is not None):
            raise LoweringError("MoE norms over a value with no float32 copy")
        if t.gate_up_scale < 0:
            return self.moe_f32(g, t, r, spec)
        router = self.param_name(g, t.router, spec)
        if self.specs[router].dtype != "bfloat16":
            raise LoweringError(f"router weight dtype {self.specs[router].dtype}; the H100 "
                                "router GEMV takes bf16 (run cast_bf16)")
        gate_up, down = (self.param_name(g, i, spec) for i in (t.gate_up, t.down))
        for name in (gate_up, down):
            if self.specs[name].dtype != "float8_e4m3fn":
                raise LoweringError(f"expert weight {name} is {self.specs[name].dtype}; the H100 "
                                    "expert kernels take FP8 with per-row scales")
        experts, two_inter, hdim = self.specs[gate_up].shape
        inter, k, m = two_inter // 2, t.top_k, self.m
        w = {i: Ref("weights", self.param_name(g, i, spec)) for i in (
            t.router_scale, t.expert_norm, t.per_expert_scale, t.gate_up_scale, t.down_scale)}
        z, x2 = self.buffer(m * hdim * 2), self.buffer(m * hdim * 2)
        self.emit(moe.SOURCE, moe.NORMS_ENTRY, moe.norm_geometry(m, hdim), r.f32,
                  w[t.router_scale], _f32(t.router_mul), w[t.expert_norm], z, x2, _i32(hdim),
                  _f32(t.eps))
        logits = self.buffer(m * experts * 4)
        if m <= moe.MAX_ROWS:
            self.gemv(z, Ref("weights", router), None, logits, m, experts, hdim)
        else:
            self.emit(moe.SOURCE, moe.ROUTER_ROWS_ENTRY, moe.router_rows_geometry(m, experts, hdim),
                      z, Ref("weights", router), logits, _i32(m), _i32(experts), _i32(hdim))
        ids, weights = self.buffer(m * k * 4), self.buffer(m * k * 4)
        self.emit(moe.SOURCE, moe.ROUTE_ENTRY, moe.route_geometry(m, experts, k), logits,
                  w[t.per_expert_scale], ids, weights, _i32(experts), _i32(k))
        y = self.buffer(m * hdim * 4)
        gate_up_w = (Ref("weights", gate_up), w[t.gate_up_scale])
        down_w = (Ref("weights", down), w[t.down_scale])
        if m <= moe.MAX_ROWS:  # decode: one launch each, the chosen experts' rows only
            dims = (_i32(m), _i32(k), _i32(inter), _i32(hdim))
            hid = self.buffer(m * k * inter * 2)
            self.emit(moe.SOURCE, moe.GATE_UP_ENTRY,
                      moe.gate_up_geometry(m, k, inter, hdim, SM_COUNT), *gate_up_w, x2, ids,
                      hid, *dims)
            self.emit(moe.SOURCE, moe.DOWN_ENTRY, moe.down_geometry(m, k, inter, hdim, SM_COUNT),
                      *down_w, hid, ids, weights, y, *dims)
            return _Val(hdim, f32=y)
        pairs = m * k  # prefill: the (row, slot) pairs grouped by expert
        order, offsets = self.buffer(pairs * 4), self.buffer((experts + 1) * 4)
        hid, part = self.buffer(pairs * inter * 2), self.buffer(pairs * hdim * 4)
        self.emit(moe.SOURCE, moe.SORT_ENTRY, moe.sort_geometry(pairs, experts), ids, order,
                  offsets, _i32(pairs), _i32(experts))
        self.emit(moe.SOURCE, moe.GATE_UP_GROUPED_ENTRY,
                  moe.gate_up_grouped_geometry(experts, inter, hdim), *gate_up_w, x2, order,
                  offsets, hid, _i32(k), _i32(inter), _i32(hdim))
        self.emit(moe.SOURCE, moe.DOWN_GROUPED_ENTRY,
                  moe.down_grouped_geometry(experts, inter, hdim), *down_w, hid, order, offsets,
                  weights, part, _i32(inter), _i32(hdim))
        self.emit(moe.SOURCE, moe.SUM_PAIRS_ENTRY, moe.sum_pairs_geometry(m, hdim), part, y,
                  _i32(k), _i32(hdim))
        return _Val(hdim, f32=y)

    def moe_f32(self, g: Graph, t: _MoE, r: _Val, spec):
        """The float32 plan's MoE (unquantized experts): moe_norms_f32, the float32 router GEMV,
        moe_route, then one launch each for the experts' gate/up and down at any row count."""
        names = {i: self.param_name(g, i, spec) for i in (
            t.router, t.router_scale, t.expert_norm, t.per_expert_scale, t.gate_up, t.down)}
        for i in (t.router, t.gate_up, t.down):
            if self.specs[names[i]].dtype != "float32":
                raise LoweringError(f"MoE weight {names[i]} is {self.specs[names[i]].dtype} "
                                    "beside unquantized float32 experts")
        w = {i: Ref("weights", name) for i, name in names.items()}
        experts, two_inter, hdim = self.specs[names[t.gate_up]].shape
        inter, k, m = two_inter // 2, t.top_k, self.m
        z, x2 = self.buffer(m * hdim * 4), self.buffer(m * hdim * 4)
        self.emit(moe.SOURCE, moe.NORMS_F32_ENTRY, moe.norm_geometry(m, hdim), r.f32,
                  w[t.router_scale], _f32(t.router_mul), w[t.expert_norm], z, x2, _i32(hdim),
                  _f32(t.eps))
        logits = self.buffer(m * experts * 4)
        self.gemv(z, w[t.router], None, logits, m, experts, hdim)
        ids, weights = self.buffer(m * k * 4), self.buffer(m * k * 4)
        self.emit(moe.SOURCE, moe.ROUTE_ENTRY, moe.route_geometry(m, experts, k), logits,
                  w[t.per_expert_scale], ids, weights, _i32(experts), _i32(k))
        hid, y = self.buffer(m * k * inter * 4), self.buffer(m * hdim * 4)
        dims = (_i32(m), _i32(k), _i32(inter), _i32(hdim))
        self.emit(moe.SOURCE, moe.GATE_UP_F32_ENTRY,
                  moe.expert_f32_geometry(m, k, inter, hdim, SM_COUNT, gate_up=True),
                  w[t.gate_up], x2, ids, hid, *dims)
        self.emit(moe.SOURCE, moe.DOWN_F32_ENTRY,
                  moe.expert_f32_geometry(m, k, inter, hdim, SM_COUNT, gate_up=False),
                  w[t.down], hid, ids, weights, y, *dims)
        return _Val(hdim, f32=y)

    def moe_branch_sum(self, g: Graph, n: Node, env, spec):
        """RESIDUAL_RMSNORM(RMSNORM(f, w1), moe, w2): the dense and expert branches, each
        normed, added in one launch (the inner RMSNORM is part of the MoE cluster)."""
        norm1 = g.nodes[n.inputs[0]]
        if norm1.op != Op.RMSNORM or len(norm1.inputs) != 2 or len(n.inputs) != 3:
            raise LoweringError("MoE branch sum other than rmsnorm(f, w1) + rmsnorm(moe, w2)")
        if norm1.attrs.eps != n.attrs.eps:
            raise LoweringError("MoE branch norms with different eps")
        f, y = env[norm1.inputs[0]], env[n.inputs[1]]
        if not (isinstance(f, _Val) and f.f32 is not None):
            raise LoweringError("MoE dense branch has no float32 copy")
        hdim = self.cfg.hidden_size
        out = self.buffer(self.m * hdim * 4)
        self.emit(moe.SOURCE, moe.BRANCH_SUM_ENTRY, moe.norm_geometry(self.m, hdim), f.f32,
                  Ref("weights", self.param_name(g, norm1.inputs[1], spec)), y.f32,
                  Ref("weights", self.param_name(g, n.inputs[2], spec)), out, _i32(hdim),
                  _f32(n.attrs.eps))
        return _Val(hdim, f32=out)

    def softcapped(self, x):
        if self.kind != "logits":
            return x  # the sampler applies the cap on the fly
        n = self.m * x.cols
        self.emit(rows.SOURCE, rows.SOFTCAP_ENTRY, rows.softcap_geometry(n), x.f32, ("i64", n),
                  _f32(self.softcap))
        self.outputs["logits"] = (x.f32, "float32", (self.m, x.cols))
        return x

    def sample(self, logits):
        """The IR's SAMPLE over softcap(logits), per row from the io sampling fields."""
        if self.kind == "logits":
            return None
        m, v = (1 if self.kind == "prefill" else self.m), logits.cols
        plan = sample.plan(m, v, SM_COUNT)
        ws, out = self.buffer(plan.workspace), self.buffer(m * 4)
        io = {name: Ref("io", name) for name in ("temperature", "top_k", "top_p", "seed", "step")}
        self.emit(sample.SOURCE, sample.PREPARE_ENTRY, plan.prepare, logits.f32, _i32(m), _i32(v),
                  _f32(self.softcap or 0.0), ws)
        self.emit(sample.SOURCE, sample.FILTER_ENTRY, plan.filter, _i32(m), _i32(v),
                  _i32(plan.chunk), io["temperature"], io["top_k"], ws)
        self.emit(sample.SOURCE, sample.PICK_ENTRY, plan.pick, _i32(m), _i32(v),
                  io["temperature"], io["top_k"], io["top_p"], io["seed"], io["step"], ws, out)
        self.outputs["out_tokens"] = (out, "int32", (m,))
        return None

    # -- attention

    def attention(self, g: Graph, idx: int, env, spec: LayerSpec):
        a = _trace_attention(g, idx)
        if a.scale != 1.0:
            raise LoweringError(f"attention scale {a.scale}: the kernels use 1.0 (Gemma 4)")
        owner = self.pools[spec.kv_source]
        qkv = env[a.projection]
        nh, kh, d = a.heads, owner.kv_heads, a.head_dim
        if a.q_start != 0 or (a.shared is False and a.k_start != nh * d):
            raise LoweringError("q/k/v slices not in q | k | v order")
        inv_freq = self.consts.add(np.asarray(a.rope.inv_freq, np.float32))
        wq = Ref("weights", self.param_name(g, a.q_norm, spec))
        wk = Ref("weights", self.param_name(g, a.k_norm, spec)) if a.k_norm >= 0 else None
        table = Ref("io", "table_ring" if owner.ring else "table_full")
        width = owner.table_width
        k_pool, v_pool = Ref("kv", (owner.layer, 0)), (Ref("kv", (owner.layer, 1))
                                                       if len(owner.names) == 2 else None)
        write_kv = not a.shared
        kv_dtype = owner.dtype
        f32 = kv_dtype == "float32"  # q and the attention output stay float32 too
        q_out = self.buffer(self.m * nh * d * (4 if f32 else 2))
        self.emit(qkv_post.SOURCE, qkv_post.entry(d, kv_dtype),
                  qkv_post.launch_geometry(self.m, nh, kh if write_kv else 0, d),
                  qkv.f32, _i32(qkv.cols), _i32(nh), _i32(kh if write_kv else 0), _i32(d),
                  _i32(a.k_eq_v), wq, wk, Ref("io", "positions"), inv_freq, _f32(a.eps), q_out,
                  k_pool if write_kv else None, v_pool if write_kv else None, table,
                  _i32(width), _i32(width))
        wkv = Ref("weights", self.param_name(g, a.k_eq_v_norm, spec)) if a.k_eq_v else None
        out = self.buffer(self.m * nh * d * 4)
        out_bf16 = None if f32 else self.buffer(self.m * nh * d * 2)
        # One sequence's chunk: the flash-style kernel (bf16/e4m3 only); a float32 plan runs the
        # decode kernel, each row its own query (seq_len = position + 1, its own table row).
        if self.kind != "decode" and self.m > 1 and not f32:
            geometry = attn_prefill.geometry(self.m, kh, d, nh // kh, a.k_eq_v)
            if a.k_eq_v:
                self.emit(attn_prefill.SOURCE, attn_prefill.entry_keqv(d, nh // kh, kv_dtype),
                          geometry,
                          q_out, k_pool, table, _i32(width), Ref("io", "positions"),
                          _i32(a.window), _i32(kh), _i32(self.m), wkv, inv_freq, out, out_bf16)
            else:
                self.emit(attn_prefill.SOURCE, attn_prefill.entry(d, nh // kh, kv_dtype),
                          geometry,
                          q_out, k_pool, v_pool, table, _i32(width), Ref("io", "positions"),
                          _i32(a.window), _i32(kh), _i32(self.m), out, out_bf16)
            return _Val(d, f32=out, lin=out_bf16)
        keys = min(self.ir.max_context, a.window or self.ir.max_context)
        splits = attn_decode.num_splits(self.m, kh, keys, SM_COUNT)
        part_acc = self.buffer(self.m * nh * splits * d * 4)
        part_ml = self.buffer(self.m * nh * splits * 2 * 4)
        geometry = attn_decode.split_geometry(self.m, kh, splits)
        if a.k_eq_v:
            self.emit(attn_decode.SOURCE, attn_decode.entry_keqv(d, nh // kh, kv_dtype),
                      geometry,
                      q_out, k_pool, table, _i32(width), _i32(width), Ref("io", "seq_len"),
                      _i32(a.window), _i32(kh), wkv, inv_freq, part_acc, part_ml)
        else:
            self.emit(attn_decode.SOURCE, attn_decode.entry(d, nh // kh, kv_dtype), geometry,
                      q_out, k_pool, v_pool, table, _i32(width), _i32(width),
                      Ref("io", "seq_len"), _i32(a.window), _i32(kh), part_acc, part_ml)
        self.emit(attn_decode.SOURCE, attn_decode.COMBINE_ENTRY,
                  attn_decode.combine_geometry(self.m, nh, d, splits),
                  part_acc, part_ml, _i32(splits), _i32(d), out, out_bf16)
        return _Val(d, f32=out, lin=out if f32 else out_bf16)


# ---------------------------------------------------------------- attention cluster matching

@dataclass(frozen=True)
class _Attention:
    projection: int  # the MULTI_LINEAR / LINEAR node producing q | k | v rows
    heads: int
    head_dim: int
    q_start: int
    k_start: int  # -1 when shared
    q_norm: int  # PARAM nodes
    k_norm: int  # -1 when shared (nothing written)
    k_eq_v_norm: int  # PARAM of the K=V read-time norm (kv_source's k_norm), or -1
    rope: ops.RopeAttrs
    eps: float
    window: int
    scale: float
    k_eq_v: bool
    shared: bool  # KV-shared: reads the producer's cache, writes nothing


def _walk(g: Graph, idx: int, expected: tuple[Op, ...]) -> list[int]:
    """Follow first inputs from idx through nodes of the expected ops; their indices."""
    out = []
    for op in expected:
        if g.nodes[idx].op != op:
            raise LoweringError(f"attention input %{idx} is {g.nodes[idx].op.value}, expected "
                                f"{op.value}")
        out.append(idx)
        follow = 1 if op == Op.KV_WRITE else 0  # KV_WRITE(cache, rows, positions)
        idx = g.nodes[idx].inputs[follow] if g.nodes[idx].inputs else idx
    return out


def _trace_attention(g: Graph, idx: int) -> _Attention:
    nodes = g.nodes
    att = nodes[idx]
    q_in, k_in, v_in = att.inputs[:3]
    rope_q, norm_q, reshape_q = _walk(g, q_in, (Op.ROPE, Op.RMSNORM, Op.RESHAPE))
    q_src = nodes[reshape_q].inputs[0]
    if nodes[q_src].op == Op.SLICE_LAST:  # q | k | v from one fused projection
        projection, q_start = nodes[q_src].inputs[0], nodes[q_src].attrs.start
    else:  # KV-shared layers project q alone
        projection, q_start = q_src, 0
    heads, head_dim = nodes[q_in].shape[-2], nodes[q_in].shape[-1]
    k_eq_v = nodes[k_in].op == Op.ROPE and nodes[nodes[k_in].inputs[0]].op == Op.MUL
    shared = nodes[v_in].op == Op.ARG
    k_start, k_norm, k_eq_v_norm = -1, -1, -1
    if k_eq_v:
        mul = nodes[nodes[k_in].inputs[0]]
        k_eq_v_norm = mul.inputs[1]
        k_norm = k_eq_v_norm
        if not shared:
            write, norm_v, _, slice_v = _walk(g, v_in, (Op.KV_WRITE, Op.RMSNORM, Op.RESHAPE,
                                                        Op.SLICE_LAST))
            k_start = nodes[slice_v].attrs.start
            del write, norm_v
    elif not shared:
        _, _, norm_k, _, slice_k = _walk(g, k_in, (Op.KV_WRITE, Op.ROPE, Op.RMSNORM, Op.RESHAPE,
                                                   Op.SLICE_LAST))
        # KV_WRITE's first input is the cache ARG; the written rows are its second input
        k_norm = nodes[norm_k].inputs[1]
        k_start = nodes[slice_k].attrs.start
    elif nodes[k_in].op != Op.ARG:
        raise LoweringError("KV-shared attention whose K is not the producer's cache")
    return _Attention(projection, int(heads), int(head_dim), q_start, k_start,
                      nodes[norm_q].inputs[1], k_norm, k_eq_v_norm, nodes[rope_q].attrs,
                      nodes[norm_q].attrs.eps, att.attrs.window or 0, att.attrs.scale, k_eq_v,
                      shared)


@dataclass(frozen=True)
class _PleEmbed:
    """The embed graph's per-layer-input tail, lowered as one ple_combine launch:
    out = SCALE(ADD(RMSNORM(RESHAPE(SCALE(projection)), w), RESHAPE(EMBED(table, tokens))))."""

    out: int  # the `ple` output node
    projection: int  # the LINEAR of the model projection (lowered as a GEMV)
    table: int  # PARAM nodes
    norm_weight: int
    ctx_scale: float
    tok_mult: float
    out_scale: float
    eps: float
    consumed: frozenset[int]  # nodes between the projection / table and `out`


def _trace_ple_embed(g: Graph) -> _PleEmbed:
    nodes = g.nodes
    out = dict(g.outputs).get("ple")
    if out is None or nodes[out].op != Op.SCALE:
        raise LoweringError("graph embed: `ple` is not SCALE(ADD(...)) as the front end emits")
    add = nodes[out].inputs[0]
    try:
        norm, reshape_c, scale_c, projection = _walk(g, nodes[add].inputs[0], (
            Op.RMSNORM, Op.RESHAPE, Op.SCALE, Op.LINEAR))
        reshape_t, embed = _walk(g, nodes[add].inputs[1], (Op.RESHAPE, Op.EMBED))
    except LoweringError as e:
        raise LoweringError(f"graph embed, per-layer inputs: {e}") from None
    if nodes[add].op != Op.ADD or len(nodes[norm].inputs) != 2:
        raise LoweringError("graph embed: per-layer inputs not ADD(RMSNORM(., w), table rows)")
    table, ids = nodes[embed].inputs
    if nodes[ids].op != Op.ARG or nodes[ids].attrs.name != "tokens":
        raise LoweringError("graph embed: per-layer embedding ids other than the step's tokens")
    return _PleEmbed(out, projection, table, nodes[norm].inputs[1], nodes[scale_c].attrs.value,
                     nodes[embed].attrs.multiplier, nodes[out].attrs.value,
                     nodes[norm].attrs.eps,
                     frozenset({add, norm, reshape_c, scale_c, reshape_t, embed}))


def _attention_cluster_nodes(g: Graph) -> set[int]:
    """Nodes an attention cluster consumes: everything feeding an ATTENTION back to its
    projection, the step's args and weights."""
    stop = {Op.MULTI_LINEAR, Op.LINEAR, Op.ARG, Op.PARAM}
    out: set[int] = set()
    for n in g.nodes:
        if n.op != Op.ATTENTION:
            continue
        todo = list(n.inputs)
        while todo:
            i = todo.pop()
            if i in out or g.nodes[i].op in stop:
                continue
            out.add(i)
            todo.extend(g.nodes[i].inputs)
    return out


# ---------------------------------------------------------------- MoE cluster matching

@dataclass(frozen=True)
class _MoE:
    """An MoE node and the router chain feeding it; PARAM nodes by index."""

    residual: int  # the value both norms read (the layer's residual r)
    router_scale: int
    router_mul: float  # the SCALE after router.scale (H^-0.5)
    router: int  # the router projection [E, H]
    expert_norm: int  # pre_feedforward_layernorm_2
    eps: float
    per_expert_scale: int
    gate_up: int
    down: int
    gate_up_scale: int  # -1 for float32 experts (unquantized: h100-f32)
    down_scale: int
    top_k: int
    nodes: frozenset[int]  # non-PARAM nodes the MoE launches compute (the MOE node aside)


def _expect(g: Graph, idx: int, op: Op, inputs: int, what: str) -> Node:
    n = g.nodes[idx]
    if n.op != op or len(n.inputs) != inputs:
        raise LoweringError(f"MoE {what}: %{idx} is {n.op.value} of {len(n.inputs)} inputs, "
                            f"expected {op.value} of {inputs}")
    return n


def _trace_moe(g: Graph, idx: int) -> _MoE:
    """MOE(RMSNORM(r, w2), LINEAR_router(SCALE(MUL(RMSNORM(r), router.scale))), pes,
    gate_up, down, gate_up.scale, down.scale), the front end's and quantize_fp8's form; the
    front end's unquantized form has no scales (-1)."""
    moe_node = g.nodes[idx]
    if moe_node.attrs.quantized:
        x2_i, logits_i, pes, gate_up, down, gus, ds = moe_node.inputs
    else:
        (x2_i, logits_i, pes, gate_up, down), gus, ds = moe_node.inputs, -1, -1
    x2 = _expect(g, x2_i, Op.RMSNORM, 2, "expert input")
    router = _expect(g, logits_i, Op.LINEAR, 2, "router logits")
    if router.attrs.role != "router":
        raise LoweringError(f"MoE router logits %{logits_i} are a {router.attrs.role} linear")
    scale = _expect(g, router.inputs[0], Op.SCALE, 1, "router input")
    mul = _expect(g, scale.inputs[0], Op.MUL, 2, "router input")
    norm = _expect(g, mul.inputs[0], Op.RMSNORM, 1, "router norm")
    if norm.inputs[0] != x2.inputs[0] or norm.attrs.eps != x2.attrs.eps:
        raise LoweringError("MoE router and expert norms read different values or eps")
    nodes = frozenset({x2_i, logits_i, router.inputs[0], scale.inputs[0], mul.inputs[0]})
    return _MoE(x2.inputs[0], mul.inputs[1], scale.attrs.value, router.inputs[1], x2.inputs[1],
                x2.attrs.eps, pes, gate_up, down, gus, ds, moe_node.attrs.top_k, nodes)


def _moe_cluster_nodes(g: Graph) -> set[int]:
    """Nodes the MoE launches compute besides the MOE and branch-sum nodes themselves: the
    router chain, the expert input norm and the dense branch's post-norm (summed by
    moe_branch_sum). Each must feed nothing outside the cluster."""
    out: set[int] = set()
    for idx, n in enumerate(g.nodes):
        if n.op != Op.MOE:
            continue
        cluster = set(_trace_moe(g, idx).nodes)
        sums = [i for i, s in enumerate(g.nodes)
                if s.op == Op.RESIDUAL_RMSNORM and s.inputs[1] == idx]
        if len(sums) != 1 or g.nodes[g.nodes[sums[0]].inputs[0]].op != Op.RMSNORM:
            raise LoweringError(f"MoE %{idx}: its output must feed one branch sum "
                                "rmsnorm(f, w1) + rmsnorm(moe, w2) (run fuse_residual_norm)")
        cluster.add(g.nodes[sums[0]].inputs[0])
        allowed = cluster | {idx, sums[0]}
        for i, user in enumerate(g.nodes):
            if i not in allowed and cluster & set(user.inputs):
                raise LoweringError(f"%{i} ({user.op.value}) reads a value inside MoE %{idx}")
        out |= cluster
    return out


# ---------------------------------------------------------------- the whole schedule

def decode_buckets(slots: int) -> tuple[int, ...]:
    """Decode graphs for 1, 2, 4, ... sequences, and all slots."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return (*out, slots)


def _kv_kinds(ir: ModelIR, pools, slots: int, full: int, ring: int):
    kinds = []
    if any(not p.ring for p in pools.values()):
        kinds.append(KvKindLayout("full", "table_full", full, False, 0, slots * full))
    if any(p.ring for p in pools.values()):
        window = max(ir.config.layers[p.layer].window for p in pools.values() if p.ring)
        kinds.append(KvKindLayout("sliding", "table_ring", ring, True, window, slots * ring))
    return tuple(kinds)


def lower_to_h100(ir: ModelIR, *, slots: int, prefill_buckets: tuple[int, ...]) -> H100Lowering:
    weights, weights_bytes = layout_weights(ir)
    consts = _Constants()
    pools, full, ring = _pools(ir)
    entries: dict[str, tuple[str, _EntryLowering]] = {}
    for b in decode_buckets(slots):
        entries[f"decode_{b}"] = ("decode", _EntryLowering(ir, "decode", b, consts, pools))
    for t in sorted(set(prefill_buckets)):
        entries[f"prefill_{t}"] = ("prefill", _EntryLowering(ir, "prefill", t, consts, pools))
    entries[f"logits_{ir.max_chunk}"] = ("logits",
                                        _EntryLowering(ir, "logits", ir.max_chunk, consts, pools))
    for _, e in entries.values():
        e.run()

    # regions
    offset = weights_bytes
    const_offset = offset
    offset = memory_plan.align(offset + consts.size)
    kv_offset = offset
    pool_offsets: dict[tuple[int, int], int] = {}
    for layer, pool in sorted(pools.items()):
        nbytes = (slots * pool.table_width * BLOCK * pool.kv_heads * pool.head_dim
                  * numpy_dtype(pool.dtype).itemsize)
        for t in range(len(pool.names)):
            pool_offsets[(layer, t)] = offset
            offset = memory_plan.align(offset + nbytes)
    pool_bytes = offset - kv_offset
    io_offset = offset
    max_rows = max(max(prefill_buckets), ir.max_chunk, slots)
    io: dict[str, Field] = {}
    for name, (dtype, shape) in _io_fields(max_rows, full, ring).items():
        io[name] = Field(offset, dtype, shape)
        offset = memory_plan.align(offset + int(np.prod(shape)) * 4)
    io_bytes = offset - io_offset
    act_offset = offset
    act_bytes = 0
    resolved: dict[str, EntryPoint] = {}
    outputs: dict[str, Field] = {}
    for name, (kind, e) in entries.items():
        uses = [tuple(a.key for a in launch.args if isinstance(a, Ref) and a.region == "act")
                for launch in e.launches]
        lives = memory_plan.lifetimes(uses, e.sizes)
        offsets, total = memory_plan.plan(lives)
        memory_plan.check(lives, offsets)
        act_bytes = max(act_bytes, total)

        def address(ref: Ref, act: dict[int, int] = offsets) -> int:
            if ref.region == "weights":
                return weights[ref.key].offset + ref.offset
            return ref.offset + {"const": lambda: const_offset,
                                 "kv": lambda: pool_offsets[ref.key],
                                 "io": lambda: io[ref.key].offset,
                                 "act": lambda: act_offset + act[ref.key]}[ref.region]()

        def arg(a, address=address) -> Arg:
            if a is None:
                return Arg("null", 0)
            if isinstance(a, Ref):
                return Arg("ptr", address(a))
            return Arg(a[0], a[1])

        resolved[name] = EntryPoint(name, e.m, kind == "decode", tuple(
            Launch(x.module, x.kernel, tuple(x.geometry.grid), tuple(x.geometry.block),
                   x.geometry.smem, tuple(arg(a) for a in x.args)) for x in e.launches))
        for out_name, (ref, dtype, shape) in e.outputs.items():
            outputs[f"{name}.{out_name}"] = Field(address(ref), dtype, shape)
    arena = memory_plan.align(act_offset + act_bytes)
    schedule = KernelSchedule(
        arena_bytes=arena, weights_bytes=weights_bytes, constants_offset=const_offset,
        constants_bytes=consts.size, kv_offset=kv_offset, io_offset=io_offset,
        io_bytes=io_bytes, slots=slots, max_context=ir.max_context, max_chunk=ir.max_chunk,
        vocab_size=ir.config.vocab_size,
        kv=KvLayout(BLOCK, pool_bytes, next(iter(pools.values())).dtype if pools else "bfloat16",
                    _kv_kinds(ir, pools, slots, full, ring)),
        io=io, outputs=outputs, entries=resolved, cubins={})
    modules = tuple(sorted({x.module for e in resolved.values() for x in e.launches}))
    return H100Lowering(schedule, consts.data(),
                        {k: [v] for k, v in weights.items()}, modules)
