// y[m, n] = scale[n] * sum_k x[m, k] * W[n, k]   (W: e4m3 [N, K], x: bf16 [M, K], y: f32 [M, N])
//
// Small-batch decode GEMV on the tensor cores ("swap AB"), M = 1..32 token rows, same arguments
// as gemv_fp8_rowscale. Bound by reading W once, whatever M: the weights are the mma's M side
// (16 W rows per m16n8k16), the token rows its N side (8 per n tile; NT tiles hold 8 NT rows,
// rows >= M are zero fragments), so one e4m3 -> bf16 conversion of a weight serves every token
// row and the work per weight byte barely grows with M.
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
// Numerics: e4m3 -> bf16 is exact, x is used as given, products are exact in f32; each 64-wide
// k block goes into a fresh mma accumulator that is then added (round-to-nearest) into the
// running f32 sum (tensor cores truncate inside their accumulation; this keeps it from
// compounding over long K, as in gemm_fp8w.cu). The k order inside a block is permuted the same
// way for W and x (a lane's 16 W bytes at 16t are its k values for the block's 4 mma steps).
//
// Contract: K % 16 == 0; W, x rows 16-byte aligned; 1 <= M <= 8 NT; any N >= 1; grid
// (ceil(N / (16 NW)), 1, S), NW * 32 threads, dynamic shared memory NSTAGE * M * XROW bytes
// (gemv_mma_fp8.py computes it; the kernel traps when given less).
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

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory");
}

// Two e4m3 (low byte first) -> bf16x2, exactly (gemm_fp8w.cu's conversion): the hardware
// e4m3x2 -> f16x2 convert makes every e4m3 a normal f16 (or zero); its bits shifted right by 3
// read as a bf16 of the same mantissa and an exponent 112 too small; a multiply by 2^112 restores
// it, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t pair) {
    const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
    const uint32_t h = static_cast<uint32_t>(h2.x) | (static_cast<uint32_t>(h2.y) << 16);
    const uint32_t biased = (h & 0x80008000u) | ((h >> 3) & 0x0FFF0FFFu);
    const __nv_bfloat162 two112 = __halves2bfloat162(__ushort_as_bfloat16(0x7780),
                                                     __ushort_as_bfloat16(0x7780));
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&biased), two112);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// c = a . b on one m16n8k16 tile, starting from zero
__device__ __forceinline__ void mma_bf16_first(float (&c)[4], const uint32_t (&a)[4],
                                               uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};\n"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

// One 64-wide k block of a warp: W rows g (wa) and g + 8 (wb), 16 bytes each at k 16t; xs points
// at this block's x window column 16t of token row 0. acc[j] += the block's sums for token rows
// 8j .. 8j + 7: c0, c1 = W row g with token rows 8j + 2t, 8j + 2t + 1; c2, c3 = W row g + 8.
template <int NT>
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
        const uint32_t a[4] = {e4m3x2_to_bf16x2(a_words[s]), e4m3x2_to_bf16x2(b_words[s]),
                               e4m3x2_to_bf16x2(a_words[s] >> 16),
                               e4m3x2_to_bf16x2(b_words[s] >> 16)};
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const uint4& xv = s < 2 ? xlo[j] : xhi[j];
            const uint32_t b0 = (s & 1) ? xv.z : xv.x, b1 = (s & 1) ? xv.w : xv.y;
            if (s == 0) {
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

template <int NT, int NW, int SPLIT>
__device__ __forceinline__ void gemv_mma(const uint8_t* __restrict__ W,
                                         const float* __restrict__ scale,
                                         const __nv_bfloat16* __restrict__ x,
                                         float* __restrict__ y, int M, int N, int K) {
    constexpr int THREADS = NW * 32;
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
        for (int c = tid; c < M * (WIN * KB / 8); c += THREADS) {
            const int m = c / (WIN * KB / 8), ch = c % (WIN * KB / 8);
            const int k = k0 + ch * 8;
            const bool ok = k < K;
            cp_async16(smem_u32(xs + m * XROW + ch * 16), ok ? x + (size_t)m * K + k : x, ok);
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
        const unsigned char* xs = smem + (w % NSTAGE) * M * XROW + 32 * t;
#pragma unroll
        for (int i = 0; i < WIN; ++i) {
            const int kb = kb0 + w * WIN + i;
            if (kb >= kb1) break;  // only the last window may be partial: nothing follows it
            mma_block<NT>(w_regs[i][0], w_regs[i][1], xs + i * KB * 2, M, g, acc);
            load_block(kb + WIN, w_regs[i][0], w_regs[i][1]);  // refill the slot just used
        }
    }

    if constexpr (SPLIT == 1) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int m = 8 * j + 2 * t;
            if (ok_a) {
                const float s = scale[row_a];
                if (m < M) y[(size_t)m * N + row_a] = acc[j][0] * s;
                if (m + 1 < M) y[(size_t)(m + 1) * N + row_a] = acc[j][1] * s;
            }
            if (ok_b) {
                const float s = scale[row_b];
                if (m < M) y[(size_t)m * N + row_b] = acc[j][2] * s;
                if (m + 1 < M) y[(size_t)(m + 1) * N + row_b] = acc[j][3] * s;
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
            if (n < N) y[(size_t)m * N + n] = sum * scale[n];
        }
        cluster.sync();  // no CTA leaves while another still reads its shared memory
    }
}
}  // namespace

