// The ends of the decode step.
//
// softcap_argmax: out[m] = argmax_v cap * tanh(logits[m, v] / cap) (f32, IEEE division, tanhf),
// ties to the lowest index like numpy.argmax; NaN logits are never picked (inputs are finite).
// One CTA of THREADS per row: each thread scans its float4 chunks in increasing index order
// (UNROLL loads in flight), then a (value, index) block reduction. Contract: V % 4 == 0.
//
// embed_rows_bf16: h[m, :] = f32(table[ids[m], :]) * mult          table bf16 [V, H], H % 8 == 0
// embed_rows_fp8:  h[m, :] = (f32(table[ids[m], :]) * row_scale[ids[m]]) * mult
//                  table e4m3 (uint8) [V, H], H % 16 == 0
// embed_rows_f32:  h[m, :] = table[ids[m], :] * mult               table f32 [V, H], H % 4 == 0
//                  (the float32 plan)
// (ops.ref_embed, same f32 steps.) Grid (ceil(chunks / EMBED_THREADS), M), one 16-byte table
// load per thread.
#include "common.cuh"

namespace {
constexpr int THREADS = 1024;
constexpr int UNROLL = 4;
constexpr int EMBED_THREADS = 128;

__device__ __forceinline__ void take(float v, int i, float& best, int& bi) {
    if (v > best || (v == best && i < bi)) {
        best = v;
        bi = i;
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
softcap_argmax(const float* __restrict__ logits, int V, float cap, int* __restrict__ out) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    const float4* row = reinterpret_cast<const float4*>(logits + (size_t)blockIdx.x * V);
    const int n4 = V / 4;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int base = threadIdx.x; base < n4; base += THREADS * UNROLL) {
        float4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = base + u * THREADS;
            if (c < n4) v[u] = __ldg(row + c);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = base + u * THREADS;
            if (c < n4) {  // indices increase along the scan: strict > keeps the first
                const float e[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float s = cap * tanhf(e[k] / cap);
                    if (s > best) {
                        best = s;
                        bi = 4 * c + k;
                    }
                }
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        take(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o), best,
             bi);
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = bi;
    }
    __syncthreads();
    if (warp != 0) return;
    const int nw = blockDim.x >> 5;
    best = lane < nw ? s_val[lane] : -INFINITY;
    bi = lane < nw ? s_idx[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        take(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o), best,
             bi);
    if (lane == 0) out[blockIdx.x] = bi;
}

extern "C" __global__ void __launch_bounds__(EMBED_THREADS)
embed_rows_bf16(const __nv_bfloat16* __restrict__ table, const int* __restrict__ ids, float mult,
                float* __restrict__ h, int H) {
    pdl_wait();
    pdl_launch_dependents();
    const int m = blockIdx.y;
    const int c = blockIdx.x * EMBED_THREADS + threadIdx.x;
    if (c >= H / 8) return;
    const size_t id = (size_t)ids[m];
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(table + id * H) + c);
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
    float4* dst = reinterpret_cast<float4*>(h + (size_t)m * H) + 2 * c;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const float2 a = __bfloat1622float2(p[2 * k]), b = __bfloat1622float2(p[2 * k + 1]);
        dst[k] = make_float4(a.x * mult, a.y * mult, b.x * mult, b.y * mult);
    }
}

extern "C" __global__ void __launch_bounds__(EMBED_THREADS)
embed_rows_fp8(const uint8_t* __restrict__ table, const float* __restrict__ row_scale,
               const int* __restrict__ ids, float mult, float* __restrict__ h, int H) {
    pdl_wait();
    pdl_launch_dependents();
    const int m = blockIdx.y;
    const int c = blockIdx.x * EMBED_THREADS + threadIdx.x;
    if (c >= H / 16) return;
    const size_t id = (size_t)ids[m];
    const float s = __ldg(row_scale + id);
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(table + id * H) + c);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    float4* dst = reinterpret_cast<float4*>(h + (size_t)m * H) + 4 * c;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        float f[4];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const __nv_fp8x2_storage_t pair = (words[w] >> (16 * k)) & 0xFFFF;
            const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
            const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&hr));
            f[2 * k] = __fmul_rn(__fmul_rn(v.x, s), mult);
            f[2 * k + 1] = __fmul_rn(__fmul_rn(v.y, s), mult);
        }
        dst[w] = make_float4(f[0], f[1], f[2], f[3]);
    }
}

extern "C" __global__ void __launch_bounds__(EMBED_THREADS)
embed_rows_f32(const float* __restrict__ table, const int* __restrict__ ids, float mult,
               float* __restrict__ h, int H) {
    pdl_wait();
    pdl_launch_dependents();
    const int m = blockIdx.y;
    const int c = blockIdx.x * EMBED_THREADS + threadIdx.x;
    if (c >= H / 4) return;
    const size_t id = (size_t)ids[m];
    const float4 v = __ldg(reinterpret_cast<const float4*>(table + id * H) + c);
    reinterpret_cast<float4*>(h + (size_t)m * H)[c] =
        make_float4(__fmul_rn(v.x, mult), __fmul_rn(v.y, mult), __fmul_rn(v.z, mult),
                    __fmul_rn(v.w, mult));
}
