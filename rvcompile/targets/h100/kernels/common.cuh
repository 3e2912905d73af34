// Device helpers shared by the h100 kernel modules: the programmatic-dependent-launch pair every
// entry begins with, warp sums and maxima, the CTA sum, the RMSNorm row load and residual update,
// gelu_tanh rounded like ops.gelu_tanh, e4m3 widening, bf16x4 and float4 stores, the mma /
// shared-memory wrappers of the tensor-core kernels.
// Everything is static and force-inlined: each module compiles only what it calls and no symbol
// crosses modules. Elementwise helpers round step by step (__fmul_rn / __fadd_rn: no FMA
// contraction), as the numpy references do.
// nvcc.py keys every cubin on every *.cuh, so an edit here rebuilds all modules.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// ---------------------------------------------------------------- programmatic dependent launch

// The runtime launches every kernel with programmatic stream serialization (cuda_driver.py), so a
// kernel's CTAs may start while the kernel before it in the stream is still running. Every entry
// begins with pdl_wait(); pdl_launch_dependents();: the wait blocks until the previous kernel
// has completed and its writes are visible (and, since that kernel waited too, every earlier
// one), so nothing before it may read or write global memory; the trigger lets the next kernel's
// CTAs be scheduled now, to wait on this one. Neither instruction does anything in a kernel
// launched without the attribute.
static __device__ __forceinline__ void pdl_wait() {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

static __device__ __forceinline__ void pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// ---------------------------------------------------------------- reductions

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the CTA; every thread gets the total. red: 32 floats of shared memory.
static __device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.f;
    v = warp_sum(v);
    __syncthreads();  // red may be reused
    return v;
}

// Maximum over the CTA; every thread gets it. red: 32 floats of shared memory.
static __device__ __forceinline__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? red[lane] : -INFINITY;
    v = warp_max(v);
    __syncthreads();  // red may be reused
    return v;
}

// ---------------------------------------------------------------- per-row FP8 quantization

// The FP8 tensor-core GEMM's activations: a row x quantized as scale = amax / 448, q =
// e4m3_rn_satfinite(x * (448 / amax)) (q = 0 and scale = 0 where amax = 0), each division and
// the multiply rounded to nearest in float32 (gemm_tc.quantize_rows_reference, bit for bit).
// quant_fp8_rows.cu does it as a launch of its own; norms.cu and gelu_mul.cu's _q entries in
// the epilogue of the kernel writing the row.
constexpr float E4M3_MAX = 448.f;

// a * inv and b * inv (float32, rounded) -> two e4m3 bytes (low byte = a), round to nearest
// even, saturating to +-448.
static __device__ __forceinline__ uint32_t to_e4m3x2(float a, float b, float inv) {
    const float2 v = make_float2(__fmul_rn(a, inv), __fmul_rn(b, inv));
    return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3));
}

// 4 values -> 4 e4m3 bytes in one word (first value in the low byte)
static __device__ __forceinline__ uint32_t to_e4m3x4(const float4 v, float inv) {
    return to_e4m3x2(v.x, v.y, inv) | to_e4m3x2(v.z, v.w, inv) << 16;
}

// The multiplier 448 / amax of a row whose largest magnitude is amax (0 for an all-zero row);
// thread 0 writes the row's scale.
static __device__ __forceinline__ float row_quant_inv(float amax, float* __restrict__ scale) {
    if (threadIdx.x == 0) *scale = __fdiv_rn(amax, E4M3_MAX);
    return amax > 0.f ? __fdiv_rn(E4M3_MAX, amax) : 0.f;
}

static __device__ __forceinline__ float max_abs4(const float4 v) {
    return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
}

// v rounded to bf16 (nearest even), as float32: what a bf16 store of v holds
static __device__ __forceinline__ float4 round_bf16x4(const float4 v) {
    return make_float4(__bfloat162float(__float2bfloat16_rn(v.x)),
                       __bfloat162float(__float2bfloat16_rn(v.y)),
                       __bfloat162float(__float2bfloat16_rn(v.z)),
                       __bfloat162float(__float2bfloat16_rn(v.w)));
}

// ---------------------------------------------------------------- RMSNorm rows

static __device__ __forceinline__ float sq4(const float4 v) {
    return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
}

// 1 / sqrt(ss / H + eps): the RMSNorm factor of a row of H values with sum of squares ss
static __device__ __forceinline__ float inv_rms(float ss, int H, float eps) {
    return 1.f / sqrtf(ss / (float)H + eps);
}

