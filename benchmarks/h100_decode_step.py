"""A whole 31B decode step (batch 1) from the H100 kernels, captured in one CUDA graph: how fast
the kernel set is before the h100-fp8 target's planner and runtime exist.

Per layer, in order: [embed + input norm on layer 0] -> QKV GEMV -> q/k norm + RoPE + paged KV
write -> split-KV attention + combine -> o GEMV -> residual + post-norm + pre-FFN norm ->
gate||up GEMV -> gelu*up -> down GEMV -> residual + post-norm * layer_scalar + next input norm;
then the head GEMV and softcap argmax. Random FP8 weights of the real shapes (30.7 GB), context
1200 tokens (sliding layers: a 1024-token window in a ring of 65 blocks).

K=V (full) layers store each token's normalised base once and derive K while reading. The
roofline is all weight and KV bytes read once over the device-to-device copy bandwidth measured
in the same run.

    python benchmarks/h100_decode_step.py
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from rvcompile.model.presets import gemma_4_31b
from rvcompile.runtime.executors.cuda_driver import CudaContext
from rvcompile.targets.h100 import attn_decode, gelu_mul, gemv_fp8, head, norms, qkv_post
from rvcompile.targets.h100.nvcc import compile_cubin

CTX = 1200
EPS = 1e-6
P = ctypes.c_uint64
I32 = ctypes.c_int
F32 = ctypes.c_float


class Bench:
    def __init__(self):
        self.ctx = CudaContext()
        self.cfg = gemma_4_31b()
        self.fn = {}
        for src, names in [
            (gemv_fp8.SOURCE, [gemv_fp8.ENTRY]),
            (attn_decode.SOURCE, [attn_decode.entry(256, 2), attn_decode.entry_keqv(512, 8),
                                  "attn_decode_combine"]),
            ("norms.cu", ["rmsnorm_bf16", "residual_rmsnorm"]),
            ("qkv_post.cu", ["qkv_post"]),
            ("gelu_mul.cu", ["gelu_mul"]),
            ("head.cu", ["softcap_argmax", "embed_rows_fp8"]),
        ]:
            cubin = compile_cubin(src)
            for n in names:
                self.fn[n] = self.ctx.load_function(cubin, n)
        self.rng = np.random.default_rng(0)
        self.source = self.random_bytes(256 << 20)
        self.weight_bytes = 0
        self.kv_bytes = 0

    def random_bytes(self, nbytes: int, fp8: bool = True):
        b = self.rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        if fp8:
            b[(b & 0x7F) == 0x7F] ^= 1  # no e4m3 NaN codes
        else:  # bf16 pairs: keep values finite and moderate (exponent byte 0x3c..0x3f)
            b[1::2] = 0x3C + (b[1::2] & 3) | (b[1::2] & 0x80)
        return self.ctx.upload(b)

    def fill(self, nbytes: int, fp8: bool = True):
        """A device buffer of nbytes filled from a random source buffer (device copies)."""
        buf = self.ctx.alloc(nbytes)
        src = self.source if fp8 else self.random_bytes(min(nbytes, 64 << 20), fp8=False)
        for off in range(0, nbytes, src.nbytes):
            n = min(src.nbytes, nbytes - off)
            self.ctx.copy_device(buf.ptr + off, src.ptr, n)
        return buf

    def f32(self, values) -> object:
        return self.ctx.upload(np.asarray(values, np.float32))

    def matrix(self, n: int, k: int):
        self.weight_bytes += n * k + 4 * n
        return self.fill(n * k), self.f32(self.rng.uniform(1e-3, 2e-3, n))

    def build(self):
        cfg, H = self.cfg, self.cfg.hidden_size
        nh, inter, vocab = cfg.num_heads, cfg.intermediate_size, cfg.vocab_size
        self.layers = []
        for spec in cfg.layers:
            d, kh = spec.head_dim, spec.num_kv_heads
            width = qkv_post.row_width(nh, kh, d, spec.k_eq_v)
            ring = spec.window // attn_decode.BLOCK + 1 if spec.window else -(-CTX // 16)
            pool_bytes = ring * attn_decode.BLOCK * kh * d * 2
            keys = min(CTX, spec.window or CTX)
            self.kv_bytes += keys * kh * d * 2 * (1 if spec.k_eq_v else 2)
            layer = {
                "spec": spec, "d": d, "kh": kh, "width": width, "ring": ring, "keys": keys,
                "qkv": self.matrix(width, H), "o": self.matrix(H, nh * d),
                "gate_up": self.matrix(2 * inter, H), "down": self.matrix(H, inter),
                "norms": [self.f32(self.rng.uniform(0.5, 1.5, H)) for _ in range(4)],
                "qk_norm": [self.f32(self.rng.uniform(0.5, 1.5, d)) for _ in range(2)],
                "scalar": self.f32([0.8]),
                "inv_freq": self.f32(spec.rope.inv_freq(d)),
                "k_pool": self.fill(pool_bytes, fp8=False),
                "v_pool": None if spec.k_eq_v else self.fill(pool_bytes, fp8=False),
                "table": self.ctx.upload(np.arange(ring, dtype=np.int32)),
            }
            self.layers.append(layer)
        self.head = self.matrix(vocab, H)
        self.final_norm = self.f32(self.rng.uniform(0.5, 1.5, H))
        self.one = self.f32([1.0])
        a = self.ctx.alloc
        max_width = max(layer["width"] for layer in self.layers)
        self.h, self.y = a(H * 4), a(max(H, inter) * 2)
        self.qkv, self.q = a(max_width * 4), a(nh * 512 * 2)
        self.attn_out, self.attn_bf16 = a(nh * 512 * 4), a(nh * 512 * 2)
        self.o, self.gu, self.down = a(H * 4), a(2 * inter * 4), a(H * 4)
        self.logits, self.token = a(vocab * 4), a(4)
        self.ids = self.ctx.upload(np.array([1234], np.int32))
        self.positions = self.ctx.upload(np.array([CTX - 1], np.int32))
        self.seq_len = self.ctx.upload(np.array([CTX], np.int32))
        splits_max = 64
        self.part_acc, self.part_ml = a(nh * splits_max * 512 * 4), a(nh * splits_max * 8)
        self.ctx.synchronize()

    def gemv(self, w, x, y, n, k, stream):
        launch = gemv_fp8.launch_geometry(1, n, k, self.ctx.sm_count)
        fn = self.fn[gemv_fp8.ENTRY]  # x is at most 21504 bf16 = 43 KB: under the 48 KB default
        self.ctx.launch(fn, launch.grid, launch.block, launch.smem,
                        [P(w[0].ptr), P(w[1].ptr), P(x.ptr), P(y.ptr), I32(1), I32(n), I32(k)],
                        stream)

    def step(self, stream):
        ctx, cfg, H = self.ctx, self.cfg, self.cfg.hidden_size
        nh, inter = cfg.num_heads, cfg.intermediate_size
        g = head.embed_geometry(1, H, fp8=True)
        ctx.launch(self.fn["embed_rows_fp8"], g.grid, g.block, 0,
                   [P(self.head[0].ptr), P(self.head[1].ptr), P(self.ids.ptr),
                    F32(73.5), P(self.h.ptr), I32(H)], stream)
        g = norms.launch_geometry(1, H)
        ctx.launch(self.fn["rmsnorm_bf16"], g.grid, g.block, 0,
                   [P(self.h.ptr), P(self.layers[0]["norms"][0].ptr), P(self.y.ptr), I32(H),
                    F32(EPS)], stream)
        for i, L in enumerate(self.layers):
            d, kh, spec = L["d"], L["kh"], L["spec"]
            self.gemv(L["qkv"], self.y, self.qkv, L["width"], H, stream)
            g = qkv_post.launch_geometry(1, nh, kh, d)
            ctx.launch(self.fn["qkv_post"], g.grid, g.block, 0,
                       [P(self.qkv.ptr), I32(L["width"]), I32(nh), I32(kh), I32(d),
                        I32(int(spec.k_eq_v)), P(L["qk_norm"][0].ptr), P(L["qk_norm"][1].ptr),
                        P(self.positions.ptr), P(L["inv_freq"].ptr), F32(EPS), P(self.q.ptr),
                        P(L["k_pool"].ptr), P(L["v_pool"].ptr if L["v_pool"] else 0),
                        P(L["table"].ptr), I32(L["ring"]), I32(L["ring"])], stream)
            splits = attn_decode.num_splits(1, kh, L["keys"], ctx.sm_count)
            if spec.k_eq_v:
                ctx.launch(self.fn[attn_decode.entry_keqv(d, nh // kh)], (splits, kh, 1),
                           (128, 1, 1), 0,
                           [P(self.q.ptr), P(L["k_pool"].ptr), P(L["table"].ptr),
                            I32(L["ring"]), I32(L["ring"]), P(self.seq_len.ptr), I32(0), I32(kh),
                            P(L["qk_norm"][1].ptr), P(L["inv_freq"].ptr),
                            P(self.part_acc.ptr), P(self.part_ml.ptr), P(0), P(0)], stream)
            else:
                ctx.launch(self.fn[attn_decode.entry(d, nh // kh)], (splits, kh, 1),
                           (128, 1, 1), 0,
                           [P(self.q.ptr), P(L["k_pool"].ptr), P(L["v_pool"].ptr),
                            P(L["table"].ptr), I32(L["ring"]), I32(L["ring"]),
                            P(self.seq_len.ptr), I32(spec.window or 0), I32(kh),
                            P(self.part_acc.ptr), P(self.part_ml.ptr), P(0), P(0)], stream)
            ctx.launch(self.fn["attn_decode_combine"], (nh, 1, 1), (d, 1, 1), splits * 4,
                       [P(self.part_acc.ptr), P(self.part_ml.ptr), I32(splits), I32(d),
                        P(self.attn_out.ptr), P(self.attn_bf16.ptr)], stream)
            self.gemv(L["o"], self.attn_bf16, self.o, H, nh * d, stream)
            g = norms.launch_geometry(1, H)
            ctx.launch(self.fn["residual_rmsnorm"], g.grid, g.block, 0,
                       [P(self.h.ptr), P(self.o.ptr), P(L["norms"][1].ptr),
                        P(self.one.ptr), P(L["norms"][2].ptr), P(self.y.ptr),
                        I32(H), F32(EPS)], stream)
            self.gemv(L["gate_up"], self.y, self.gu, 2 * inter, H, stream)
            g = gelu_mul.launch_geometry(1, inter)
            ctx.launch(self.fn["gelu_mul"], g.grid, g.block, 0,
                       [P(self.gu.ptr), P(self.y.ptr), I32(inter)], stream)
            self.gemv(L["down"], self.y, self.down, H, inter, stream)
            nxt = self.layers[i + 1]["norms"][0] if i + 1 < len(self.layers) else self.final_norm
            ctx.launch(self.fn["residual_rmsnorm"], g_norm(H).grid, g_norm(H).block, 0,
                       [P(self.h.ptr), P(self.down.ptr), P(L["norms"][3].ptr),
                        P(L["scalar"].ptr), P(nxt.ptr), P(self.y.ptr), I32(H), F32(EPS)],
                       stream)
        self.gemv(self.head, self.y, self.logits, cfg.vocab_size, H, stream)
        g = head.argmax_geometry(1, cfg.vocab_size)
        ctx.launch(self.fn["softcap_argmax"], g.grid, g.block, 0,
                   [P(self.logits.ptr), I32(cfg.vocab_size), F32(30.0), P(self.token.ptr)],
                   stream)


def g_norm(h: int):
    return norms.launch_geometry(1, h)


def time_ms(ctx, stream, run, reps: int = 20) -> float:
    for _ in range(3):
        run()
    ctx.synchronize()
    times = []
    for _ in range(reps):
        a, b = ctx.event(), ctx.event()
        ctx.record(a, stream)
        run()
        ctx.record(b, stream)
        times.append(ctx.elapsed_ms(a, b))
    return float(np.median(times))


def main() -> None:
    bench = Bench()
    ctx = bench.ctx
    nbytes = 4 << 30
    src, dst = bench.fill(nbytes), ctx.alloc(nbytes)
    stream = ctx.stream()
    copy_ms = time_ms(ctx, stream, lambda: ctx.copy_device(dst.ptr, src.ptr, nbytes, stream), 10)
    ctx.free(src)
    ctx.free(dst)
    bw = 2 * nbytes / (copy_ms * 1e-3)
    bench.build()
    eager_ms = time_ms(ctx, stream, lambda: bench.step(stream))
    graph = ctx.capture(stream, lambda: bench.step(stream))
    graph_ms = time_ms(ctx, stream, lambda: ctx.graph_launch(graph, stream))
    total = bench.weight_bytes + bench.kv_bytes
    roof_ms = total / bw * 1e3
    launches = 2 + 11 * len(bench.layers) + 2
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)")
    print(f"bytes per step: weights {bench.weight_bytes / 1e9:.2f} GB + KV "
          f"{bench.kv_bytes / 1e9:.2f} GB; roofline {roof_ms:.2f} ms = {1e3 / roof_ms:.1f} tok/s")
    print(f"{launches} launches per step")
    print(f"eager launches: {eager_ms:.2f} ms/step = {1e3 / eager_ms:.1f} tok/s")
    print(f"one CUDA graph: {graph_ms:.2f} ms/step = {1e3 / graph_ms:.1f} tok/s "
          f"({100 * roof_ms / graph_ms:.0f}% of roofline)")
    assert math.isfinite(graph_ms)


if __name__ == "__main__":
    main()
