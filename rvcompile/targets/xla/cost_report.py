"""Cost report of a decode program compiled for a TPU topology: an estimate, never a measurement.

Inputs, per device, from the compiled decode_{max_seqs} executable: its arguments as sharded (weight
bytes and elements, KV pool bytes; the pools hold `max_seqs` sequences at the built context),
XLA's memory analysis (argument, output, alias and temp bytes) and XLA's cost analysis (flops,
bytes accessed, kept as reported). XLA's TPU cost analysis counts a `lax.scan` body once, not
once per iteration (measured: a 10-step scan of matmuls reports the flops of one step), and the
layer groups are scans, so its totals are not used for the estimate.

Estimate for B decode lanes, a roofline per device. The weights a step reads (`ReadModel`):
dense arrays whole; MoE expert arrays only the experts the B tokens pick (an expected fraction
1 - (1 - k/E)^B of them: prefill's ragged_dot reads each picked expert once; decode slices each
token's top-k experts, under TP each device its 1/tp share of each, sharding.py);
gather-only tables (the per-layer-input embedding) a few rows, taken as none.
  bytes(B) = dense + expert * fraction(B) + B * KV read per lane at the report's context C:
             each attending layer reads its cache's live keys once (C of them, a sliding layer
             min(C, window)); a KV-shared layer reads its source's (`ReadModel.kv_reads`;
             without them, every pool whole: the built context)
  flops(B) = 2 * B * (dense elements + expert elements * k/E + query_per_kv * KV elements read
             per lane)
  step(B)  = max(bytes(B) / HBM bandwidth, flops(B) / bf16 peak); tok/s = B / step(B)
This is the best the chip could do with these programs (a lower bound on step time): it leaves
out activations, collectives and launch overhead. HBM fit at B: all weight bytes + B * KV per
lane + XLA's temp bytes at the built batch, against the chip's HBM.

A second figure uses XLA's own traffic: `xla_amplification` = XLA's bytes accessed / the bytes
above at the built batch counted as XLA counts them (each layer group's stacked weights and pools
once, not `count` times). It says how many bytes XLA's program moves per byte the roofline
reads (dequantized copies, gathered KV, activations); step_xla(B) scales bytes(B) by it, taking
the ratio as the same in every layer and at every batch (a heuristic).

The report is made at a context C (`at_context`, the built context unless given): every lane
holds C tokens after the step. The traffic table (`traffic`, targets/xla/hlo_traffic.py): from
the compiled program's optimized HLO, at C (attention's span loops, whose trips depend on the
lanes' lengths, run as many spans as C tokens need), the bytes each top-level instruction
reads (by class: weights, embeddings, kv, io, temps, activations) and writes, scaled by loop
trip counts; kept compact: per-class totals and the TRAFFIC_TOP instructions that move the most
bytes a step, and every whole copy of a weight matrix or table (hlo_traffic.Traffic.whole_copies:
none in a program that reads each weight byte once, where it is used). Its `amplification` is
its scaled total over the roofline's bytes at the built batch: the program's own answer to "how
many bytes per byte needed", where `xla_amplification` above counts scan bodies once.

Chip figures (per chip), from Google Cloud's TPU pages (docs.cloud.google.com/tpu/docs/v5e and
.../v6e): v5e 819 GB/s HBM, 197 bf16 TFLOP/s, 394 int8 TOP/s, 16 GiB; v6e 1640 GB/s (the page
lists 1638), 918 bf16 TFLOP/s, 1836 int8 TOP/s, 32 GiB. Compute uses the bf16 peak: int8 weights
are widened to bf16 before they meet the activations. ICI: v5e 1600 Gbps, v6e 3584 Gbps per chip.

The traffic record also gives the built batch's step at the table's bytes: HBM time (its total
over HBM bandwidth) plus a separate collectives term (`collectives_term`): the step's all-reduces
and other collectives, counted and sized from the HLO, as ring transfers at the ICI bandwidth plus
an ASSUMED fixed latency each (Google's pages give no latency figure). The table counts every
branch of a conditional; `cases` gives the bytes and step of a greedy and of a top-k step, the
branches of the sampler (and the penalties' and log-probabilities' conditionals) those run
(STEP_CASES).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass

import jax
import numpy as np

from rvcompile.targets.xla.hlo_traffic import CLASSES, Traffic, traffic
from rvcompile.targets.xla.paged_kernel import BLOCK_TOKENS

GiB = 2**30
REPORT_BATCHES = (1, 4, 16, 64)  # decode lanes the report estimates, besides the built max_seqs
TRAFFIC_TOP = 12  # instructions the manifest keeps of the traffic table (the most bytes a step)
# Steps by the branches of the decode program's named conditionals they run (hlo_traffic
# BRANCHES scopes: lower.sample's switch, sampler.sample_step, sampler.penalize and
# sampler.logprobs, the verify program's ratio rule; jax's branch order): the table's total
# counts every branch, an upper bound no step reaches (the 31B at B = 64: the sampler's sort is
# 2.6 GiB of it). Both cases are steps of plain requests: no penalty, no token mask (shaping 0),
# no top log-probabilities.
STEP_CASES = {
    "greedy": {"shaping": 0, "sample": 0, "penalties": 0, "top_logprobs": 0, "spec_ratio": 0},
    "top_k": {"shaping": 0, "sample": 1, "penalties": 0, "top_logprobs": 0, "spec_ratio": 0},
}


@dataclass(frozen=True)
class TpuChip:
    generation: str
    device_kind: str  # jax's Device.device_kind
    hbm_bytes_per_s: float
    bf16_flops: float
    int8_ops: float
    hbm_bytes: int
    ici_bytes_per_s: float = 0.0  # inter-chip interconnect, all 4 ports of one chip


CHIPS: dict[str, TpuChip] = {
    "v5e": TpuChip("v5e", "TPU v5 lite", 819e9, 197e12, 394e12, 16 * GiB, 1600e9 / 8),
    "v6e": TpuChip("v6e", "TPU v6 lite", 1640e9, 918e12, 1836e12, 32 * GiB, 3584e9 / 8),
}
# Google's pages give ICI bandwidth, not a collective's latency. This is an ASSUMED fixed cost
# per collective (launch and synchronization across the slice), a round figure, not a
# measurement: the collectives term reports its count alongside so it can be rescaled.
ASSUMED_COLLECTIVE_LATENCY_S = 5e-6
# bytes each device sends per byte of a collective's output, on a ring of n devices
_RING_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
                "reduce-scatter": lambda n: n - 1, "collective-permute": lambda n: 1.0,
                "all-to-all": lambda n: (n - 1) / n}


def collectives_term(collectives: dict[str, dict[str, float]], devices: int,
                     chip: TpuChip) -> dict:
    """The collectives of one step as time, apart from HBM time: each collective's output bytes
    through a ring of `devices` at the chip's ICI bandwidth (Google's figure), plus
    ASSUMED_COLLECTIVE_LATENCY_S per collective (an assumption)."""
    count = sum(c["count"] for c in collectives.values())
    wire = sum(_RING_FACTOR[op](devices) * c["bytes"] for op, c in collectives.items())
    transfer = wire / chip.ici_bytes_per_s if devices > 1 and chip.ici_bytes_per_s else 0.0
    latency = count * ASSUMED_COLLECTIVE_LATENCY_S if devices > 1 else 0.0
    return {"devices": devices, "count": count, "by_op": collectives,
            "transfer_ms": transfer * 1e3, "latency_ms": latency * 1e3,
            "assumed_latency_us": ASSUMED_COLLECTIVE_LATENCY_S * 1e6,
            "ms": (transfer + latency) * 1e3}


@dataclass(frozen=True)
class ReadModel:
    """Which weight arrays a decode step reads, beyond "all of it"."""

    gathered: frozenset[str] = frozenset()  # array keys only gathered by row (EMBED)
    experts: int = 0  # MoE experts per layer (0: dense model)
    top_k: int = 0  # experts each token reads
    # (pool key, window tokens or 0 for a full layer, layers reading each stacked slice of it)
    kv_reads: tuple[tuple[str, int, float], ...] = ()

    def kind(self, key: str) -> str:
        base = key.removesuffix(".scale")
        if base in self.gathered:
            return "gathered"
        return "expert" if self.experts and ".experts." in f".{base}" else "dense"

    def expert_fraction(self, batch: int) -> float:
        """Expected share of a layer's experts that `batch` tokens pick."""
        if not self.experts:
            return 0.0
        return 1.0 - (1.0 - self.top_k / self.experts) ** batch


