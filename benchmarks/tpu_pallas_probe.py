"""Do JAX's Pallas TPU paged-attention kernels compile for a TPU topology on this machine (no TPU),
and what does XLA's cost analysis see of them? (Issue 19 item 3; an estimate aid, nothing runs.)

    PYTHONPATH=.:.venv/tpu-aot .venv/bin/python benchmarks/tpu_pallas_probe.py --topology v6e:2x2

For each kernel (jax.experimental.pallas.ops.tpu: `paged_attention` and `ragged_paged_attention`)
at one device's share of the 26B-A4B's sliding layer at TP = 4 (4 query heads, 2 KV heads of 256,
bf16 pages of 16 tokens, a 2048-token table, one decode row; paged_attention also at a full layer's
head of 512), lowered and compiled on one device of
the topology the way the cost report compiles: prints whether it compiled (or the error), the
custom calls in the optimized HLO, XLA's "bytes accessed", and the bytes the kernel must read
itself (the live pages of K and V at `--context` tokens), since a Mosaic custom call is opaque to
XLA's cost analysis and to the traffic table (targets/xla/hlo_traffic.py).
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np

from rvcompile.targets.xla.precompile import parse_topology, topology_devices

PAGE, HEADS, KV_HEADS, D = 16, 4, 2, 256


def probe(name: str, fn, args, device, live_bytes: int) -> None:
    sharding = jax.sharding.SingleDeviceSharding(device)
    shaped = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    print(f"== {name}")
    try:
        lowered = jax.jit(fn).lower(*shaped)
        compiled = lowered.compile()
    except Exception as e:  # report the error text, whatever it is
        print("   did not compile:", type(e).__name__)
        print("   " + "\n   ".join(str(e).splitlines()[:12]))
        return
    text = compiled.as_text()
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    print("   compiled; custom calls:", calls)
    print(f"   XLA bytes accessed {cost.get('bytes accessed', 0):.4g}, flops "
          f"{cost.get('flops', 0):.4g}; live K+V bytes the kernel reads: {live_bytes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v6e:2x2")
    ap.add_argument("--context", type=int, default=2048, help="tokens in the lane's table")
    args = ap.parse_args()
    device = topology_devices(parse_topology(args.topology))[0]
    pages_per_seq = args.context // PAGE
    total_pages = 2 * pages_per_seq
    live = 2 * KV_HEADS * args.context * D * 2  # K and V, bf16

    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    q = np.zeros((1, HEADS, D), jnp.bfloat16)
    pages = np.zeros((KV_HEADS, total_pages, PAGE, D), jnp.bfloat16)
    lengths = np.full((1,), args.context, np.int32)
    table = np.zeros((1, pages_per_seq), np.int32)
    probe("paged_attention (q [1, 4, 256], k/v pages [2, pages, 16, 256])",
          lambda q, k, v, n, t: paged_attention(q, k, v, n, t, pages_per_compute_block=8),
          (q, pages, pages, lengths, table), device, live)

    # a full layer's head of 512 (the E4B's: 2 KV heads, keys stored with RoPE applied)
    q512 = np.zeros((1, HEADS, 2 * D), jnp.bfloat16)
    pages512 = np.zeros((KV_HEADS, total_pages, PAGE, 2 * D), jnp.bfloat16)
    probe("paged_attention at head_dim 512 (q [1, 4, 512], k/v pages [2, pages, 16, 512])",
          lambda q, k, v, n, t: paged_attention(q, k, v, n, t, pages_per_compute_block=8),
          (q512, pages512, pages512, lengths, table), device, 2 * live)

    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    kv = np.zeros((total_pages, PAGE, 2 * KV_HEADS, D), jnp.bfloat16)  # K and V interleaved
    cu = np.asarray([0, 1], np.int32)
    rargs = (q, kv, lengths, table, cu, np.ones((1,), np.int32))
    # Its block sizes come from a table keyed by jax.devices()[0]'s TPU version unless given;
    # this process's devices are CPUs (the topology's devices only compile).
    probe("ragged_paged_attention, tuned block sizes",
          lambda q, kv, n, t, cu, s: ragged_paged_attention(q, kv, n, t, cu, s,
                                                            sliding_window=1024),
          rargs, device, live)
    probe("ragged_paged_attention, 8 pages and 8 queries a block",
          lambda q, kv, n, t, cu, s: ragged_paged_attention(
              q, kv, n, t, cu, s, sliding_window=1024, num_kv_pages_per_block=8,
              num_queries_per_block=8),
          rargs, device, live)
    # The kernel asks jax's default device for the chip's VMEM and tiling (tpu_info).
    with jax.default_device(device):
        probe("ragged_paged_attention, 8 pages and 8 queries a block, the topology's device "
              "as jax's default device",
              lambda q, kv, n, t, cu, s: ragged_paged_attention(
                  q, kv, n, t, cu, s, sliding_window=1024, num_kv_pages_per_block=8,
                  num_queries_per_block=8),
              rargs, device, live)
        # The same at head_dim 128 (no Gemma 4 layer has it: 256 sliding, 512 full)
        q128, kv128 = q[..., :128], kv[..., :128]
        probe("ragged_paged_attention as above at head_dim 128 (not a Gemma 4 shape)",
              lambda q, kv, n, t, cu, s: ragged_paged_attention(
                  q, kv, n, t, cu, s, sliding_window=1024, num_kv_pages_per_block=8,
                  num_queries_per_block=8),
              (q128, kv128, *rargs[2:]), device, live // 2)


if __name__ == "__main__":
    main()
