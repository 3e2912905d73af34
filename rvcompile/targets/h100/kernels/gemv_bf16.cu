// y[m, n] = sum_k x[m, k] * W[n, k]   (W: bf16 [N, K], x: bf16 [M, K], y: f32)
//
// The head GEMV over the tied bf16 embedding table: bound by reading W once. Same scheme as
// gemv_fp8.cu (the loop: gemv.cuh): a persistent grid of 512-thread blocks stages x in shared
// memory; each warp owns one row at a time and streams it with 16-byte loads (8 weights), UNROLL
// in flight per lane, accumulating in f32. Contract: K % 8 == 0, M <= 4, x and W rows 16-byte
// aligned.
#include "gemv.cuh"

extern "C" __global__ void __launch_bounds__(gemv::WARPS * 32, 4)
gemv_bf16(const __nv_bfloat16* __restrict__ W, const __nv_bfloat16* __restrict__ x,
          float* __restrict__ y, int M, int N, int K) {
    pdl_wait();
    pdl_launch_dependents();
    gemv::gemv<gemv::Bf16Weights>(W, nullptr, gemv::stage_x(x, M, K), y, M, N, K);
}
