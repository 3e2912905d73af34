"""Micro-benchmark: one stacked int8 weight [L, N, K] read by a scan at M=1, as XLA sees it in
decode, in three forms: bf16 dot after convert, multiply-reduce, and an unstacked dot. Prints
GB/s of int8 weight bytes (median of 20, warm)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SHAPES = {"qkv_sliding": (16384, 5376), "gate_up": (43008, 5376), "down": (5376, 21504),
          "o_sliding": (5376, 8192)}


def dot_form(x, w):
    return jnp.einsum("k,nk->n", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)


def reduce_form(x, w):
    return jnp.sum(x.astype(jnp.bfloat16).astype(jnp.float32)[None, :] * w.astype(jnp.float32),
                   axis=-1)


def scanned(form):
    def run(x, ws):
        def body(h, w):
            y = form(h, w)
            return h + y[: h.shape[0]].sum() * 1e-9, None
        return lax.scan(body, x, ws)[0]
    return jax.jit(run)


def bench(f, *args, reps=20):
    f(*args).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main():
    layers = 10
    for name, (n, k) in SHAPES.items():
        key = jax.random.key(0)
        ws = jax.random.randint(key, (layers, n, k), -127, 128, dtype=jnp.int8)
        x = jax.random.normal(key, (k,), jnp.float32)
        nbytes = layers * n * k
        out = {form.__name__: nbytes / bench(scanned(form), x, ws) / 1e9
               for form in (dot_form, reduce_form)}
        print(f"{name:12} {n}x{k}: " + "  ".join(f"{f} {v:.0f} GB/s" for f, v in out.items()),
              flush=True)


if __name__ == "__main__":
    main()
