// out[m, i] = bf16(gelu_tanh(gu[m, i]) * gu[m, I + i]) for the fused gate||up GEMV output
// gu f32 [M, 2I]; gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), rounded step
// by step in the order of ops.gelu_tanh (no FMA contraction). Each thread: 4 columns, two 16-byte
// loads, one 8-byte store. Grid (ceil(I/4 / THREADS), M). Contract: I % 4 == 0.
// gelu_mul_f32 (the float32 plan): the same product stored as float32, unrounded (16-byte store).
#include "common.cuh"

namespace {
constexpr int THREADS = 256;

// out[m, 4c : 4c + 4] = Out(gelu_tanh(g) * u) for the thread's 4 columns
template <typename Out>
__device__ __forceinline__ void gelu_mul_cols(const float* __restrict__ gu, Out* __restrict__ out,
                                              int I) {
    const int m = blockIdx.y;
    const int c = blockIdx.x * THREADS + threadIdx.x;
    if (c >= I / 4) return;
    const float* row = gu + (size_t)m * 2 * I;
    const float4 g = __ldg(reinterpret_cast<const float4*>(row) + c);
    const float4 u = __ldg(reinterpret_cast<const float4*>(row + I) + c);
    store4(out + (size_t)m * I + 4 * c,
           make_float4(__fmul_rn(gelu_tanh(g.x), u.x), __fmul_rn(gelu_tanh(g.y), u.y),
                       __fmul_rn(gelu_tanh(g.z), u.z), __fmul_rn(gelu_tanh(g.w), u.w)));
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
gelu_mul(const float* __restrict__ gu, __nv_bfloat16* __restrict__ out, int I) {
    pdl_wait();
    pdl_launch_dependents();
    gelu_mul_cols(gu, out, I);
}

extern "C" __global__ void __launch_bounds__(THREADS)
gelu_mul_f32(const float* __restrict__ gu, float* __restrict__ out, int I) {
    pdl_wait();
    pdl_launch_dependents();
    gelu_mul_cols(gu, out, I);
}