// A row of H floats into NV float4 per thread of a THREADS-thread CTA (zeros beyond the row);
// returns r = 1 / sqrt(sum(x^2) / H + eps). red: 32 floats of shared memory.
template <int THREADS, int NV>
static __device__ __forceinline__ float load_row_rms(const float* __restrict__ x, float4 v[NV],
                                                     int n4, int H, float eps, float* red) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * THREADS;
        v[i] = c < n4 ? x4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        ss += sq4(v[i]);
    }
    return inv_rms(block_sum(ss, red), H, eps);
}

static __device__ __forceinline__ float4 mul4(const float4 v, float r) {
    return make_float4(__fmul_rn(v.x, r), __fmul_rn(v.y, r), __fmul_rn(v.z, r),
                       __fmul_rn(v.w, r));
}

static __device__ __forceinline__ float4 mul4(const float4 v, const float4 w) {
    return make_float4(__fmul_rn(v.x, w.x), __fmul_rn(v.y, w.y), __fmul_rn(v.z, w.z),
                       __fmul_rn(v.w, w.w));
}

// (h + v * r * w) * s, each step rounded: the residual update of residual_rmsnorm (ops order)
static __device__ __forceinline__ float4 residual4(const float4 h, const float4 v, float r,
                                                   const float4 w, float s) {
    const float4 n = mul4(mul4(v, r), w);
    return mul4(make_float4(__fadd_rn(h.x, n.x), __fadd_rn(h.y, n.y), __fadd_rn(h.z, n.z),
                            __fadd_rn(h.w, n.w)),
                s);
}

// ---------------------------------------------------------------- elementwise

// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in the order of ops.gelu_tanh
static __device__ __forceinline__ float gelu_tanh(float x) {
    const float c = 0.7978845608028654f;  // float32(sqrt(2 / pi))
    const float x3 = __fmul_rn(__fmul_rn(x, x), x);
    const float inner = __fmul_rn(c, __fadd_rn(x, __fmul_rn(0.044715f, x3)));
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.f, tanhf(inner)));
}

// ---------------------------------------------------------------- conversions and stores

// 16 e4m3 bytes (low byte first) -> f32, exactly (e4m3 -> f16 is exact)
static __device__ __forceinline__ void fp8x16_to_f32(const uint4 v, float out[16]) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const __nv_fp8x2_storage_t pair = (words[w] >> (16 * h)) & 0xFFFF;
            const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&raw));
            out[4 * w + 2 * h] = f.x;
            out[4 * w + 2 * h + 1] = f.y;
        }
    }
}

// four floats -> bf16 (round to nearest even), one 8-byte store
static __device__ __forceinline__ void store_bf16x4(__nv_bfloat16* p, float a, float b, float c,
                                                    float d) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t*>(&lo);
    u.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(p) = u;
}

static __device__ __forceinline__ void store_bf16x4(__nv_bfloat16* p, const float4 o) {
    store_bf16x4(p, o.x, o.y, o.z, o.w);
}

static __device__ __forceinline__ void store_bf16x4(__nv_bfloat16* p, const float o[4]) {
    store_bf16x4(p, o[0], o[1], o[2], o[3]);
}

// four values stored as bf16 (rounded) or float32 (as they are)
static __device__ __forceinline__ void store4(__nv_bfloat16* p, const float4 o) {
    store_bf16x4(p, o);
}

static __device__ __forceinline__ void store4(float* p, const float4 o) {
    *reinterpret_cast<float4*>(p) = o;
}

// ---------------------------------------------------------------- tensor-core kernels

static __device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async groups (each kernel issues its copies with its own cache hints)
static __device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int PENDING>
static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory");
}

// Two e4m3 (low byte first) -> bf16x2, exactly. The hardware e4m3x2 -> f16x2 convert makes every
// e4m3 (subnormals too) a normal f16; its bits shifted right by 3 read as a bf16 of the same
// mantissa and an exponent 112 too small (zero stays zero); a multiply by 2^112 restores it, and
// is exact on these normal numbers.
static __device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t pair) {
    const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
    const uint32_t h = static_cast<uint32_t>(h2.x) | (static_cast<uint32_t>(h2.y) << 16);
    const uint32_t biased = (h & 0x80008000u) | ((h >> 3) & 0x0FFF0FFFu);
    const __nv_bfloat162 two112 = __halves2bfloat162(__ushort_as_bfloat16(0x7780),
                                                     __ushort_as_bfloat16(0x7780));
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&biased), two112);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// c += a . b on one m16n8k16 tile: a bf16 row-major fragments, b col-major, f32 accumulators
static __device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4],
                                                uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same with f16 operands (e4m3 values widened exactly to f16)
static __device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4],
                                               uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
