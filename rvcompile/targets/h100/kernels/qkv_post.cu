// After the fused QKV GEMV: per-head q/k norms, RoPE, and the paged KV-cache write, one launch.
//
// qkv f32 [M, ld]: row m holds nh q heads, then kh k heads, then (unless k_eq_v) kh v heads,
// each d wide (ld >= (nh + 2 kh) d, or (nh + kh) d for K=V layers).
// CTA (x, m): x < nh is q head x, x >= nh is KV head j = x - nh. With r(v) = 1/sqrt(mean(v^2)+eps):
//   q_out[m, x, :]               = bf16(rope(q * r(q) * wq, pos))
//   k_pool[slot(m, pos), j, :]   = bf16(rope(k * r(k) * wk, pos))
//   v_pool[slot(m, pos), j, :]   = bf16(v * r(v))        v = k (the raw k part) when k_eq_v
// RoPE is half-split: dim i pairs with i + d/2 at angle pos * inv_freq[i] (f32 product), so
//   out[i] = x[i] cos - x[i + d/2] sin,  out[i + d/2] = x[i + d/2] cos + x[i] sin.
// slot(m, pos) = (table[m, (pos / 16) % ring], pos % 16) in pools [blocks, 16, kh, d] (the
// layout of attn_decode.cu). pos = positions[m]; pos < 0 skips the cache writes (idle row).
// Launch grid (nh, M) for KV-shared layers: then only q is written.
// The _fp8 entries keep e4m3 pools: each K/V value is rounded once, from f32, to the nearest
// e4m3 (saturating at +-448) instead of to bf16; q_out stays bf16.
// The _f32 entries (the float32 plan) keep q_out and the pools float32: nothing is rounded.
//
// Thread t owns dims 4t..4t+3 and their RoPE partners d/2 + 4t.. as float4 pairs, so d / 8
// threads cover a head. Two entries with the same arguments:
//   qkv_post        d % 256 == 0 (256 and 512 in Gemma 4): CTAs of d / 8 threads;
//   qkv_post_small  d in {32, 64, 128} (the tiny test models): CTAs of one full warp, lanes
//                   t >= d / 8 idle (they add zeros to the sums and write nothing).
// Elementwise steps are rounded one by one (no FMA contraction), matching ops.ref_rmsnorm and
// ops.ref_rope.
#include "common.cuh"

namespace {
constexpr int BS = 16;

__device__ __forceinline__ float2 warp_sum2(float2 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
        v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
    }
    return v;
}

__device__ __forceinline__ float2 block_sum2(float2 v, float2* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum2(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? red[lane] : make_float2(0.f, 0.f);
    return warp_sum2(v);
}

// four values to e4m3 (round to nearest even, saturating), one 4-byte store
__device__ __forceinline__ void store_fp8x4(unsigned char* p, const float o[4]) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(o[0], o[1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(o[2], o[3]), __NV_SATFINITE, __NV_E4M3);
    *reinterpret_cast<uint32_t*>(p) = lo | (hi << 16);
}

// four values to q_out or a pool, by element type: bf16, e4m3 bytes (FP8) or f32
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float o[4]) { store_bf16x4(p, o); }

__device__ __forceinline__ void store4(unsigned char* p, const float o[4]) { store_fp8x4(p, o); }

