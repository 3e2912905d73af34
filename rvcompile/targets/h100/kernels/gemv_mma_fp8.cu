// y[m, n] = scale[n] * sum_k x[m, k] * W[n, k]   (W: e4m3 [N, K], x: bf16 [M, K], y: f32 [M, N])
//   gemv_mma_fp8_*: gemv_fp8_rowscale's arguments (W, scale, x, y, M, N, K);
//   gemv_mma_f16_*: the same product from (W, scale, x, q_scale, y, M, N, K), q_scale[m] being
//     x row m's amax / 448 as the norms' / gelu_mul's _q twins write it: each x window is turned
//     into f16 rows times a power of two per row (f16_row_factor), exact, and the weights take
//     one e4m3 -> f16 conversion a pair where bf16 takes five.
//
// Small-batch decode GEMV on the tensor cores ("swap AB"), M = 1..32 token rows. Bound by reading
// W once, whatever M: the weights are the mma's M side (16 W rows per m16n8k16), the token rows
// its N side (8 per n tile; NT tiles hold 8 NT rows, rows >= M are zero fragments), so one
// conversion of a weight serves every token row and the work per weight byte barely grows with
// M. Tried and not adopted (2026-11-29, docs/BENCHMARKS.md): e4m3 rows into an m16n8k32 e4m3 mma,
// no conversion at all (faster still, but it rounds the activations to e4m3, so a sequence's
// tokens would depend on whether it decodes alone, on gemv_fp8's bf16 rows, or in a batch).
//
// A CTA of NW warps owns 16 NW rows of W; each warp owns 16 of them. The CTA walks its share of K
// in 64-wide k blocks, in order: every lane loads 16 bytes of its rows g and g + 8 per block
// straight into registers, up to WIN blocks ahead (2 WIN - 2 .. 2 WIN 16-byte loads in flight per
// lane; a slot is refilled right after its block's mma). The x rows of the current k window (WIN
// blocks) sit in shared memory, NSTAGE windows staged ahead by cp.async, one __syncthreads per
// window. A split-K variant (_s2 .. _s8) is a thread-block cluster along z: each CTA sums a
// contiguous share of the k blocks and the partial tiles are added in rank order through
// distributed shared memory. Results are deterministic.
//
// Tried and dropped (H100 sweeps, 2026-11-24, docs/BENCHMARKS.md): starting each CTA at a
// different k window so that neighbours do not march through W in step (3-18% slower); no L2
// 256-byte prefetch hint on the W loads (slower). Open: issuing a slot's refill before its
// block's mma at 80-96 registers was faster at M <= 8 but only timed at an older launch choice.
//
// Numerics: e4m3 -> bf16 / f16 is exact, x is used as given (f16: times a power of two, exact
// for every value within 2^-28 of its row's largest), products are exact in f32; each 64-wide k block goes into a fresh mma accumulator that is then added
// (round-to-nearest) into the running f32 sum (tensor cores truncate inside their accumulation;
// this keeps it from compounding over long K, as in gemm_fp8w.cu). The k order inside a block is
// permuted the same way for W and x (a lane's 16 W bytes at 16t are its k values for the block's
// mma steps).
//
// Contract: K % 16 == 0; W, x rows 16-byte aligned; 1 <= M <= 8 NT; any N >= 1; grid
// (ceil(N / (16 NW)), 1, S), NW * 32 threads, dynamic shared memory NSTAGE * M * XROW bytes (gemv_mma_fp8.py computes it; the kernel traps when given less).
#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;

