"""The IR's containers: immutable nodes in SSA order, graphs with named outputs, and `ModelIR`,
which ties the graphs of one Gemma 4 model together with its weights and KV caches.

A `ModelIR` is four kinds of graph plus data:
- `embed`: ARG tokens [B,T] -> outputs "h" [B,T,H] (and "ple" [B,T,L,P] with per-layer inputs);
- `layers[k]`: a layer template; `layer_template[i]` says which one layer i runs. Its PARAM names
  are relative ("self_attn.q_proj.weight" means "layers.{i}.self_attn.q_proj.weight"; see
  resolve_param for the prefixes). ARGs: "h", "positions" [B,T] (-1 = padding), "cache_len" [B]
  (cached tokens after this step), "ple" [B,T,P] if any, and its caches ("cache_k"+"cache_v", or
  "cache_kv" for K=V layers, holding the normalised shared K/V base); outputs "h" and, for layers
  that own a cache, the updated caches;
- `head`: ARG "h" -> "logits" [B,T,V]; `sampler`: "logits" [B,V] + sampling ARGs -> "tokens".
After passes/fuse_next_norm every graph that hands "h" on also hands "x", the next graph's first
RMSNORM of h (its input norm), and the next graph takes ARG "x" instead of computing it: embed,
layers and head pass the CARRIED values from one graph to the next.
`params` lists every stored weight (full names) with its dtype and how the build derives it from
a checkpoint tensor; `caches` lists the KV caches, one per layer that owns one.

With an assistant drafter, `ModelIR.assistant` is a `DraftIR` (see it): its graphs join
`graphs()` and `with_graphs`, its weights (named "assistant.*", plus the target's embedding,
final norm and, for K=V caches, k_norm weights it reads) join `params`; it owns no cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rvcompile.ir.ops import (
    OPS,
    ArgAttrs,
    Attrs,
    Op,
    ParamAttrs,
    Shape,
    SpecError,
)
from rvcompile.model.assistant import TENSOR_PREFIX, AssistantConfig
from rvcompile.model.config import Gemma4Config, LayerSpec


@dataclass(frozen=True)
class Node:
    op: Op
    inputs: tuple[int, ...]
    shape: Shape
    dtype: str
    attrs: Attrs = None


@dataclass(frozen=True)
class Graph:
    name: str
    nodes: tuple[Node, ...]
    outputs: tuple[tuple[str, int], ...]

    def output(self, name: str) -> int:
        return dict(self.outputs)[name]

    def args(self) -> dict[str, Node]:
        return {n.attrs.name: n for n in self.nodes if n.op is Op.ARG}

    def params(self) -> dict[str, Node]:
        return {n.attrs.name: n for n in self.nodes if n.op is Op.PARAM}


class GraphBuilder:
    """Appends nodes, inferring each one's shape and dtype, so a bad edge fails where it is
    made."""

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[Node] = []
        self._leaves: dict[tuple[Op, str], int] = {}

    def add(self, op: Op, inputs: tuple[int, ...] = (), attrs: Attrs = None) -> int:
        lo, hi = OPS[op].arity
        if not lo <= len(inputs) <= hi:
            raise SpecError(f"{self.name}: {op.value} takes {lo}..{hi} inputs, got {len(inputs)}")
        shape, dtype = OPS[op].infer(attrs, *[
            (self.nodes[i].shape, self.nodes[i].dtype) for i in inputs
        ])
        self.nodes.append(Node(op, tuple(inputs), tuple(shape), dtype, attrs))
        return len(self.nodes) - 1

    def leaf(self, op: Op, name: str, shape: Shape, dtype: str) -> int:
        key = (op, name)
        if key not in self._leaves:
            attrs = ArgAttrs(name) if op is Op.ARG else ParamAttrs(name)
            self.nodes.append(Node(op, (), tuple(shape), dtype, attrs))
            self._leaves[key] = len(self.nodes) - 1
        return self._leaves[key]

    def arg(self, name: str, shape: Shape, dtype: str = "float32") -> int:
        return self.leaf(Op.ARG, name, shape, dtype)

    def param(self, name: str, shape: Shape, dtype: str = "float32") -> int:
        return self.leaf(Op.PARAM, name, shape, dtype)

    def build(self, outputs: dict[str, int]) -> Graph:
        return Graph(self.name, tuple(self.nodes), tuple(outputs.items()))


@dataclass(frozen=True)
class ParamSpec:
    """One stored weight. `derive` says how the build makes it from checkpoint tensor `source`:
    "copy" (float32), "bf16", "int8_values" or "int8_scales" (per output row over the last axis),
    "int32" (token ids, stored as read)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    source: str
    derive: str = "copy"


