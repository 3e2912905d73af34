// y[m, n] = scale[n] * sum_k x[m, k] * W[n, k]   (W: FP8 e4m3 [N, K], x: bf16 [M, K], y: f32 [M, N])
//
// Prefill GEMM for any M (same arguments as gemv_fp8_rowscale). A CTA of 8 warps owns a BM x 128
// tile of y; a cp.async pipeline stages 64-wide k slices of W (e4m3) and x (bf16) in shared
// memory; tensor cores (mma.sync m16n8k16, bf16 in, f32 out) do the products.
//
// Numerics match the f32 reference up to summation order: e4m3 -> bf16 is exact, x is used as
// given, and since tensor cores have been measured to truncate inside their f32 accumulation,
// each 64-wide k slice goes into a fresh accumulator that is then added (round-to-nearest) into
// the running sum, so truncation never compounds over long K.
//
// The k order inside each 16-wide mma step is permuted (the same way for x and W, so the sum is
// unchanged) so that one 16-byte shared-memory load gives a thread its W bytes for four steps.
//
// Split-K variants (entry suffix _s2, _s4) are thread-block clusters along z: each CTA of a
// cluster sums a contiguous share of the k slices, and the partial tiles are added in rank order
// through distributed shared memory, so results are deterministic.
//
// Contract: K % 16 == 0; W, x, y 16-byte aligned; any M >= 1 and N >= 1 (tails are zero-filled
// on load and masked on store); grid (ceil(M / BM), ceil(N / 128), SPLIT), 256 threads, dynamic
// shared memory as gemm_fp8w.py computes it (the kernel traps when given less).
#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;

