"""Numpy interpreter of the IR: runs any graph on each op's one reference, and a whole ModelIR
step over KV caches. Slow and exact; used to test passes and targets against the IR semantics.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rvcompile.ir.graph import (
    CACHE_ARGS,
    CARRIED,
    Graph,
    ModelIR,
    resolve_draft_param,
    resolve_param,
)
from rvcompile.ir.ops import OPS, Int8Cache, Op, empty_cache

ParamGetter = Callable[[str], np.ndarray]


def run_graph(g: Graph, args: dict[str, np.ndarray], param: ParamGetter) -> dict[str, np.ndarray]:
    vals: list[np.ndarray] = []
    sym: dict[str, int] = {}
    for n in g.nodes:
        if n.op is Op.ARG:
            v = args[n.attrs.name]
            if not isinstance(v, Int8Cache):  # an int8 cache stays values + scales
                v = np.asarray(v)
            for d, actual in zip(n.shape, v.shape, strict=True):
                if isinstance(d, str):
                    if sym.setdefault(d, actual) != actual:
                        raise ValueError(f"{g.name}: dim {d} is {sym[d]} and {actual}")
                elif d != actual:
                    raise ValueError(f"{g.name}: arg {n.attrs.name} has shape {v.shape}")
        elif n.op is Op.PARAM:
            v = param(n.attrs.name)
        elif n.op is Op.RESHAPE:
            v = vals[n.inputs[0]].reshape([sym[d] if isinstance(d, str) else d
                                           for d in n.attrs.shape])
        else:
            v = OPS[n.op].reference(n.attrs, *[vals[i] for i in n.inputs])
        vals.append(v)
    return {name: vals[i] for name, i in g.outputs}


class ReferenceModel:
    """A ModelIR executed step by step on the numpy references, with its own KV caches."""

    def __init__(self, ir: ModelIR, weights: dict[str, np.ndarray], slots: int = 1):
        self.ir, self.weights = ir, weights
        self.caches = {
            (c.layer, name): empty_cache(c.dtype, (slots, c.size, c.kv_heads, c.head_dim))
            for c in ir.caches for name in c.names
        }

    def step(self, tokens: np.ndarray, start: np.ndarray, n_new: np.ndarray, *,
             hidden: bool = False):
        """Run tokens [B,T] whose first `n_new[b]` entries follow `start[b]` cached tokens;
        update the caches and return logits [B,T,V] (rows past n_new are meaningless). With
        `hidden` (a model with an assistant), return (logits, the target's final-normed hidden
        state [B,T,H]), the state a draft step starts from."""
        ir, cfg = self.ir, self.ir.config
        b, t = tokens.shape
        offs = np.arange(t)[None, :]
        positions = np.where(offs < n_new[:, None], start[:, None] + offs, -1).astype(np.int32)
        cache_len = (start + n_new).astype(np.int32)
        emb = run_graph(ir.embed, {"tokens": tokens.astype(np.int32)}, self.weights.__getitem__)
        carried = {name: v for name, v in emb.items() if name in CARRIED}
        for spec, tid in zip(cfg.layers, ir.layer_template, strict=True):
            g = ir.layers[tid]
            args = {"positions": positions, "cache_len": cache_len}
            if cfg.ple:
                args["ple"] = emb["ple"][:, :, spec.index]
            for name in g.args():
                if name in CACHE_ARGS:
                    args[name] = self.caches[(spec.kv_source, name)]
                elif name in CARRIED:
                    args[name] = carried[name]
            out = run_graph(g, args, lambda rel, s=spec: self.weights[resolve_param(rel, s)])
            carried = {name: v for name, v in out.items() if name in CARRIED}
            for name, v in out.items():
                if name in CACHE_ARGS:
                    self.caches[(spec.index, name)] = v
        args = {name: carried[name] for name in ir.head.args()}
        logits = run_graph(ir.head, args, self.weights.__getitem__)["logits"]
        if not hidden:
            return logits
        state = run_graph(ir.assistant.hidden, {"h": carried["h"]}, self.weights.__getitem__)
        return logits, state["hidden"]

    def draft(self, tokens: np.ndarray, hidden: np.ndarray,
              start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One draft step of the assistant: tokens [B] at positions `start` [B] (the target's
        cached tokens; the caches are only read), the state hidden [B,H] (the target's
        final-normed hidden state before them, or the previous step's). Returns the drafter's
        logits [B,V] and the next step's state [B,H]."""
        d, w = self.ir.assistant, self.weights
        start = np.asarray(start, np.int32)
        x = run_graph(d.draft_in, {"tokens": np.asarray(tokens, np.int32)[:, None],
                                   "hidden": np.asarray(hidden, np.float32)[:, None]},
                      w.__getitem__)["h"]
        for i, (t, read) in enumerate(zip(d.layer_template, d.reads, strict=True)):
            g = d.layers[t]
            args = {"h": x, "positions": start[:, None], "cache_len": start}
            for name in g.args():
                if name in CACHE_ARGS:
                    args[name] = self.caches[(read, name)]
            x = run_graph(g, args, lambda rel, i=i, read=read:
                          w[resolve_draft_param(rel, i, read)])["h"]
        out = run_graph(d.draft_out, {"h": x}, w.__getitem__)
        return out["logits"][:, 0], out["hidden"][:, 0]

    def sample(self, logits: np.ndarray, temperature, top_k, top_p, seed, step) -> np.ndarray:
        args = {"logits": logits, "temperature": np.asarray(temperature, np.float32),
                "top_k": np.asarray(top_k, np.int32), "top_p": np.asarray(top_p, np.float32),
                "seed": np.asarray(seed, np.int32), "step": np.asarray(step, np.int32)}
        return run_graph(self.ir.sampler, args, self.weights.__getitem__)["tokens"]