namespace {
constexpr int KB = 64;                // k per block: 16 bytes of a W row per lane quad member
constexpr int WIN = 4;                // k blocks per x window, and W blocks in flight per lane
constexpr int NSTAGE = 3;             // x windows in shared memory
constexpr int XROW = WIN * KB * 2 + 16;  // bytes per x row of a window (+16: no bank conflicts)

// 16 bytes of W, streamed (no L1 allocation, the L2 fetches 256 bytes); zero when !valid.
__device__ __forceinline__ uint4 load_w(const uint8_t* p, bool valid) {
    uint4 v;
    asm("{\n"
        " .reg .pred p;\n"
        " setp.ne.b32 p, %5, 0;\n"
        " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
        " @p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        "}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"((int)valid));
    return v;
}

// 16 bytes global -> shared, bypassing L1; zero-filled when !valid (src is then not read)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// c = a . b on one m16n8k16 tile, starting from zero
__device__ __forceinline__ void mma_bf16_first(float (&c)[4], const uint32_t (&a)[4],
                                               uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};\n"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

// Two e4m3 (low byte first) -> f16x2: one hardware conversion, exact.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
    const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
    return static_cast<uint32_t>(h2.x) | (static_cast<uint32_t>(h2.y) << 16);
}

// 8 bf16 -> 8 f16 times `factor` (a power of two: exact while in f16's normal range, which
// f16_row_factor keeps each row's largest values in).
__device__ __forceinline__ uint4 bf16x8_to_f16x8(const uint4 v, float factor) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 h = __floats2half2_rn(__uint_as_float(w[i] << 16) * factor,
                                            __uint_as_float(w[i] & 0xFFFF0000u) * factor);
        out[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}

// One 64-wide k block of a warp: W rows g (wa) and g + 8 (wb), 16 bytes each at k 16t; xs points
// at this block's x window column 16t of token row 0 (bf16, or with F16 the f16 rows the window
// was converted to). acc[j] += the block's sums for token rows 8j .. 8j + 7: c0, c1 = W row g
// with token rows 8j + 2t, 8j + 2t + 1; c2, c3 = W row g + 8.
template <int NT, bool F16>
__device__ __forceinline__ void mma_block(const uint4 wa, const uint4 wb,
                                          const unsigned char* xs, int M, int g,
                                          float (&acc)[NT][4]) {
    uint4 xlo[NT], xhi[NT];  // x[8j + g][16t .. 16t + 8), [16t + 8 .. 16t + 16)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int m = 8 * j + g;
        if (m < M) {
            xlo[j] = *reinterpret_cast<const uint4*>(xs + m * XROW);
            xhi[j] = *reinterpret_cast<const uint4*>(xs + m * XROW + 16);
        } else {
            xlo[j] = xhi[j] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    const uint32_t a_words[4] = {wa.x, wa.y, wa.z, wa.w};
    const uint32_t b_words[4] = {wb.x, wb.y, wb.z, wb.w};
    float block[NT][4];
    // Step s: mma k 2t, 2t+1 <- k 16t + 4s + {0, 1}; mma k 2t+8, 2t+9 <- k 16t + 4s + {2, 3}.
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        uint32_t a[4];
        if constexpr (F16) {
            a[0] = e4m3x2_to_f16x2(a_words[s]);
            a[1] = e4m3x2_to_f16x2(b_words[s]);
            a[2] = e4m3x2_to_f16x2(a_words[s] >> 16);
            a[3] = e4m3x2_to_f16x2(b_words[s] >> 16);
        } else {
            a[0] = e4m3x2_to_bf16x2(a_words[s]);
            a[1] = e4m3x2_to_bf16x2(b_words[s]);
            a[2] = e4m3x2_to_bf16x2(a_words[s] >> 16);
            a[3] = e4m3x2_to_bf16x2(b_words[s] >> 16);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const uint4& xv = s < 2 ? xlo[j] : xhi[j];
            const uint32_t b0 = (s & 1) ? xv.z : xv.x, b1 = (s & 1) ? xv.w : xv.y;
            if constexpr (F16) {
                if (s == 0) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) block[j][e] = 0.f;
                }
                mma_f16(block[j], a, b0, b1);
            } else if (s == 0) {
                mma_bf16_first(block[j], a, b0, b1);
            } else {
                mma_bf16(block[j], a, b0, b1);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] += block[j][e];
}