@dataclass(frozen=True)
class CacheSpec:
    """The KV cache of one layer that owns one: [slots, size, kv_heads, head_dim] per tensor."""

    layer: int
    names: tuple[str, ...]  # ("cache_k", "cache_v") or ("cache_kv",) for K=V layers
    size: int
    kv_heads: int
    head_dim: int
    ring: bool  # sliding layers keep a ring of `size` >= window + longest prefill chunk - 1
    dtype: str = "float32"  # "float32", "bfloat16", "float8_e4m3fn" (passes/kv_fp8), or "int8"
    # (+ a float32 scale per slot and KV head: ops.Int8Cache)


@dataclass(frozen=True)
class DraftIR:
    """The assistant drafter of a ModelIR: one draft step over the target's KV caches.

    - `hidden`: ARG "h" [B,T,H] (the target's last layer output) -> "hidden" [B,T,H], the
      target's final norm: the state the first draft step starts from.
    - `draft_in`: ARGs "tokens" [B,T], "hidden" [B,T,H] -> "h" [B,T,D]: the target's embedding
      of the tokens, concatenated with the state, through pre_projection.
    - `layers[k]`: a drafter layer template; `layer_template[i]` says which one drafter layer i
      runs and `reads[i]` which target layer's cache it reads. ARGs "h", "positions" [B,T] (the
      query's position p; -1 = idle), "cache_len" [B] (= p: the target's tokens cached) and the
      read layer's cache ARGs; output "h". PARAM names are relative (`resolve_draft_param`).
    - `draft_out`: ARG "h" -> "logits" [B,T,V] and "hidden" [B,T,H] (post_projection: the next
      step's state).
    PARAMs of the other graphs are full names.
    """

    config: AssistantConfig
    hidden: Graph
    draft_in: Graph
    layers: tuple[Graph, ...]
    layer_template: tuple[int, ...]
    reads: tuple[int, ...]
    draft_out: Graph

    def graphs(self) -> tuple[Graph, ...]:
        return (self.hidden, self.draft_in, *self.layers, self.draft_out)

    def with_graphs(self, fn) -> DraftIR:
        return replace(self, hidden=fn(self.hidden), draft_in=fn(self.draft_in),
                       layers=tuple(fn(g) for g in self.layers), draft_out=fn(self.draft_out))

    def resolved_params(self):
        """(graph, resolve) for every graph: `resolve(rel)` is a PARAM's full weight name."""
        for g in (self.hidden, self.draft_in, self.draft_out):
            yield g, str
        for i, (t, read) in enumerate(zip(self.layer_template, self.reads, strict=True)):
            yield self.layers[t], lambda rel, i=i, read=read: resolve_draft_param(rel, i, read)


@dataclass(frozen=True)
class ModelIR:
    config: Gemma4Config
    embed: Graph
    layers: tuple[Graph, ...]
    layer_template: tuple[int, ...]
    head: Graph
    sampler: Graph
    params: tuple[ParamSpec, ...]
    caches: tuple[CacheSpec, ...]
    max_context: int
    max_chunk: int
    notes: tuple[str, ...] = field(default=())  # passes applied, in order
    assistant: DraftIR | None = None  # the drafter, when built with one

    def graphs(self) -> tuple[Graph, ...]:
        drafter = self.assistant.graphs() if self.assistant else ()
        return (self.embed, *self.layers, self.head, self.sampler, *drafter)

    def param_map(self) -> dict[str, ParamSpec]:
        return {p.name: p for p in self.params}

    def cache_of(self, layer: int) -> CacheSpec:
        for c in self.caches:
            if c.layer == layer:
                return c
        raise KeyError(layer)

    def with_graphs(self, fn) -> ModelIR:
        """Apply `fn(graph) -> graph` to every graph."""
        return replace(self, embed=fn(self.embed), layers=tuple(fn(g) for g in self.layers),
                       head=fn(self.head), sampler=fn(self.sampler),
                       assistant=self.assistant and self.assistant.with_graphs(fn))


