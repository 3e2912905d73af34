// Per-row (per-token) dynamic FP8 quantization of activations for the FP8 tensor-core GEMM:
//   amax[m] = max_k |x[m, k]|,  scale[m] = amax[m] / 448,
//   q[m, k] = e4m3_rn_satfinite(x[m, k] * (448 / amax[m]))   (q = 0 and scale = 0 where amax = 0)
// so that x[m, k] ~= q[m, k] * scale[m]. x is bf16 or float32 [M, K] row-major, q e4m3 [M, K],
// scale float32 [M]. 448 / amax and amax / 448 are IEEE float32 divisions and x * (448 / amax) one
// float32 multiply, each rounded to nearest, then one conversion to e4m3 (round to nearest even,
// clamped to +-448): bit for bit the numpy reference (gemm_tc.quantize_rows_reference).
//
// One CTA of 256 threads per row: a pass over the row for amax (16-byte loads) that also keeps
// the row in shared memory, a CTA maximum, a second pass over the shared copy converting and
// storing 8 (bf16) or 4 (float32) e4m3 bytes per load (re-read from global memory, the rows in
// flight outgrow L2 at large M x K: docs/BENCHMARKS.md). The rows the norms and gelu_mul write
// are quantized in those kernels (their _q entries, the same math: common.cuh); this launch
// serves the other GEMM inputs (the attention output, MoE and PLE rows).
//
// Contract: K % 16 == 0; x, q 16-byte aligned; grid (M, 1, 1), 256 threads, dynamic shared
// memory K * sizeof(x element) (the kernel traps when given less); inputs finite.
#include "common.cuh"

namespace {
constexpr int THREADS = 256;

struct Bf16Row {  // 8 values per 16-byte load
    using Vec = uint4;
    static constexpr int PER = 8;
    __device__ static void unpack(const Vec& v, float out[PER]) {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = __uint_as_float(w[i] << 16);
            out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        }
    }
    __device__ static void store(uint8_t* q, int i, const float v[PER], float inv) {
        reinterpret_cast<uint2*>(q)[i] =
            make_uint2(to_e4m3x2(v[0], v[1], inv) | to_e4m3x2(v[2], v[3], inv) << 16,
                       to_e4m3x2(v[4], v[5], inv) | to_e4m3x2(v[6], v[7], inv) << 16);
    }
};

struct F32Row {  // 4 values per 16-byte load
    using Vec = float4;
    static constexpr int PER = 4;
    __device__ static void unpack(const Vec& v, float out[PER]) {
        out[0] = v.x;
        out[1] = v.y;
        out[2] = v.z;
        out[3] = v.w;
    }
    __device__ static void store(uint8_t* q, int i, const float v[PER], float inv) {
        reinterpret_cast<uint32_t*>(q)[i] = to_e4m3x2(v[0], v[1], inv) | to_e4m3x2(v[2], v[3], inv)
                                                                         << 16;
    }
};

template <class Row>
__device__ __forceinline__ void quant_row(const void* __restrict__ x, uint8_t* __restrict__ q,
                                          float* __restrict__ scale, int M, int K) {
    __shared__ float red[32];
    extern __shared__ __align__(16) unsigned char stage[];  // the row as loaded
    const int nvec = K / Row::PER;
    {
        uint32_t dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (uint32_t)nvec * sizeof(typename Row::Vec)) __trap();
    }
    const int m = blockIdx.x;
    if (m >= M) return;
    const auto* row = reinterpret_cast<const typename Row::Vec*>(x) + (size_t)m * nvec;
    auto* copy = reinterpret_cast<typename Row::Vec*>(stage);
    uint8_t* qrow = q + (size_t)m * K;
    float amax = 0.f;
    for (int i = threadIdx.x; i < nvec; i += THREADS) {
        const typename Row::Vec raw = row[i];
        copy[i] = raw;  // read back below by this same thread
        float v[Row::PER];
        Row::unpack(raw, v);
#pragma unroll
        for (int j = 0; j < Row::PER; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
    const float inv = row_quant_inv(block_max(amax, red), scale + m);
    for (int i = threadIdx.x; i < nvec; i += THREADS) {
        float v[Row::PER];
        Row::unpack(copy[i], v);
        Row::store(qrow, i, v, inv);
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
quant_fp8_rows_bf16(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ q,
                    float* __restrict__ scale, int M, int K) {
    pdl_wait();
    pdl_launch_dependents();
    quant_row<Bf16Row>(x, q, scale, M, K);
}

extern "C" __global__ void __launch_bounds__(THREADS)
quant_fp8_rows_f32(const float* __restrict__ x, uint8_t* __restrict__ q,
                   float* __restrict__ scale, int M, int K) {
    pdl_wait();
    pdl_launch_dependents();
    quant_row<F32Row>(x, q, scale, M, K);
}
