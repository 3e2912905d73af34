"""The assistant drafter's entry points on the H100: `draft_{B}`, K draft steps of B lanes in
one launch list (a CUDA graph at load), lowered from the IR's DraftIR (ir/graph.py) with the
target's kernels.

Inputs (io): tokens [B] (the token to draft after), positions [B] (its position q; -1: an idle
lane), seq_len [B] (= q: the target's cached tokens, the keys a drafter query sees), the block
tables and sampling parameters as for decode, `draft_state` float32 [max_seqs, H] (the state to
start from: a verify row's "states" output) and `draft_step` int32 [K, max_seqs] (the RNG step
of draft i per lane: step + i, what the verify row checking it samples at). One step i:
- the target's embedding of the token (io tokens for step 0, else step i - 1's sampled token)
  beside the state (io draft_state, else step i - 1's post_projection), packed into one row
  per lane (draft_rows.draft_concat: bf16 in the quantized plan, which its GEMVs read; float32
  in the float32 plan), then pre_projection into the drafter's residual stream [B, D];
- the drafter's layers (launches.py's table): query-only attention over the pools of the
  target layers they read (DraftIR.reads) at the token's position q, keys [q - W - 1, q - 1]
  (sliding: the IR window W + 2 less the query's own slot, `key_lag`) or [0, q - 1];
- the drafter's final norm, post_projection (the next state, [B, H] float32) and its tied head
  (logits [B, V]), sampled like decode (greedy lanes take the argmax).
Outputs: `tokens` int32 [K, B], `logits` float32 [K * B, V] and `states` float32 [K * B, H]
(row i * B + b: step i of lane b). Every step runs at the same position q: the target has not
run the drafts yet.

A centroid-masked head (use_ordered_embeddings, the small models' drafters) scores only its top
clusters' tokens (draft_rows.py's centroid_select, centroid_score and centroid_fill, after the
centroid GEMV), every other token getting the smallest of those minus 1.
"""

from __future__ import annotations

from dataclasses import replace

from rvcompile.artifacts.kernel_schedule import RATIO_LANE_WORDS, RATIO_LANES_FIELD
from rvcompile.dtypes import numpy_dtype
from rvcompile.ir.graph import DraftIR, Graph, ModelIR, readers, resolve_draft_param
from rvcompile.ir.ops import Op
from rvcompile.targets.h100 import draft_rows, norms, ratio, sample
from rvcompile.targets.h100.launches import SM_COUNT, EntryLowering, _At
from rvcompile.targets.h100.layout import Constants, EntryPlan, LoweringError, Pool, Ref

STATE_FIELD = "draft_state"  # io: float32 [max_seqs, H], the state draft step 0 starts from
STEP_FIELD = "draft_step"  # io: int32 [K, max_seqs], draft i's RNG step per lane
Q_FIELD = "draft_q"  # ratio region: float32 [K * max_seqs, V], the logits each draft came from
DIST_FIELD = "draft_dist"  # ratio region: their sampling records (ratio.py)


