// The decode GEMV loop of gemv_fp8.cu, gemv_bf16.cu and gemv_f32.cu, for M <= 4 rows of x:
//   y[m, n] = sum_k x[m, k] * W[n, k]   (times scale[n] for e4m3 weights)
// Bound by reading W once: a persistent grid of WARPS-warp blocks; each warp owns one row of W
// at a time and streams it with 16-byte loads, UNROLL of them in flight per lane; products
// accumulate in f32 (fmaf, k order within a lane) and the lanes' sums meet in a warp sum.
// A weight policy says what a 16-byte chunk holds and how it meets x:
//   Fp8Weights   16 e4m3 (hardware pair convert to f16, then f32), x bf16, rows scaled
//   Bf16Weights   8 bf16, x bf16
//   F32Weights    4 f32, x f32 read through the read-only cache (not staged)
// Contract: K a multiple of the chunk's weights, x and W rows 16-byte aligned.
#pragma once

#include "common.cuh"

namespace gemv {
constexpr int WARPS = 16;
constexpr int UNROLL = 4;

struct Fp8Weights {
    using Weight = uint8_t;
    using X = __nv_bfloat16;
    using Chunk = uint4;
    static constexpr int PER_CHUNK = 16;
    static constexpr bool SCALED = true;

    // acc[m] += chunk c of the row . x[m, 16c : 16c + 16]
    template <int M>
    static __device__ __forceinline__ void fma_chunk(const Chunk v, const X* __restrict__ x,
                                                     int K, int c, float (&acc)[M]) {
        float w[16];
        fp8x16_to_f32(v, w);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const __nv_bfloat162* xv =
                reinterpret_cast<const __nv_bfloat162*>(x + (size_t)m * K + 16 * c);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float2 xf = __bfloat1622float2(xv[j]);
                acc[m] = fmaf(w[2 * j], xf.x, acc[m]);
                acc[m] = fmaf(w[2 * j + 1], xf.y, acc[m]);
            }
        }
    }
};

struct Bf16Weights {
    using Weight = __nv_bfloat16;
    using X = __nv_bfloat16;
    using Chunk = uint4;
    static constexpr int PER_CHUNK = 8;
    static constexpr bool SCALED = false;

    template <int M>
    static __device__ __forceinline__ void fma_chunk(const Chunk v, const X* __restrict__ x,
                                                     int K, int c, float (&acc)[M]) {
        const __nv_bfloat162* wv = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const __nv_bfloat162* xv =
                reinterpret_cast<const __nv_bfloat162*>(x + (size_t)m * K + 8 * c);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 wf = __bfloat1622float2(wv[j]);
                const float2 xf = __bfloat1622float2(xv[j]);
                acc[m] = fmaf(wf.x, xf.x, acc[m]);
                acc[m] = fmaf(wf.y, xf.y, acc[m]);
            }
        }
    }
};

struct F32Weights {
    using Weight = float;
    using X = float;
    using Chunk = float4;
    static constexpr int PER_CHUNK = 4;
    static constexpr bool SCALED = false;

    template <int M>
    static __device__ __forceinline__ void fma_chunk(const Chunk v, const X* __restrict__ x,
                                                     int K, int c, float (&acc)[M]) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float4 xv = __ldg(reinterpret_cast<const float4*>(x + (size_t)m * K) + c);
            acc[m] = fmaf(v.x, xv.x, acc[m]);
            acc[m] = fmaf(v.y, xv.y, acc[m]);
            acc[m] = fmaf(v.z, xv.z, acc[m]);
            acc[m] = fmaf(v.w, xv.w, acc[m]);
        }
    }
};

template <typename Weights, int M>
__device__ __forceinline__ void rows(const typename Weights::Weight* __restrict__ W,
                                     const float* __restrict__ scale,
                                     const typename Weights::X* __restrict__ x,
                                     float* __restrict__ y, int N, int K) {
    using Chunk = typename Weights::Chunk;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int chunks = K / Weights::PER_CHUNK;  // 16-byte chunks per row
    for (int row = blockIdx.x * WARPS + warp; row < N; row += gridDim.x * WARPS) {
        const Chunk* wrow = reinterpret_cast<const Chunk*>(W + (size_t)row * K);
        float acc[M];
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = 0.f;
        for (int base = lane; base < chunks; base += 32 * UNROLL) {
            Chunk v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = base + 32 * u;
                v[u] = c < chunks ? __ldg(wrow + c) : Chunk{};
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = base + 32 * u;
                if (c >= chunks) break;
                Weights::fma_chunk(v[u], x, K, c, acc);
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float a = warp_sum(acc[m]);
            if constexpr (Weights::SCALED) {
                if (lane == 0) y[(size_t)m * N + row] = a * scale[row];
            } else {
                if (lane == 0) y[(size_t)m * N + row] = a;
            }
        }
    }
}

// y = x W^T (scaled) for M = 1..4 rows of x (x in shared memory for the bf16-x policies)
template <typename Weights>
__device__ __forceinline__ void gemv(const typename Weights::Weight* __restrict__ W,
                                     const float* __restrict__ scale,
                                     const typename Weights::X* __restrict__ x,
                                     float* __restrict__ y, int M, int N, int K) {
    switch (M) {
        case 1: rows<Weights, 1>(W, scale, x, y, N, K); break;
        case 2: rows<Weights, 2>(W, scale, x, y, N, K); break;
        case 3: rows<Weights, 3>(W, scale, x, y, N, K); break;
        case 4: rows<Weights, 4>(W, scale, x, y, N, K); break;
    }
}

// The M x K bf16 rows of x copied into dynamic shared memory (16-byte chunks), for every warp of
// the block to read; returns the copy.
__device__ __forceinline__ const __nv_bfloat16* stage_x(const __nv_bfloat16* __restrict__ x,
                                                        int M, int K) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    const uint4* src = reinterpret_cast<const uint4*>(x);
    uint4* dst = reinterpret_cast<uint4*>(xs);
    for (int i = threadIdx.x; i < M * K / 8; i += blockDim.x) dst[i] = src[i];
    __syncthreads();
    return xs;
}
}  // namespace gemv
