"""The build's TPU cost report (an estimate, not a measurement) for preset models, without
writing weights: the IR of a preset, the target's passes, the exported programs (`lower_to_xla`,
as `rvcompile build --platforms tpu` exports them: pools fixed at --tp > 1), their
decode_{max_seqs} compiled for a TPU topology through libtpu (targets/xla/precompile.py) and
the cost report of that executable
(targets/xla/cost_report.py). Weights play no part in the report, so none are made.

    PYTHONPATH=.venv/tpu-aot .venv/bin/python benchmarks/tpu_cost_report.py \\
        gemma-4-31B:512 gemma-4-31B:2048 gemma-4-E4B:2048 --tp 4 --topology v6e:2x2

Prints one markdown table row per model and batch, the traffic table of each decode program (as
`rvcompile inspect --cost` shows it), and the JSON reports to --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

from rvcompile.build import BuildOptions, lower_model
from rvcompile.model.presets import get_preset
from rvcompile.targets.xla.cost_report import (
    CHIPS,
    GiB,
    cost_report,
    format_traffic,
    query_per_kv,
    read_model,
)
from rvcompile.targets.xla.export import fixed_pools, lower_to_xla
from rvcompile.targets.xla.precompile import (
    check_topology,
    compile_entries,
    parse_topology,
    topology_devices,
)


def report(model: str, context: int, args) -> dict:
    topo = parse_topology(args.topology)
    check_topology(topo, args.tp)
    cfg = get_preset(model)
    opts = BuildOptions(target=args.target, max_context=context, max_seqs=args.max_seqs,
                        platforms=("tpu",), tp=args.tp)
    t0 = time.perf_counter()
    ir = lower_model(SimpleNamespace(config=cfg), opts, log=lambda s: None)
    lowering = lower_to_xla(ir, max_seqs=args.max_seqs, prefill_buckets=opts.prefill_buckets,
                            platforms=("tpu",), tp=args.tp,
                            static_pools=args.static_pools or fixed_pools(("tpu",), args.tp))
    t_export = time.perf_counter() - t0
    decode = f"decode_{args.max_seqs}"
    compiled = compile_entries(lowering.programs, lowering.manifest, topology_devices(topo),
                               names=(decode,))[decode]
    t_compile = time.perf_counter() - t0 - t_export
    if args.hlo_dir:
        with open(f"{args.hlo_dir}/{model}-{context}-tp{args.tp}.hlo.txt", "w") as f:
            f.write(compiled.as_text())
    rep = cost_report(compiled, args.max_seqs, CHIPS[topo.generation], query_per_kv(ir),
                      ir.max_context, read_model(ir),
                      tuple(g["count"] for g in lowering.manifest["layer_groups"]),
                      at_context=args.at_context)
    rep["model"], rep["topology"], rep["tp"], rep["target"] = model, topo.name, args.tp, \
        args.target
    rep["seconds"] = {"export": round(t_export, 1), "compile_decode": round(t_compile, 1)}
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="PRESET:CONTEXT, e.g. gemma-4-31B:2048")
    ap.add_argument("--target", default="tpu-int8")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--topology", default="v6e:2x2")
    ap.add_argument("--max-seqs", type=int, default=1, help="decode lanes of the built program")
    ap.add_argument("--at-context", type=int, default=None,
                    help="estimate with every lane holding this many tokens (default: the "
                         "built context): the KV a step reads, and the traffic table's "
                         "attention span loops, follow the lanes' length")
    ap.add_argument("--static-pools", action="store_true",
                    help="export the pools at their default block counts also at --tp 1 "
                         "(an artifact's are symbolic there); at --tp > 1 they are fixed "
                         "anyway, as `rvcompile build --platforms tpu` fixes them "
                         "(export.fixed_pools)")
    ap.add_argument("--json", default=None, help="write the reports here")
    ap.add_argument("--hlo-dir", default=None,
                    help="write each decode program's optimized HLO text into this folder")
    args = ap.parse_args()
    reports = []
    print("| model | context | B | per-device weights GiB | KV/seq GiB | roofline step ms "
          "| roofline tok/s | tok/s at XLA's traffic | HBM need GiB | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.models:
        model, context = spec.rsplit(":", 1)
        rep = report(model, int(context), args)
        reports.append(rep)
        dev = rep["per_device"]
        for r in rep["decode"]:
            print(f"| {model} | {context} | {r['batch']} | {dev['weight_bytes'] / GiB:.2f} "
                  f"| {dev['kv_bytes_per_lane'] / GiB:.3f} | {r['step_ms']:.2f} "
                  f"| {r['tok_s']:.1f} | {r['tok_s_xla']:.1f} | {r['hbm_need_bytes'] / GiB:.2f} "
                  f"| {'yes' if r['fits'] else 'no'} |")
        print(f"<!-- {model}:{context} at {rep['at_context']} tokens a lane: KV read "
              f"{rep['kv_read_per_lane'] / GiB:.3f} GiB a lane; XLA temp "
              f"{dev['temp_bytes'] / GiB:.2f} GiB, peak "
              f"{dev['peak_bytes'] / GiB:.2f} GiB; XLA cost analysis {dev['xla_flops']:.3g} "
              f"flops, {dev['xla_bytes_accessed']:.3g} bytes, amplification "
              f"{dev['xla_amplification']:.2f}; times {rep['seconds']} -->")
        print("\n".join(["<!-- traffic table (rvcompile inspect --cost):",
                         *format_traffic(f"{model}:{context}", rep["traffic"]), "-->"]))
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
