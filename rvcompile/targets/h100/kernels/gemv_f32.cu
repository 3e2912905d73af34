// y[m, n] = sum_k x[m, k] * W[n, k]   (W: f32 [N, K], x: f32 [M, K], y: f32)
//
// The float32 plan's GEMV (h100-f32: no quantization), for every linear: the gemv_bf16.cu
// scheme with float32 weights and activations (the loop: gemv.cuh). A persistent grid of
// 512-thread blocks; each warp owns one output row at a time and streams it with 16-byte loads
// (4 weights), UNROLL in flight per lane, accumulating in f32 (fmaf). x is read through the
// read-only cache, not staged in shared memory, so any K fits. Contract: K % 4 == 0,
// 1 <= M <= 4, x and W rows 16-byte aligned.
#include "gemv.cuh"

extern "C" __global__ void __launch_bounds__(gemv::WARPS * 32, 4)
gemv_f32(const float* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int M,
         int N, int K) {
    pdl_wait();
    pdl_launch_dependents();
    gemv::gemv<gemv::F32Weights>(W, nullptr, x, y, M, N, K);
}
