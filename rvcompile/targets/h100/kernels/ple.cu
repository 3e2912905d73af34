// Per-layer-input (PLE) kernels of E2B/E4B-style models, f32 math rounded step by step in the
// order of the IR references (no FMA contraction outside the dot products):
//
// to_bf16:       y[i] = bf16(x[i])                      (n % 4 == 0; bf16 copy of the embedding)
// ple_combine:   ple[m, l, :] = (rmsnorm(ctx[m, l*P:(l+1)*P] * ctx_scale) * w
//                               + table[ids[m], l*P:(l+1)*P] * tok_mult) * out_scale
//                one warp per (row, layer) group; the per-layer table row is gathered here.
// ple_project:   y[m, n] = scale[n] * sum_k bf16(gelu_tanh(gate[m, k]) * ple[m, layer, k]) * W[n, k]
//                W e4m3 [N, P]; CTA = WARPS warps and up to ROWS token rows, the gated vector in
//                shared memory, a warp per output row n reading W[n, :] once for those rows.
//                Contract: P % 4 == 0 (4-byte weight loads).
// ple_gelu_mul:  out[m, k] = bf16(gelu_tanh(gate[m, k]) * ple[m, layer, k]), the input of the
//                prefill GEMM that replaces ple_project for longer chunks.
// residual_rmsnorm_copy: h[m, :] = (h[m, :] + x[m, :] * r(x[m, :]) * w_post) * scalar[0]
//                y[m, :] = bf16(h[m, :])   (the un-normed copy the per-layer gate reads)
//                one CTA of NORM_THREADS per row, H % 4 == 0, H <= NORM_THREADS * 4 * NV.
// The float32 plan's entries: ple_combine_f32 (table f32) and ple_project_f32 (W f32 [N, P], no
// scale, the gated vector kept f32 in shared memory: nothing rounded); same arguments otherwise.
#include <type_traits>

#include "common.cuh"