// Token row kinds: bf16 rows; bf16 rows with their float32 amax / 448 each (a _q twin's q_scale),
// converted to f16 times a power of two per row.
enum RowKind { ROWS_BF16, ROWS_F16 };

// 2^(14 - floor(log2 amax)), so that amax * 2^e < 2^15 (f16's largest binade below 65504), for a
// row whose largest magnitude is about amax = q_scale * 448 (within a float32 rounding, which the
// bound's factor-2 margin absorbs); 1 for an all-zero row; 2^127 at most (a subnormal amax).
__device__ __forceinline__ float f16_row_factor(float q_scale) {
    const float amax = q_scale * E4M3_MAX;
    if (!(amax > 0.f)) return 1.f;
    const int biased = (int)((__float_as_uint(amax) >> 23) & 0xFFu);  // floor(log2 amax) + 127
    return __uint_as_float((uint32_t)min(268 - biased, 254) << 23);
}

// A row sum times W's row scale; for f16 rows first times the row's 1 / factor (a power of two:
// exact), so the result rounds as the bf16 rows' sum * scale does.
template <RowKind X>
__device__ __forceinline__ float scaled(float sum, float w_scale,
                                        const float* __restrict__ q_scale, int m) {
    if constexpr (X == ROWS_F16) return (sum * (1.f / f16_row_factor(q_scale[m]))) * w_scale;
    return sum * w_scale;
}