namespace {
constexpr int THREADS = 256;
constexpr int BN = 128;          // W rows (output columns) per CTA
constexpr int BK = 64;           // k per pipeline stage: 64 bytes of a W row, 128 of an x row
constexpr int RED_STRIDE = BN + 8;  // floats per row of a split-K partial tile (no bank conflicts)

// The tile shape of one variant: WM x (8 / WM) warps, each owning MT m16 tiles and NT n8 tiles.
template <int MT, int WM>
struct Tile {
    static constexpr int WN = 8 / WM;
    static constexpr int NT = BN / (8 * WN);
    static constexpr int BM = 16 * MT * WM;
    static constexpr int STAGES = 6;
    static constexpr int W_STAGE = BN * BK;        // bytes
    static constexpr int X_STAGE = BM * BK * 2;    // bytes
    static constexpr int PIPE_SMEM = STAGES * (W_STAGE + X_STAGE);
    static constexpr int RED_SMEM = BM * RED_STRIDE * 4;
};

// 16 bytes global -> shared, bypassing L1; zero-filled when !valid (src is then not read). The
// L2 prefetch hint pulls the whole 128-byte line, so the next stage's half of it is an L2 hit.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// y[row, col] and y[row, col + 1] (col even), scaled; float2 when N is even (then col + 1 < N
// follows from col < N and the address is 8-byte aligned).
__device__ __forceinline__ void store_pair(float* __restrict__ y, const float* __restrict__ scale,
                                           int row, int col, float v0, float v1, int M, int N) {
    if (row >= M || col >= N) return;
    float* dst = y + (size_t)row * N + col;
    if ((N & 1) == 0) {
        *reinterpret_cast<float2*>(dst) = make_float2(v0 * scale[col], v1 * scale[col + 1]);
    } else {
        dst[0] = v0 * scale[col];
        if (col + 1 < N) dst[1] = v1 * scale[col + 1];
    }
}

template <int MT, int WM, int SPLIT>
__device__ __forceinline__ void gemm_tile(const uint8_t* __restrict__ W,
                                          const float* __restrict__ scale,
                                          const __nv_bfloat16* __restrict__ x,
                                          float* __restrict__ y, int M, int N, int K) {
    using T = Tile<MT, WM>;
    constexpr int NT = T::NT;
    extern __shared__ __align__(128) unsigned char smem[];
    {
        uint32_t dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        constexpr int need = SPLIT == 1 || T::PIPE_SMEM >= T::RED_SMEM ? T::PIPE_SMEM
                                                                        : T::RED_SMEM;
        if (dyn < (uint32_t)need) __trap();
    }
    unsigned char* sW = smem;                                  // [STAGES][BN][64] e4m3
    unsigned char* sX = smem + T::STAGES * T::W_STAGE;         // [STAGES][BM][64] bf16, swizzled

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;        // mma fragment row group and k/column quad
    const int wm = warp / T::WN, wn = warp % T::WN;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * BN;
    const int kt_total = (K + BK - 1) / BK;
    const int part = SPLIT == 1 ? 0 : (int)blockIdx.z;
    const int kt_begin = kt_total * part / SPLIT;
    const int iters = kt_total * (part + 1) / SPLIT - kt_begin;

    // x rows are 8 chunks of 16 bytes; chunk c of row r sits at c ^ (r & 7), so the 8 threads of
    // one shared-memory phase (rows r, r + 1; 4 chunks each) hit 8 distinct bank groups.
    auto load_stage = [&](int slot, int kt) {
        const int k0 = kt * BK;
        unsigned char* w_s = sW + slot * T::W_STAGE;
        unsigned char* x_s = sX + slot * T::X_STAGE;
#pragma unroll
        for (int q = 0; q < BN * 4 / THREADS; ++q) {
            const int c = tid + q * THREADS;
            const int row = c >> 2, ch = c & 3;
            const int n = n0 + row, k = k0 + ch * 16;
            const bool ok = n < N && k < K;
            cp_async16(smem_u32(w_s + row * 64 + ch * 16), ok ? W + (size_t)n * K + k : W, ok);
        }
#pragma unroll
        for (int q = 0; q < (T::BM * 8 + THREADS - 1) / THREADS; ++q) {
            const int c = tid + q * THREADS;
            if (c >= T::BM * 8) break;
            const int row = c >> 3, ch = c & 7;
            const int m = m0 + row, k = k0 + ch * 8;
            const bool ok = m < M && k < K;
            cp_async16(smem_u32(x_s + row * 128 + ((ch ^ (row & 7)) << 4)),
                       ok ? x + (size_t)m * K + k : x, ok);
        }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    // One stage = 4 mma k-steps s. Step s gives quad t the k offsets 16t + 4s + {0,1} (mma k 2t,
    // 2t+1) and 16t + 4s + {2,3} (mma k 2t+8, 2t+9): for W, bytes 4s.. of the thread's 16 bytes
    // at 16t; for x, the bf16 pairs 2s and 2s+1 of its 16 elements at 16t (two 16-byte loads).
    // Each stage's products go to a fresh accumulator, added to `acc` once per stage.
    auto compute_stage = [&](int slot) {
        const unsigned char* w_s = sW + slot * T::W_STAGE;
        const unsigned char* x_s = sX + slot * T::X_STAGE;
        uint32_t b[4][NT][2];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const uint4 raw = *reinterpret_cast<const uint4*>(
                w_s + ((wn * NT + j) * 8 + g) * 64 + t * 16);
            const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                b[s][j][0] = e4m3x2_to_bf16x2(words[s]);
                b[s][j][1] = e4m3x2_to_bf16x2(words[s] >> 16);
            }
        }
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const int r = (wm * MT + i) * 16 + g;  // r & 7 == g and (r + 8) & 7 == g
            uint4 lo[2], hi[2];                    // rows r and r + 8, elements 16t + 8h ..
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int chunk = ((2 * t + h) ^ g) << 4;
                lo[h] = *reinterpret_cast<const uint4*>(x_s + r * 128 + chunk);
                hi[h] = *reinterpret_cast<const uint4*>(x_s + (r + 8) * 128 + chunk);
            }
            float slice_acc[NT][4];
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) slice_acc[j][e] = 0.f;
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const uint4& l = lo[s >> 1];
                const uint4& u = hi[s >> 1];
                const uint32_t a[4] = {(s & 1) ? l.z : l.x, (s & 1) ? u.z : u.x,
                                       (s & 1) ? l.w : l.y, (s & 1) ? u.w : u.y};
#pragma unroll
                for (int j = 0; j < NT; ++j) mma_bf16(slice_acc[j], a, b[s][j][0], b[s][j][1]);
            }
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] += slice_acc[j][e];
        }
    };

