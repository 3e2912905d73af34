"""Tensor parallelism as SPMD sharding: the PartitionSpec of every weight array and KV pool of a
`LayoutPlan` over one mesh axis, TP_AXIS, of `tp` devices. XLA's SPMD partitioner does the rest.

Rules (Megatron-style, so each layer costs two all-reduces of the hidden state, which XLA
inserts after the row-parallel O and down projections):
- column-parallel, split by output rows with their per-row scales: q_proj (whole query heads),
  k_proj / v_proj (whole KV heads), mlp gate_proj / up_proj (MLP columns);
- row-parallel, split by input columns (their per-row scales stay whole): o_proj, down_proj;
- KV pools [layers, blocks, 16, K * D] (program.cache_pools): split by KV head, each device
  a contiguous run of whole heads' columns (their int8 scale pools by head too);
- a layer with fewer KV heads K than devices (26B-A4B's 2 global KV heads at tp=4) keeps its
  k/v projections whole on every device (each computes every KV head); its pools store each
  head tp / K times (program.kv_copies) and split like the others, one copy a device: the
  head its query heads use. Where K does not divide tp the pools stay whole;
- MoE experts: every expert on every device, its intermediate dimension I split like the
  dense MLP's (so moe_intermediate_size % tp == 0; 26B-A4B: 704, 176 per device at tp=4):
  gate/up rows, in the layout's [E, 2, I, H] view (program.layout_shape), and their per-row
  scales on I; down_proj [E, H, I] on its columns I, its per-row scales whole. The MoE runs in
  shard_map over this split (lower.moe): every device routes the same tokens, runs its share
  of each picked expert, and one all-reduce adds the partial outputs. A decode step so reads
  1/tp of each picked expert per device; split by whole experts instead, every device sliced
  all k picked experts per token (the ones it did not hold clamped and masked), tp times its
  share (the 26B-A4B at tp=4: 2.57x the roofline's bytes, docs/TPU_COST.md);
- embedding tables (the token table, tied to the head, and the PLE table), values and per-row
  scales, split by vocabulary row. The head reads 1/tp of the tied table per device per decode
  step (the 31B's is 1.4 GB in int8, about 1/6 of its per-device bytes at tp=4), and the PLE
  table (E4B: 2.8 GB in int8), only ever gathered from, takes 1/tp of the memory. A lookup
  becomes a local masked gather plus one all-reduce of the finished float32 rows
  (lower.embed); the head's logits come out split by vocabulary and are all-gathered (B x T x
  V floats) for sampling, except where a decode step's B lanes divide over the devices: each
  device then samples B / tp of them, the logits moved by one all-to-all
  (sampler.split_by_rows);
- everything else whole on every device: norms, the router, layer scalars, the per-layer-input
  projections.
An assistant drafter (`ModelIR.assistant`, its weights "assistant.*") splits by the same rules:
- its layers' q_proj column-parallel and o_proj row-parallel (whole query heads, the groups of
  the KV heads each device holds: drafter heads and KV heads both divide by tp, so the
  contiguous slices line up), and its MLPs column/row-parallel, as the target's layers: its
  query-only attention reads the target's pools, split by KV head, locally, and each draft step
  reads 1/tp of the drafter's layer weights per device (the 31B's: 4 layers of about 50M
  weights) for one all-reduce of a [B, D] vector after each of o_proj and down_proj. (Left
  whole, XLA still attends locally, slicing the whole query by the pools' split, but every
  device reads every weight each step);
- a dense head's table (tied to its own embedding, [V, D]) by vocabulary row with its per-row
  scales, like the target's tied head: a step reads 1/tp of it per device (the 31B's drafter:
  268M weights, more than its layers) and its logits are gathered for sampling as the target's;
- a centroid-masked head's table whole: it reads only the picked clusters' rows (E2B's: 4096
  of 262144), and split, those rows would be a masked gather plus an all-reduce of [B, 4096, D]
  floats every step;
- pre_projection, post_projection (the state in and out), the norms, the centroids and the
  token ordering whole: the drafter's residual stream and state are whole on every device.
Head and width counts that do not divide evenly are refused by `check_tp`, naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jax.sharding import PartitionSpec

from rvcompile.ir.graph import KV_SOURCE_PREFIX, ModelIR
from rvcompile.ir.ops import Op
from rvcompile.model.assistant import TENSOR_PREFIX, AssistantConfig
from rvcompile.model.config import ConfigError, Gemma4Config
from rvcompile.targets.xla.program import LayoutPlan, cache_pools, pool_heads, weight_shapes

TP_AXIS = "tp"

Spec = tuple[str | None, ...]  # one entry per array axis: TP_AXIS (split) or None (whole)

# Template PARAM name (without ".scale") -> the axis it splits on, in the unstacked param.
_COLUMN_PARALLEL = ("self_attn.q_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")
_KV_PROJECTIONS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
# MoE expert arrays, in the layout's view -> the axis of I, in the unstacked param
_EXPERTS = {"experts.gate_up_proj": 2, "experts.gate_up_proj.scale": 2,
            "experts.down_proj": 2}
_DRAFT_LAYER = re.compile(rf"{re.escape(TENSOR_PREFIX)}layers\.\d+\.(.+)")  # drafter layer weight
_DRAFT_TABLE = TENSOR_PREFIX + "embed_tokens.weight"  # the drafter's head (its tied table)


@dataclass(frozen=True)
class TpLayout:
    """Where every program argument lives on a 1-D mesh of `size` devices."""

    size: int
    weights: dict[str, Spec]  # weight array key -> its spec
    pools: dict[str, Spec]  # KV pool key -> its spec

    def to_json(self) -> dict:
        return {"axis": TP_AXIS, "size": self.size,
                "weights": {k: list(v) for k, v in self.weights.items()},
                "pools": {k: list(v) for k, v in self.pools.items()}}


def partition_spec(spec: Spec) -> PartitionSpec:
    return PartitionSpec(*spec)


def check_tp(cfg: Gemma4Config, tp: int, assistant: AssistantConfig | None = None) -> None:
    """Refuse a model (and its assistant drafter) whose heads, MLP width or experts do not split
    evenly over `tp`."""
    if tp < 1:
        raise ConfigError(f"--tp {tp}: need at least 1 device")
    if tp == 1:
        return
    if assistant is not None:
        a = assistant.text
        for field, n in [("num_attention_heads", a.num_heads),
                         *(("intermediate_size", s.mlp_width) for s in a.layers)]:
            if n % tp:
                raise ConfigError(f"assistant {assistant.name}: text_config.{field} {n} does "
                                  f"not split over --tp {tp} devices")
    counts = [("num_attention_heads", cfg.num_heads)]
    counts += [("num_key_value_heads", s.num_kv_heads) for s in cfg.layers
               if s.num_kv_heads >= tp and not (s.k_eq_v and cfg.num_global_kv_heads)]
    counts += [("num_global_key_value_heads", s.num_kv_heads) for s in cfg.layers
               if s.num_kv_heads >= tp and s.k_eq_v and cfg.num_global_kv_heads]
    counts += [("intermediate_size", s.mlp_width) for s in cfg.layers]
    if cfg.num_experts:
        counts.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for field, n in counts:
        if n % tp:
            raise ConfigError(f"{cfg.name}: {field} {n} does not split over --tp {tp} devices")


def _param_axis(rel: str, kv_split: bool) -> int | None:
    """The axis template PARAM `rel` splits on, None if it stays whole."""
    if rel.startswith(KV_SOURCE_PREFIX):
        return None  # a KV-shared layer's borrowed k_norm: a vector
    scale = rel.endswith(".scale")
    base = rel.removesuffix(".scale")
    if base in _COLUMN_PARALLEL or (base in _KV_PROJECTIONS and kv_split):
        return 0
    if base in _ROW_PARALLEL:
        return None if scale else 1  # the scale is per output row, and output rows stay whole
    if base.startswith("experts."):
        return _EXPERTS.get(rel)  # down_proj's scale is per output row: whole
    return None


def _embedding_params(ir: ModelIR) -> set[str]:
    """The tables EMBED reads, with their per-row scales (quantized targets)."""
    names = set()
    for n in ir.embed.nodes:
        if n.op is Op.EMBED:
            leaves = [ir.embed.nodes[i] for i in (n.inputs[0], *n.inputs[2:])]
            names |= {leaf.attrs.name for leaf in leaves if leaf.op is Op.PARAM}
    return names


def _global_axis(ir: ModelIR, name: str, tables: set[str], tp: int) -> int | None:
    """The axis an unstacked weight splits on: the target's embedding tables and a dense drafter
    head's table by vocabulary row, the drafter's layer weights as the target's layers' (no k/v
    projections: its attention reads the target's caches), None for the rest."""
    if tp == 1:
        return None
    if name in tables:
        return 0
    if name.removesuffix(".scale") == _DRAFT_TABLE:
        return None if ir.assistant.config.use_ordered_embeddings else 0
    m = _DRAFT_LAYER.fullmatch(name)
    return _param_axis(m.group(1), kv_split=False) if m else None


def _spec(ndim: int, axis: int | None) -> Spec:
    return tuple(TP_AXIS if i == axis else None for i in range(ndim))


def plan_tp(ir: ModelIR, plan: LayoutPlan, tp: int) -> TpLayout:
    """The spec of every weight array and KV pool of `plan` (`check_tp` must have passed)."""
    check_tp(ir.config, tp, ir.assistant.config if ir.assistant else None)
    shapes = weight_shapes(ir, plan)
    tables = _embedding_params(ir) if tp > 1 else set()
    weights: dict[str, Spec] = {
        name: _spec(len(shapes[name].shape), _global_axis(ir, name, tables, tp))
        for name in plan.globals_}
    for sp in plan.stacked:
        spec = ir.config.layers[plan.groups[sp.group].layer(0, sp.j)]
        axis = _param_axis(sp.rel, spec.num_kv_heads >= tp) if tp > 1 else None
        # stacked arrays carry the layer axis first
        weights[sp.key] = _spec(len(shapes[sp.key].shape), None if axis is None else axis + 1)
    pools: dict[str, Spec] = {}
    heads = pool_heads(ir, plan, tp)
    for key, (_, _, block, _) in cache_pools(ir, plan, tp).items():
        split = tp > 1 and heads[key] >= tp
        # [layers, blocks, 16, K * D] (a scale pool's: K, or its rows [layers, blocks, 1, S] of
        # one lane range a device: lower.scale_block_shape): whole heads per device
        pools[key] = _spec(2 + len(block), 3 if split else None)
    return TpLayout(tp, weights, pools)
