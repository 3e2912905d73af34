// y[m, n] = scale[n] * sum_k x[m, k] * W[n, k]   (W: FP8 e4m3 [N, K], x: bf16 [M, K], y: f32)
//
// Decode GEMV: bound by reading W once. A persistent grid of 512-thread blocks stages x in
// shared memory once per block; each warp owns one row at a time and streams it with 16-byte
// loads, UNROLL of them in flight per lane; e4m3 -> f16 uses the hardware pair convert and the
// products accumulate in f32 (the loop: gemv.cuh). Contract: K % 16 == 0, M <= 4, x and W rows
// 16-byte aligned.
#include "gemv.cuh"

extern "C" __global__ void __launch_bounds__(gemv::WARPS * 32, 4)
gemv_fp8_rowscale(const uint8_t* __restrict__ W, const float* __restrict__ scale,
                  const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int M, int N,
                  int K) {
    pdl_wait();
    pdl_launch_dependents();
    gemv::gemv<gemv::Fp8Weights>(W, scale, gemv::stage_x(x, M, K), y, M, N, K);
}
