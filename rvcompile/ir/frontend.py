"""Model front end: a Gemma4Config becomes a float32 ModelIR (shared/GEMMA4.md, "Forward pass").

Layers with equal `LayerSpec` structure share one template graph. PARAM names inside a template
are relative to its layer; a name starting with "kv_source." is relative to the layer whose KV
cache it reads (a KV-shared K=V layer derives K with its producer's k_norm). Param specs are read
off the graphs, so the weights listed are exactly the weights the graphs use.
"""

from __future__ import annotations

import math

from rvcompile.ir.graph import (
    KV_SOURCE_PREFIX,
    CacheSpec,
    Graph,
    GraphBuilder,
    ModelIR,
    ParamSpec,
    check_model,
    resolve_param,
)
from rvcompile.ir.ops import (
    AttentionAttrs,
    CachePositionsAttrs,
    EmbedAttrs,
    KVWriteAttrs,
    LinearAttrs,
    MoEAttrs,
    Op,
    ReshapeAttrs,
    RMSNormAttrs,
    RopeAttrs,
    ScaleAttrs,
    SoftcapAttrs,
)
from rvcompile.model.config import Gemma4Config, LayerSpec


def cache_names(layer: LayerSpec) -> tuple[str, ...]:
    return ("cache_kv",) if layer.k_eq_v else ("cache_k", "cache_v")


def cache_geometry(cfg: Gemma4Config, layer: LayerSpec, max_context: int,
                   max_chunk: int) -> tuple[int, bool]:
    """(slots, ring) of the cache layer `layer` reads. A sliding ring must hold the window plus a
    whole prefill chunk, because a chunk is written before it is attended to."""
    if layer.window is None:
        return max_context, False
    return min(max_context, layer.window + max_chunk - 1), True