__device__ __forceinline__ void store4(float* p, const float o[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(o[0], o[1], o[2], o[3]);
}

__device__ __forceinline__ void to4(const float4 v, float o[4]) {
    o[0] = v.x;
    o[1] = v.y;
    o[2] = v.z;
    o[3] = v.w;
}

__device__ __forceinline__ float sq4(const float a[4]) {
    return a[0] * a[0] + a[1] * a[1] + a[2] * a[2] + a[3] * a[3];
}

// normalise (x * r * w), rotate, and store both halves as Out (bf16, e4m3 bytes or f32)
template <typename Out>
__device__ __forceinline__ void norm_rope_store(const float lo[4], const float hi[4], float r,
                                                const float* __restrict__ w, int t, int half,
                                                const float c[4], const float s[4], Out* dst) {
    float wl[4], wh[4], ol[4], oh[4];
    to4(__ldg(reinterpret_cast<const float4*>(w) + t), wl);
    to4(__ldg(reinterpret_cast<const float4*>(w + half) + t), wh);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float a = __fmul_rn(__fmul_rn(lo[i], r), wl[i]);
        const float b = __fmul_rn(__fmul_rn(hi[i], r), wh[i]);
        ol[i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
        oh[i] = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
    }
    store4(dst + 4 * t, ol);
    store4(dst + half + 4 * t, oh);
}

// The whole kernel; PADDED: the CTA is one warp and lanes t >= d / 8 only join the sums.
// Q: q_out's element type (bf16 or f32); KV: the pools' (bf16, e4m3 bytes or f32).
template <bool PADDED, typename Q, typename KV>
__device__ __forceinline__ void qkv_post_head(
    const float* __restrict__ qkv, int ld, int nh, int kh, int d, int k_eq_v,
    const float* __restrict__ wq, const float* __restrict__ wk, const int* __restrict__ positions,
    const float* __restrict__ inv_freq, float eps, Q* __restrict__ q_out,
    KV* __restrict__ k_pool, KV* __restrict__ v_pool, const int* __restrict__ table,
    int max_blocks, int ring) {
    __shared__ float2 red[32];
    const int x = blockIdx.x, m = blockIdx.y, t = threadIdx.x, half = d / 2;
    const bool live = !PADDED || t < d / 8;
    const bool is_q = x < nh;
    const int j = x - nh;
    const int pos = positions[m];
    const float* row = qkv + (size_t)m * ld;
    const float* src = row + (size_t)x * d;  // q head x, or k head j at (nh + j) * d
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    float lo[4], hi[4], vlo[4], vhi[4], c[4], s[4];
    to4(live ? *(reinterpret_cast<const float4*>(src) + t) : zero, lo);
    to4(live ? *(reinterpret_cast<const float4*>(src + half) + t) : zero, hi);
    if (live && !is_q && !k_eq_v) {
        const float* vsrc = row + (size_t)(nh + kh + j) * d;
        to4(*(reinterpret_cast<const float4*>(vsrc) + t), vlo);
        to4(*(reinterpret_cast<const float4*>(vsrc + half) + t), vhi);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            vlo[i] = lo[i];
            vhi[i] = hi[i];
        }
    }
    if (live) {
        float f[4];
        to4(__ldg(reinterpret_cast<const float4*>(inv_freq) + t), f);
#pragma unroll
        for (int i = 0; i < 4; ++i) sincosf(__fmul_rn((float)pos, f[i]), &s[i], &c[i]);
    }
    const float2 ss = block_sum2(make_float2(sq4(lo) + sq4(hi), sq4(vlo) + sq4(vhi)), red);
    if (!live) return;
    const float r = 1.f / sqrtf(ss.x / (float)d + eps);
    if (is_q) {
        norm_rope_store(lo, hi, r, wq, t, half, c, s, q_out + ((size_t)m * nh + x) * d);
        return;
    }
    if (pos < 0) return;
    const int block = table[(size_t)m * max_blocks + (pos / BS) % ring];
    const size_t off = (((size_t)block * BS + pos % BS) * kh + j) * d;
    const float rv = 1.f / sqrtf(ss.y / (float)d + eps);
    float ol[4], oh[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        ol[i] = __fmul_rn(vlo[i], rv);
        oh[i] = __fmul_rn(vhi[i], rv);
    }
    if (v_pool == nullptr) {  // K=V stored once: the normalised base (= V); K is derived on read
        store4(k_pool + off + 4 * t, ol);
        store4(k_pool + off + half + 4 * t, oh);
        return;
    }
    norm_rope_store(lo, hi, r, wk, t, half, c, s, k_pool + off);
    store4(v_pool + off + 4 * t, ol);
    store4(v_pool + off + half + 4 * t, oh);
}
}  // namespace

#define QKV_POST_ENTRY(NAME, THREADS, PADDED, Q, KV)                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                 \
        const float* __restrict__ qkv, int ld, int nh, int kh, int d, int k_eq_v,              \
        const float* __restrict__ wq, const float* __restrict__ wk,                            \
        const int* __restrict__ positions, const float* __restrict__ inv_freq, float eps,      \
        Q* __restrict__ q_out, KV* __restrict__ k_pool, KV* __restrict__ v_pool,               \
        const int* __restrict__ table, int max_blocks, int ring) {                             \
        pdl_wait();                                                                            \
        pdl_launch_dependents();                                                               \
        qkv_post_head<PADDED>(qkv, ld, nh, kh, d, k_eq_v, wq, wk, positions, inv_freq, eps,     \
                              q_out, k_pool, v_pool, table, max_blocks, ring);                 \
    }
QKV_POST_ENTRY(qkv_post, 64, false, __nv_bfloat16, __nv_bfloat16)
QKV_POST_ENTRY(qkv_post_small, 32, true, __nv_bfloat16, __nv_bfloat16)
QKV_POST_ENTRY(qkv_post_fp8, 64, false, __nv_bfloat16, unsigned char)
QKV_POST_ENTRY(qkv_post_small_fp8, 32, true, __nv_bfloat16, unsigned char)
QKV_POST_ENTRY(qkv_post_f32, 64, false, float, float)
QKV_POST_ENTRY(qkv_post_small_f32, 32, true, float, float)