#pragma unroll
    for (int s = 0; s < T::STAGES - 1; ++s) {
        if (s < iters) load_stage(s, kt_begin + s);
        cp_async_commit();
    }
    for (int it = 0; it < iters; ++it) {
        cp_async_wait<T::STAGES - 2>();
        __syncthreads();  // stage `it` visible to all; slot (it - 1) % STAGES free to refill
        const int ahead = it + T::STAGES - 1;
        if (ahead < iters) load_stage(ahead % T::STAGES, kt_begin + ahead);
        cp_async_commit();
        compute_stage(it % T::STAGES);
    }

    if constexpr (SPLIT == 1) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int row = m0 + (wm * MT + i) * 16 + g;
                const int col = n0 + (wn * NT + j) * 8 + 2 * t;
                store_pair(y, scale, row, col, acc[i][j][0], acc[i][j][1], M, N);
                store_pair(y, scale, row + 8, col, acc[i][j][2], acc[i][j][3], M, N);
            }
    } else {
        cp_async_wait<0>();
        __syncthreads();  // the pipeline's shared memory now holds this CTA's partial tile
        float* red = reinterpret_cast<float*>(smem);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int r = (wm * MT + i) * 16 + g;
                const int c = (wn * NT + j) * 8 + 2 * t;
                *reinterpret_cast<float2*>(red + r * RED_STRIDE + c) =
                    make_float2(acc[i][j][0], acc[i][j][1]);
                *reinterpret_cast<float2*>(red + (r + 8) * RED_STRIDE + c) =
                    make_float2(acc[i][j][2], acc[i][j][3]);
            }
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();
        // CTA `rank` adds rows [rank * BM / SPLIT, (rank + 1) * BM / SPLIT) over the cluster.
        constexpr int ROWS = T::BM / SPLIT;
        const int rank = (int)cluster.block_rank();
        for (int e = tid; e < ROWS * (BN / 4); e += THREADS) {
            const int r = rank * ROWS + e / (BN / 4), c = (e % (BN / 4)) * 4;
            float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int src = 0; src < SPLIT; ++src) {
                const float* remote = cluster.map_shared_rank(red, src);
                const float4 v = *reinterpret_cast<const float4*>(remote + r * RED_STRIDE + c);
                sum.x += v.x;
                sum.y += v.y;
                sum.z += v.z;
                sum.w += v.w;
            }
            store_pair(y, scale, m0 + r, n0 + c, sum.x, sum.y, M, N);
            store_pair(y, scale, m0 + r, n0 + c + 2, sum.z, sum.w, M, N);
        }
        cluster.sync();  // no CTA leaves while another still reads its shared memory
    }
}
}  // namespace

// One entry per (BM, split). BM 16/32/64: 1 x 8 warps of 16 columns, so each W byte is converted
// once per CTA; BM 128: 2 x 4 warps of 64 x 32 (one CTA per SM for its registers).
#define GEMM_FP8W_ENTRY(NAME, MT, WM, SPLIT, MIN_BLOCKS, CLUSTER)                            \
    extern "C" __global__ void CLUSTER __launch_bounds__(THREADS, MIN_BLOCKS)                 \
    NAME(const uint8_t* __restrict__ W, const float* __restrict__ scale,                      \
         const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int M, int N, int K) {   \
        pdl_wait();                                                                           \
        pdl_launch_dependents();                                                              \
        gemm_tile<MT, WM, SPLIT>(W, scale, x, y, M, N, K);                                     \
    }
#define NO_CLUSTER
GEMM_FP8W_ENTRY(gemm_fp8w_m16_s1, 1, 1, 1, 2, NO_CLUSTER)
GEMM_FP8W_ENTRY(gemm_fp8w_m16_s2, 1, 1, 2, 2, __cluster_dims__(1, 1, 2))
GEMM_FP8W_ENTRY(gemm_fp8w_m16_s4, 1, 1, 4, 2, __cluster_dims__(1, 1, 4))
GEMM_FP8W_ENTRY(gemm_fp8w_m32_s1, 2, 1, 1, 2, NO_CLUSTER)
GEMM_FP8W_ENTRY(gemm_fp8w_m32_s2, 2, 1, 2, 2, __cluster_dims__(1, 1, 2))
GEMM_FP8W_ENTRY(gemm_fp8w_m32_s4, 2, 1, 4, 2, __cluster_dims__(1, 1, 4))
GEMM_FP8W_ENTRY(gemm_fp8w_m64_s1, 4, 1, 1, 2, NO_CLUSTER)
GEMM_FP8W_ENTRY(gemm_fp8w_m64_s2, 4, 1, 2, 2, __cluster_dims__(1, 1, 2))
GEMM_FP8W_ENTRY(gemm_fp8w_m64_s4, 4, 1, 4, 2, __cluster_dims__(1, 1, 4))
GEMM_FP8W_ENTRY(gemm_fp8w_m128_s1, 4, 2, 1, 1, NO_CLUSTER)
GEMM_FP8W_ENTRY(gemm_fp8w_m128_s2, 4, 2, 2, 1, __cluster_dims__(1, 1, 2))
GEMM_FP8W_ENTRY(gemm_fp8w_m128_s4, 4, 2, 4, 1, __cluster_dims__(1, 1, 4))
