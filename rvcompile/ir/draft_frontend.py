"""Assistant front end: an AssistantConfig becomes the float32 DraftIR of a target's ModelIR.

`add_assistant(ir, assistant)` runs on the front end's float32 IR, before any pass, so every pass
treats the drafter's graphs and weights as the target's: cast, quantized, KV-retyped alike.
The drafter's own weights are named by their checkpoint names under "assistant." (the
"model." prefix dropped, as for a target); it also reads the target's "embed_tokens.weight"
(the last token's embedding), "norm.weight" (the target's final norm, the first step's state)
and, for a K=V cache, the read layer's k_norm. See ir.graph.DraftIR for the graphs' contract.

Attention: drafter layer i reads target layer `reads[i]`'s cache as the target wrote it. Its
query, at the position p of the token the step feeds, sees the keys at [p - W - 1, p - 1]
(sliding, W the drafter's sliding_window) or [0, p - 1] (full). Every cached position is below p
(cache_len = p), so the causal mask holds. transformers' assistant masks the target's sliding
states with its bidirectional sliding-window mask flipped on the key axis: keys within distance
W of the last, |0 - kv| <= W, i.e. the last W + 1 keys (tests/test_assistant_oracle.py fails
with W or W + 1 keys). ATTENTION keeps keys k > q - window, so window = W + 2. A K=V cache's keys
are derived as the target derives them (its k_norm, its RoPE); the query gets the drafter's RoPE.
"""

from __future__ import annotations

from dataclasses import replace

from rvcompile.ir.frontend import _Layer, cache_geometry, cache_names
from rvcompile.ir.graph import (
    KV_SOURCE_PREFIX,
    DraftIR,
    Graph,
    GraphBuilder,
    ModelIR,
    ParamSpec,
    check_model,
)
from rvcompile.ir.ops import (
    AttentionAttrs,
    CachePositionsAttrs,
    CentroidHeadAttrs,
    EmbedAttrs,
    LinearAttrs,
    Op,
    ReshapeAttrs,
    RMSNormAttrs,
    RopeAttrs,
)
from rvcompile.model.assistant import TENSOR_PREFIX, AssistantConfig
from rvcompile.model.config import LayerSpec

P = TENSOR_PREFIX
# A drafter query at p sees sliding keys [p - W - 1, p - 1]: ATTENTION's window is W + this.
DRAFT_WINDOW_EXTRA = 2


class _DraftLayer(_Layer):
    """A drafter layer: the target layer template's norms and MLP, with query-only attention
    over the cache of target layer `read` (spec `src`)."""

    def __init__(self, assistant: AssistantConfig, spec: LayerSpec, src: LayerSpec, size: int,
                 ring: bool):
        super().__init__(assistant.text, spec, size, ring)
        self.b = GraphBuilder(f"draft_layer{spec.index}_template")
        self.src = src

    def attention(self, n: int, pos: int) -> tuple[int, dict[str, int]]:
        cfg, s, src, b = self.cfg, self.spec, self.src, self.b
        nh, d, kh = cfg.num_heads, s.head_dim, s.num_kv_heads
        q = self.heads(self.linear(n, "self_attn.q_proj.weight", nh * d, cfg.hidden_size), nh, d)
        q = b.add(Op.ROPE, (self.norm(q, "self_attn.q_norm.weight", d), pos),
                  RopeAttrs(tuple(s.rope.inv_freq(d))))
        caches = {name: b.arg(name, ("B", self.size, kh, d)) for name in cache_names(src)}
        cache_len = b.arg("cache_len", ("B",), "int32")
        k_pos = b.add(Op.CACHE_POSITIONS, (cache_len,), CachePositionsAttrs(self.size, self.ring))
        if src.k_eq_v:
            k_norm = b.param(KV_SOURCE_PREFIX + "self_attn.k_norm.weight", (d,))
            k = b.add(Op.ROPE, (b.add(Op.MUL, (caches["cache_kv"], k_norm)), k_pos),
                      RopeAttrs(tuple(src.rope.inv_freq(d))))
            v = caches["cache_kv"]
        else:
            k, v = caches["cache_k"], caches["cache_v"]
        window = None if s.window is None else s.window + DRAFT_WINDOW_EXTRA
        o = b.add(Op.ATTENTION, (q, k, v, pos, k_pos), AttentionAttrs(window, 1.0))
        o = b.add(Op.RESHAPE, (o,), ReshapeAttrs(("B", "T", nh * d)))
        return self.linear(o, "self_attn.o_proj.weight", cfg.hidden_size, nh * d), {}