template <int NT, int NW, int SPLIT, RowKind X>
__device__ __forceinline__ void gemv_mma(const uint8_t* __restrict__ W,
                                         const float* __restrict__ scale,
                                         const unsigned char* __restrict__ x,
                                         const float* __restrict__ q_scale,
                                         float* __restrict__ y, int M, int N, int K) {
    constexpr int THREADS = NW * 32;
    constexpr int CHUNKS = WIN * KB * 2 / 16;  // 16-byte pieces of an x row's window
    constexpr int R = 16 * NW;       // W rows per CTA
    constexpr int RED_STRIDE = R + 4;  // floats per token row of a split-K partial (no conflicts)
    extern __shared__ __align__(128) unsigned char smem[];
    {
        uint32_t dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (uint32_t)(NSTAGE * M * XROW)) __trap();
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * R;
    const int blocks = (K + KB - 1) / KB;
    const int part = SPLIT == 1 ? 0 : (int)blockIdx.z;
    const int kb0 = blocks * part / SPLIT, kb1 = blocks * (part + 1) / SPLIT;
    const int windows = (kb1 - kb0 + WIN - 1) / WIN;

    const int row_a = n0 + warp * 16 + g, row_b = row_a + 8;
    const bool ok_a = row_a < N, ok_b = row_b < N;
    const uint8_t* wa = W + (size_t)(ok_a ? row_a : 0) * K + 16 * t;
    const uint8_t* wb = W + (size_t)(ok_b ? row_b : 0) * K + 16 * t;
    auto load_block = [&](int kb, uint4& va, uint4& vb) {
        const bool in = kb < kb1 && kb * KB + 16 * t < K;
        va = load_w(wa + (size_t)kb * KB, in && ok_a);
        vb = load_w(wb + (size_t)kb * KB, in && ok_b);
    };
    // x window w of this CTA (k from (kb0 + WIN w) * KB, WIN * KB wide) into stage w % NSTAGE
    auto load_window = [&](int w) {
        unsigned char* xs = smem + (w % NSTAGE) * M * XROW;
        const int k0 = (kb0 + w * WIN) * KB;
#pragma unroll 1  // a few chunks per thread once per window: keep registers for W
        for (int c = tid; c < M * CHUNKS; c += THREADS) {
            const int m = c / CHUNKS, ch = c % CHUNKS;
            const int k = k0 + ch * 8;
            const bool ok = k < K;
            cp_async16(smem_u32(xs + m * XROW + ch * 16), ok ? x + ((size_t)m * K + k) * 2 : x,
                       ok);
        }
    };

    uint4 w_regs[WIN][2];
#pragma unroll
    for (int i = 0; i < WIN; ++i) load_block(kb0 + i, w_regs[i][0], w_regs[i][1]);
#pragma unroll
    for (int s = 0; s < NSTAGE - 1; ++s) {
        if (s < windows) load_window(s);
        cp_async_commit();
    }
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

    for (int w = 0; w < windows; ++w) {
        cp_async_wait<NSTAGE - 2>();
        __syncthreads();  // window w visible to all; stage (w - 1) % NSTAGE free to refill
        if (w + NSTAGE - 1 < windows) load_window(w + NSTAGE - 1);
        cp_async_commit();
        if constexpr (X == ROWS_F16) {  // window w's bf16 rows -> f16 x their factor, in place
            unsigned char* stage = smem + (w % NSTAGE) * M * XROW;
#pragma unroll 1
            for (int c = tid; c < M * CHUNKS; c += THREADS) {
                const int m = c / CHUNKS;
                uint4* p = reinterpret_cast<uint4*>(stage + m * XROW + (c % CHUNKS) * 16);
                *p = bf16x8_to_f16x8(*p, f16_row_factor(q_scale[m]));
            }
            __syncthreads();
        }
        const unsigned char* xs = smem + (w % NSTAGE) * M * XROW + 32 * t;
#pragma unroll
        for (int i = 0; i < WIN; ++i) {
            const int kb = kb0 + w * WIN + i;
            if (kb >= kb1) break;  // only the last window may be partial: nothing follows it
            mma_block<NT, X == ROWS_F16>(w_regs[i][0], w_regs[i][1], xs + i * KB * 2, M, g, acc);
            load_block(kb + WIN, w_regs[i][0], w_regs[i][1]);  // refill the slot just used
        }
    }

    if constexpr (SPLIT == 1) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int m = 8 * j + 2 * t;
            if (ok_a) {
                const float s = scale[row_a];
                if (m < M) y[(size_t)m * N + row_a] = scaled<X>(acc[j][0], s, q_scale, m);
                if (m + 1 < M)
                    y[(size_t)(m + 1) * N + row_a] = scaled<X>(acc[j][1], s, q_scale, m + 1);
            }
            if (ok_b) {
                const float s = scale[row_b];
                if (m < M) y[(size_t)m * N + row_b] = scaled<X>(acc[j][2], s, q_scale, m);
                if (m + 1 < M)
                    y[(size_t)(m + 1) * N + row_b] = scaled<X>(acc[j][3], s, q_scale, m + 1);
            }
        }
    } else {
        cp_async_wait<0>();
        __syncthreads();  // every x read is done: the stages now hold this CTA's partial tile
        float* red = reinterpret_cast<float*>(smem);  // [M][RED_STRIDE]
        const int r = warp * 16 + g;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int m = 8 * j + 2 * t;
            if (m < M) {
                red[m * RED_STRIDE + r] = acc[j][0];
                red[m * RED_STRIDE + r + 8] = acc[j][2];
            }
            if (m + 1 < M) {
                red[(m + 1) * RED_STRIDE + r] = acc[j][1];
                red[(m + 1) * RED_STRIDE + r + 8] = acc[j][3];
            }
        }
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();
        // CTA `rank` adds elements [rank E / SPLIT, (rank + 1) E / SPLIT) of the E = M * R
        // partial sums (n fastest), in rank order.
        const int rank = (int)cluster.block_rank();
        const int total = M * R;
        const int end = total * (rank + 1) / SPLIT;
        for (int e = total * rank / SPLIT + tid; e < end; e += THREADS) {
            const int m = e / R, c = e % R, n = n0 + c;
            float sum = 0.f;
#pragma unroll
            for (int src = 0; src < SPLIT; ++src)
                sum += cluster.map_shared_rank(red, src)[m * RED_STRIDE + c];
            if (n < N) y[(size_t)m * N + n] = scaled<X>(sum, scale[n], q_scale, m);
        }
        cluster.sync();  // no CTA leaves while another still reads its shared memory
    }
}
}  // namespace

