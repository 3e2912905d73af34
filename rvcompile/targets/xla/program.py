"""A ModelIR as JAX entry points whose decoder layers run as `lax.scan`s over stacked weights,
reading and writing a paged KV cache.

Layers are cut into periods of the (nS, F) pattern; consecutive periods with the same templates
form a group and run as one scan, so the program is as small at 60 layers as at 6. Weights and KV
pools are flat dicts of arrays named by `LayoutPlan`: a stacked entry "g{group}.{j}.{rel}" holds
that template PARAM for every period of the group ([count, ...]); pools "g{group}.{j}.cache_k"
are [count, blocks, BLOCK_SIZE, kv_heads * head_dim] (`cache_pools`: a slot's heads side by
side). An array's shape is its PARAM's, except
where `layout_shape` views the same bytes otherwise: the MoE experts' fused gate/up rows.

Paged KV (`KvKind`): every layer that owns a cache is of kind "full" or "sliding", and the layers
of one kind share block ids: block b of kind k is row b of every pool of that kind. A sequence
reaches its blocks through one block table per kind, [B, table_width]:
- full: entry j holds positions [16j, 16j + 16);
- sliding: a ring of `table_width` blocks, entry j % width holding logical block j, so the table
  always covers the window plus one prefill chunk. Slot positions follow the IR's ring
  semantics (CACHE_POSITIONS) with size = width * BLOCK_SIZE.
Pool sizes are symbolic in the exported programs ("blocks_full", "blocks_sliding"): the runtime
chooses them at load.

Entry points (all return the updated pools first; pools are meant to be donated):
- prefill(weights, caches, tokens [1,T], start [1], n_new [1], tables, sampling..., extras...)
  -> token [1], logprob [1], top_ids [1,K], top_logprobs [1,K]
- decode(weights, caches, tokens [B,1], start [B], n_new [B], tables, sampling..., extras...)
  -> tokens [B], logprob [B], top_ids [B,K], top_logprobs [B,K]
  (extras: penalties, a token mask, top log-probabilities wanted: targets/xla/sampler.py)
- logits(weights, caches, tokens [1,T], start [1], n_new [1], tables) -> logits [1,T,V]
- decode_loop(decode's arguments, stop_ids [B,S], budget [B]) -> tokens [B,N], steps: up to N
  decode steps in one `lax.while_loop`, sampling and stop checks on the device.
- verify(weights, caches, tokens [B,R], start [B], n_new [B], tables, sampling...[, draft_probs
  [B,R-1,V], draft_lane [B]]) -> tokens [B,R] (and, with an assistant, hidden [B,R,H]): R rows
  per lane (a token and the drafts after it), each row's next token sampled (row i at RNG step
  step + i; -1 past n_new), and the target's final-normed hidden state of each row (the
  drafter's first state). With an assistant, the lanes with draft_lane >= 0 at temperature > 0
  accept their drafts by the ratio rule against draft_probs[draft_lane] (rejection.py).
- draft(weights, caches, tokens [B,1], start [B], n_new [B], tables, hidden [B,H], sampling...,
  n_draft []) -> tokens [B,K], logits [B,K,V], draft_probs [B,K,V], hidden [B,K,H]: up to K
  assistant steps (n_draft of them) from each lane's token at position start, its caches read
  only (not returned, not donated); draft i samples at RNG step step + i, like the verify row
  that checks it, from draft_probs[:, i].
`start` = tokens already cached; `n_new` = valid tokens in this call (0 = idle lane); `tables`
= {kind: int32 [B, width]}. The next token is sampled from each lane's last valid row.
An assistant's weights are unstacked entries under their full names ("assistant.*"); the few
target weights it reads come from the target's arrays (`Program.weight`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from rvcompile.ir.graph import CACHE_ARGS, ModelIR, resolve_draft_param, resolve_param
from rvcompile.ir.ops import Op
from rvcompile.targets.xla import rejection, sampler
from rvcompile.targets.xla.hlo_traffic import BRANCHES
from rvcompile.targets.xla.lower import (
    BLOCK_SIZE,
    BLOCKWISE_LOWERINGS,
    JNP_DTYPES,
    LOWERINGS,
    PagedSlice,
    TakesPaged,
    attention_blockwise,
    cache_positions,
    decode_mlp_kernel,
    decode_projections_kernel,
    embed,
    filtered_probs,
    kv_write,
    moe,
    run_graph,
    sample_branch,
    scale_block_shape,
)
from rvcompile.targets.xla.lower import sample as lower_sample


@dataclass(frozen=True)
class KvKind:
    """The layers whose caches share one block table and one block id space."""

    name: str  # "full" or "sliding"
    ring: bool  # sliding: the table is a ring indexed by logical block % table_width
    table_width: int  # block table entries per sequence
    window: int | None  # sliding window in tokens (None for full attention)


def kv_kinds(ir: ModelIR) -> dict[str, KvKind]:
    """The cache kinds of `ir`. A sliding ring holds every block a step can touch: the keys
    of the window behind the chunk's first query, plus the chunk itself."""
    full_width = math.ceil(ir.max_context / BLOCK_SIZE)
    kinds: dict[str, KvKind] = {}
    windows = [ir.config.layers[c.layer].window for c in ir.caches if c.ring]
    if any(not c.ring for c in ir.caches):
        kinds["full"] = KvKind("full", False, full_width, None)
    if windows:
        window = max(windows)
        ring = math.ceil((window + ir.max_chunk - 1) / BLOCK_SIZE) + 1
        kinds["sliding"] = KvKind("sliding", True, min(full_width, ring), window)
    return kinds


