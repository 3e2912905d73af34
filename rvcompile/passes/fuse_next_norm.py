"""Next-norm fusion: the RMSNORM that follows a residual add is computed by the add's kernel, also
where it belongs to the next graph. Expects a ModelIR after fuse_residual_norm (the adds are
RESIDUAL_RMSNORMs) whose layer templates and head open with one RMSNORM of ARG "h" with a
weight (their input norm; the front end's input_layernorm and final norm). Run it last of the
fusions: it changes how graphs hand values on.

Across graphs, the choice (graph.py, CARRIED): a graph's input norm moves to the end of the
graph before it, which hands the normed value on as output "x", and the graph takes ARG "x"
instead. Layer templates are shared, so the moved norm's weight is named relative to the layer
that computes it: "next_layer.input_layernorm.weight" (layer i + 1's), or for the last layer
"head.norm.weight" (the head's); the last layer gets a template of its own when it shared one.
The embed graph computes layer 0's input norm as a plain RMSNORM (an EMBED is no residual add).
The head keeps "h" no more.

Within a graph (and for the moved norms), the first RMSNORM with a weight that reads a
RESIDUAL_RMSNORM's result becomes `NEXT_NORM(result, w)`: the same math (its reference is
ref_rmsnorm), which the spec check holds to one per residual and the H100 target computes in
the residual's launch. In a Gemma 4 layer: the post-attention add's NEXT_NORM is the dense MLP's
pre-norm, the last add's is the next layer's input norm (or the final norm).

Guarantees: the model computes the same bits (the same references on the same values, handed
on under another name); weights, ParamSpecs and caches are untouched. Returns `ir` itself when
it has already run or a graph lacks an input norm.
"""

from __future__ import annotations

from dataclasses import replace

from rvcompile.ir.graph import (
    HEAD_PREFIX,
    KV_SOURCE_PREFIX,
    NEXT_LAYER_PREFIX,
    Graph,
    GraphBuilder,
    ModelIR,
    Node,
    check_graph,
    drop_unread,
    readers,
    resolve_param,
)
from rvcompile.ir.ops import Op, RMSNormAttrs

NAME = "fuse_next_norm"
PREFIXES = (KV_SOURCE_PREFIX, NEXT_LAYER_PREFIX, HEAD_PREFIX)


def _input_norm(g: Graph) -> int | None:
    """The graph's one RMSNORM of ARG "h" with a PARAM weight, or None."""
    h = [i for i, n in enumerate(g.nodes) if n.op is Op.ARG and n.attrs.name == "h"]
    norms = [i for i, n in enumerate(g.nodes)
             if n.op is Op.RMSNORM and len(n.inputs) == 2 and n.inputs[0] in h
             and g.nodes[n.inputs[1]].op is Op.PARAM]
    return norms[0] if len(norms) == 1 else None


def _weight(g: Graph, norm: int) -> Node:
    return g.nodes[g.nodes[norm].inputs[1]]


def _folds(g: Graph) -> set[int]:
    """The RMSNORMs that become NEXT_NORMs: per RESIDUAL_RMSNORM, its first reader that is an
    RMSNORM of it with a weight."""
    users = readers(g)
    out = set()
    for i, n in enumerate(g.nodes):
        if n.op is Op.RESIDUAL_RMSNORM:
            norms = [u for u in users[i] if g.nodes[u].op is Op.RMSNORM
                     and len(g.nodes[u].inputs) == 2 and g.nodes[u].inputs[0] == i]
            out |= set(norms[:1])
    return out


def _rebuild(g: Graph, name: str, input_norm: int | None,
             next_norm: tuple[Node, RMSNormAttrs] | None) -> Graph:
    """g with its input norm (if given) read as ARG "x", its in-graph folds, and (if given) the
    next graph's input norm of its "h" appended as output "x"."""
    b = GraphBuilder(name)
    users = readers(g)
    folds = _folds(g)
    remap: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        if i == input_norm:
            remap[i] = b.arg("x", n.shape, n.dtype)
        elif (input_norm is not None and n.op is Op.ARG and n.attrs.name == "h"
              and set(users[i]) == {input_norm}):
            continue  # the head: h was read only by the norm that moved out
        elif n.op in (Op.ARG, Op.PARAM):
            remap[i] = b.leaf(n.op, n.attrs.name, n.shape, n.dtype)
        else:
            op = Op.NEXT_NORM if i in folds else n.op
            remap[i] = b.add(op, tuple(remap[j] for j in n.inputs), n.attrs)
    outputs = {out: remap[i] for out, i in g.outputs}
    if next_norm is not None:
        weight, attrs = next_norm
        h = outputs["h"]
        w = b.param(weight.attrs.name, weight.shape, weight.dtype)
        taken = any(n.op is Op.NEXT_NORM and n.inputs[0] == h for n in b.nodes)
        op = Op.NEXT_NORM if b.nodes[h].op is Op.RESIDUAL_RMSNORM and not taken else Op.RMSNORM
        outputs["x"] = b.add(op, (h, w), attrs)
    out = b.build(outputs)
    check_graph(out)
    return drop_unread(out)  # the moved norm's weight


def run(ir: ModelIR) -> ModelIR:
    if "x" in ir.head.args():
        return ir
    norms = {id(g): _input_norm(g) for g in (*ir.layers, ir.head)}
    if None in norms.values() or "h" not in dict(ir.embed.outputs):
        return ir
    cfg = ir.config
    firsts = [ir.layers[t] for t in ir.layer_template[1:]] + [ir.head]
    moved = []  # per layer: (weight PARAM the layer's "x" is normed with, its attrs)
    for g in firsts:
        norm = norms[id(g)]
        weight = _weight(g, norm)
        if weight.attrs.name.startswith(PREFIXES):
            return ir
        prefix = HEAD_PREFIX if g is ir.head else NEXT_LAYER_PREFIX
        moved.append((replace(weight, attrs=replace(weight.attrs, name=prefix + weight.attrs.name)),
                      g.nodes[norm].attrs))
    templates: dict[tuple, int] = {}
    layers: list[Graph] = []
    layer_template = []
    for i, t in enumerate(ir.layer_template):
        key = (t, moved[i][0], moved[i][1])
        if key not in templates:
            templates[key] = len(layers)
            g = ir.layers[t]
            layers.append(_rebuild(g, f"layer{i}_template", norms[id(g)], moved[i]))
        layer_template.append(templates[key])
    first = ir.layers[ir.layer_template[0]]
    weight = _weight(first, norms[id(first)])
    layer0 = replace(weight, attrs=replace(weight.attrs,
                                           name=resolve_param(weight.attrs.name, cfg.layers[0])))
    embed = _rebuild(ir.embed, ir.embed.name, None,
                     (layer0, first.nodes[norms[id(first)]].attrs))
    head = _rebuild(ir.head, ir.head.name, norms[id(ir.head)], None)
    return replace(ir, embed=embed, layers=tuple(layers), layer_template=tuple(layer_template),
                   head=head, notes=(*ir.notes, NAME))