KV_SOURCE_PREFIX = "kv_source."  # the layer whose cache this one reads (KV sharing)
NEXT_LAYER_PREFIX = "next_layer."  # the next layer (fuse_next_norm: its input norm)
HEAD_PREFIX = "head."  # a weight of the head graph (fuse_next_norm: the final norm)
CACHE_ARGS = ("cache_k", "cache_v", "cache_kv")
CARRIED = ("h", "x")  # the outputs one graph hands the next as ARGs of the same name


def resolve_param(rel: str, layer: LayerSpec) -> str:
    """Full weight name of a layer template's PARAM `rel` for layer `layer`."""
    if rel.startswith(KV_SOURCE_PREFIX):
        return f"layers.{layer.kv_source}.{rel[len(KV_SOURCE_PREFIX):]}"
    if rel.startswith(NEXT_LAYER_PREFIX):
        return f"layers.{layer.index + 1}.{rel[len(NEXT_LAYER_PREFIX):]}"
    if rel.startswith(HEAD_PREFIX):
        return rel[len(HEAD_PREFIX):]
    return f"layers.{layer.index}.{rel}"


def resolve_draft_param(rel: str, index: int, read: int) -> str:
    """Full weight name of drafter layer `index`'s template PARAM `rel`; the layer reads target
    layer `read`'s cache ("kv_source." names: a K=V cache's k_norm is the target's)."""
    if rel.startswith(KV_SOURCE_PREFIX):
        return f"layers.{read}.{rel[len(KV_SOURCE_PREFIX):]}"
    return f"{TENSOR_PREFIX}layers.{index}.{rel}"


def check_graph(g: Graph) -> None:
    """Re-derive every node's shape and dtype from its inputs; raise SpecError on any mismatch."""
    for i, n in enumerate(g.nodes):
        if any(j >= i for j in n.inputs):
            raise SpecError(f"{g.name}: node {i} ({n.op.value}) reads a later node")
        lo, hi = OPS[n.op].arity
        if not lo <= len(n.inputs) <= hi:
            raise SpecError(f"{g.name}: node {i} ({n.op.value}) has {len(n.inputs)} inputs")
        if n.op in (Op.ARG, Op.PARAM):
            continue
        shape, dtype = OPS[n.op].infer(n.attrs, *[
            (g.nodes[j].shape, g.nodes[j].dtype) for j in n.inputs
        ])
        if tuple(shape) != n.shape or dtype != n.dtype:
            raise SpecError(
                f"{g.name}: node {i} ({n.op.value}) says {n.shape} {n.dtype}, "
                f"inputs give {tuple(shape)} {dtype}"
            )
    for name, i in g.outputs:
        if not 0 <= i < len(g.nodes):
            raise SpecError(f"{g.name}: output {name} points nowhere")
    _check_next_norms(g)


def _check_next_norms(g: Graph) -> None:
    """A NEXT_NORM is computed by the kernel of the RESIDUAL_RMSNORM it reads, which writes one
    normed copy: it must read one, and no other NEXT_NORM may read the same."""
    seen: set[int] = set()
    for i, n in enumerate(g.nodes):
        if n.op is Op.NEXT_NORM:
            src = n.inputs[0]
            if g.nodes[src].op is not Op.RESIDUAL_RMSNORM or src in seen:
                raise SpecError(f"{g.name}: node {i} (next_norm) must be the only next_norm of "
                                f"a residual_rmsnorm; it reads %{src} ({g.nodes[src].op.value})")
            seen.add(src)


