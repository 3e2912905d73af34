"""int8 weight quantization. Expects a ModelIR (float32 or bf16 weights). Guarantees: the weight
of every LINEAR (except router projections), every EMBED table and MoE expert stacks is int8
with a float32 per-output-row scale (amax/127, over the input axis), stored as "<name>.scale"; a
tied table is quantized once and read by both EMBED and the head's LINEAR. Nothing else changes.
"""

from __future__ import annotations

from dataclasses import replace

from rvcompile.ir.graph import Graph, ModelIR, ParamSpec, resolve_param, rewrite_nodes
from rvcompile.ir.ops import MoEAttrs, Op


def _targets(g: Graph) -> set[str]:
    """Names of the PARAMs this graph quantizes."""
    names = set()
    for n in g.nodes:
        weights = []
        if n.op is Op.LINEAR and n.attrs.role != "router" and len(n.inputs) == 2:
            weights = [n.inputs[1]]
        elif n.op is Op.EMBED and len(n.inputs) == 2:
            weights = [n.inputs[0]]
        elif n.op is Op.MOE and not n.attrs.quantized:
            weights = [n.inputs[3], n.inputs[4]]
        for i in weights:
            if g.nodes[i].op is Op.PARAM and g.nodes[i].dtype != "int8":
                names.add(g.nodes[i].attrs.name)
    return names


def _quantize_graph(g: Graph, targets: set[str]) -> Graph:
    def qparam(b, name, shape):
        return b.param(name, shape, "int8"), b.param(name + ".scale", shape[:-1], "float32")

    def rule(b, n, ins):
        if n.op is Op.PARAM and n.attrs.name in targets:
            return b.param(n.attrs.name, n.shape, "int8")
        if n.op is Op.LINEAR and len(ins) == 2 and g.nodes[n.inputs[1]].op is Op.PARAM:
            w = g.nodes[n.inputs[1]]
            if w.attrs.name in targets:
                q, s = qparam(b, w.attrs.name, w.shape)
                return b.add(Op.LINEAR, (ins[0], q, s), n.attrs)
        if n.op is Op.EMBED and len(ins) == 2 and g.nodes[n.inputs[0]].attrs.name in targets:
            t = g.nodes[n.inputs[0]]
            q, s = qparam(b, t.attrs.name, t.shape)
            return b.add(Op.EMBED, (q, ins[1], s), n.attrs)
        if n.op is Op.MOE and not n.attrs.quantized:
            gu, dn = g.nodes[n.inputs[3]], g.nodes[n.inputs[4]]
            gq, gs = qparam(b, gu.attrs.name, gu.shape)
            dq, ds = qparam(b, dn.attrs.name, dn.shape)
            return b.add(Op.MOE, (*ins[:3], gq, dq, gs, ds), MoEAttrs(n.attrs.top_k, True))
        return None

    return rewrite_nodes(g, rule)


def run(ir: ModelIR) -> ModelIR:
    full: set[str] = set()
    full |= _targets(ir.embed) | _targets(ir.head)
    for spec, t in zip(ir.config.layers, ir.layer_template, strict=True):
        full |= {resolve_param(rel, spec) for rel in _targets(ir.layers[t])}
    params: list[ParamSpec] = []
    for p in ir.params:
        if p.name in full:
            params.append(replace(p, dtype="int8", derive="int8_values"))
            params.append(ParamSpec(p.name + ".scale", p.shape[:-1], "float32", p.source,
                                    "int8_scales"))
        else:
            params.append(p)
    layers = tuple(_quantize_graph(g, _targets(g)) for g in ir.layers)
    return replace(ir, embed=_quantize_graph(ir.embed, _targets(ir.embed) | _targets(ir.head)),
                   head=_quantize_graph(ir.head, _targets(ir.head) | _targets(ir.embed)),
                   layers=layers, params=tuple(params), notes=(*ir.notes, "quantize_int8"))
