// y[m, n] = scale[n] * sum_k x[m, k] * W[n, k]   (W: FP8 e4m3 [N, K], x: bf16 [M, K], y: f32)
//
// Decode GEMV: bound by reading W once. A persistent grid of 512-thread blocks stages x in
// shared memory once per block; each warp owns one row at a time and streams it with 16-byte
// loads, UNROLL of them in flight per lane; e4m3 -> f16 uses the hardware pair convert and the
// products accumulate in f32. Contract: K % 16 == 0, M <= 4, x and W rows 16-byte aligned.
#include "common.cuh"

namespace {
constexpr int WARPS = 16;
constexpr int UNROLL = 4;

template <int M>
__device__ __forceinline__ void gemv_rows(const uint8_t* __restrict__ W,
                                          const float* __restrict__ scale,
                                          const __nv_bfloat16* __restrict__ xs,
                                          float* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int chunks = K / 16;  // 16-byte chunks per row
    for (int row = blockIdx.x * WARPS + warp; row < N; row += gridDim.x * WARPS) {
        const uint4* wrow = reinterpret_cast<const uint4*>(W + (size_t)row * K);
        float acc[M];
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = 0.f;
        for (int base = lane; base < chunks; base += 32 * UNROLL) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = base + 32 * u;
                v[u] = c < chunks ? __ldg(wrow + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = base + 32 * u;
                if (c >= chunks) break;
                float w[16];
                fp8x16_to_f32(v[u], w);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const __nv_bfloat162* xv =
                        reinterpret_cast<const __nv_bfloat162*>(xs + (size_t)m * K + 16 * c);
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const float2 xf = __bfloat1622float2(xv[j]);
                        acc[m] = fmaf(w[2 * j], xf.x, acc[m]);
                        acc[m] = fmaf(w[2 * j + 1], xf.y, acc[m]);
                    }
                }
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float a = warp_sum(acc[m]);
            if (lane == 0) y[(size_t)m * N + row] = a * scale[row];
        }
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)
gemv_fp8_rowscale(const uint8_t* __restrict__ W, const float* __restrict__ scale,
                  const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int M, int N,
                  int K) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    const uint4* src = reinterpret_cast<const uint4*>(x);
    uint4* dst = reinterpret_cast<uint4*>(xs);
    for (int i = threadIdx.x; i < M * K / 8; i += blockDim.x) dst[i] = src[i];
    __syncthreads();
    switch (M) {
        case 1: gemv_rows<1>(W, scale, xs, y, N, K); break;
        case 2: gemv_rows<2>(W, scale, xs, y, N, K); break;
        case 3: gemv_rows<3>(W, scale, xs, y, N, K); break;
        case 4: gemv_rows<4>(W, scale, xs, y, N, K); break;
    }
}