def _hidden_graph(ir: ModelIR) -> Graph:
    cfg = ir.config
    b = GraphBuilder("draft_hidden")
    h = b.arg("h", ("B", "T", cfg.hidden_size))
    n = b.add(Op.RMSNORM, (h, b.param("norm.weight", (cfg.hidden_size,))),
              RMSNormAttrs(cfg.rms_norm_eps))
    return b.build({"hidden": n})


def _draft_in_graph(ir: ModelIR, a: AssistantConfig) -> Graph:
    cfg = ir.config
    hb = cfg.hidden_size
    b = GraphBuilder("draft_in")
    tokens = b.arg("tokens", ("B", "T"), "int32")
    state = b.arg("hidden", ("B", "T", hb))
    table = b.param("embed_tokens.weight", (cfg.vocab_size, hb))
    e = b.add(Op.EMBED, (table, tokens), EmbedAttrs(cfg.embed_scale))
    x = b.add(Op.CONCAT, (e, state))
    w = b.param(P + "pre_projection.weight", (a.hidden_size, 2 * hb))
    return b.build({"h": b.add(Op.LINEAR, (x, w), LinearAttrs())})


def _draft_out_graph(a: AssistantConfig) -> Graph:
    d, v = a.hidden_size, a.vocab_size
    b = GraphBuilder("draft_out")
    h = b.arg("h", ("B", "T", d))
    n = b.add(Op.RMSNORM, (h, b.param(P + "norm.weight", (d,))),
              RMSNormAttrs(a.text.rms_norm_eps))
    post = b.param(P + "post_projection.weight", (a.backbone_hidden_size, d))
    hidden = b.add(Op.LINEAR, (n, post), LinearAttrs())
    table = b.param(P + "embed_tokens.weight", (v, d))
    if a.use_ordered_embeddings:
        # The centroid scores pick which tokens are scored at all: unquantized, as a router.
        centroids = b.param(P + "masked_embedding.centroids.weight", (a.num_centroids, d))
        cl = b.add(Op.LINEAR, (n, centroids), LinearAttrs("router"))
        ordering = b.param(P + "masked_embedding.token_ordering", (v,), "int32")
        logits = b.add(Op.CENTROID_HEAD, (n, cl, ordering, table),
                       CentroidHeadAttrs(a.centroid_intermediate_top_k, a.num_centroids))
    else:
        logits = b.add(Op.LINEAR, (n, table), LinearAttrs())
    return b.build({"logits": logits, "hidden": hidden})


def add_assistant(ir: ModelIR, assistant: AssistantConfig) -> ModelIR:
    """`ir` (the front end's float32 IR, no pass applied) with `assistant` as its DraftIR.
    ConfigError when the assistant does not fit the target."""
    if ir.notes:
        raise ValueError(f"add_assistant expects the front end's IR, not one after {ir.notes}")
    cfg = ir.config
    reads = assistant.target_layers(cfg)
    templates: dict[tuple, int] = {}
    graphs: list[Graph] = []
    layer_template = []
    for spec, read in zip(assistant.text.layers, reads, strict=True):
        src = cfg.layers[read]
        key = (spec.kind, spec.mlp_width, read)
        if key not in templates:
            size, ring = cache_geometry(cfg, src, ir.max_context, ir.max_chunk)
            templates[key] = len(graphs)
            graphs.append(_DraftLayer(assistant, spec, src, size, ring).build())
        layer_template.append(templates[key])
    draft = DraftIR(assistant, _hidden_graph(ir), _draft_in_graph(ir, assistant), tuple(graphs),
                    tuple(layer_template), reads, _draft_out_graph(assistant))
    params = {p.name: p for p in ir.params}
    for g, resolve in draft.resolved_params():
        for rel, node in g.params().items():
            name = resolve(rel)
            if name not in params:
                derive = "int32" if node.dtype == "int32" else "copy"
                params[name] = ParamSpec(name, tuple(node.shape), node.dtype, name, derive)
    out = replace(ir, assistant=draft, params=tuple(params.values()))
    check_model(out)
    return out