def read_model(ir) -> ReadModel:
    """The ReadModel of a ModelIR: gather-only params, the MoE expert count and top-k."""
    from rvcompile.ir.ops import Op

    gathered, used = set(), set()
    for g in ir.graphs():
        names = {i: n.attrs.name for i, n in enumerate(g.nodes) if n.op is Op.PARAM}
        for n in g.nodes:
            for j in n.inputs:
                if j in names:
                    (gathered if n.op is Op.EMBED else used).add(names[j])
    cfg = ir.config
    return ReadModel(frozenset(gathered - used), cfg.num_experts, cfg.top_k_experts,
                     kv_reads(ir))


def kv_reads(ir) -> tuple[tuple[str, int, float], ...]:
    """(pool key, window or 0, readers) of a ModelIR's decode program: every layer attends over
    its own cache or, KV-shared, its source's; `readers` is how many layers read each stacked
    layer slice of the pool (the program's LayoutPlan), on average."""
    from rvcompile.targets.xla.program import SCALE_SUFFIX, _cache_owner, plan_layout

    plan = plan_layout(ir)
    reads: Counter = Counter()
    for spec in ir.config.layers:
        source = spec.kv_source if spec.kv_shared else spec.index
        gi, j, _ = _cache_owner(plan, source)
        c = ir.cache_of(source)
        for name in c.names:
            keys = [f"g{gi}.{j}.{name}"] + ([f"g{gi}.{j}.{name}{SCALE_SUFFIX}"]
                                            if c.dtype == "int8" else [])
            for key in keys:
                reads[key, spec.window or 0] += 1
    counts = {f"g{gi}.": g.count for gi, g in enumerate(plan.groups)}
    return tuple((key, window, n / counts[key[:key.index(".") + 1]])
                 for (key, window), n in sorted(reads.items()))