def kind_of(ring: bool) -> str:
    return "sliding" if ring else "full"


SCALE_SUFFIX = ".scale"  # pool key + this: the float32 scales of an int8 pool


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


_TARGET_LAYER = re.compile(r"layers\.(\d+)\.(.+)")  # a (stacked) target layer weight


def plan_layout(ir: ModelIR) -> LayoutPlan:
    groups = plan_groups(ir)
    stacked = []
    for gi, g in enumerate(groups):
        for j, t in enumerate(g.templates):
            for rel in ir.layers[t].params():
                stacked.append(StackedParam(f"g{gi}.{j}.{rel}", rel, gi, j))
    names = list(ir.embed.params()) + [n for n in ir.head.params() if n not in ir.embed.params()]
    if ir.assistant:
        for g, resolve in ir.assistant.resolved_params():
            for name in map(resolve, g.params()):
                if not _TARGET_LAYER.fullmatch(name) and name not in names:
                    names.append(name)
    return LayoutPlan(groups, tuple(stacked), tuple(names))


GATE_UP = "experts.gate_up_proj"  # MoE: [E, 2 * I, H], gate rows then up rows


def layout_shape(rel: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of template PARAM `rel` as a program argument: the PARAM's, except the experts'
    gate/up rows [E, 2I, H] (and their per-row scales [E, 2I]), viewed as [E, 2, I, H] ([E, 2,
    I]). The bytes, and so the weights section, stay the IR's at every TP degree; the view gives
    each expert's intermediate dimension an axis of its own, which tensor parallelism splits
    (sharding.py) so that a device holds matching gate and up rows."""
    if rel.removesuffix(".scale") != GATE_UP:
        return shape
    e, rows, *rest = shape
    return (e, 2, rows // 2, *rest)


def weight_shapes(ir: ModelIR, plan: LayoutPlan) -> dict[str, jax.ShapeDtypeStruct]:
    specs = ir.param_map()
    out = {}
    for name in plan.globals_:
        out[name] = jax.ShapeDtypeStruct(specs[name].shape, JNP_DTYPES[specs[name].dtype])
    for sp in plan.stacked:
        g = plan.groups[sp.group]
        spec = specs[resolve_param(sp.rel, ir.config.layers[g.layer(0, sp.j)])]
        out[sp.key] = jax.ShapeDtypeStruct((g.count, *layout_shape(sp.rel, spec.shape)),
                                           JNP_DTYPES[spec.dtype])
    return out


def _cache_owner(plan: LayoutPlan, layer: int) -> tuple[int, int, int]:
    for gi, g in enumerate(plan.groups):
        for p in range(g.count):
            for j in range(g.period):
                if g.layer(p, j) == layer:
                    return gi, j, p
    raise KeyError(layer)


def cache_shapes(ir: ModelIR, plan: LayoutPlan, blocks: dict[str, int],
                 tp: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    """Pool shapes, with `blocks[kind]` blocks per pool (an int or a jax.export symbol), for
    `tp`-way tensor parallelism (`kv_copies`)."""
    return {key: jax.ShapeDtypeStruct((count, blocks[kind], *block), dtype)
            for key, (kind, count, block, dtype) in cache_pools(ir, plan, tp).items()}


def _owned_caches(ir: ModelIR, plan: LayoutPlan):
    """(pool key, layer group, cache) of every cache a layer group owns (not KV-shared)."""
    for gi, g in enumerate(plan.groups):
        for j in range(g.period):
            spec = ir.config.layers[g.layer(0, j)]
            if spec.kv_shared:
                continue
            c = ir.cache_of(spec.index)
            for name in c.names:
                yield f"g{gi}.{j}.{name}", g, c


def kv_copies(kv_heads: int, tp: int) -> int:
    """How many times a pool stores each of a layer's `kv_heads` KV heads under `tp`-way tensor
    parallelism: tp / K when the layer has fewer KV heads than devices and K divides tp, else 1.
    Stored K * (tp / K) = tp times, head k as copies k * tp / K .., the pool splits by head like
    any other (sharding.py): each device holds one copy, of the KV head its query heads use
    (query head n reads stored head n // (heads / tp), a copy of head n // (heads / K)). Kept
    whole instead, every device gathered both of the 26B-A4B's full-layer heads from every span
    and sliced its own out (0.07 GiB a decode step at TP = 4 and 8; docs/TPU_COST.md)."""
    return tp // kv_heads if kv_heads < tp and tp % kv_heads == 0 else 1


def cache_pools(ir: ModelIR, plan: LayoutPlan,
                tp: int = 1) -> dict[str, tuple[str, int, tuple, object]]:
    """Every KV pool: key -> (kind, stacked layers, one block's shape, dtype). A block is
    [BLOCK_SIZE, K * D]: a slot is one row, its K heads' D values side by side (head k at
    columns k * D ..), so the slots and a head's values are the two minor dimensions, the ones
    TPU tiles. As [BLOCK_SIZE, K, D] the tiles held K (1 to 4 per device) rows: XLA relaid
    each pool of a layer scan whole into a (slots, D)-tiled layout at the start of every step
    and back at its end (the E4B at TP = 4: 2 x 16 MiB for each full-layer pool), then kept
    the pools in on-chip memory where the weights' prefetches would go (docs/TPU_COST.md).
    An int8 cache's float32 scales: a pool of the same blocks, each [BLOCK_SIZE, K] or a row
    [1, S] (lower.scale_block_shape: 2 or more heads a device), split like it. Under
    `tp`-way tensor parallelism K counts each head's copies (`kv_copies`)."""
    out = {}
    heads = pool_heads(ir, plan, tp)
    for key, g, c in _owned_caches(ir, plan):
        out[key] = (kind_of(c.ring), g.count, (BLOCK_SIZE, heads[key] * c.head_dim),
                    JNP_DTYPES[c.dtype])
        if c.dtype == "int8":
            split = tp if tp > 1 and heads[key] >= tp else 1
            out[key + SCALE_SUFFIX] = (kind_of(c.ring), g.count,
                                       scale_block_shape(heads[key], split), jnp.float32)
    return out


def pool_heads(ir: ModelIR, plan: LayoutPlan, tp: int = 1) -> dict[str, int]:
    """The KV heads of every pool of `cache_pools` (a scale pool's are its cache's), each
    head's copies counted (`kv_copies`)."""
    out = {}
    for key, _, c in _owned_caches(ir, plan):
        out[key] = c.kv_heads * kv_copies(c.kv_heads, tp)
        if c.dtype == "int8":
            out[key + SCALE_SUFFIX] = out[key]
    return out


class Program:
    """Builds the traced functions of one ModelIR under one layout."""

    def __init__(self, ir: ModelIR, plan: LayoutPlan,
                 pool_shardings: dict[str, NamedSharding] | None = None, tp: int = 1,
                 tpu_kernels: bool = False):
        """`pool_shardings`: each KV pool's sharding when the entry points are exported for
        `tp`-way tensor parallelism (targets/xla/sharding.py); the layer scans keep the pools
        they carry in it, or XLA may pick another and all-gather a whole pool at the end of
        every call. `tp` also sets how many copies of each KV head the pools hold
        (`kv_copies`). `tpu_kernels`: the programs are exported for TPU alone, so attention
        may run Pallas TPU kernels (lower.attention_blockwise's `tpu_kernel`)."""
        self.ir, self.plan, self.pool_shardings = ir, plan, pool_shardings or {}
        self.tpu_kernels = tpu_kernels
        self.kinds = kv_kinds(ir)
        pools = cache_pools(ir, plan, tp)
        self.pool_kind = {key: kind for key, (kind, *_) in pools.items()}
        self.pool_heads = pool_heads(ir, plan, tp)

    def forward(self, weights, caches, tokens, start, n_new, tables):
        """Run tokens [B,T] through the decoder; returns (caches, hidden [B,T,H])."""
        ir = self.ir
        t = tokens.shape[1]
        offs = jnp.arange(t, dtype=jnp.int32)[None, :]
        positions = jnp.where(offs < n_new[:, None], start[:, None] + offs, -1)
        cache_len = start + n_new
        mesh = self._mesh()  # under TP: one all-reduce of the looked-up rows (lower.embed)
        emb = run_graph(ir.embed, {"tokens": tokens}, weights.__getitem__,
                        LOWERINGS if mesh is None
                        else {**LOWERINGS, Op.EMBED: functools.partial(embed, mesh=mesh)})
        h = emb["h"]
        caches = dict(caches)
        lowerings, kernels = self._paged_lowerings(), self._layer_kernels()
        for gi, g in enumerate(self.plan.groups):
            h, caches = self._run_group(gi, g, weights, caches, tables, h, positions, cache_len,
                                        emb.get("ple"), lowerings, kernels)
        return caches, h

    def _paged_lowerings(self):
        """BLOCKWISE_LOWERINGS (ATTENTION reads each lane's needed blocks only) with
        CACHE_POSITIONS sized by the block tables: the IR's ring semantics over table_width *
        BLOCK_SIZE slots instead of the IR's contiguous cache size; ATTENTION told whether it
        may run TPU kernels; under tensor parallelism MOE, ATTENTION and KV_WRITE given the
        mesh (the experts' split, the per-head dots, the rows of a pool with copies of each
        head whole before they are repeated)."""
        size = {k.ring: k.table_width * BLOCK_SIZE for k in self.kinds.values()}

        def positions(a, cache_len):
            return cache_positions(dataclasses.replace(a, size=size[a.ring]), cache_len)

        lowerings = {**BLOCKWISE_LOWERINGS, Op.CACHE_POSITIONS: positions}
        mesh = self._mesh()
        if mesh is not None:  # tensor parallel: each device runs its share of every expert
            lowerings[Op.MOE] = functools.partial(moe, mesh=mesh)
            lowerings[Op.KV_WRITE] = TakesPaged(functools.partial(kv_write, mesh=mesh))
        lowerings[Op.ATTENTION] = TakesPaged(functools.partial(
            attention_blockwise, mesh=mesh, tpu_kernel=self.tpu_kernels), takes_read_as_bf16=True)
        return lowerings

    def _layer_kernels(self):
        """run_graph's (mlp, proj): decode_mlp_kernel and decode_projections_kernel under the
        program's mesh where the programs may run Pallas TPU kernels (`tpu_kernels`), else
        (None, None): the layers op by op."""
        if not self.tpu_kernels:
            return None, None
        mesh = self._mesh()
        return (functools.partial(decode_mlp_kernel, mesh=mesh),
                functools.partial(decode_projections_kernel, mesh=mesh))

    def _run_group(self, gi, g, weights, caches, tables, h, positions, cache_len, ple,
                   lowerings, kernels=(None, None)):
        ir, cfg = self.ir, self.ir.config
        own = {k: v for k, v in caches.items() if k.startswith(f"g{gi}.")}
        stacked_w = {sp.key: weights[sp.key] for sp in self.plan.stacked if sp.group == gi}
        ple_xs = None
        if ple is not None:
            b, t = ple.shape[:2]
            sl = ple[:, :, g.start:g.start + g.count * g.period]
            ple_xs = jnp.transpose(sl.reshape(b, t, g.count, g.period, -1), (2, 3, 0, 1, 4))

        def paged(pools, key, index):
            kind = self.pool_kind[key]
            return PagedSlice(pools[key], index, tables[kind], self.kinds[kind].ring,
                              self.pool_heads[key], pools.get(key + SCALE_SUFFIX))

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
                        args[name] = paged(own if sgi == gi else caches, f"g{sgi}.{sj}.{name}",
                                           sp)
                    else:
                        args[name] = paged(own, f"g{gi}.{j}.{name}", p)
                out = run_graph(graph, args,
                                lambda rel, j=j: lax.dynamic_index_in_dim(
                                    stacked_w[f"g{gi}.{j}.{rel}"], p, 0, keepdims=False),
                                lowerings,
                                *(k and functools.partial(k, stacked=lambda rel, j=j: (
                                    stacked_w[f"g{gi}.{j}.{rel}"], p)) for k in kernels),
                                # the layer's end lazy into the next layer's projections kernel
                                # (lower.LayerEnd); the body's last layer's made for the carry
                                lazy_end=j + 1 < len(g.templates))
                h = out["h"]
                for name, v in out.items():
                    if name in CACHE_ARGS:
                        key = f"g{gi}.{j}.{name}"
                        own[key] = self._placed(key, v.pool)
                        if v.scale is not None:
                            own[key + SCALE_SUFFIX] = self._placed(key + SCALE_SUFFIX, v.scale)
            return (h, own), None

        xs = (jnp.arange(g.count, dtype=jnp.int32), ple_xs)
        if g.count == 1:
            (h, own), _ = body((h, own), jax.tree.map(lambda x: x[0], xs))
        else:
            (h, own), _ = lax.scan(body, (h, own), xs)
        return h, {**caches, **own}

    def _mesh(self):
        """The programs' mesh under tensor parallelism (the pools'), else None."""
        return next(iter(self.pool_shardings.values())).mesh if self.pool_shardings else None

    def _whole(self, x):
        """`x` on every device, whole. Under tensor parallelism the head's logits come out split
        by vocabulary; sampling reads all of them, and gathering once here replaces one
        all-gather per sampling step (sort, cumulative sums, choice)."""
        mesh = self._mesh()
        if mesh is None:
            return x
        return lax.with_sharding_constraint(lax.optimization_barrier(x),
                                            NamedSharding(mesh, PartitionSpec()))

    def _placed(self, key: str, pool):
        sharding = self.pool_shardings.get(key)
        return pool if sharding is None else lax.with_sharding_constraint(pool, sharding)

    def head(self, weights, h):
        return run_graph(self.ir.head, {"h": h}, weights.__getitem__)["logits"]

    def sample(self, weights, logits, temperature, top_k, top_p, seed, step, greedy=None,
               sort=True, branch=None):
        """The IR's sampler graph on logits [B, V]; `greedy`: their argmax, if already taken;
        sort=False: without the sort branch; `branch`: the branch, if chosen over a whole batch
        of which these rows are a share (lower.sample)."""
        args = {"logits": logits, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "seed": seed, "step": step}
        lowerings = LOWERINGS if greedy is None and sort and branch is None else {
            **LOWERINGS, Op.SAMPLE: functools.partial(lower_sample, greedy=greedy, sort=sort,
                                                      branch=branch)}
        return run_graph(self.ir.sampler, args, weights.__getitem__, lowerings)["tokens"]

    # ------------------------------------------------------------------ entry points

    def step(self, weights, caches, tokens, start, n_new, tables, temperature, top_k, top_p,
             seed, step):
        """One decode step of decode_loop: run the tokens and sample the next token of every
        lane from its last valid row (step_sampled with neutral extras, bit for bit: split by
        rows over the devices where step_sampled's sampling is, sampler.split_by_rows)."""
        caches, logits = self._last_logits(weights, caches, tokens, start, n_new, tables,
                                           whole=False)
        mesh = self._mesh()
        if not sampler.splits_by_rows(mesh, logits.shape[0]):
            return caches, self.sample(weights, self._whole(logits), temperature, top_k, top_p,
                                       seed, step)

        def sample_rows(logits, temperature, top_k, top_p, seed, step, branch):
            return self.sample(weights, logits, temperature, top_k, top_p, seed, step,
                               branch=branch)

        return caches, sampler.split_by_rows(sample_rows, mesh, logits,
                                             (temperature, top_k, top_p, seed, step),
                                             sample_branch(temperature, top_k))

    def step_sampled(self, weights, caches, tokens, start, n_new, tables, temperature, top_k,
                     top_p, seed, step, mask, pen_ids, pen_counts, presence, frequency,
                     repetition, n_top):
        """prefill_{T} (one lane, T tokens) and decode_{B} (B lanes, one token each): run the
        tokens and sample the next token of every lane from its last valid row, after its
        penalties and token mask; returns (caches, tokens, logprob, top_ids, top_logprobs)
        (targets/xla/sampler.py). Under tensor parallelism with B a multiple of the devices,
        each device samples B / N lanes (sampler.split_by_rows); else every device samples
        every lane from the logits gathered whole (`_whole`)."""
        caches, logits = self._last_logits(weights, caches, tokens, start, n_new, tables,
                                           whole=False)
        rows = (temperature, top_k, top_p, seed, step, mask, pen_ids, pen_counts, presence,
                frequency, repetition, n_top)
        choice = sampler.choose(temperature, top_k, mask, pen_ids, n_top)

        def sample_rows(logits, temperature, top_k, top_p, seed, step, mask, pen_ids,
                        pen_counts, presence, frequency, repetition, n_top, choice, whole=None):
            def draw(x, greedy, sort):
                return self.sample(weights, x, temperature, top_k, top_p, seed, step, greedy,
                                   sort, choice.sample)

            return sampler.sample_step(draw, logits, temperature, top_k, mask, pen_ids,
                                       pen_counts, presence, frequency, repetition, n_top,
                                       whole, choice)

        mesh = self._mesh()
        if sampler.splits_by_rows(mesh, logits.shape[0]):
            return caches, *sampler.split_by_rows(sample_rows, mesh, logits, rows, choice)
        return caches, *sample_rows(logits, *rows, choice, whole=self._whole)

    def _last_logits(self, weights, caches, tokens, start, n_new, tables, whole=True):
        """The logits [B, V] of each lane's last valid row; whole=False: as the head leaves
        them (under TP split by vocabulary, `_whole` gathers them)."""
        caches, h = self.forward(weights, caches, tokens, start, n_new, tables)
        last = jnp.take_along_axis(h, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)
        logits = self.head(weights, last)[:, 0]
        return caches, self._whole(logits) if whole else logits

    def logits(self, weights, caches, tokens, start, n_new, tables):
        caches, h = self.forward(weights, caches, tokens, start, n_new, tables)
        return caches, self.head(weights, h)

    def verify(self, weights, caches, tokens, start, n_new, tables, temperature, top_k, top_p,
               seed, step, draft_probs=None, draft_lane=None):
        """verify_{B}x{R}: run R rows per lane (its last token, then its drafts) and sample every
        row's next token, row i at RNG step step + i: what decode would sample there, given the
        same rows before it. Returns (caches, tokens [B,R], -1 past n_new) and, with an
        assistant, the final-normed hidden states [B,R,H] too. With an assistant it also takes
        draft_probs [B, R-1, V] (a draft call's) and draft_lane [B]: a lane with draft_lane
        j >= 0 and temperature > 0 had its drafts sampled from draft_probs[j] and accepts them
        by the ratio rule (rejection.py; its tokens past the new one -1); the others (-1,
        greedy) keep the sampled tokens, which the caller compares with its drafts."""
        caches, h = self.forward(weights, caches, tokens, start, n_new, tables)
        b, r = tokens.shape
        logits = self._whole(self.head(weights, h)).reshape(b * r, -1)
        per_row = [jnp.repeat(x, r) for x in (temperature, top_k, top_p, seed)]
        steps = (step[:, None] + jnp.arange(r, dtype=jnp.int32)[None, :]).reshape(-1)
        toks = self.sample(weights, logits, *per_row, steps).reshape(b, r)
        toks = jnp.where(jnp.arange(r)[None, :] < n_new[:, None], toks, -1)
        if self.ir.assistant is None:
            return caches, toks
        ratio = (draft_lane >= 0) & (temperature > 0) & (n_new > 1)

        def by_ratio(logits, toks):
            q = jnp.take(draft_probs, jnp.maximum(draft_lane, 0), axis=0)
            got = rejection.ratio_rule(logits.reshape(b, r, -1), toks, tokens, n_new, q,
                                       temperature, top_k, top_p, seed, step)
            return jnp.where(ratio[:, None], got, toks)

        # Lanes that all compare exactly (greedy, n-gram) skip the rule's sort and residuals.
        with jax.named_scope(BRANCHES.format(name="spec_ratio")):
            toks = lax.cond(jnp.any(ratio), by_ratio, lambda _, t: t, logits, toks)
        hidden = run_graph(self.ir.assistant.hidden, {"h": h}, weights.__getitem__)["hidden"]
        return caches, toks, hidden

    def weight(self, weights, name: str):
        """A weight by its full name: an unstacked entry, or a target layer's slice of its
        group's stacked array (an assistant reads a K=V cache with the target's k_norm)."""
        if name in weights:
            return weights[name]
        layer, rel = _TARGET_LAYER.fullmatch(name).groups()
        gi, j, p = _cache_owner(self.plan, int(layer))
        return weights[f"g{gi}.{j}.{rel}"][p]

    def draft(self, weights, caches, tokens, start, n_new, tables, hidden, temperature, top_k,
              top_p, seed, step, n_draft, *, max_steps: int):
        """draft_{B}: up to `max_steps` assistant steps (n_draft of them, a traced count) per
        lane, each feeding the last sampled token and the projected state to the next, all at
        the lane's position `start` (the token's: the target's cached tokens) over the target's
        caches, which are only read. Returns (tokens [B,K] (-1 past n_draft or on an idle lane),
        logits [B,K,V], draft_probs [B,K,V], hidden [B,K,H]) with K = max_steps: draft_probs
        is the distribution each token was sampled from (lower.filtered_probs), which verify's
        ratio rule takes."""
        d = self.ir.assistant
        b = tokens.shape[0]
        positions = jnp.where(n_new > 0, start, -1)[:, None]
        lowerings = self._paged_lowerings()
        reads = {}
        for read in set(d.reads):
            gi, j, p = _cache_owner(self.plan, read)
            ring = self.ir.cache_of(read).ring
            kind = kind_of(ring)
            reads[read] = {name: PagedSlice(caches[f"g{gi}.{j}.{name}"], p, tables[kind], ring,
                                            self.pool_heads[f"g{gi}.{j}.{name}"],
                                            caches.get(f"g{gi}.{j}.{name}{SCALE_SUFFIX}"))
                           for name in self.ir.cache_of(read).names}

        def one_step(tok, state):
            x = run_graph(d.draft_in, {"tokens": tok[:, None], "hidden": state[:, None]},
                          weights.__getitem__)["h"]
            for i, (t, read) in enumerate(zip(d.layer_template, d.reads, strict=True)):
                args = {"h": x, "positions": positions, "cache_len": start, **reads[read]}
                x = run_graph(d.layers[t], args, lambda rel, i=i, read=read: self.weight(
                    weights, resolve_draft_param(rel, i, read)), lowerings)["h"]
            out = run_graph(d.draft_out, {"h": x}, weights.__getitem__)
            return self._whole(out["logits"][:, 0]), out["hidden"][:, 0]

        vocab, width = self.ir.config.vocab_size, hidden.shape[-1]
        init = (tokens[:, 0], hidden, jnp.full((b, max_steps), -1, jnp.int32),
                jnp.zeros((b, max_steps, vocab), jnp.float32),
                jnp.zeros((b, max_steps, vocab), jnp.float32),
                jnp.zeros((b, max_steps, width), jnp.float32))

        def body(i, carry):
            tok, state, toks, logits_all, probs_all, states = carry
            logits, state = one_step(tok, state)
            tok = self.sample(weights, logits, temperature, top_k, top_p, seed, step + i)
            probs = filtered_probs(logits, temperature, top_k, top_p)
            toks = lax.dynamic_update_index_in_dim(toks, jnp.where(n_new > 0, tok, -1), i, 1)
            logits_all = lax.dynamic_update_index_in_dim(logits_all, logits, i, 1)
            probs_all = lax.dynamic_update_index_in_dim(probs_all, probs, i, 1)
            states = lax.dynamic_update_index_in_dim(states, state, i, 1)
            return tok, state, toks, logits_all, probs_all, states

        count = jnp.clip(n_draft, 0, max_steps)
        _, _, toks, logits_all, probs_all, states = lax.fori_loop(0, count, body, init)
        return toks, logits_all, probs_all, states

    def decode_loop(self, weights, caches, tokens, start, n_new, tables, temperature, top_k,
                    top_p, seed, step, stop_ids, budget, *, n_steps: int):
        """decode_loop_{B}: up to `n_steps` decode steps in one call, each the `step` of
        decode_{B} on the same shapes (tests/test_xla_decode_loop.py checks the bits on the
        CPU), feeding every lane its sampled token.
        stop_ids [B, S] (-1 = none) and budget [B] (most tokens to sample) end a lane; an
        ended lane runs idle (n_new 0, writes nothing). The loop ends when every lane has ended
        or after n_steps. Each lane must own the blocks of positions [start, start + budget).
        Returns (caches, tokens [B, n_steps] with -1 where a lane sampled nothing, steps run)."""
        b = tokens.shape[0]
        active = (n_new > 0) & (budget > 0)
        out = jnp.full((b, n_steps), -1, jnp.int32)

        def more(carry):
            i, active = carry[0], carry[3]
            return (i < n_steps) & jnp.any(active)

        def body(carry):
            i, caches, last, active, pos, out = carry
            caches, nxt = self.step(weights, caches, last[:, None], pos,
                                    active.astype(jnp.int32), tables, temperature, top_k,
                                    top_p, seed, step + i)
            out = lax.dynamic_update_index_in_dim(out, jnp.where(active, nxt, -1), i, 1)
            ended = jnp.any(nxt[:, None] == stop_ids, axis=1) | (i + 1 >= budget)
            return (i + 1, caches, jnp.where(active, nxt, last), active & ~ended,
                    pos + active.astype(jnp.int32), out)

        steps, caches, *_, out = lax.while_loop(
            more, body, (jnp.int32(0), caches, tokens[:, 0], active, start, out))
        return caches, out, steps


def table_shapes(kinds: dict[str, KvKind], batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {k.name: jax.ShapeDtypeStruct((batch, k.table_width), jnp.int32)
            for k in kinds.values()}


def sampling_shapes(batch: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    f, i = jnp.float32, jnp.int32
    return tuple(jax.ShapeDtypeStruct((batch,), d) for d in (f, i, f, i, i))


DECODE_LOOP_STOPS = 4  # stop token ids per lane a decode_loop call takes


def loop_steps(ir: ModelIR, requested: int) -> int:
    """Steps per decode_loop call: at most max_chunk, so the positions one call writes fit the
    block tables like one prefill chunk (the sliding ring is sized for that)."""
    return min(requested, ir.max_chunk)


def loop_shapes(batch: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """stop_ids [B, DECODE_LOOP_STOPS], budget [B] of decode_loop."""
    return (jax.ShapeDtypeStruct((batch, DECODE_LOOP_STOPS), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))


def draft_shapes(ir: ModelIR, batch: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """hidden [B, H] of draft (after the lane arguments); n_draft [] comes after sampling."""
    return (jax.ShapeDtypeStruct((batch, ir.config.hidden_size), jnp.float32),)


def verify_shapes(ir: ModelIR, batch: int, draft_tokens: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """draft_probs [B, K, V] and draft_lane [B] of verify with an assistant (after sampling);
    none without one."""
    if ir.assistant is None:
        return ()
    return (jax.ShapeDtypeStruct((batch, draft_tokens, ir.config.vocab_size), jnp.float32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))