class _Layer:
    """Builds one layer template; small methods, one per sub-block of the forward pass."""

    def __init__(self, cfg: Gemma4Config, spec: LayerSpec, size: int, ring: bool):
        self.cfg, self.spec, self.size, self.ring = cfg, spec, size, ring
        self.b = GraphBuilder(f"layer{spec.index}_template")
        self.eps = RMSNormAttrs(cfg.rms_norm_eps)

    def norm(self, x: int, weight: str | None, dim: int) -> int:
        if weight is None:
            return self.b.add(Op.RMSNORM, (x,), self.eps)
        return self.b.add(Op.RMSNORM, (x, self.b.param(weight, (dim,))), self.eps)

    def linear(self, x: int, weight: str, out: int, inp: int, role: str = "dense") -> int:
        return self.b.add(Op.LINEAR, (x, self.b.param(weight, (out, inp))), LinearAttrs(role))

    def heads(self, x: int, n: int, d: int) -> int:
        return self.b.add(Op.RESHAPE, (x,), ReshapeAttrs(("B", "T", n, d)))

    def build(self) -> Graph:
        cfg, b = self.cfg, self.b
        hidden = cfg.hidden_size
        h = b.arg("h", ("B", "T", hidden))
        pos = b.arg("positions", ("B", "T"), "int32")
        n = self.norm(h, "input_layernorm.weight", hidden)
        attn, outputs = self.attention(n, pos)
        h = b.add(Op.ADD, (h, self.norm(attn, "post_attention_layernorm.weight", hidden)))
        f = self.mlp(h)
        h = b.add(Op.ADD, (h, self.norm(f, "post_feedforward_layernorm.weight", hidden)))
        if cfg.ple:
            h = self.per_layer_input(h)
        h = b.add(Op.MUL, (h, b.param("layer_scalar", (1,))))
        return b.build({"h": h, **outputs})

    def attention(self, n: int, pos: int) -> tuple[int, dict[str, int]]:
        cfg, s, b = self.cfg, self.spec, self.b
        nh, d, kh = cfg.num_heads, s.head_dim, s.num_kv_heads
        rope = RopeAttrs(tuple(s.rope.inv_freq(d)))
        q = self.heads(self.linear(n, "self_attn.q_proj.weight", nh * d, cfg.hidden_size), nh, d)
        q = b.add(Op.ROPE, (self.norm(q, "self_attn.q_norm.weight", d), pos), rope)
        cache_shape = ("B", self.size, kh, d)
        caches = {name: b.arg(name, cache_shape) for name in cache_names(s)}
        outputs: dict[str, int] = {}
        if not s.kv_shared:
            k_raw = self.heads(
                self.linear(n, "self_attn.k_proj.weight", kh * d, cfg.hidden_size), kh, d)
            write = KVWriteAttrs(self.ring)
            if s.k_eq_v:
                base = self.norm(k_raw, None, d)  # V, and K before k_norm's weight and RoPE
                outputs["cache_kv"] = b.add(Op.KV_WRITE, (caches["cache_kv"], base, pos), write)
            else:
                k = b.add(Op.ROPE, (self.norm(k_raw, "self_attn.k_norm.weight", d), pos), rope)
                v_raw = self.heads(
                    self.linear(n, "self_attn.v_proj.weight", kh * d, cfg.hidden_size), kh, d)
                v = self.norm(v_raw, None, d)
                outputs["cache_k"] = b.add(Op.KV_WRITE, (caches["cache_k"], k, pos), write)
                outputs["cache_v"] = b.add(Op.KV_WRITE, (caches["cache_v"], v, pos), write)
            caches = {**caches, **outputs}
        cache_len = b.arg("cache_len", ("B",), "int32")
        k_pos = b.add(Op.CACHE_POSITIONS, (cache_len,), CachePositionsAttrs(self.size, self.ring))
        if s.k_eq_v:
            prefix = KV_SOURCE_PREFIX if s.kv_shared else ""
            k_norm = b.param(prefix + "self_attn.k_norm.weight", (d,))
            k = b.add(Op.ROPE, (b.add(Op.MUL, (caches["cache_kv"], k_norm)), k_pos), rope)
            v = caches["cache_kv"]
        else:
            k, v = caches["cache_k"], caches["cache_v"]
        o = b.add(Op.ATTENTION, (q, k, v, pos, k_pos), AttentionAttrs(s.window, 1.0))
        o = b.add(Op.RESHAPE, (o,), ReshapeAttrs(("B", "T", nh * d)))
        return self.linear(o, "self_attn.o_proj.weight", cfg.hidden_size, nh * d), outputs

    def mlp(self, r: int) -> int:
        cfg, s, b = self.cfg, self.spec, self.b
        hidden, width = cfg.hidden_size, s.mlp_width
        m = self.norm(r, "pre_feedforward_layernorm.weight", hidden)
        gate = b.add(Op.GELU_TANH, (self.linear(m, "mlp.gate_proj.weight", width, hidden),))
        up = self.linear(m, "mlp.up_proj.weight", width, hidden)
        f = self.linear(b.add(Op.MUL, (gate, up)), "mlp.down_proj.weight", hidden, width)
        if not s.moe:
            return f
        e, im = cfg.num_experts, cfg.moe_intermediate_size
        f1 = self.norm(f, "post_feedforward_layernorm_1.weight", hidden)
        z = b.add(Op.MUL, (self.norm(r, None, hidden), b.param("router.scale", (hidden,))))
        z = b.add(Op.SCALE, (z,), ScaleAttrs(hidden**-0.5))
        logits = self.linear(z, "router.proj.weight", e, hidden, role="router")
        x2 = self.norm(r, "pre_feedforward_layernorm_2.weight", hidden)
        y = b.add(Op.MOE, (
            x2, logits, b.param("router.per_expert_scale", (e,)),
            b.param("experts.gate_up_proj", (e, 2 * im, hidden)),
            b.param("experts.down_proj", (e, hidden, im)),
        ), MoEAttrs(cfg.top_k_experts))
        y = self.norm(y, "post_feedforward_layernorm_2.weight", hidden)
        return b.add(Op.ADD, (f1, y))

    def per_layer_input(self, h: int) -> int:
        cfg, b = self.cfg, self.b
        hidden, p = cfg.hidden_size, cfg.hidden_size_per_layer_input
        g = b.add(Op.GELU_TANH, (self.linear(h, "per_layer_input_gate.weight", p, hidden),))
        g = b.add(Op.MUL, (g, b.arg("ple", ("B", "T", p))))
        out = self.linear(g, "per_layer_projection.weight", hidden, p)
        return b.add(Op.ADD, (h, self.norm(out, "post_per_layer_input_norm.weight", hidden)))


