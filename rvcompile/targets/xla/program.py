"""A ModelIR as JAX entry points whose decoder layers run as `lax.scan`s over stacked weights.

Layers are cut into periods of the (nS, F) pattern; consecutive periods with the same templates
form a group and run as one scan, so the program is as small at 60 layers as at 6. Weights and KV
caches are flat dicts of arrays named by `LayoutPlan`: a stacked entry "g{group}.{j}.{rel}" holds
that template PARAM for every period of the group ([count, ...]); caches "g{group}.{j}.cache_k"
are [count, slots, size, kv_heads, head_dim].

Entry points (all return the updated caches first; caches are meant to be donated):
- prefill(weights, caches, tokens [1,T], slot, start [1], n_new [1], sampling...) -> next token [1]
- decode(weights, caches, tokens [S,1], start [S], n_new [S], sampling...) -> next tokens [S]
- logits(weights, caches, tokens [1,T], slot, start [1], n_new [1]) -> logits [1,T,V]
`start` = tokens already cached in the slot; `n_new` = valid tokens in this call (0 = idle slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from rvcompile.ir.graph import CACHE_ARGS, ModelIR, resolve_param
from rvcompile.targets.xla.lower import JNP_DTYPES, StackedSlice, run_graph


@dataclass(frozen=True)
class LayerGroup:
    start: int  # first layer
    period: int  # layers per iteration
    count: int  # iterations
    templates: tuple[int, ...]  # template of each layer in a period

    def layer(self, p: int, j: int) -> int:
        return self.start + p * self.period + j


@dataclass(frozen=True)
class StackedParam:
    key: str  # array name in the weights dict
    rel: str  # template PARAM name
    group: int
    j: int


@dataclass(frozen=True)
class LayoutPlan:
    """How the model's weights and caches are laid out as program arguments."""

    groups: tuple[LayerGroup, ...]
    stacked: tuple[StackedParam, ...]
    globals_: tuple[str, ...]  # weights of embed/head, by full name

    def weight_slices(self, ir: ModelIR):
        """(array key, index in stack or None, full param name) for every stored slice."""
        for name in self.globals_:
            yield name, None, name
        for sp in self.stacked:
            g = self.groups[sp.group]
            for p in range(g.count):
                spec = ir.config.layers[g.layer(p, sp.j)]
                yield sp.key, p, resolve_param(sp.rel, spec)


def plan_groups(ir: ModelIR) -> tuple[LayerGroup, ...]:
    period = ir.config.pattern_period
    sigs = []
    for start in range(0, ir.config.num_layers, period):
        sigs.append((start, tuple(ir.layer_template[start:start + period])))
    groups: list[LayerGroup] = []
    for start, sig in sigs:
        last = groups[-1] if groups else None
        if last and last.templates == sig and not _reads_inside(ir, last, sig, start):
            groups[-1] = LayerGroup(last.start, last.period, last.count + 1, sig)
        else:
            groups.append(LayerGroup(start, len(sig), 1, sig))
    return tuple(groups)


def _reads_inside(ir: ModelIR, group: LayerGroup, sig, start: int) -> bool:
    """True if a layer of the new period reads a cache made inside `group` (it must not scan)."""
    end = group.start + group.period * group.count
    return any(group.start <= ir.config.layers[start + j].kv_source < end
               for j in range(len(sig)) if ir.config.layers[start + j].kv_shared)


def plan_layout(ir: ModelIR) -> LayoutPlan:
    groups = plan_groups(ir)
    stacked = []
    for gi, g in enumerate(groups):
        for j, t in enumerate(g.templates):
            for rel in ir.layers[t].params():
                stacked.append(StackedParam(f"g{gi}.{j}.{rel}", rel, gi, j))
    names = list(ir.embed.params()) + [n for n in ir.head.params() if n not in ir.embed.params()]
    return LayoutPlan(groups, tuple(stacked), tuple(names))


def weight_shapes(ir: ModelIR, plan: LayoutPlan) -> dict[str, jax.ShapeDtypeStruct]:
    specs = ir.param_map()
    out = {}
    for name in plan.globals_:
        out[name] = jax.ShapeDtypeStruct(specs[name].shape, JNP_DTYPES[specs[name].dtype])
    for sp in plan.stacked:
        g = plan.groups[sp.group]
        spec = specs[resolve_param(sp.rel, ir.config.layers[g.layer(0, sp.j)])]
        out[sp.key] = jax.ShapeDtypeStruct((g.count, *spec.shape), JNP_DTYPES[spec.dtype])
    return out


def _cache_owner(plan: LayoutPlan, layer: int) -> tuple[int, int, int]:
    for gi, g in enumerate(plan.groups):
        for p in range(g.count):
            for j in range(g.period):
                if g.layer(p, j) == layer:
                    return gi, j, p
    raise KeyError(layer)


def cache_shapes(ir: ModelIR, plan: LayoutPlan, slots: int) -> dict[str, jax.ShapeDtypeStruct]:
    out = {}
    for gi, g in enumerate(plan.groups):
        for j in range(g.period):
            spec = ir.config.layers[g.layer(0, j)]
            if spec.kv_shared:
                continue
            c = ir.cache_of(spec.index)
            for name in c.names:
                out[f"g{gi}.{j}.{name}"] = jax.ShapeDtypeStruct(
                    (g.count, slots, c.size, c.kv_heads, c.head_dim), JNP_DTYPES[c.dtype])
    return out