def query_per_kv(ir) -> int:
    """The most query heads that share one KV head in any layer."""
    return max(ir.config.num_heads // s.num_kv_heads for s in ir.config.layers)


@dataclass(frozen=True)
class DecodeFootprint:
    """Per-device figures of one compiled decode_{max_seqs} program."""

    max_seqs: int
    weight_bytes: int  # every weight array, as resident
    dense_bytes: int  # read whole every step
    expert_bytes: int  # MoE experts: read per picked expert
    dense_elements: int  # matrix and vector elements, scales excluded
    expert_elements: int
    kv_bytes_per_lane: int
    kv_elements_per_lane: int
    argument_bytes: int  # XLA memory analysis
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    xla_flops: float  # XLA cost analysis, as reported (a scan body counted once)
    xla_bytes_accessed: float
    once_bytes: int  # the roofline's bytes at `max_seqs` lanes, each layer group's counted once
    # (window tokens or 0, bytes, elements) one lane reads per cached token, summed over the
    # layers reading caches of that window (ReadModel.kv_reads; empty: pools read whole)
    kv_token_reads: tuple[tuple[int, float, float], ...] = ()

    def kv_read(self, context: int | None) -> tuple[float, float]:
        """(bytes, elements) of KV one lane reads a step holding `context` tokens: each
        attending layer's live keys once (a sliding layer's last `window`); without
        kv_token_reads (or context), its pools whole."""
        if not self.kv_token_reads or context is None:
            return float(self.kv_bytes_per_lane), float(self.kv_elements_per_lane)
        tokens = [min(context, w) if w else context for w, _, _ in self.kv_token_reads]
        return (sum(n * b for n, (_, b, _) in zip(tokens, self.kv_token_reads, strict=True)),
                sum(n * e for n, (_, _, e) in zip(tokens, self.kv_token_reads, strict=True)))

    @property
    def xla_amplification(self) -> float:
        return self.xla_bytes_accessed / self.once_bytes if self.once_bytes else 0.0

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def _shard_size(info, sharding) -> int:
    return math.prod(sharding.shard_shape(tuple(info.shape)))


def _group_count(key: str, group_counts: tuple[int, ...]) -> int:
    """Iterations of the layer group that stacks array `key` ("g{group}.{j}.{name}"), 1 for
    the arrays outside the layers."""
    head = key.split(".", 1)[0]
    if head[:1] == "g" and head[1:].isdigit() and int(head[1:]) < len(group_counts):
        return group_counts[int(head[1:])]
    return 1


def decode_footprint(compiled, max_seqs: int, reads: ReadModel = ReadModel(),
                     group_counts: tuple[int, ...] = ()) -> DecodeFootprint:
    """Read a compiled decode program whose first two arguments are the weights and the pools;
    `group_counts`: the iterations of each layer group (manifest xla.layer_groups)."""
    (args, _kwargs) = compiled.args_info
    (shardings, _) = compiled.input_shardings
    sizes, slots = [], {}
    for part in (0, 1):
        infos = jax.tree_util.tree_leaves_with_path(args[part])
        shards = jax.tree.leaves(shardings[part])
        sizes.append([(path[-1].key, _shard_size(i, s), np.dtype(i.dtype).itemsize)
                      for (path, i), s in zip(infos, shards, strict=True)])
        if part == 1:  # a pool [layers, blocks, ...]: BLOCK_TOKENS slots a block in each layer
            slots = {path[-1].key: i.shape[1] * BLOCK_TOKENS for path, i in infos}
    weights, pools = sizes
    per_token: dict[int, list[float]] = {}
    pool = {k: (n, b) for k, n, b in pools}
    for key, window, readers in reads.kv_reads:
        n, b = pool[key]
        got = per_token.setdefault(window, [0.0, 0.0])
        got[0] += readers * n * b / slots[key]
        got[1] += 0 if key.endswith(".scale") else readers * n / slots[key]
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}

    def total(kind: str, elements: bool = False) -> int:
        return sum(n if elements else n * b for k, n, b in weights if reads.kind(k) == kind
                   and not (elements and k.endswith(".scale")))

    fraction = {"dense": 1.0, "gathered": 0.0, "expert": reads.expert_fraction(max_seqs)}
    once = sum(n * b * fraction[reads.kind(k)] / _group_count(k, group_counts)
               for k, n, b in weights)
    once += sum(n * b / _group_count(k, group_counts) for k, n, b in pools)
    return DecodeFootprint(
        max_seqs=max_seqs,
        weight_bytes=sum(n * b for _, n, b in weights),
        dense_bytes=total("dense"), expert_bytes=total("expert"),
        dense_elements=total("dense", True), expert_elements=total("expert", True),
        kv_bytes_per_lane=sum(n * b for _, n, b in pools) // max_seqs,
        kv_elements_per_lane=sum(n for k, n, _ in pools if not k.endswith(".scale")) // max_seqs,
        argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
        alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
        xla_flops=float(cost.get("flops", 0.0)),
        xla_bytes_accessed=float(cost.get("bytes accessed", 0.0)), once_bytes=round(once),
        kv_token_reads=tuple((w, b, e) for w, (b, e) in sorted(per_token.items())))