// One entry per (rows bucket 8 NT, warps NW, split). MIN_BLOCKS caps the registers so that this
// many CTAs fit on an SM.
#define GEMV_MMA_ENTRY(NAME, NT, NW, SPLIT, MIN_BLOCKS, CLUSTER)                              \
    extern "C" __global__ void CLUSTER __launch_bounds__(NW * 32, MIN_BLOCKS)                  \
    NAME(const uint8_t* __restrict__ W, const float* __restrict__ scale,                      \
         const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int M, int N, int K) {   \
        pdl_wait();                                                                           \
        pdl_launch_dependents();                                                              \
        gemv_mma<NT, NW, SPLIT>(W, scale, x, y, M, N, K);                                      \
    }
#define NO_CLUSTER
#define C2 __cluster_dims__(1, 1, 2)
#define C3 __cluster_dims__(1, 1, 3)
#define C4 __cluster_dims__(1, 1, 4)
#define C6 __cluster_dims__(1, 1, 6)
#define C8 __cluster_dims__(1, 1, 8)
#define GEMV_MMA_SPLITS(PREFIX, NT, NW, MIN_BLOCKS)                 \
    GEMV_MMA_ENTRY(PREFIX##_s1, NT, NW, 1, MIN_BLOCKS, NO_CLUSTER)  \
    GEMV_MMA_ENTRY(PREFIX##_s2, NT, NW, 2, MIN_BLOCKS, C2)          \
    GEMV_MMA_ENTRY(PREFIX##_s3, NT, NW, 3, MIN_BLOCKS, C3)          \
    GEMV_MMA_ENTRY(PREFIX##_s4, NT, NW, 4, MIN_BLOCKS, C4)          \
    GEMV_MMA_ENTRY(PREFIX##_s6, NT, NW, 6, MIN_BLOCKS, C6)          \
    GEMV_MMA_ENTRY(PREFIX##_s8, NT, NW, 8, MIN_BLOCKS, C8)
GEMV_MMA_SPLITS(gemv_mma_fp8_m8_w4, 1, 4, 8)
GEMV_MMA_SPLITS(gemv_mma_fp8_m16_w4, 2, 4, 6)
GEMV_MMA_SPLITS(gemv_mma_fp8_m32_w4, 4, 4, 4)
GEMV_MMA_SPLITS(gemv_mma_fp8_m8_w8, 1, 8, 4)
GEMV_MMA_SPLITS(gemv_mma_fp8_m16_w8, 2, 8, 3)
GEMV_MMA_SPLITS(gemv_mma_fp8_m32_w8, 4, 8, 2)
