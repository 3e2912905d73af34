// RMSNorm kernels, one CTA of THREADS threads per row, any number of rows.
//
// rmsnorm_bf16:      y[m, :] = bf16(x[m, :] * r(x[m, :]) * w)
// residual_rmsnorm:  h[m, :] = (h[m, :] + x[m, :] * r(x[m, :]) * w_post) * scalar[0]   (in place)
//                    y[m, :] = bf16(h[m, :] * r(h[m, :]) * w_next)                      (new h)
// with r(v) = 1 / sqrt(sum(v^2) / H + eps). The _f32 entries (rmsnorm_f32, residual_rmsnorm_f32,
// the float32 plan) write y as float32, unrounded; otherwise the same code. All math in f32,
// step for step in the order of the IR references (ops.ref_rmsnorm, ops.ref_residual_rmsnorm:
// x * r, then * w, then + h, then * s; no FMA contraction in the elementwise steps); only the
// sum of squares is ordered differently.
// The _q entries (rmsnorm_bf16_q, residual_rmsnorm_q) also write y's per-row e4m3 quantization
// q [M, H] and q_scale [M] for the FP8 tensor-core GEMM reading y (common.cuh: what
// quant_fp8_rows_bf16 would make of y, bit for bit), saving that launch.
// Contract: H % 4 == 0, H <= THREADS * 4 * NV = 8192, rows 16-byte aligned; the row stays in
// registers (NV float4 per thread), so x and h are each read once.
#include "common.cuh"

namespace {
constexpr int THREADS = 512;
constexpr int NV = 4;

// v * r * w, rounded per step like numpy
__device__ __forceinline__ float4 scale_w(const float4 v, float r, const float4 w) {
    return mul4(mul4(v, r), w);
}

// y row = Out(v * r * w) from the NV float4 held by this thread (Out: bf16, or f32 unrounded)
template <typename Out>
__device__ __forceinline__ void write_normed(const float4 v[NV], float r,
                                             const float4* __restrict__ w4,
                                             Out* __restrict__ yrow, int n4) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * THREADS;
        if (c < n4) store4(yrow + 4 * c, scale_w(v[i], r, __ldg(w4 + c)));
    }
}

// write_normed's bf16 row, and its per-row e4m3 quantization for the FP8 GEMM reading it
// (common.cuh, quant_fp8_rows.cu's bit for bit): q [H] e4m3, *q_scale
__device__ __forceinline__ void write_normed_q(const float4 v[NV], float r,
                                               const float4* __restrict__ w4,
                                               __nv_bfloat16* __restrict__ yrow,
                                               uint8_t* __restrict__ qrow,
                                               float* __restrict__ q_scale, int n4, float* red) {
    float4 b[NV];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * THREADS;
        b[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < n4) {
            const float4 y = scale_w(v[i], r, __ldg(w4 + c));
            store4(yrow + 4 * c, y);
            b[i] = round_bf16x4(y);
            amax = fmaxf(amax, max_abs4(b[i]));
        }
    }
    const float inv = row_quant_inv(block_max(amax, red), q_scale);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * THREADS;
        if (c < n4) reinterpret_cast<uint32_t*>(qrow)[c] = to_e4m3x4(b[i], inv);
    }
}

// The row's output: y, and with q (the _q entries, y bf16) its e4m3 quantization
__device__ __forceinline__ void write_row(const float4 v[NV], float r,
                                          const float* __restrict__ w, float* __restrict__ y,
                                          uint8_t* __restrict__, float* __restrict__, int H,
                                          float*) {
    write_normed(v, r, reinterpret_cast<const float4*>(w), y + (size_t)blockIdx.x * H, H / 4);
}

__device__ __forceinline__ void write_row(const float4 v[NV], float r,
                                          const float* __restrict__ w,
                                          __nv_bfloat16* __restrict__ y, uint8_t* __restrict__ q,
                                          float* __restrict__ q_scale, int H, float* red) {
    const float4* w4 = reinterpret_cast<const float4*>(w);
    const size_t row = (size_t)blockIdx.x * H;
    if (q) {
        write_normed_q(v, r, w4, y + row, q + row, q_scale + blockIdx.x, H / 4, red);
    } else {
        write_normed(v, r, w4, y + row, H / 4);
    }
}