def estimate(fp: DecodeFootprint, chip: TpuChip, query_per_kv: int,
             reads: ReadModel = ReadModel(),
             batches: tuple[int, ...] = REPORT_BATCHES, context: int | None = None) -> list[dict]:
    """One row per batch: bytes, flops, step time, tok/s, HBM need and fit (see the module),
    every lane holding `context` tokens (None: its pools read whole)."""
    rows = []
    picked = reads.top_k / reads.experts if reads.experts else 0.0
    kv_bytes, kv_elements = fp.kv_read(context)
    for b in sorted({*batches, fp.max_seqs}):
        nbytes = round(fp.dense_bytes + fp.expert_bytes * reads.expert_fraction(b)
                       + b * kv_bytes)
        flops = 2 * b * (fp.dense_elements + fp.expert_elements * picked
                         + query_per_kv * kv_elements)
        step = max(nbytes / chip.hbm_bytes_per_s, flops / chip.bf16_flops)
        need = fp.weight_bytes + b * fp.kv_bytes_per_lane + fp.temp_bytes
        step_xla = max(nbytes * fp.xla_amplification / chip.hbm_bytes_per_s,
                       flops / chip.bf16_flops)
        rows.append({"batch": b, "bytes": nbytes, "flops": flops, "step_ms": step * 1e3,
                     "tok_s": b / step, "bound": "memory" if nbytes / chip.hbm_bytes_per_s
                     >= flops / chip.bf16_flops else "compute",
                     "step_xla_ms": step_xla * 1e3, "tok_s_xla": b / step_xla,
                     "hbm_need_bytes": need, "fits": need <= chip.hbm_bytes})
    return rows


