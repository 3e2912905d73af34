// y[m, n] = sum_k x[m, k] * W[n, k]   (W: bf16 [N, K], x: bf16 [M, K], y: f32)
//
// The head GEMV over the tied bf16 embedding table: bound by reading W once. Same scheme as
// gemv_fp8.cu: a persistent grid of 512-thread blocks stages x in shared memory; each warp owns
// one row at a time and streams it with 16-byte loads (8 weights), UNROLL in flight per lane,
// accumulating in f32. Contract: K % 8 == 0, M <= 4, x and W rows 16-byte aligned.
#include <cuda_bf16.h>
#include <stdint.h>

namespace {
constexpr int WARPS = 16;
constexpr int UNROLL = 4;

template <int M>
__device__ __forceinline__ void gemv_rows(const __nv_bfloat16* __restrict__ W,
                                          const __nv_bfloat16* __restrict__ xs,
                                          float* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int chunks = K / 8;  // 16-byte chunks per row
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
                const __nv_bfloat162* wv = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const __nv_bfloat162* xv =
                        reinterpret_cast<const __nv_bfloat162*>(xs + (size_t)m * K + 8 * c);
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float2 wf = __bfloat1622float2(wv[j]);
                        const float2 xf = __bfloat1622float2(xv[j]);
                        acc[m] = fmaf(wf.x, xf.x, acc[m]);
                        acc[m] = fmaf(wf.y, xf.y, acc[m]);
                    }
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
gemv_bf16(const __nv_bfloat16* __restrict__ W, const __nv_bfloat16* __restrict__ x,
          float* __restrict__ y, int M, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    const uint4* src = reinterpret_cast<const uint4*>(x);
    uint4* dst = reinterpret_cast<uint4*>(xs);
    for (int i = threadIdx.x; i < M * K / 8; i += blockDim.x) dst[i] = src[i];
    __syncthreads();
    switch (M) {
        case 1: gemv_rows<1>(W, xs, y, N, K); break;
        case 2: gemv_rows<2>(W, xs, y, N, K); break;
        case 3: gemv_rows<3>(W, xs, y, N, K); break;
        case 4: gemv_rows<4>(W, xs, y, N, K); break;
    }
}
