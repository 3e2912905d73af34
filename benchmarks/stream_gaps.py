"""Streamed chunk gaps against the bursty decode loop (issue 17, item 4).

Loads ARTIFACT through the normal runtime and generates --tokens tokens (greedy, EOS ignored)
for one request, recording when each engine output arrives. Per mode: the gaps between outputs
after the first (median, p90, p90/median) and the decode throughput (tokens after the first
over the time after the first output). Modes: "bursty" (stream=False: every loop call runs the
artifact's decode_loop_steps) and "stream@X" (stream=True, Engine.stream_interval_s = X s).
Runs alternate between modes, --repeats times each after one warm-up run each; reports the
median throughput over repeats and the gaps of all repeats together. Writes JSON with --json.

    python benchmarks/stream_gaps.py build/rv-gemma4-tiny.rvp --tokens 256 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from rvcompile import runtime
from rvcompile.runtime.engine import Request


def one_run(m, stream: bool, interval: float, tokens: int, prompt: list[int]):
    """(arrival times of each output with tokens, tokens per output)."""
    m.engine.stream_interval_s = interval
    m.engine.add(Request(f"bench-{time.perf_counter_ns()}", prompt, tokens, ignore_eos=True,
                         stream=stream))
    times, sizes = [], []
    while m.engine.has_work():
        for out in m.engine.step():
            if out.token_ids:
                times.append(time.perf_counter())
                sizes.append(len(out.token_ids))
    return times, sizes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--intervals", default="0.05", help="stream intervals (s), comma-separated")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    m = runtime.load(a.artifact, verify=False)
    prompt = m.encode("In the beginning")
    modes = [("bursty", False, 0.05)] + [(f"stream@{x}", True, float(x))
                                        for x in a.intervals.split(",")]
    gaps = {name: [] for name, *_ in modes}
    rates = {name: [] for name, *_ in modes}
    sizes = {}
    for rep in range(a.repeats + 1):
        for name, stream, interval in modes:
            times, chunk_sizes = one_run(m, stream, interval, a.tokens, prompt)
            if rep == 0:  # warm-up (compiles, first measurement of the loop's step time)
                continue
            gaps[name] += list(np.diff(times[1:]))
            rates[name].append((sum(chunk_sizes) - chunk_sizes[0]) / (times[-1] - times[0]))
            sizes[name] = chunk_sizes
    report = {"artifact": a.artifact, "tokens": a.tokens, "repeats": a.repeats,
              "decode_loop_steps": m.executor.decode_loop_steps, "modes": {}}
    base = float(np.median(rates["bursty"]))
    for name, *_ in modes:
        g = np.array(gaps[name])
        med, p90 = float(np.median(g)), float(np.percentile(g, 90))
        rate = float(np.median(rates[name]))
        report["modes"][name] = {"gap_median_ms": med * 1e3, "gap_p90_ms": p90 * 1e3,
                                 "p90_over_median": p90 / med, "tok_s": rate,
                                 "throughput_cost": 1 - rate / base,
                                 "outputs": len(sizes[name]),
                                 "tokens_per_output": sorted(set(sizes[name][1:]))}
        r = report["modes"][name]
        print(f"{name:12} gaps median {r['gap_median_ms']:7.1f} ms  p90 {r['gap_p90_ms']:7.1f} ms"
              f"  p90/median {r['p90_over_median']:.2f}  {rate:7.1f} tok/s  cost "
              f"{100 * r['throughput_cost']:+.1f}%  outputs {r['outputs']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