def cost_report(compiled_decode, max_seqs: int, chip: TpuChip, query_per_kv: int,
                context: int, reads: ReadModel = ReadModel(),
                group_counts: tuple[int, ...] = (), at_context: int | None = None) -> dict:
    """The manifest's cost report of one topology: `context` the built one; the estimates and
    the traffic table with every lane holding `at_context` tokens (default: `context`)."""
    at = at_context or context
    fp = decode_footprint(compiled_decode, max_seqs, reads, group_counts)
    rows = estimate(fp, chip, query_per_kv, reads, context=at)
    built = next(r for r in rows if r["batch"] == max_seqs)
    return {
        "label": "estimate (roofline from the compiled program; not a measurement)",
        "chip": asdict(chip), "context": context, "at_context": at,
        "query_per_kv": query_per_kv,
        "reads": {"gathered": sorted(reads.gathered), "experts": reads.experts,
                  "top_k": reads.top_k},
        "per_device": {**asdict(fp), "peak_bytes": fp.peak_bytes,
                       "kv_token_reads": [list(r) for r in fp.kv_token_reads],
                       "xla_amplification": fp.xla_amplification},
        "fits_at_max_seqs": fp.peak_bytes <= chip.hbm_bytes,
        "kv_read_per_lane": fp.kv_read(at)[0],
        "decode": rows,
        "traffic": traffic_record(traffic(compiled_decode.as_text(), context=at),
                                  built["bytes"], chip, _devices(compiled_decode)),
    }


def _devices(compiled) -> int:
    """Devices the compiled program runs on (its mesh)."""
    return jax.tree.leaves(compiled.input_shardings[0])[0].num_devices


def traffic_record(table: Traffic, roofline_bytes: float, chip: TpuChip, devices: int,
                   top: int = TRAFFIC_TOP) -> dict:
    """The manifest's compact traffic table: per-class totals and the top instructions, bytes
    per call of the program (one decode step); the step at the table's bytes (HBM time) and
    its collectives (`collectives_term`), at the built batch: estimates."""
    total = table.total()
    rows = sorted(table.rows, key=lambda r: -r.bytes * r.runs)[:top]
    hbm_ms = total / chip.hbm_bytes_per_s * 1e3
    coll = collectives_term(table.collectives(), devices, chip)
    named = table.branch_names()
    cases = {}
    for case, taken in STEP_CASES.items():
        if not named & set(taken):
            continue
        b = table.total(taken=taken)
        ms = b / chip.hbm_bytes_per_s * 1e3
        # its own collectives: one in a branch the step does not run is not waited for
        step_coll = collectives_term(table.collectives(taken), devices, chip)
        cases[case] = {"total_bytes": b, "on_chip_bytes": table.on_chip(taken=taken),
                       "amplification": b / roofline_bytes if roofline_bytes else 0.0,
                       "hbm_ms": ms, "collectives_ms": step_coll["ms"],
                       "step_ms": ms + step_coll["ms"]}
    return {
        "hbm_ms": hbm_ms, "collectives": coll, "step_ms": hbm_ms + coll["ms"],
        "label": "bytes per decode step from the compiled HLO, loops scaled by trip count",
        "total_bytes": total, "once_bytes": table.total(scaled=False),
        "on_chip_bytes": table.on_chip(),
        "amplification": total / roofline_bytes if roofline_bytes else 0.0,
        "trips": dict(table.trips), "unknown_trips": list(table.unknown_trips),
        "span_loops": list(table.span_loops),
        "cases": cases,  # a step running given branches (STEP_CASES); the rest: every branch
        "classes": table.by_class(),
        "whole_copies": [{"name": r.name, "op": r.opcode, "runs": r.runs, "read": r.read,
                          "written": r.written} for r in table.whole_copies()],
        "top": [{"name": r.name, "op": r.opcode, "calls": r.calls, "runs": r.runs,
                 "read": r.read, "written": r.written, "written_class": r.written_class,
                 "on_chip": r.on_chip, "step_bytes": r.bytes * r.runs} for r in rows],
    }


def _trips(trips: dict[str, int]) -> str:
    """'1 x 10 trips, 60 x 8 trips': how many loops run how many times."""
    counts = Counter(trips.values())
    return ", ".join(f"{n} x {k} trips" for k, n in sorted(counts.items())) or "none"