def draft_io_fields(ir: ModelIR, max_seqs: int,
                    steps: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The io fields of a drafter's schedule beyond decode's (layout.py places them last):
    the ratio rule's lanes (which every call writes), then the draft entries' own."""
    return {RATIO_LANES_FIELD: ("int32", (max_seqs, RATIO_LANE_WORDS)),
            STATE_FIELD: ("float32", (max_seqs, ir.config.hidden_size)),
            STEP_FIELD: ("int32", (steps, max_seqs))}


def ratio_fields(ir: ModelIR, max_seqs: int,
                 steps: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The ratio region's fields: what a draft call leaves for verify's ratio rule."""
    rows = steps * max_seqs
    return {DIST_FIELD: ("int32", (rows, 2 * ratio.DIST_WORDS)),
            Q_FIELD: ("float32", (rows, ir.config.vocab_size))}


class DraftLowering(EntryLowering):
    """`draft_{rows}`: `steps` drafter steps over `rows` lanes (module docstring)."""

    key_lag = 1  # a drafter query at q sees the target's keys up to q - 1

    def __init__(self, ir: ModelIR, rows: int, consts: Constants, pools: dict[int, Pool], *,
                 steps: int, max_seqs: int):
        super().__init__(ir, "draft", rows, consts, pools)
        if ir.assistant is None:
            raise LoweringError("draft entries need an assistant in the IR")
        self.d: DraftIR = ir.assistant
        self.steps, self.max_seqs = steps, max_seqs
        self.target_hidden = ir.config.hidden_size
        # the drafter's layers run over its own residual stream, D wide
        self.cfg = self.d.config.text
        self.h = self.buffer(rows * self.cfg.hidden_size * 4)

    def run(self, name: str) -> EntryPlan:
        m, hb, v = self.m, self.target_hidden, self.ir.config.vocab_size
        tokens = self.buffer(self.steps * m * 4)
        states = self.buffer(self.steps * m * hb * 4)
        logits = Ref("ratio", Q_FIELD)  # kept there for the ratio rule until the next draft
        for i in range(self.steps):
            tok = Ref("io", "tokens") if i == 0 else tokens.at((i - 1) * m * 4)
            state = Ref("io", STATE_FIELD) if i == 0 else states.at((i - 1) * m * hb * 4)
            self.draft_in(tok, state)
            layers = self.d.config.text.layers
            for j, (t, read) in enumerate(zip(self.d.layer_template, self.d.reads,
                                              strict=True)):
                spec = replace(layers[j], kv_source=read)  # the target layer's pools
                self.walk(self.d.layers[t], spec, {},
                          lambda rel, j=j, read=read: resolve_draft_param(rel, j, read))
            self.draft_out(states.at(i * m * hb * 4), logits.at(i * m * v * 4))
            self.sample_step(logits.at(i * m * v * 4), tokens.at(i * m * 4), i)
        self.outputs.update(tokens=(tokens, "int32", (self.steps, m)),
                            logits=(logits, "float32", (self.steps * m, v)),
                            states=(states, "float32", (self.steps * m, hb)))
        return EntryPlan(name, m, True, tuple(self.launches), self.sizes, self.outputs)

    def draft_in(self, tok: Ref, state: Ref) -> None:
        """DraftIR.draft_in: LINEAR(CONCAT(EMBED(table, tokens), hidden)) into the residual
        stream."""
        g = self.d.draft_in
        at = _node(g, dict(g.outputs)["h"], Op.LINEAR)
        cat = _node(g, at.node.inputs[0], Op.CONCAT)
        emb = _node(g, cat.node.inputs[0], Op.EMBED)
        if not (emb.is_arg(1, "tokens") and cat.is_arg(1, "hidden")):
            raise LoweringError(f"graph {g.name}: expected the tokens' embedding beside the "
                                "hidden state")
        hb, dim = self.target_hidden, self.cfg.hidden_size
        e = self.buffer(self.m * hb * 4)
        self.embed_rows(emb.weight(0), tok, emb.node.attrs.multiplier, e, hb)
        x = self.buffer(self.m * 2 * hb * self.lin_size)
        self.emit(draft_rows.CONCAT_F32_ENTRY if self.f32 else draft_rows.CONCAT_ENTRY,
                  draft_rows.concat_geometry(self.m, 2 * hb), a=e, b=state, out=x, M=self.m,
                  Ha=hb, Hb=hb)
        values, scales = self.linear_weights(at, 1, 1)
        self.gemv(x, Ref("weights", values[0]), Ref("weights", scales[0]) if scales else None,
                  self.h, self.m, dim, 2 * hb)

    def draft_out(self, state: Ref, logits: Ref) -> None:
        """DraftIR.draft_out: RMSNORM of the stream, then post_projection (the next state) and
        the tied head, each into its step's slice of the entry's outputs."""
        g = self.d.draft_out
        out = dict(g.outputs)
        post = _node(g, out["hidden"], Op.LINEAR)
        centroids = g.nodes[out["logits"]].op == Op.CENTROID_HEAD
        head = _node(g, out["logits"], Op.CENTROID_HEAD if centroids else Op.LINEAR)
        norm = _node(g, post.node.inputs[0], Op.RMSNORM)
        if head.node.inputs[0] != post.node.inputs[0] or not norm.is_arg(0, "h"):
            raise LoweringError(f"graph {g.name}: expected post_projection and the head over "
                                "the final norm of h")
        dim, hb, v = self.cfg.hidden_size, self.target_hidden, self.ir.config.vocab_size
        n = self.buffer(self.m * dim * self.lin_size)
        self.emit(norms.RMSNORM_F32_ENTRY if self.f32 else norms.RMSNORM_ENTRY,
                  norms.launch_geometry(self.m, dim), x=self.h, w=Ref("weights", norm.weight(1)),
                  y=n, H=dim, eps=norm.node.attrs.eps)
        values, scales = self.linear_weights(post, 1, 1)
        self.gemv(n, Ref("weights", values[0]), Ref("weights", scales[0]) if scales else None,
                  state, self.m, hb, dim)
        if centroids:
            self.centroid_head(g, head, n, logits)
            return
        values, scales = self.linear_weights(head, 1, 1)
        self.product(n, Ref("weights", values[0]), Ref("weights", scales[0]) if scales else None,
                     logits, self.m, v, dim)

    def centroid_head(self, g: Graph, head: _At, n: Ref, logits: Ref) -> None:
        """CENTROID_HEAD(n, LINEAR(n, centroids), token_ordering, table): the centroid logits
        (a GEMV), the top clusters' tokens, their logits, the rest filled (draft_rows.py)."""
        a, m = head.node.attrs, self.m
        router = _node(g, head.node.inputs[1], Op.LINEAR)
        if router.node.inputs[0] != head.node.inputs[0]:
            raise LoweringError(f"graph {g.name}: centroid logits of another input than the "
                                "head's")
        values, scales = self.linear_weights(router, 1, 1)
        if scales:
            raise LoweringError("quantized centroid weights; the centroid GEMV takes bf16 or "
                                "float32 (they stay unquantized, as a router)")
        table, ordering = head.weight(3), head.weight(2)
        dtype = self.specs[table].dtype
        entry = {"bfloat16": draft_rows.SCORE_ENTRY,
                 "float32": draft_rows.SCORE_F32_ENTRY}.get(dtype)
        if entry is None or self.lin_size != numpy_dtype(dtype).itemsize:
            raise LoweringError(f"centroid head table of dtype {dtype} beside "
                                f"{'float32' if self.f32 else 'bf16'} activations")
        vocab, dim = self.specs[table].shape
        per = vocab // a.clusters
        cl = self.buffer(m * a.clusters * 4)
        self.gemv(n, Ref("weights", values[0]), None, cl, m, a.clusters, dim)
        count = a.top_k * per
        ids, sel = self.buffer(m * count * 4), self.buffer(m * count * 4)
        self.emit(draft_rows.SELECT_ENTRY, draft_rows.select_geometry(m, a.clusters), cl=cl,
                  ordering=Ref("weights", ordering), ids=ids, C=a.clusters, T=per,
                  top_k=a.top_k)
        self.emit(entry, draft_rows.score_geometry(m, count), h=n, table=Ref("weights", table),
                  ids=ids, sel=sel, N=count, D=dim)
        self.emit(draft_rows.FILL_ENTRY, draft_rows.fill_geometry(m), sel=sel, ids=ids,
                  logits=logits, N=count, V=vocab)

    def sample_step(self, logits: Ref, out: Ref, i: int) -> None:
        """The decode sampler (no softcap) over step i's logits, at RNG step draft_step[i],
        its records (ratio.py) into the ratio region beside the logits."""
        m, v = self.m, self.ir.config.vocab_size
        plan = sample.plan(m, v, SM_COUNT)
        ws = self.buffer(plan.workspace)
        io = {name: Ref("io", name) for name in ("temperature", "top_k", "top_p", "seed")}
        io["step"] = Ref("io", STEP_FIELD).at(i * self.max_seqs * 4)
        self.emit(sample.PREPARE_ENTRY, plan.prepare, logits=logits, M=m, V=v, cap=0.0,
                  workspace=ws)
        self.emit(sample.FILTER_ENTRY, plan.filter, M=m, V=v, chunk=plan.chunk,
                  temperature=io["temperature"], top_k=io["top_k"], workspace=ws)
        self.emit(ratio.PICK_DIST_ENTRY, plan.pick, M=m, V=v, **io, workspace=ws, out=out,
                  dist=Ref("ratio", DIST_FIELD).at(ratio.dist_bytes(i * m)))


def _node(g: Graph, idx: int, op: Op) -> _At:
    """Node `idx` of g, which must be an `op`, as launches.py's lowering functions see it."""
    if g.nodes[idx].op != op:
        raise LoweringError(f"graph {g.name}, node %{idx}: expected {op.value}, got "
                            f"{g.nodes[idx].op.value}")
    return _At(g, idx, None, {}, readers(g)[idx])