class Program:
    """Builds the traced functions of one ModelIR under one layout."""

    def __init__(self, ir: ModelIR, plan: LayoutPlan):
        self.ir, self.plan = ir, plan

    def forward(self, weights, caches, tokens, start, n_new):
        """Run tokens [B,T] through the decoder; returns (caches, hidden [B,T,H])."""
        ir = self.ir
        t = tokens.shape[1]
        offs = jnp.arange(t, dtype=jnp.int32)[None, :]
        positions = jnp.where(offs < n_new[:, None], start[:, None] + offs, -1)
        cache_len = start + n_new
        emb = run_graph(ir.embed, {"tokens": tokens}, weights.__getitem__)
        h = emb["h"]
        caches = dict(caches)
        for gi, g in enumerate(self.plan.groups):
            h, caches = self._run_group(gi, g, weights, caches, h, positions, cache_len,
                                        emb.get("ple"))
        return caches, h

    def _run_group(self, gi, g, weights, caches, h, positions, cache_len, ple):
        ir, cfg = self.ir, self.ir.config
        own = {k: v for k, v in caches.items() if k.startswith(f"g{gi}.")}
        stacked_w = {sp.key: weights[sp.key] for sp in self.plan.stacked if sp.group == gi}
        ple_xs = None
        if ple is not None:
            b, t = ple.shape[:2]
            sl = ple[:, :, g.start:g.start + g.count * g.period]
            ple_xs = jnp.transpose(sl.reshape(b, t, g.count, g.period, -1), (2, 3, 0, 1, 4))

        def body(carry, xs):
            h, own = carry
            p, ple_p = xs
            own = dict(own)
            for j, tid in enumerate(g.templates):
                graph = ir.layers[tid]
                spec = cfg.layers[g.start + j]  # structure only; indices come from p
                args = {"h": h, "positions": positions, "cache_len": cache_len}
                if ple_p is not None:
                    args["ple"] = ple_p[j]
                for name in graph.args():
                    if name not in CACHE_ARGS:
                        continue
                    if spec.kv_shared:
                        sgi, sj, sp = _cache_owner(self.plan, spec.kv_source)
                        key = f"g{sgi}.{sj}.{name}"
                        src = own if sgi == gi else caches
                        args[name] = StackedSlice(src[key], sp)
                    else:
                        args[name] = StackedSlice(own[f"g{gi}.{j}.{name}"], p)
                out = run_graph(graph, args,
                                lambda rel, j=j: lax.dynamic_index_in_dim(
                                    stacked_w[f"g{gi}.{j}.{rel}"], p, 0, keepdims=False))
                h = out["h"]
                for name, v in out.items():
                    if name in CACHE_ARGS:
                        own[f"g{gi}.{j}.{name}"] = v.array
            return (h, own), None

        xs = (jnp.arange(g.count, dtype=jnp.int32), ple_xs)
        if g.count == 1:
            (h, own), _ = body((h, own), jax.tree.map(lambda x: x[0], xs))
        else:
            (h, own), _ = lax.scan(body, (h, own), xs)
        return h, {**caches, **own}

    def head(self, weights, h):
        return run_graph(self.ir.head, {"h": h}, weights.__getitem__)["logits"]

    def sample(self, weights, logits, temperature, top_k, top_p, seed, step):
        args = {"logits": logits, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "seed": seed, "step": step}
        return run_graph(self.ir.sampler, args, weights.__getitem__)["tokens"]

    # ------------------------------------------------------------------ entry points

    def _slot_caches(self, caches, slot):
        return {k: lax.dynamic_slice_in_dim(v, slot, 1, axis=1) for k, v in caches.items()}

    def _put_slot(self, caches, slot_caches, slot):
        return {k: lax.dynamic_update_slice_in_dim(caches[k], v, slot, axis=1)
                for k, v in slot_caches.items()}

    def prefill(self, weights, caches, tokens, slot, start, n_new, temperature, top_k, top_p,
                seed, step):
        sc, h = self.forward(weights, self._slot_caches(caches, slot), tokens, start, n_new)
        last = jnp.take_along_axis(h, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)
        logits = self.head(weights, last)[:, 0]
        tok = self.sample(weights, logits, temperature, top_k, top_p, seed, step)
        return self._put_slot(caches, sc, slot), tok

    def decode(self, weights, caches, tokens, start, n_new, temperature, top_k, top_p, seed,
               step):
        caches, h = self.forward(weights, caches, tokens, start, n_new)
        logits = self.head(weights, h)[:, 0]
        return caches, self.sample(weights, logits, temperature, top_k, top_p, seed, step)

    def logits(self, weights, caches, tokens, slot, start, n_new):
        sc, h = self.forward(weights, self._slot_caches(caches, slot), tokens, start, n_new)
        return self._put_slot(caches, sc, slot), self.head(weights, h)


def sampling_shapes(batch: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    f, i = jnp.float32, jnp.int32
    return tuple(jax.ShapeDtypeStruct((batch,), d) for d in (f, i, f, i, i))