template <typename Out>
__device__ __forceinline__ void rmsnorm_row(const float* __restrict__ x,
                                            const float* __restrict__ w, Out* __restrict__ y,
                                            uint8_t* __restrict__ q, float* __restrict__ q_scale,
                                            int H, float eps) {
    __shared__ float red[32];
    float4 v[NV];
    const float r = load_row_rms<THREADS, NV>(x + (size_t)blockIdx.x * H, v, H / 4, H, eps, red);
    write_row(v, r, w, y, q, q_scale, H, red);
}

template <typename Out>
__device__ __forceinline__ void residual_row(float* __restrict__ h, const float* __restrict__ x,
                                             const float* __restrict__ w_post,
                                             const float* __restrict__ scalar,
                                             const float* __restrict__ w_next,
                                             Out* __restrict__ y, uint8_t* __restrict__ q,
                                             float* __restrict__ q_scale, int H, float eps) {
    __shared__ float red[32];
    const int n4 = H / 4;
    const size_t row = (size_t)blockIdx.x * H;
    const float4* x4 = reinterpret_cast<const float4*>(x + row);
    float4* h4 = reinterpret_cast<float4*>(h + row);
    const float4* wp4 = reinterpret_cast<const float4*>(w_post);
    float4 v[NV], hv[NV];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * THREADS;
        const bool ok = c < n4;
        v[i] = ok ? x4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        hv[i] = ok ? h4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        ss += sq4(v[i]);
    }
    const float rx = inv_rms(block_sum(ss, red), H, eps);
    const float s = __ldg(scalar);
    ss = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * THREADS;
        if (c < n4) {
            const float4 o = residual4(hv[i], v[i], rx, __ldg(wp4 + c), s);
            h4[c] = o;
            hv[i] = o;
        }
        ss += sq4(hv[i]);  // zeros beyond the row
    }
    const float rh = inv_rms(block_sum(ss, red), H, eps);
    write_row(hv, rh, w_next, y, q, q_scale, H, red);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
rmsnorm_bf16(const float* __restrict__ x, const float* __restrict__ w,
             __nv_bfloat16* __restrict__ y, int H, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    rmsnorm_row(x, w, y, nullptr, nullptr, H, eps);
}

extern "C" __global__ void __launch_bounds__(THREADS)
rmsnorm_bf16_q(const float* __restrict__ x, const float* __restrict__ w,
               __nv_bfloat16* __restrict__ y, uint8_t* __restrict__ q,
               float* __restrict__ q_scale, int H, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    rmsnorm_row(x, w, y, q, q_scale, H, eps);
}

extern "C" __global__ void __launch_bounds__(THREADS)
rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
            int H, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    rmsnorm_row(x, w, y, nullptr, nullptr, H, eps);
}

extern "C" __global__ void __launch_bounds__(THREADS)
residual_rmsnorm(float* __restrict__ h, const float* __restrict__ x,
                 const float* __restrict__ w_post, const float* __restrict__ scalar,
                 const float* __restrict__ w_next, __nv_bfloat16* __restrict__ y, int H,
                 float eps) {
    pdl_wait();
    pdl_launch_dependents();
    residual_row(h, x, w_post, scalar, w_next, y, nullptr, nullptr, H, eps);
}

extern "C" __global__ void __launch_bounds__(THREADS)
residual_rmsnorm_q(float* __restrict__ h, const float* __restrict__ x,
                   const float* __restrict__ w_post, const float* __restrict__ scalar,
                   const float* __restrict__ w_next, __nv_bfloat16* __restrict__ y,
                   uint8_t* __restrict__ q, float* __restrict__ q_scale, int H, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    residual_row(h, x, w_post, scalar, w_next, y, q, q_scale, H, eps);
}

extern "C" __global__ void __launch_bounds__(THREADS)
residual_rmsnorm_f32(float* __restrict__ h, const float* __restrict__ x,
                     const float* __restrict__ w_post, const float* __restrict__ scalar,
                     const float* __restrict__ w_next, float* __restrict__ y, int H, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    residual_row(h, x, w_post, scalar, w_next, y, nullptr, nullptr, H, eps);
}
