"""Single-stream decode of an h100-fp8 artifact through the product path (`rvcompile.runtime.load`,
the schedule's CUDA graphs, on-device sampling), against the HBM roofline measured in the same
run.

    python benchmarks/h100_decode.py g31-h100.rvp [--contexts 16,1200] [--tokens 128]
                                     [--json out.json]

Reports: load time (cold start: checks, arena, weight upload, cubins, graph capture; the sha256
verification is timed separately), and per context length the decode rate two ways: `generate`
(Model's loop: detokenising and stop checks included) and the bare graph step (executor.decode
in a loop). The roofline is the bytes one step must read (every weight once, the tied bf16
embedding as the head, plus the context's KV) over the device-to-device copy bandwidth. Two
kinds of weights are not read whole by a batch-1 step, and are counted as read: of a PLE model's
per-layer embedding table (bf16) one row, of a MoE layer's experts (FP8 rows + float32 row
scales) the top-k chosen.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from rvcompile import runtime
from rvcompile.artifacts import Artifact
from rvcompile.runtime.executor_api import SeqChunk
from rvcompile.runtime.executors.cuda_driver import CudaContext


def copy_bandwidth(ctx: CudaContext, nbytes: int = 4 << 30) -> float:
    """Read + write bytes per second of a device-to-device copy (median of 10)."""
    src, dst = ctx.alloc(nbytes), ctx.alloc(nbytes)
    stream = ctx.stream()
    times = []
    for i in range(13):
        a, b = ctx.event(), ctx.event()
        ctx.record(a, stream)
        ctx.copy_device(dst.ptr, src.ptr, nbytes, stream)
        ctx.record(b, stream)
        if i >= 3:
            times.append(ctx.elapsed_ms(a, b))
    ctx.synchronize()
    ctx.free(src)
    ctx.free(dst)
    return 2 * nbytes / (float(np.median(times)) * 1e-3)


def kv_bytes_per_step(cfg: dict, context: int, window: int) -> int:
    """KV bytes one decode step reads at `context` tokens (K=V full layers store one tensor)."""
    total = 0
    pattern = cfg["layer_types"]
    for kind in pattern:
        full = kind == "full_attention"
        kh = cfg["num_global_key_value_heads"] if full and cfg.get(
            "num_global_key_value_heads") else cfg["num_key_value_heads"]
        d = cfg.get("global_head_dim") or cfg["head_dim"] if full else cfg["head_dim"]
        keys = context if full else min(context, window)
        tensors = 1 if full and cfg.get("attention_k_eq_v") else 2
        total += keys * kh * d * 2 * tensors
    return total


def unread_bytes_per_step(cfg: dict) -> int:
    """Weight bytes a batch-1 decode step does not touch (see the module docstring)."""
    unread = 0
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    p = cfg.get("hidden_size_per_layer_input") or 0
    if p:
        unread += (cfg["vocab_size_per_layer_input"] - 1) * layers * p * 2
    if cfg.get("enable_moe_block"):
        e, k, i = cfg["num_experts"], cfg["top_k_experts"], cfg["moe_intermediate_size"]
        per_expert = 3 * i * hidden + 4 * (2 * i + hidden)  # gate||up + down rows, their scales
        unread += layers * (e - k) * per_expert
    return unread


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--contexts", default="16,1200")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()

    ctx = CudaContext()
    bw = copy_bandwidth(ctx)
    t0 = time.perf_counter()
    Artifact.open(args.artifact).verify()
    verify_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = runtime.load(args.artifact, verify=False)
    load_s = time.perf_counter() - t0
    ex = m.executor
    cfg = m.manifest["model"]["config"]
    weights = ex.schedule.weights_bytes
    read = weights - unread_bytes_per_step(m.manifest["model"]["config"])
    result = {"device": ctx.device_name(), "copy_bandwidth_GBps": bw / 1e9,
              "weights_GB": weights / 1e9, "step_weight_read_GB": read / 1e9,
              "verify_s": verify_s, "load_s": load_s,
              "upload_s": ex.upload_s, "contexts": {}}
    print(f"{ctx.device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; weights "
          f"{weights / 1e9:.2f} GB ({read / 1e9:.2f} GB read a step); load {load_s:.1f} s "
          f"(upload {ex.upload_s:.1f} s), "
          f"sha256 verify {verify_s:.1f} s")
    rng = np.random.default_rng(0)
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = rng.integers(4, cfg["vocab_size"], context).tolist()
        r = m.generate(prompt, max_tokens=args.tokens, ignore_eos=True)
        # bare graph steps over a sequence of the same length (blocks 0.. of each kind)
        pos = context + len(r.token_ids) - 1
        tables = {k.name: list(range(k.table_width)) for k in ex.kinds.values()}
        tok = r.token_ids[-1]
        steps = min(64, ex.max_context - pos - 1)
        t = time.perf_counter()
        for i in range(steps):
            tok = ex.decode([SeqChunk([tok], pos + i, tables)])[0]
        step_s = (time.perf_counter() - t) / steps
        window = cfg.get("sliding_window") or context
        roof_s = (read + kv_bytes_per_step(cfg, context + args.tokens // 2, window)) / bw
        row = {"prompt_tokens": context, "ttft_s": r.ttft_s, "generate_tok_s": r.decode_tok_s,
               "graph_step_ms": step_s * 1e3, "graph_tok_s": 1 / step_s,
               "roofline_tok_s": 1 / roof_s, "pct_of_roofline": 100 * roof_s / step_s}
        result["contexts"][context] = row
        print(f"context {context}: TTFT {r.ttft_s:.2f} s; generate {r.decode_tok_s:.1f} tok/s; "
              f"graph step {step_s * 1e3:.2f} ms = {1 / step_s:.1f} tok/s; roofline "
              f"{1 / roof_s:.1f} tok/s ({100 * roof_s / step_s:.0f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