def _embed_graph(cfg: Gemma4Config) -> Graph:
    b = GraphBuilder("embed")
    tokens = b.arg("tokens", ("B", "T"), "int32")
    table = b.param("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    h = b.add(Op.EMBED, (table, tokens), EmbedAttrs(cfg.embed_scale))
    outputs = {"h": h}
    if cfg.ple:
        n_layers, p = cfg.num_layers, cfg.hidden_size_per_layer_input
        eps = RMSNormAttrs(cfg.rms_norm_eps)
        ple_table = b.param("embed_tokens_per_layer.weight",
                            (cfg.vocab_size_per_layer_input, n_layers * p))
        tok = b.add(Op.EMBED, (ple_table, tokens), EmbedAttrs(math.sqrt(p)))
        tok = b.add(Op.RESHAPE, (tok,), ReshapeAttrs(("B", "T", n_layers, p)))
        proj = b.param("per_layer_model_projection.weight", (n_layers * p, cfg.hidden_size))
        ctx = b.add(Op.LINEAR, (h, proj), LinearAttrs())
        ctx = b.add(Op.SCALE, (ctx,), ScaleAttrs(cfg.hidden_size**-0.5))
        ctx = b.add(Op.RESHAPE, (ctx,), ReshapeAttrs(("B", "T", n_layers, p)))
        ctx = b.add(Op.RMSNORM, (ctx, b.param("per_layer_projection_norm.weight", (p,))), eps)
        outputs["ple"] = b.add(Op.SCALE, (b.add(Op.ADD, (ctx, tok)),), ScaleAttrs(2**-0.5))
    return b.build(outputs)


def _head_graph(cfg: Gemma4Config) -> Graph:
    b = GraphBuilder("head")
    h = b.arg("h", ("B", "T", cfg.hidden_size))
    n = b.add(Op.RMSNORM, (h, b.param("norm.weight", (cfg.hidden_size,))),
              RMSNormAttrs(cfg.rms_norm_eps))
    table = b.param("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    logits = b.add(Op.LINEAR, (n, table), LinearAttrs())
    if cfg.final_logit_softcapping:
        logits = b.add(Op.SOFTCAP, (logits,), SoftcapAttrs(float(cfg.final_logit_softcapping)))
    return b.build({"logits": logits})


def _sampler_graph(cfg: Gemma4Config) -> Graph:
    b = GraphBuilder("sampler")
    ins = (
        b.arg("logits", ("B", cfg.vocab_size)),
        b.arg("temperature", ("B",)),
        b.arg("top_k", ("B",), "int32"),
        b.arg("top_p", ("B",)),
        b.arg("seed", ("B",), "int32"),
        b.arg("step", ("B",), "int32"),
    )
    return b.build({"tokens": b.add(Op.SAMPLE, ins)})


def _template_key(cfg: Gemma4Config, s: LayerSpec, max_context: int, max_chunk: int) -> tuple:
    src = cfg.layers[s.kv_source]
    return (s.kind, s.head_dim, s.num_kv_heads, s.k_eq_v, s.kv_shared, s.mlp_width, s.moe,
            s.window, cache_geometry(cfg, src, max_context, max_chunk))


def build_model_ir(cfg: Gemma4Config, *, max_context: int, max_chunk: int) -> ModelIR:
    """The float32 IR of `cfg` with KV caches for `max_context` tokens and prefill chunks of at
    most `max_chunk` tokens."""
    if max_chunk < 1 or max_context < max_chunk:
        raise ValueError(f"need 1 <= max_chunk ({max_chunk}) <= max_context ({max_context})")
    templates: dict[tuple, int] = {}
    graphs: list[Graph] = []
    layer_template = []
    for s in cfg.layers:
        key = _template_key(cfg, s, max_context, max_chunk)
        if key not in templates:
            size, ring = cache_geometry(cfg, cfg.layers[s.kv_source], max_context, max_chunk)
            templates[key] = len(graphs)
            graphs.append(_Layer(cfg, s, size, ring).build())
        layer_template.append(templates[key])
    embed, head = _embed_graph(cfg), _head_graph(cfg)
    params: dict[str, ParamSpec] = {}
    for g, resolve in [(embed, str), (head, str)] + [
        (graphs[t], lambda rel, s=s: resolve_param(rel, s))
        for s, t in zip(cfg.layers, layer_template, strict=True)
    ]:
        for rel, node in g.params().items():
            name = resolve(rel)
            params.setdefault(name, ParamSpec(name, tuple(node.shape), "float32", name))
    caches = []
    for s in cfg.layers:
        if not s.kv_shared:
            size, ring = cache_geometry(cfg, s, max_context, max_chunk)
            caches.append(CacheSpec(s.index, cache_names(s), size, s.num_kv_heads, s.head_dim,
                                    ring))
    ir = ModelIR(cfg, embed, tuple(graphs), tuple(layer_template), head, _sampler_graph(cfg),
                 tuple(params.values()), tuple(caches), max_context, max_chunk)
    check_model(ir)
    return ir
