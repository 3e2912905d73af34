"""Chains of IR nodes that the XLA lowering treats as one: pure functions of a graph and its
readers (graph.reads), no JAX.

lower.run_graph asks these which nodes to hand to a Pallas kernel whole or to keep lazy, and
lowers every node they do not name op by op:
- `read_as_bf16`: values that every reader rounds to bf16 first (a lowering may write bf16);
- `lazy_queries`: a query's RMSNORM and ROPE, left to the attention kernel (lower.NormedQuery);
- `gated_mlps`: a layer's gated MLP with its residual add (lower.decode_mlp_kernel);
- `normed_projections`: an input norm with the projections reading it and k's and v's tails
  into their cache writes (lower.decode_projections_kernel);
- `layer_end`: the post-FFW norm, residual add and layer scalar of a layer graph's output,
  which the next layer's projections kernel may make (lower.LayerEnd).
A matcher answers only for chains whose intermediate values nothing else reads: handing the
chain to a kernel drops no value another node needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from rvcompile.ir.graph import Graph
from rvcompile.ir.ops import Op


def read_as_bf16(g: Graph, readers: list[list[tuple[int, int]]]) -> set[int]:
    """The nodes of `g` whose value every reader rounds to bf16 before using it: each reader is
    the activation of a LINEAR with a weight that is not float32, or a RESHAPE whose readers are
    all such (graph outputs are read as they are). `readers`: graph.reads(g)."""
    outputs = {i for _, i in g.outputs}
    out: set[int] = set()
    for i in reversed(range(len(g.nodes))):
        if i in outputs or not readers[i]:
            continue
        if all((g.nodes[r].op is Op.LINEAR and slot == 0
                and g.nodes[g.nodes[r].inputs[1]].dtype != "float32")
               or (g.nodes[r].op is Op.RESHAPE and r in out)
               for r, slot in readers[i]):
            out.add(i)
    return out


def lazy_queries(g: Graph, readers: list[list[tuple[int, int]]]) -> tuple[set[int], set[int]]:
    """The RMSNORMs (with a weight) and ROPEs that lower.run_graph keeps lazy
    (lower.NormedQuery): a norm whose one reader is a ROPE whose one reader is an ATTENTION, as
    its query; neither a graph output. `readers`: graph.reads(g)."""
    outputs = {i for _, i in g.outputs}
    norms, ropes = set(), set()
    for i, n in enumerate(g.nodes):
        if n.op is not Op.RMSNORM or len(n.inputs) != 2 or i in outputs:
            continue
        if len(readers[i]) != 1 or readers[i][0][1] != 0:
            continue
        r = readers[i][0][0]
        if g.nodes[r].op is not Op.ROPE or r in outputs or len(readers[r]) != 1:
            continue
        a, slot = readers[r][0]
        if g.nodes[a].op is Op.ATTENTION and slot == 0:
            norms.add(i)
            ropes.add(r)
    return norms, ropes


@dataclass(frozen=True)
class GatedMlp:
    """A layer's MLP as its nodes: LINEAR down(MUL(GELU_TANH(LINEAR gate(n)), LINEAR up(n))) of
    n = RMSNORM(x, w) (graph indices); where x is ADD(h, RMSNORM(y, w_r)) (the residual add of
    the attention's output y), `add` and `post` are that ADD and RMSNORM, else None; where y is
    a LINEAR with a per-row scale read only there (the output projection), `proj` is it."""

    norm: int
    gate: int
    act: int
    up: int
    mul: int
    down: int
    add: int | None = None
    post: int | None = None
    proj: int | None = None

    @property
    def inner(self) -> tuple[int, ...]:
        """The nodes the chain computes before `down` and reads nowhere else, in graph
        order (the ADD, read on by the next residual add, is the kernel's other output; the
        output projection's dot is made there, its scale applied in the kernel)."""
        nodes = (self.proj, self.post, self.add, self.norm, self.gate, self.act, self.up,
                 self.mul)
        return tuple(sorted(i for i in nodes if i is not None))


def gated_mlps(g: Graph, readers: list[list[tuple[int, int]]]) -> dict[int, GatedMlp]:
    """The gated MLPs of `g` that a kernel may compute whole (lower.decode_mlp_kernel), by their
    down LINEAR: a weighted RMSNORM read only as the activation of two LINEARs (gate, up),
    the gate read only by a GELU_TANH, that and the up only by one MUL, which only the down
    LINEAR reads; none of them a graph output; the three weights (and scales) PARAMs. With
    them the residual ADD(h, RMSNORM(y, w_r)) the norm reads, when that RMSNORM has a weight
    and the ADD alone reads it, and the ADD's other readers come after the down LINEAR.
    `readers`: graph.reads(g)."""
    outputs = {i for _, i in g.outputs}
    nodes = g.nodes

    def only(i: int, op: Op) -> tuple[int, int] | None:
        """`i`'s one reader (index, slot), if it is the one reader and an `op`."""
        if i in outputs or len(readers[i]) != 1 or nodes[readers[i][0][0]].op is not op:
            return None
        return readers[i][0]

    out = {}
    for i, n in enumerate(nodes):
        if n.op is not Op.LINEAR or nodes[n.inputs[0]].op is not Op.MUL:
            continue
        m = n.inputs[0]
        act, up = nodes[m].inputs
        if nodes[act].op is not Op.GELU_TANH or nodes[up].op is not Op.LINEAR:
            continue
        gate = nodes[act].inputs[0]
        norm = nodes[up].inputs[0]
        if (nodes[gate].op is not Op.LINEAR or nodes[gate].inputs[0] != norm
                or nodes[norm].op is not Op.RMSNORM or len(nodes[norm].inputs) != 2
                or norm in outputs or sorted(readers[norm]) != sorted([(gate, 0), (up, 0)])):
            continue
        params = [j for lin in (gate, up, i) for j in nodes[lin].inputs[1:]]
        if any(nodes[j].op is not Op.PARAM for j in params):
            continue
        if not (only(gate, Op.GELU_TANH) == (act, 0) and only(act, Op.MUL) == (m, 0)
                and only(up, Op.MUL) == (m, 1) and only(m, Op.LINEAR) == (i, 0)):
            continue
        add, post = nodes[norm].inputs[0], None
        if nodes[add].op is Op.ADD:
            post = nodes[add].inputs[1]
            if not (nodes[post].op is Op.RMSNORM and len(nodes[post].inputs) == 2
                    and only(post, Op.ADD) == (add, 1) and nodes[add].shape == nodes[post].shape
                    and nodes[nodes[add].inputs[0]].shape == nodes[post].shape
                    and all(r == norm or r > i for r, _ in readers[add])):
                post = None
        if post is None:
            out[i] = GatedMlp(norm, gate, act, up, m, i)
            continue
        proj = nodes[post].inputs[0]
        if not (nodes[proj].op is Op.LINEAR and len(nodes[proj].inputs) == 3
                and nodes[nodes[proj].inputs[2]].op is Op.PARAM
                and only(proj, Op.RMSNORM) == (post, 0)):
            proj = None
        out[i] = GatedMlp(norm, gate, act, up, m, i, add, post, proj)
    return out


@dataclass(frozen=True)
class Projection:
    """A projection of `normed_projections`: its LINEAR, the heads its RESHAPE makes, and its
    tail into a cache write, if any: the RMSNORM of its heads (`norm`), then the ROPE (`rope`,
    or None) that a KV_WRITE alone reads, into a cache of `cache_dtype`."""

    linear: int
    heads: int
    reshape: int
    norm: int | None = None
    rope: int | None = None
    cache_dtype: str | None = None

    @property
    def last(self) -> int:
        """The node whose value the kernel makes: the tail's last, else the LINEAR."""
        return self.rope if self.rope is not None else (
            self.norm if self.norm is not None else self.linear)

    @property
    def skipped(self) -> tuple[int, ...]:
        """The nodes before `last` that the kernel's value replaces (a tail's LINEAR, RESHAPE
        and, before a ROPE, RMSNORM)."""
        if self.norm is None:
            return ()
        return (self.linear, self.reshape) + ((self.norm,) if self.rope is not None else ())


def _cache_tail(g: Graph, readers, reshape: int) -> tuple[int, int | None, str] | None:
    """(RMSNORM, ROPE or None, cache dtype) when RESHAPE `reshape`'s one reader is an RMSNORM
    (a PARAM weight or none) whose one reader is a KV_WRITE's new rows, or a ROPE by halves
    (no zero frequencies) whose one reader is."""
    nodes, outputs = g.nodes, {i for _, i in g.outputs}

    def one(i: int) -> tuple[int, int] | None:
        return readers[i][0] if len(readers[i]) == 1 and i not in outputs else None

    norm = one(reshape)
    if norm is None or nodes[norm[0]].op is not Op.RMSNORM or norm[1] != 0:
        return None
    norm = norm[0]
    if len(nodes[norm].inputs) == 2 and nodes[nodes[norm].inputs[1]].op is not Op.PARAM:
        return None
    nxt, rope = one(norm), None
    if nxt is not None and nodes[nxt[0]].op is Op.ROPE and nxt[1] == 0:
        rope = nxt[0]
        if not all(nodes[rope].attrs.inv_freq):
            return None
        nxt = one(rope)
    if nxt is None or nodes[nxt[0]].op is not Op.KV_WRITE or nxt[1] != 1:
        return None
    return norm, rope, nodes[nodes[nxt[0]].inputs[0]].dtype


def normed_projections(g: Graph, readers: list[list[tuple[int, int]]]
                       ) -> dict[int, tuple[Projection, ...]]:
    """The RMSNORMs (with a weight) of `g` whose every reader is the activation of a LINEAR
    (at least two: a layer's q, k and v), each with PARAM weights (and scales, all or none)
    and read only by a RESHAPE into heads [.., heads, D]; neither a graph output. Norm -> its
    projections in graph order, with their tails into cache writes (k's norm and RoPE, v's
    norm: `_cache_tail`). `readers`: graph.reads(g)."""
    outputs = {i for _, i in g.outputs}
    nodes = g.nodes
    out = {}
    for i, n in enumerate(nodes):
        if (n.op is not Op.RMSNORM or len(n.inputs) != 2 or i in outputs
                or len(readers[i]) < 2 or any(s != 0 for _, s in readers[i])):
            continue
        lins = sorted(r for r, _ in readers[i])
        if any(nodes[r].op is not Op.LINEAR or r in outputs or len(readers[r]) != 1
               or nodes[readers[r][0][0]].op is not Op.RESHAPE
               or any(nodes[j].op is not Op.PARAM for j in nodes[r].inputs[1:])
               for r in lins):
            continue
        if len({len(nodes[r].inputs) for r in lins}) != 1:
            continue
        projs = []
        for r in lins:
            s = readers[r][0][0]
            tail = _cache_tail(g, readers, s)
            projs.append(Projection(r, nodes[s].shape[-2], s, *(tail or ())))
        out[i] = tuple(projs)
    return out


def layer_end(g: Graph, readers: list[list[tuple[int, int]]], name: str = "h"
              ) -> tuple[int, int, int, int] | None:
    """(RMSNORM, ADD, MUL, the stream's node) where output `name` is MUL(ADD(h0, RMSNORM(y,
    PARAM w)), PARAM scalar) of a LINEAR y, the RMSNORM read only by the ADD, the ADD only by
    the MUL and the MUL by nothing (a layer's end: the post-FFW norm, residual add and layer
    scalar), else None."""
    nodes, outs = g.nodes, dict(g.outputs)
    out_nodes = [i for _, i in g.outputs]
    m = outs.get(name)
    if m is None or nodes[m].op is not Op.MUL or readers[m] or out_nodes.count(m) != 1:
        return None
    a, c = nodes[m].inputs
    if nodes[a].op is not Op.ADD or nodes[c].op is not Op.PARAM or readers[a] != [(m, 0)]:
        return None
    h0, r = nodes[a].inputs
    if (nodes[r].op is not Op.RMSNORM or readers[r] != [(a, 1)] or len(nodes[r].inputs) != 2
            or nodes[nodes[r].inputs[1]].op is not Op.PARAM
            or nodes[nodes[r].inputs[0]].op is not Op.LINEAR
            or a in out_nodes or r in out_nodes):
        return None
    return r, a, m, h0