def format_traffic(name: str, t: dict) -> list[str]:
    """Lines of `rvcompile inspect --cost`: the traffic table of one topology."""
    lines = [f"  {name}: traffic, {t['label']}",
             f"    total {t['total_bytes'] / GiB:.3f} GiB a step ({t['amplification']:.2f}x the "
             f"roofline's bytes; {t['on_chip_bytes'] / GiB:.3f} GiB of it on chip), each "
             f"instruction once {t['once_bytes'] / GiB:.3f} GiB; loops: {_trips(t['trips'])}"
             + (f"; UNKNOWN trip counts (counted once): {t['unknown_trips']}"
                if t["unknown_trips"] else ""),
             f"    {'class':12} {'read GiB':>10} {'written GiB':>12}"]
    for c in CLASSES:
        v = t["classes"][c]
        lines.append(f"    {c:12} {v['read'] / GiB:10.3f} {v['written'] / GiB:12.3f}")
    if "collectives" in t:  # absent from reports made before issue 19
        c = t["collectives"]
        ops = ", ".join(f"{v['count']} {op} ({v['bytes'] / 2**20:.2f} MiB)"
                        for op, v in sorted(c["by_op"].items()))
        lines.append(f"    step at these bytes {t['hbm_ms']:.3f} ms HBM + {c['ms']:.3f} ms "
                     f"collectives = {t['step_ms']:.3f} ms; collectives over {c['devices']} "
                     f"devices: {ops or 'none'}; {c['transfer_ms']:.3f} ms at ICI bandwidth + "
                     f"{c['latency_ms']:.3f} ms at an assumed {c['assumed_latency_us']:.0f} us "
                     "each")
    for case, v in t.get("cases", {}).items():  # absent from reports before per-step cases
        lines.append(f"    a {case.replace('_', '-')} step (its branches only): "
                     f"{v['total_bytes'] / GiB:.3f} GiB ({v['amplification']:.2f}x; "
                     f"{v['on_chip_bytes'] / GiB:.3f} on chip), step {v['step_ms']:.3f} ms")
    copies = t.get("whole_copies", [])  # absent from reports made before issue 19
    lines.append(f"    whole weight copies: {len(copies) or 'none'}" + "".join(
        f"; {c['name']} ({c['op']}, {c['runs']} x {c['written'] / 2**20:.1f} MiB)"
        for c in copies))
    lines.append(f"    top instructions (GiB a step = runs x bytes a run): {'runs':>5} "
                 f"{'GiB/step':>9}  reads by class")
    for r in t["top"]:
        reads = ", ".join(f"{c} {b / 2**20:.1f}" for c, b in sorted(r["read"].items()))
        lines.append(f"    {r['name'][:40]:40} {r['op'][:14]:14} {r['runs']:5} "
                     f"{r['step_bytes'] / GiB:9.3f}  read MiB/run: {reads}; wrote "
                     f"{r['written'] / 2**20:.1f} MiB {r['written_class']}; on chip "
                     f"{r['on_chip'] / 2**20:.1f} MiB")
    return lines


def format_report(name: str, report: dict) -> list[str]:
    """Lines for `rvcompile inspect`."""
    chip, dev = report["chip"], report["per_device"]
    lines = [
        f"  {name}: cost {report['label']}",
        f"    chip {chip['generation']}: {chip['hbm_bytes_per_s'] / 1e9:.0f} GB/s HBM, "
        f"{chip['bf16_flops'] / 1e12:.0f} bf16 TFLOP/s, {chip['hbm_bytes'] / GiB:.0f} GiB",
        f"    per device: weights {dev['weight_bytes'] / GiB:.2f} GiB (read per step: dense "
        f"{dev['dense_bytes'] / GiB:.2f}, experts {dev['expert_bytes'] / GiB:.2f} as picked), KV "
        f"{dev['kv_bytes_per_lane'] / GiB:.3f} GiB per sequence at {report['context']} tokens, "
        f"XLA peak {dev['peak_bytes'] / GiB:.2f} GiB at B={dev['max_seqs']} "
        f"({'fits' if report['fits_at_max_seqs'] else 'DOES NOT FIT'})",
        f"    XLA cost analysis (scan bodies counted once): {dev['xla_flops']:.3g} flops, "
        f"{dev['xla_bytes_accessed']:.3g} bytes accessed, {dev['xla_amplification']:.2f}x "
        "the roofline's bytes counted the same way",
    ]
    if "at_context" in report:  # absent from reports made before issue 19's item 3
        lines.append(f"    decode with every lane at {report['at_context']} tokens: KV read "
                     f"{report['kv_read_per_lane'] / GiB:.3f} GiB a lane (live keys; a sliding "
                     "layer's window)")
    for r in report["decode"]:
        lines.append(f"    B={r['batch']:<4} step {r['step_ms']:8.3f} ms  {r['tok_s']:9.1f} tok/s"
                     f"  ({r['bound']}-bound); at XLA's traffic {r['tok_s_xla']:9.1f} tok/s"
                     f"  HBM {r['hbm_need_bytes'] / GiB:6.2f} GiB"
                     f"{'' if r['fits'] else '  DOES NOT FIT'}")
    return lines