def check_model(m: ModelIR) -> None:
    """Spec check of a whole model: every graph, and every PARAM backed by a ParamSpec."""
    specs = m.param_map()
    for g in m.graphs():
        check_graph(g)
    cache_dtypes = {c.dtype for c in m.caches}
    drafter = m.assistant.layers if m.assistant else ()
    for g in (*m.layers, *drafter):
        for name, node in g.args().items():
            if name in CACHE_ARGS and {node.dtype} != cache_dtypes:
                raise SpecError(f"{g.name}: cache arg {name} is {node.dtype}, caches are "
                                f"{sorted(cache_dtypes)}")
    for g in (m.embed, m.head):
        _check_params(g, specs, str)
    for layer, t in zip(m.config.layers, m.layer_template, strict=True):
        _check_params(m.layers[t], specs, lambda rel, s=layer: resolve_param(rel, s))
    if m.assistant:
        for g, resolve in m.assistant.resolved_params():
            _check_params(g, specs, resolve)


def _check_params(g: Graph, specs: dict[str, ParamSpec], resolve) -> None:
    for rel, node in g.params().items():
        spec = specs.get(resolve(rel))
        if spec is None:
            raise SpecError(f"{g.name}: PARAM {resolve(rel)} has no ParamSpec")
        if tuple(spec.shape) != node.shape or spec.dtype != node.dtype:
            raise SpecError(
                f"{g.name}: PARAM {resolve(rel)} is {node.shape} {node.dtype} in the graph but "
                f"{spec.shape} {spec.dtype} in the weights"
            )


def rewrite_nodes(g: Graph, rule) -> Graph:
    """Rebuild `g` with `rule(builder, node, new_inputs) -> int | None` deciding each node's
    replacement (None keeps it). Returns `g` itself when nothing changed."""
    return rewrite_indexed(
        g, lambda b, i, remap: rule(b, g.nodes[i], tuple(remap[j] for j in g.nodes[i].inputs)))


def rewrite_indexed(g: Graph, rule) -> Graph:
    """As rewrite_nodes, for rules that match several nodes: `rule(builder, i, remap) -> int |
    None` decides node i's replacement, `remap[j]` is any earlier node j's index in the new
    graph."""
    b = GraphBuilder(g.name)
    remap: dict[int, int] = {}
    changed = False
    for i, n in enumerate(g.nodes):
        new = rule(b, i, remap)
        if new is None:
            if n.op in (Op.ARG, Op.PARAM):
                new = b.leaf(n.op, n.attrs.name, n.shape, n.dtype)
            else:  # re-inferred: an input may have changed dtype
                new = b.add(n.op, tuple(remap[j] for j in n.inputs), n.attrs)
        else:
            changed = True
        remap[i] = new
    if not changed:
        return g
    out = b.build({name: remap[i] for name, i in g.outputs})
    check_graph(out)
    return out


def reads(g: Graph) -> list[list[tuple[int, int]]]:
    """Each node's reads: (reader, the reader's input slot), in graph order (graph outputs not
    included)."""
    out: list[list[tuple[int, int]]] = [[] for _ in g.nodes]
    for i, n in enumerate(g.nodes):
        for slot, j in enumerate(n.inputs):
            out[j].append((i, slot))
    return out


def readers(g: Graph) -> list[list[int]]:
    """The nodes that read each node, in graph order (graph outputs not included)."""
    return [[i for i, _ in r] for r in reads(g)]


def use_counts(g: Graph) -> list[int]:
    """How many times each node is read: as another node's input, or as a graph output."""
    counts = [0] * len(g.nodes)
    for n in g.nodes:
        for j in n.inputs:
            counts[j] += 1
    for _, i in g.outputs:
        counts[i] += 1
    return counts


def drop_unread(g: Graph) -> Graph:
    """`g` without the nodes no output depends on (ARGs stay: callers bind them by name), e.g.
    what a fusion left behind. Returns `g` itself when there are none."""
    live = [n.op is Op.ARG for n in g.nodes]
    for _, i in g.outputs:
        live[i] = True
    for i in range(len(g.nodes) - 1, -1, -1):
        if live[i]:
            for j in g.nodes[i].inputs:
                live[j] = True
    if all(live):
        return g
    remap: dict[int, int] = {}
    nodes = []
    for i, n in enumerate(g.nodes):
        if live[i]:
            remap[i] = len(nodes)
            nodes.append(replace(n, inputs=tuple(remap[j] for j in n.inputs)))
    out = Graph(g.name, tuple(nodes), tuple((name, remap[i]) for name, i in g.outputs))
    check_graph(out)
    return out
