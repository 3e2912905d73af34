"""Does any XLA form of a paged span's gather and dot keep the gathered span out of on-chip memory
on TPU? (Issue 19, the 31B at B = 64; an estimate aid compiled for a topology, nothing runs.)

    PYTHONPATH=.:.venv/tpu-aot .venv/bin/python benchmarks/tpu_span_gather_probe.py

One device's share of one span of the 31B's sliding-layer keys at TP = 4, B = 64: 64 lanes, each
22 blocks of 16 tokens picked by its block table out of a bf16 pool [blocks, 16, 4 * 256] (4 KV
heads of 256), scored against 2 query rows a head. Each form is compiled for one device of
v6e:1x1 as the cost report compiles, and the traffic table (targets/xla/hlo_traffic.py) gives the
KV bytes read from HBM, the bytes in on-chip memory (VMEM) and the total; the live KV is 44 MiB.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rvcompile.targets.xla.hlo_traffic import traffic
from rvcompile.targets.xla.precompile import parse_topology, topology_devices

B, S, HEADS, D, GROUP = 64, 22, 4, 256, 2  # lanes, blocks a span, KV heads, head dim, queries
KD, POOL = HEADS * D, 64 * 81 + 1  # a row's columns; the pool's blocks (81 a lane's ring)
HI = {"precision": lax.Precision.HIGHEST, "preferred_element_type": jnp.float32}


def per_head(q, rows):
    """q [B, K, G, D] against rows [B, T, K * D], each head's columns a static slice (the
    product's span_dots): [B, K, G, T]."""
    return jnp.stack([jnp.einsum("bgd,btd->bgt", q[:, j], rows[..., j * D:(j + 1) * D]
                                 .astype(jnp.float32), **HI) for j in range(HEADS)], 1)


def gathered(pool, q, table):  # the product's form: the span's blocks gathered (indexing, as
    # lower.PagedSlice.read_blocks; jnp.take's default mode adds a select and a second copy)
    return per_head(q, pool[table].reshape(B, S * 16, KD))


def token_rows(pool, q, table):  # the pool as token rows, gathered by token index
    tokens = (table[:, :, None] * 16 + jnp.arange(16)).reshape(B, S * 16)
    return per_head(q, pool.reshape(POOL * 16, KD)[tokens])


def heads_apart(pool, q, table):  # each head's columns gathered apart
    return jnp.stack([jnp.einsum("bgd,btd->bgt", q[:, j], (
        pool[..., j * D:(j + 1) * D][table]).reshape(B, S * 16, D).astype(jnp.float32),
        **HI) for j in range(HEADS)], 1)


def block_loop(pool, q, table):  # a loop over the span's blocks, every lane's block a trip
    def body(j, acc):
        s = per_head(q, pool[table[:, j]])
        return lax.dynamic_update_slice_in_dim(acc, s, j * 16, axis=3)
    return lax.fori_loop(0, S, body, jnp.zeros((B, HEADS, GROUP, S * 16), jnp.float32))


def lane_loop(pool, q, table):  # a loop over lanes, each block a dynamic slice of the pool
    def body(b, acc):
        rows = jnp.concatenate([lax.dynamic_slice(pool, (table[b, j], 0, 0), (1, 16, KD))
                                for j in range(S)]).reshape(1, S * 16, KD)
        s = per_head(lax.dynamic_slice_in_dim(q, b, 1), rows)
        return lax.dynamic_update_slice_in_dim(acc, s, b, axis=0)
    return lax.fori_loop(0, B, body, jnp.zeros((B, HEADS, GROUP, S * 16), jnp.float32))


def multiply_reduce(pool, q, table):  # no dot: products and a sum over D
    rows = pool[table].reshape(B, S * 16, HEADS, 1, D)
    return jnp.sum(q[:, None] * rows.astype(jnp.float32), -1)


FORMS = (gathered, token_rows, heads_apart, block_loop, lane_loop, multiply_reduce)


def main() -> None:
    device = topology_devices(parse_topology("v6e:1x1"))[0]
    one = jax.sharding.SingleDeviceSharding(device)
    args = (jax.ShapeDtypeStruct((POOL, 16, KD), jnp.bfloat16, sharding=one),
            jax.ShapeDtypeStruct((B, HEADS, GROUP, D), jnp.float32, sharding=one),
            jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=one))
    mib = 2 ** 20
    print(f"live KV of the span: {B * S * 16 * KD * 2 / mib:.1f} MiB")
    for form in FORMS:
        t = traffic(jax.jit(form).lower(*args).compile().as_text(), ("weights", "pool"))
        print(f"{form.__name__:16s} KV read {t.by_class()['kv']['read'] / mib:6.1f} MiB, on chip "
              f"{t.on_chip() / mib:6.1f} MiB, total {t.total() / mib:6.1f} MiB")


if __name__ == "__main__":
    main()
