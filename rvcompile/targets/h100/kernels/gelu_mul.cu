// out[m, i] = bf16(gelu_tanh(gu[m, i]) * gu[m, I + i]) for the fused gate||up GEMV output
// gu f32 [M, 2I]; gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), rounded step
// by step in the order of ops.gelu_tanh (no FMA contraction). Each thread: 4 columns, two 16-byte
// loads, one 8-byte store. Grid (ceil(I/4 / THREADS), M). Contract: I % 4 == 0.
// gelu_mul_f32 (the float32 plan): the same product stored as float32, unrounded (16-byte store).
// gelu_mul_q: the bf16 product and its per-row e4m3 quantization q [M, I], q_scale [M] for the
// FP8 tensor-core GEMM reading it (common.cuh: what quant_fp8_rows_bf16 would make of out, bit
// for bit, saving that launch); one CTA of Q_THREADS per row, the row in registers. Contract:
// I % 4 == 0, I <= Q_THREADS * 4 * Q_NV = 32768.
#include "common.cuh"

namespace {
constexpr int THREADS = 256;
constexpr int Q_THREADS = 1024, Q_NV = 8;

__device__ __forceinline__ float4 gelu_mul4(const float4 g, const float4 u) {
    return make_float4(__fmul_rn(gelu_tanh(g.x), u.x), __fmul_rn(gelu_tanh(g.y), u.y),
                       __fmul_rn(gelu_tanh(g.z), u.z), __fmul_rn(gelu_tanh(g.w), u.w));
}

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
    store4(out + (size_t)m * I + 4 * c, gelu_mul4(g, u));
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

extern "C" __global__ void __launch_bounds__(Q_THREADS)
gelu_mul_q(const float* __restrict__ gu, __nv_bfloat16* __restrict__ out, uint8_t* __restrict__ q,
           float* __restrict__ q_scale, int I) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ float red[32];
    const int m = blockIdx.x, n4 = I / 4;
    const float4* g4 = reinterpret_cast<const float4*>(gu + (size_t)m * 2 * I);
    const float4* u4 = reinterpret_cast<const float4*>(gu + (size_t)m * 2 * I + I);
    float4 b[Q_NV];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < Q_NV; ++i) {
        const int c = threadIdx.x + i * Q_THREADS;
        b[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < n4) {
            const float4 y = gelu_mul4(__ldg(g4 + c), __ldg(u4 + c));
            store4(out + (size_t)m * I + 4 * c, y);
            b[i] = round_bf16x4(y);
            amax = fmaxf(amax, max_abs4(b[i]));
        }
    }
    const float inv = row_quant_inv(block_max(amax, red), q_scale + m);
    uint32_t* qrow = reinterpret_cast<uint32_t*>(q + (size_t)m * I);
#pragma unroll
    for (int i = 0; i < Q_NV; ++i) {
        const int c = threadIdx.x + i * Q_THREADS;
        if (c < n4) qrow[c] = to_e4m3x4(b[i], inv);
    }
}