// One entry per (x kind, rows bucket 8 NT, warps NW, split). MIN_BLOCKS caps the registers so
// that this many CTAs fit on an SM.
#define GEMV_MMA_ENTRY(NAME, NT, NW, SPLIT, MIN_BLOCKS, CLUSTER)                              \
    extern "C" __global__ void CLUSTER __launch_bounds__(NW * 32, MIN_BLOCKS)                  \
    NAME(const uint8_t* __restrict__ W, const float* __restrict__ scale,                      \
         const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int M, int N, int K) {   \
        pdl_wait();                                                                           \
        pdl_launch_dependents();                                                              \
        gemv_mma<NT, NW, SPLIT, ROWS_BF16>(W, scale, reinterpret_cast<const unsigned char*>(x), \
                                           nullptr, y, M, N, K);                              \
    }
#define GEMV_MMA_F16_ENTRY(NAME, NT, NW, SPLIT, MIN_BLOCKS, CLUSTER)                          \
    extern "C" __global__ void CLUSTER __launch_bounds__(NW * 32, MIN_BLOCKS)                  \
    NAME(const uint8_t* __restrict__ W, const float* __restrict__ scale,                      \
         const __nv_bfloat16* __restrict__ x, const float* __restrict__ q_scale,              \
         float* __restrict__ y, int M, int N, int K) {                                        \
        pdl_wait();                                                                           \
        pdl_launch_dependents();                                                              \
        gemv_mma<NT, NW, SPLIT, ROWS_F16>(W, scale, reinterpret_cast<const unsigned char*>(x), \
                                          q_scale, y, M, N, K);                               \
    }
#define NO_CLUSTER
#define C2 __cluster_dims__(1, 1, 2)
#define C3 __cluster_dims__(1, 1, 3)
#define C4 __cluster_dims__(1, 1, 4)
#define C6 __cluster_dims__(1, 1, 6)
#define C8 __cluster_dims__(1, 1, 8)
#define GEMV_MMA_SPLITS(ENTRY, PREFIX, NT, NW, MIN_BLOCKS)   \
    ENTRY(PREFIX##_s1, NT, NW, 1, MIN_BLOCKS, NO_CLUSTER)   \
    ENTRY(PREFIX##_s2, NT, NW, 2, MIN_BLOCKS, C2)           \
    ENTRY(PREFIX##_s3, NT, NW, 3, MIN_BLOCKS, C3)           \
    ENTRY(PREFIX##_s4, NT, NW, 4, MIN_BLOCKS, C4)           \
    ENTRY(PREFIX##_s6, NT, NW, 6, MIN_BLOCKS, C6)           \
    ENTRY(PREFIX##_s8, NT, NW, 8, MIN_BLOCKS, C8)
#define GEMV_MMA_BUCKETS(ENTRY, PREFIX)                      \
    GEMV_MMA_SPLITS(ENTRY, PREFIX##_m8_w4, 1, 4, 8)          \
    GEMV_MMA_SPLITS(ENTRY, PREFIX##_m16_w4, 2, 4, 6)         \
    GEMV_MMA_SPLITS(ENTRY, PREFIX##_m32_w4, 4, 4, 4)         \
    GEMV_MMA_SPLITS(ENTRY, PREFIX##_m8_w8, 1, 8, 4)          \
    GEMV_MMA_SPLITS(ENTRY, PREFIX##_m16_w8, 2, 8, 3)         \
    GEMV_MMA_SPLITS(ENTRY, PREFIX##_m32_w8, 4, 8, 2)
GEMV_MMA_BUCKETS(GEMV_MMA_ENTRY, gemv_mma_fp8)
GEMV_MMA_BUCKETS(GEMV_MMA_F16_ENTRY, gemv_mma_f16)
