// y[m, n] = sum_k x[m, k] * W[n, k]   (W: f32 [N, K], x: f32 [M, K], y: f32)
//
// The float32 plan's GEMV (h100-f32: no quantization), for every linear: the gemv_bf16.cu
// scheme with float32 weights and activations. A persistent grid of 512-thread blocks; each warp
// owns one output row at a time and streams it with 16-byte loads (4 weights), UNROLL in flight
// per lane, accumulating in f32 (fmaf). x is read through the read-only cache, not staged in
// shared memory, so any K fits. Contract: K % 4 == 0, 1 <= M <= 4, x and W rows 16-byte aligned.
#include <stdint.h>

namespace {
constexpr int WARPS = 16;
constexpr int UNROLL = 4;

template <int M>
__device__ __forceinline__ void gemv_rows(const float* __restrict__ W, const float* __restrict__ x,
                                          float* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int chunks = K / 4;  // 16-byte chunks per row
    for (int row = blockIdx.x * WARPS + warp; row < N; row += gridDim.x * WARPS) {
        const float4* wrow = reinterpret_cast<const float4*>(W + (size_t)row * K);
        float acc[M];
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = 0.f;
        for (int base = lane; base < chunks; base += 32 * UNROLL) {
            float4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = base + 32 * u;
                v[u] = c < chunks ? __ldg(wrow + c) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = base + 32 * u;
                if (c >= chunks) break;
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const float4 xv = __ldg(reinterpret_cast<const float4*>(x + (size_t)m * K) + c);
                    acc[m] = fmaf(v[u].x, xv.x, acc[m]);
                    acc[m] = fmaf(v[u].y, xv.y, acc[m]);
                    acc[m] = fmaf(v[u].z, xv.z, acc[m]);
                    acc[m] = fmaf(v[u].w, xv.w, acc[m]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float a = acc[m];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
            if (lane == 0) y[(size_t)m * N + row] = a;
        }
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)
gemv_f32(const float* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int M,
         int N, int K) {
    switch (M) {
        case 1: gemv_rows<1>(W, x, y, N, K); break;
        case 2: gemv_rows<2>(W, x, y, N, K); break;
        case 3: gemv_rows<3>(W, x, y, N, K); break;
        case 4: gemv_rows<4>(W, x, y, N, K); break;
    }
}