namespace {
constexpr int WARPS = 8;
constexpr int ROWS = 4;
constexpr int NORM_THREADS = 512;
constexpr int NV = 4;

__device__ __forceinline__ float4 fp8x4_to_f32(uint32_t v) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(v & 0xFFFF, __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(v >> 16, __NV_E4M3);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    return make_float4(a.x, a.y, b.x, b.y);
}

__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ float to_f32(float v) { return v; }

// four weights of a row from chunk c: e4m3 bytes or f32
__device__ __forceinline__ float4 load_w4(const uint8_t* __restrict__ row, int c) {
    return fp8x4_to_f32(__ldg(reinterpret_cast<const uint32_t*>(row) + c));
}

__device__ __forceinline__ float4 load_w4(const float* __restrict__ row, int c) {
    return __ldg(reinterpret_cast<const float4*>(row) + c);
}

// y = vs @ W^T for R staged rows: W e4m3 [N, P] times scale, or W f32 [N, P] (no scale);
// vs bf16, or f32 with f32 weights
template <int R, typename WT, typename V>
__device__ __forceinline__ void project_rows(const WT* __restrict__ W,
                                             const float* __restrict__ scale,
                                             const V* __restrict__ vs,
                                             float* __restrict__ y, int m0, int N, int P) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = P / 4;
    for (int n = blockIdx.x * WARPS + warp; n < N; n += gridDim.x * WARPS) {
        const WT* wrow = W + (size_t)n * P;
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.f;
        for (int c = lane; c < chunks; c += 32) {
            const float4 w = load_w4(wrow, c);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const V* v = vs + r * P + 4 * c;
                acc[r] = fmaf(w.x, to_f32(v[0]), acc[r]);
                acc[r] = fmaf(w.y, to_f32(v[1]), acc[r]);
                acc[r] = fmaf(w.z, to_f32(v[2]), acc[r]);
                acc[r] = fmaf(w.w, to_f32(v[3]), acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float a = warp_sum(acc[r]);
            if constexpr (std::is_same<WT, float>::value) {
                if (lane == 0) y[(size_t)(m0 + r) * N + n] = a;
            } else {
                if (lane == 0) y[(size_t)(m0 + r) * N + n] = a * __ldg(scale + n);
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void combine_group(const float* __restrict__ ctx,
                                              const T* __restrict__ table,
                                              const int* __restrict__ ids,
                                              const float* __restrict__ w, float* __restrict__ ple,
                                              float ctx_scale, float tok_mult, float out_scale,
                                              float eps, int M, int L, int P) {
    const int lane = threadIdx.x & 31;
    const int group = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (group >= M * L) return;
    const int m = group / L, l = group % L;
    const size_t off = (size_t)m * L * P + (size_t)l * P;
    const float* c = ctx + off;
    float ss = 0.f;
    for (int k = lane; k < P; k += 32) {
        const float v = __fmul_rn(c[k], ctx_scale);
        ss = fmaf(v, v, ss);
    }
    const float r = 1.f / sqrtf(warp_sum(ss) / (float)P + eps);
    const T* tok = table + (size_t)__ldg(ids + m) * L * P + (size_t)l * P;
    for (int k = lane; k < P; k += 32) {
        const float v = __fmul_rn(__fmul_rn(__fmul_rn(c[k], ctx_scale), r), __ldg(w + k));
        const float t = __fmul_rn(to_f32(tok[k]), tok_mult);
        ple[off + k] = __fmul_rn(__fadd_rn(v, t), out_scale);
    }
}

// stage gelu_tanh(gate) * ple[:, layer] of rows m0 .. m0 + rows - 1 as V (bf16 or f32)
template <typename V>
__device__ __forceinline__ void stage_gated(const float* __restrict__ gate,
                                            const float* __restrict__ ple, int layer, int L,
                                            V* vs, int m0, int rows, int P) {
    for (int i = threadIdx.x; i < rows * P; i += blockDim.x) {
        const int r = i / P, k = i % P;
        const float g = gelu_tanh(__ldg(gate + (size_t)(m0 + r) * P + k));
        const float p = __ldg(ple + ((size_t)(m0 + r) * L + layer) * P + k);
        if constexpr (std::is_same<V, float>::value) {
            vs[i] = __fmul_rn(g, p);
        } else {
            vs[i] = __float2bfloat16_rn(__fmul_rn(g, p));
        }
    }
}

// The ROWS token rows of CTA blockIdx.y: their gated vectors staged as V in shared memory, then
// projected, a warp per output row (ple_project: V bf16, W e4m3 and scale; _f32: f32, f32, none)
template <typename V, typename WT>
__device__ __forceinline__ void project_block(const float* __restrict__ gate,
                                              const float* __restrict__ ple, int layer, int L,
                                              const WT* __restrict__ W,
                                              const float* __restrict__ scale,
                                              float* __restrict__ y, int M, int N, int P) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    V* vs = reinterpret_cast<V*>(smem_raw);
    const int m0 = blockIdx.y * ROWS;
    const int rows = min(ROWS, M - m0);
    stage_gated(gate, ple, layer, L, vs, m0, rows, P);
    __syncthreads();
    switch (rows) {
        case 1: project_rows<1>(W, scale, vs, y, m0, N, P); break;
        case 2: project_rows<2>(W, scale, vs, y, m0, N, P); break;
        case 3: project_rows<3>(W, scale, vs, y, m0, N, P); break;
        case 4: project_rows<4>(W, scale, vs, y, m0, N, P); break;
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256)
to_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, long long n) {
    pdl_wait();
    pdl_launch_dependents();
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i >= n) return;
    store_bf16x4(y + i, __ldg(reinterpret_cast<const float4*>(x + i)));
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
ple_combine(const float* __restrict__ ctx, const __nv_bfloat16* __restrict__ table,
            const int* __restrict__ ids, const float* __restrict__ w, float* __restrict__ ple,
            float ctx_scale, float tok_mult, float out_scale, float eps, int M, int L, int P) {
    pdl_wait();
    pdl_launch_dependents();
    combine_group(ctx, table, ids, w, ple, ctx_scale, tok_mult, out_scale, eps, M, L, P);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
ple_combine_f32(const float* __restrict__ ctx, const float* __restrict__ table,
                const int* __restrict__ ids, const float* __restrict__ w, float* __restrict__ ple,
                float ctx_scale, float tok_mult, float out_scale, float eps, int M, int L,
                int P) {
    pdl_wait();
    pdl_launch_dependents();
    combine_group(ctx, table, ids, w, ple, ctx_scale, tok_mult, out_scale, eps, M, L, P);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
ple_project(const float* __restrict__ gate, const float* __restrict__ ple, int layer, int L,
            const uint8_t* __restrict__ W, const float* __restrict__ scale,
            float* __restrict__ y, int M, int N, int P) {
    pdl_wait();
    pdl_launch_dependents();
    project_block<__nv_bfloat16>(gate, ple, layer, L, W, scale, y, M, N, P);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
ple_project_f32(const float* __restrict__ gate, const float* __restrict__ ple, int layer, int L,
                const float* __restrict__ W, float* __restrict__ y, int M, int N, int P) {
    pdl_wait();
    pdl_launch_dependents();
    project_block<float>(gate, ple, layer, L, W, nullptr, y, M, N, P);
}

extern "C" __global__ void __launch_bounds__(256)
ple_gelu_mul(const float* __restrict__ gate, const float* __restrict__ ple, int layer, int L,
             __nv_bfloat16* __restrict__ out, int M, int P) {
    pdl_wait();
    pdl_launch_dependents();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M * P) return;
    const int m = i / P, k = i % P;
    const float p = __ldg(ple + ((size_t)m * L + layer) * P + k);
    out[i] = __float2bfloat16_rn(__fmul_rn(gelu_tanh(__ldg(gate + i)), p));
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
residual_rmsnorm_copy(float* __restrict__ h, const float* __restrict__ x,
                      const float* __restrict__ w_post, const float* __restrict__ scalar,
                      __nv_bfloat16* __restrict__ y, int H, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ float red[32];
    const int n4 = H / 4;
    const size_t row = (size_t)blockIdx.x * H;
    float4* h4 = reinterpret_cast<float4*>(h + row);
    const float4* wp4 = reinterpret_cast<const float4*>(w_post);
    float4 v[NV];
    const float r = load_row_rms<NORM_THREADS, NV>(x + row, v, n4, H, eps, red);
    const float s = __ldg(scalar);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * NORM_THREADS;
        if (c < n4) {
            const float4 o = residual4(h4[c], v[i], r, __ldg(wp4 + c), s);
            h4[c] = o;
            store_bf16x4(y + row + 4 * c, o);
        }
    }
}
