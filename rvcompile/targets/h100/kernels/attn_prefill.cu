// Paged prefill attention, flash-attention style: a CTA owns one KV head and BM query rows (a
// query row = one (token, head of the GQA group) pair, token-major), streams the keys its rows
// see in 16-token tiles (one cache block each) and keeps an online softmax in float32; tensor
// cores (mma.sync m16n8k16, bf16 in, f32 out) do Q.K^T and P.V. Each K/V tile is read once for
// all G heads of the KV head.
//
// q [M, KH*G, D] bf16; K/V pools [blocks, 16, KH, D], bf16 or (the _fp8 entries) e4m3; table [M,
// ring], a row per token row: a CTA reads its first token row's for all of its rows, which must
// therefore be one sequence's (a packed prefill starts each sequence at a multiple of the CTA's
// tokens): token t lives in block table[(t / 16) % ring]. Row m's query is at positions[m] and sees
// keys max(0, p - window + 1) .. p (window 0: all); positions[m] < 0 (padding) writes zeros.
// Scale 1.0. out [M, KH*G, D] f32 and, when out_bf16 is not null, its bf16 rounding.
// KEQV entries read one pool of normalised bases: V = base, K = rope(base * wk, t) (half-split,
// angle t * inv_freq[i], rounded step by step like ops.ref_rope).
//
// Warps: WR row groups x WC dim slices (Shape<D>). A warp keeps the output accumulator of 16 rows
// x D/WC dims in registers, and q in registers (decode entries) or in shared memory (prefill
// entries: the accumulators of D = 512 leave no registers for it, and 4 row groups per CTA halve
// the tile loads and K=V ropes per query row against 2); the WC slices' partial scores meet in
// shared memory.
// Accuracy: tensor-core inputs are bf16, so P is split into bf16 hi + lo (two mma) and so is
// the K derived for K=V layers; bf16/e4m3 pool values are exact in bf16. The result then
// matches the float32 reference to ~1e-5 relative, like attn_decode.
// Tiles are double-buffered in dynamic shared memory (attn_prefill.py smem_bytes); the next
// tile's global loads are issued before the current tile's math. Keys outside the CTA's
// [kmin, kmax] in a loaded block are zero-filled, so stale cache bytes never reach P.V.
#include "common.cuh"

namespace {
constexpr int BS = 16;

// DEC: the decode entries' CTA, one row group (16 rows: the G heads of one token, the rest
// padding), so a K/V tile is read once for one sequence's token.
template <int D, bool DEC = false>
struct Shape {
    static constexpr int WC = D >= 256 ? D / 128 : 1;
    static constexpr int WR = DEC ? 1 : 4;
    static constexpr int DS = D / WC;  // dims per warp slice
    static constexpr int THREADS = 32 * WR * WC;
    static constexpr int BM = 16 * WR;
    static constexpr int LD = D + 8;  // shared row stride (bf16): conflict-free fragment loads
    static constexpr int TILE = BS * LD;
    static constexpr int ITEMS = BS * D / 16;  // (key, 8-dim chunk pair) per tile
    static constexpr int IPT = (ITEMS + THREADS - 1) / THREADS;
    static constexpr bool QS = !DEC;  // q in shared memory, BM rows of LD after the tiles
    static constexpr int QTILE = QS ? BM * LD : 0;
};

// Item -> (key, chunk c) of a tile. K=V tiles from D = 128 up: a warp's 32 items are 4 keys x 8
// adjacent chunks (8 lanes read a key's 8 chunks from one span), so a warp's items share their
// chunks and with partial rotary only the warps of rotated chunks call sincosf, instead of a
// quarter of the lanes of every warp while the rest wait (the 31B's full layers' decode attention
// up to 1.29x faster on an H200). Other tiles keep a key's chunks on adjacent lanes: without a
// rope the K=V order gained nothing there (within the measurement's 4% noise).
template <int D, bool KEQV>
__device__ __forceinline__ void item_at(int item, int& key, int& c) {
    if constexpr (KEQV && D / 16 >= 8) {
        c = item % 8 + 8 * (item / (8 * BS));
        key = (item / 8) % BS;
    } else {
        key = item / (D / 16);
        c = item % (D / 16);
    }
}

template <bool FP8> struct Raw { using type = uint4; };  // 8 bf16
template <> struct Raw<true> { using type = uint2; };    // 8 e4m3

__device__ __forceinline__ void to_float(const uint4& r, float f[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 x = __bfloat1622float2(h[j]);
        f[2 * j] = x.x;
        f[2 * j + 1] = x.y;
    }
}

__device__ __forceinline__ void to_float(const uint2& r, float f[8]) {
    const uint32_t w[2] = {r.x, r.y};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>((w[j / 2] >> (16 * (j % 2))) & 0xFFFFu), __NV_E4M3);
        const float2 x = __half22float2(__half2(h));
        f[2 * j] = x.x;
        f[2 * j + 1] = x.y;
    }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint4 pack_bf16x8(const float f[8]) {
    return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                      pack_bf16x2(f[6], f[7]));
}

// x - bf16(x): what the bf16 rounding of x left out
__device__ __forceinline__ float rest_bf16(float x) {
    return x - __bfloat162float(__float2bfloat16_rn(x));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

__device__ __forceinline__ uint32_t lds32(const __nv_bfloat16* p) {
    return *reinterpret_cast<const uint32_t*>(p);
}

__device__ __forceinline__ uint32_t ldg32(const __nv_bfloat16* p) {
    return __ldg(reinterpret_cast<const unsigned int*>(p));
}

// The raw pool chunks of the tile's items: for item (key, c), dims [8c, 8c + 8) and their rope
// partners [D/2 + 8c, ...); zeros for keys outside [kmin, kmax].
template <int D, bool KEQV, bool FP8, bool DEC>
__device__ __forceinline__ void load_tile(int jb, const unsigned char* __restrict__ kc,
                                          const unsigned char* __restrict__ vc,
                                          const int* __restrict__ table, int ring, int kv_heads,
                                          int kvh, int kmin, int kmax,
                                          typename Raw<FP8>::type (&kr)[Shape<D, DEC>::IPT][2],
                                          typename Raw<FP8>::type (&vr)[Shape<D, DEC>::IPT][2]) {
    using S = Shape<D, DEC>;
    using R = typename Raw<FP8>::type;
    constexpr int ES = FP8 ? 1 : 2;
    const size_t block = (size_t)table[jb % ring];
#pragma unroll
    for (int it = 0; it < S::IPT; ++it) {
        const int item = threadIdx.x + it * S::THREADS;
        int key, c;
        item_at<D, KEQV>(item, key, c);
        const int t = jb * BS + key;
        R zero{};
        kr[it][0] = kr[it][1] = vr[it][0] = vr[it][1] = zero;
        if (item < S::ITEMS && t >= kmin && t <= kmax) {
            const size_t off = (((block * BS + key) * kv_heads + kvh) * D + 8 * c) * ES;
            kr[it][0] = *reinterpret_cast<const R*>(kc + off);
            kr[it][1] = *reinterpret_cast<const R*>(kc + off + D / 2 * ES);
            if constexpr (!KEQV) {
                vr[it][0] = *reinterpret_cast<const R*>(vc + off);
                vr[it][1] = *reinterpret_cast<const R*>(vc + off + D / 2 * ES);
            }
        }
    }
}

// Loaded chunks -> the stage's bf16 tiles (K=V: V = base, K = rope(base * wk) as hi + lo).
template <int D, bool KEQV, bool FP8, bool DEC>
__device__ __forceinline__ void store_tile(int jb,
                                           const typename Raw<FP8>::type (&kr)[Shape<D, DEC>::IPT][2],
                                           const typename Raw<FP8>::type (&vr)[Shape<D, DEC>::IPT][2],
                                           const float* __restrict__ wk,
                                           const float* __restrict__ inv_freq,
                                           __nv_bfloat16* sK, __nv_bfloat16* sV,
                                           __nv_bfloat16* sKlo) {
    using S = Shape<D, DEC>;
#pragma unroll
    for (int it = 0; it < S::IPT; ++it) {
        const int item = threadIdx.x + it * S::THREADS;
        if (item >= S::ITEMS) break;
        int key, c;
        item_at<D, KEQV>(item, key, c);
        const int lo_at = key * S::LD + 8 * c, hi_at = lo_at + D / 2;
        if constexpr (!KEQV && !FP8) {
            *reinterpret_cast<uint4*>(sK + lo_at) = kr[it][0];
            *reinterpret_cast<uint4*>(sK + hi_at) = kr[it][1];
            *reinterpret_cast<uint4*>(sV + lo_at) = vr[it][0];
            *reinterpret_cast<uint4*>(sV + hi_at) = vr[it][1];
        } else {
            float a[8], b[8];
            to_float(kr[it][0], a);
            to_float(kr[it][1], b);
            if constexpr (!KEQV) {
                *reinterpret_cast<uint4*>(sK + lo_at) = pack_bf16x8(a);
                *reinterpret_cast<uint4*>(sK + hi_at) = pack_bf16x8(b);
                to_float(vr[it][0], a);
                to_float(vr[it][1], b);
                *reinterpret_cast<uint4*>(sV + lo_at) = pack_bf16x8(a);
                *reinterpret_cast<uint4*>(sV + hi_at) = pack_bf16x8(b);
            } else {
                *reinterpret_cast<uint4*>(sV + lo_at) = pack_bf16x8(a);
                *reinterpret_cast<uint4*>(sV + hi_at) = pack_bf16x8(b);
                const float tpos = (float)(jb * BS + key);
                float kl[8], kh[8], rl[8], rh[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int i = 8 * c + j;
                    const float x = __fmul_rn(a[j], __ldg(wk + i));
                    const float y = __fmul_rn(b[j], __ldg(wk + i + D / 2));
                    float sn = 0.f, cs = 1.f;
                    const float f = __ldg(inv_freq + i);
                    if (f != 0.f) sincosf(__fmul_rn(tpos, f), &sn, &cs);
                    kl[j] = __fsub_rn(__fmul_rn(x, cs), __fmul_rn(y, sn));
                    kh[j] = __fadd_rn(__fmul_rn(y, cs), __fmul_rn(x, sn));
                    rl[j] = rest_bf16(kl[j]);
                    rh[j] = rest_bf16(kh[j]);
                }
                *reinterpret_cast<uint4*>(sK + lo_at) = pack_bf16x8(kl);
                *reinterpret_cast<uint4*>(sK + hi_at) = pack_bf16x8(kh);
                *reinterpret_cast<uint4*>(sKlo + lo_at) = pack_bf16x8(rl);
                *reinterpret_cast<uint4*>(sKlo + hi_at) = pack_bf16x8(rh);
            }
        }
    }
}

// The tile loop both kinds of entry share. The warp's two fragment rows (g and g + 8 of its 16,
// wr-th row group) hold q in qa (S::QS: in the shared q tile, rows 16 wr..) and see keys
// lo[h]..hi[h] (hi < lo: none); the CTA streams the
// tiles holding keys kmin..kmax of the table row `table` (token t in block table[(t / 16) %
// ring]). Out: the unnormalised accumulator o, the running max m and the row sum l (summed over
// the row's quad of lanes).
template <int D, bool KEQV, bool FP8, bool DEC>
__device__ __forceinline__ void attend(
    const uint32_t (*qa)[4], const unsigned char* __restrict__ kc,
    const unsigned char* __restrict__ vc, const int* __restrict__ table, int ring, int kv_heads,
    int kvh, int kmin, int kmax, const int (&lo)[2], const int (&hi)[2],
    const float* __restrict__ wk, const float* __restrict__ inv_freq,
    float (&o)[Shape<D, DEC>::DS / 8][4], float (&m)[2], float (&l)[2]) {
    using S = Shape<D, DEC>;
    using R = typename Raw<FP8>::type;
    constexpr int KSTEPS = S::DS / 16;
    constexpr int NT = S::DS / 8;  // output n8 tiles per warp
    constexpr int TILES = KEQV ? 3 : 2;
    extern __shared__ __align__(16) __nv_bfloat16 stage_mem[];  // [2][TILES][BS][LD], q tile
    __shared__ float red[S::WC > 1 ? S::WR * S::WC * 32 * 8 : 1];
    {
        uint32_t dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (uint32_t)((2 * TILES * S::TILE + S::QTILE) * 2)) __trap();
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wr = warp / S::WC, wc = warp % S::WC;
    // the warp's A fragments in the q tile: lanes 8j..8j+7 address rows of matrix j (rows +8 for
    // odd j, dims +8 from j = 2), as ldmatrix wants
    const __nv_bfloat16* sQ = stage_mem + 2 * TILES * S::TILE +
                              (16 * wr + (lane & 7) + ((lane >> 3) & 1) * 8) * S::LD +
                              wc * S::DS + (lane >> 4) * 8;

#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
    R kr[S::IPT][2], vr[S::IPT][2];
    const int jb_first = kmax >= kmin ? kmin / BS : 0, jb_last = kmax >= kmin ? kmax / BS : -1;
    if (jb_first <= jb_last)
        load_tile<D, KEQV, FP8, DEC>(jb_first, kc, vc, table, ring, kv_heads, kvh, kmin, kmax, kr,
                                     vr);
    for (int jb = jb_first, stage = 0; jb <= jb_last; ++jb, stage ^= 1) {
        __nv_bfloat16* sK = stage_mem + stage * TILES * S::TILE;
        __nv_bfloat16* sV = sK + S::TILE;
        __nv_bfloat16* sKlo = sV + S::TILE;
        store_tile<D, KEQV, FP8, DEC>(jb, kr, vr, wk, inv_freq, sK, sV, sKlo);
        __syncthreads();
        if (jb < jb_last)
            load_tile<D, KEQV, FP8, DEC>(jb + 1, kc, vc, table, ring, kv_heads, kvh, kmin, kmax,
                                         kr, vr);

        // s[n][e]: rows g (e < 2) and g + 8, keys 8n + 2t + (e & 1) of the tile
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const int kd = wc * S::DS + ks * 16 + 2 * t;
            uint32_t a[4];
            if constexpr (S::QS) {
                ldmatrix_x4(a, sQ + ks * 16);
            } else {
#pragma unroll
                for (int f = 0; f < 4; ++f) a[f] = qa[ks][f];
            }
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const int at = (8 * n + g) * S::LD + kd;
                mma_bf16(s[n], a, lds32(sK + at), lds32(sK + at + 8));
                if constexpr (KEQV) mma_bf16(s[n], a, lds32(sKlo + at), lds32(sKlo + at + 8));
            }
        }
        if constexpr (S::WC > 1) {
            float* mine = red + ((wr * S::WC + wc) * 32 + lane) * 8;
#pragma unroll
            for (int e = 0; e < 8; ++e) mine[e] = s[e / 4][e % 4];
            __syncthreads();
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float sum = 0.f;
#pragma unroll
                for (int w = 0; w < S::WC; ++w) sum += red[((wr * S::WC + w) * 32 + lane) * 8 + e];
                s[e / 4][e % 4] = sum;
            }
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e / 2, key = jb * BS + 8 * n + 2 * t + (e & 1);
                if (!(key >= lo[h] && key <= hi[h])) s[n][e] = -INFINITY;
                mx[h] = fmaxf(mx[h], s[n][e]);
            }
        }
        float mu[2], alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float mn = fmaxf(m[h], mx[h]);
            mu[h] = mn == -INFINITY ? 0.f : mn;  // a row with nothing visible yet stays at zero
            alpha[h] = __expf(m[h] - mu[h]);
            m[h] = mn;
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = __expf(s[n][e] - mu[e / 2]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
            l[h] = l[h] * alpha[h] + (s[0][2 * h] + s[0][2 * h + 1] + s[1][2 * h] + s[1][2 * h + 1]);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
        // P as the A operand (rows x 16 keys), rounded to bf16 plus its remainder
        uint32_t ph[4], pl[4];
#pragma unroll
        for (int f = 0; f < 4; ++f) {
            const float x = s[f / 2][2 * (f % 2)], y = s[f / 2][2 * (f % 2) + 1];
            ph[f] = pack_bf16x2(x, y);
            pl[f] = pack_bf16x2(rest_bf16(x), rest_bf16(y));
        }
#pragma unroll
        for (int np = 0; np < S::DS / 16; ++np) {
            const int n0 = wc * S::DS + np * 16;
            uint32_t v[4];
            ldmatrix_x4_trans(v, sV + (((lane >> 3) & 1) * 8 + (lane & 7)) * S::LD + n0 +
                                     (lane >> 4) * 8);
            mma_bf16(o[2 * np], ph, v[0], v[1]);
            mma_bf16(o[2 * np], pl, v[0], v[1]);
            mma_bf16(o[2 * np + 1], ph, v[2], v[3]);
            mma_bf16(o[2 * np + 1], pl, v[2], v[3]);
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
}

// q fragments of the warp's slice for the two rows (zeros for a row that is not `live`)
template <int D, bool DEC>
__device__ __forceinline__ void load_q(uint32_t (&qa)[Shape<D, DEC>::DS / 16][4],
                                       const __nv_bfloat16* __restrict__ q,
                                       const size_t (&row)[2], const bool (&live)[2]) {
    using S = Shape<D, DEC>;
    const int lane = threadIdx.x & 31, t = lane & 3, wc = (threadIdx.x >> 5) % S::WC;
#pragma unroll
    for (int ks = 0; ks < S::DS / 16; ++ks) {
        const int d0 = wc * S::DS + ks * 16 + 2 * t;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const __nv_bfloat16* qrow = q + row[h] * D + d0;
            qa[ks][h] = live[h] ? ldg32(qrow) : 0u;
            qa[ks][h + 2] = live[h] ? ldg32(qrow + 8) : 0u;
        }
    }
}

// Row h (0: g, 1: g + 8) of the warp's output fragments times `scale` into row `at` of out
// [.., D] and, when out_bf16 is not null, its bf16 rounding.
template <int D, bool DEC>
__device__ __forceinline__ void store_row(float* __restrict__ out,
                                          __nv_bfloat16* __restrict__ out_bf16, size_t at,
                                          const float (&o)[Shape<D, DEC>::DS / 8][4], int h,
                                          float scale) {
    using S = Shape<D, DEC>;
    const int t = threadIdx.x & 3, wc = (threadIdx.x >> 5) % S::WC;
#pragma unroll
    for (int n = 0; n < S::DS / 8; ++n) {
        const int col = wc * S::DS + n * 8 + 2 * t;
        const float x = o[n][2 * h] * scale, y = o[n][2 * h + 1] * scale;
        *reinterpret_cast<float2*>(out + at * D + col) = make_float2(x, y);
        if (out_bf16) *reinterpret_cast<uint32_t*>(out_bf16 + at * D + col) = pack_bf16x2(x, y);
    }
}

template <int D, int G, bool KEQV, bool FP8>
__device__ __forceinline__ void attn_prefill(
    const __nv_bfloat16* __restrict__ q, const unsigned char* __restrict__ kc,
    const unsigned char* __restrict__ vc, const int* __restrict__ table, int ring,
    const int* __restrict__ positions, int window, int kv_heads, int rows,
    const float* __restrict__ wk, const float* __restrict__ inv_freq, float* __restrict__ out,
    __nv_bfloat16* __restrict__ out_bf16) {
    using S = Shape<D>;
    constexpr int TOK = S::BM / G;  // tokens per CTA
    constexpr int NT = S::DS / 8;
    static_assert(S::BM % G == 0 && TOK <= S::THREADS, "group does not tile the CTA's rows");
    __shared__ int key_range[2];
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, wr = warp / S::WC;
    const int kvh = blockIdx.y, nh = kv_heads * G, tok0 = blockIdx.x * TOK;
    table += (size_t)tok0 * ring;  // the CTA's sequence's row

    if (threadIdx.x == 0) {
        key_range[0] = 0x7fffffff;
        key_range[1] = -1;
    }
    __syncthreads();
    if (threadIdx.x < TOK && tok0 + (int)threadIdx.x < rows) {
        const int p = positions[tok0 + threadIdx.x];
        if (p >= 0) {
            atomicMin(&key_range[0], window > 0 ? max(0, p - window + 1) : 0);
            atomicMax(&key_range[1], p);
        }
    }
    __syncthreads();

    // the CTA's q rows into the q tile after the stages (zeros for padding rows); attend's first
    // barrier orders these stores before its fragment loads
    {
        extern __shared__ __align__(16) __nv_bfloat16 stage_mem[];
        __nv_bfloat16* sq = stage_mem + 2 * (KEQV ? 3 : 2) * S::TILE;
        for (int i = threadIdx.x; i < S::BM * D / 8; i += S::THREADS) {
            const int r = i / (D / 8), c8 = i % (D / 8), tk = tok0 + r / G;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (tk < rows && positions[tk] >= 0)
                v = __ldg(reinterpret_cast<const uint4*>(
                    q + ((size_t)tk * nh + kvh * G + r % G) * D + 8 * c8));
            *reinterpret_cast<uint4*>(sq + r * S::LD + 8 * c8) = v;
        }
    }
    // this thread's two fragment rows: r and r + 8 of the warp's 16
    int tok[2], head[2], pos[2], lo[2];
    size_t qrow[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 16 * wr + g + 8 * h;
        tok[h] = tok0 + r / G;
        head[h] = kvh * G + r % G;
        pos[h] = tok[h] < rows ? positions[tok[h]] : -1;
        lo[h] = window > 0 ? max(0, pos[h] - window + 1) : 0;
        qrow[h] = (size_t)tok[h] * nh + head[h];
    }
    float o[NT][4], m[2], l[2];
    attend<D, KEQV, FP8, false>(nullptr, kc, vc, table, ring, kv_heads, kvh, key_range[0],
                                key_range[1], lo, pos, wk, inv_freq, o, m, l);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (tok[h] < rows)
            store_row<D, false>(out, out_bf16, qrow[h], o, h, pos[h] >= 0 ? 1.f / l[h] : 0.f);
    }
}

// The decode entries (attn_decode.py's tc_entry): attn_decode's split kernel contract on tensor
// cores. A CTA owns (split, KV head, sequence b): rows 0..G-1 of its one row group are the query
// heads of b's token at pos = seq_len[b] - 1, split as attn_decode.cu splits the visible keys;
// it writes that split's unnormalised acc and (m, l) for attn_decode_combine, or with out given
// (one split) what the combine would, bit for bit.
template <int D, int G, bool KEQV, bool FP8>
__device__ __forceinline__ void attn_decode_tc(
    const __nv_bfloat16* __restrict__ q, const unsigned char* __restrict__ kc,
    const unsigned char* __restrict__ vc, const int* __restrict__ table, int max_blocks,
    int ring, const int* __restrict__ seq_len, int window, int kv_heads,
    const float* __restrict__ wk, const float* __restrict__ inv_freq,
    float* __restrict__ part_acc, float* __restrict__ part_ml, float* __restrict__ out,
    __nv_bfloat16* __restrict__ out_bf16) {
    using S = Shape<D, true>;
    constexpr int NT = S::DS / 8;
    static_assert(G <= S::BM, "a group fills at most one row group");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wc = (threadIdx.x >> 5) % S::WC;
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, splits = gridDim.x;
    const int nh = kv_heads * G;
    const int pos = seq_len[b] - 1;
    const int first = window > 0 ? max(0, pos - window + 1) : 0;
    const int per = (pos - first + splits) / splits;
    const int s0 = first + split * per, s1 = min(pos + 1, s0 + per);

    int head[2], lo[2], hi[2];
    size_t qrow[2];
    bool live[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        live[h] = r < G;
        head[h] = kvh * G + (live[h] ? r : 0);
        qrow[h] = (size_t)b * nh + head[h];
        lo[h] = s0;
        hi[h] = live[h] ? s1 - 1 : s0 - 1;  // padding rows see nothing
    }
    uint32_t qa[S::DS / 16][4];
    load_q<D, true>(qa, q, qrow, live);
    float o[NT][4], m[2], l[2];
    attend<D, KEQV, FP8, true>(qa, kc, vc, table + (size_t)b * max_blocks, ring, kv_heads, kvh,
                               s0, s1 - 1, lo, hi, wk, inv_freq, o, m, l);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (!live[h]) continue;
        if (out) {  // one split: attn_decode_combine's result, bit for bit (its weight is 1)
            store_row<D, true>(out, out_bf16, qrow[h], o, h, 1.f / l[h]);
            continue;
        }
        const size_t part = qrow[h] * splits + split;
        store_row<D, true>(part_acc, nullptr, part, o, h, 1.f);  // x * 1 is x: unscaled
        if (wc == 0 && t == 0) {
            part_ml[part * 2] = m[h];
            part_ml[part * 2 + 1] = l[h];
        }
    }
}
}  // namespace

#define PREFILL_ENTRIES(D, G, SUFFIX, FP8)                                                      \
    extern "C" __global__ void __launch_bounds__(Shape<D>::THREADS)                            \
        attn_prefill_d##D##_g##G##SUFFIX(                                                       \
            const __nv_bfloat16* q, const unsigned char* kc, const unsigned char* vc,          \
            const int* table, int ring, const int* positions, int window, int kv_heads,        \
            int rows, float* out, __nv_bfloat16* out_bf16) {                                    \
        pdl_wait();                                                                             \
        pdl_launch_dependents();                                                                \
        attn_prefill<D, G, false, FP8>(q, kc, vc, table, ring, positions, window, kv_heads,    \
                                       rows, nullptr, nullptr, out, out_bf16);                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(Shape<D>::THREADS)                            \
        attn_prefill_keqv_d##D##_g##G##SUFFIX(                                                  \
            const __nv_bfloat16* q, const unsigned char* base, const int* table, int ring,     \
            const int* positions, int window, int kv_heads, int rows, const float* wk,         \
            const float* inv_freq, float* out, __nv_bfloat16* out_bf16) {                       \
        pdl_wait();                                                                             \
        pdl_launch_dependents();                                                                \
        attn_prefill<D, G, true, FP8>(q, base, nullptr, table, ring, positions, window,         \
                                      kv_heads, rows, wk, inv_freq, out, out_bf16);            \
    }
#define DECODE_TC_ENTRIES(D, G, SUFFIX, FP8)                                                    \
    extern "C" __global__ void __launch_bounds__(Shape<D, true>::THREADS)                      \
        attn_decode_tc_d##D##_g##G##SUFFIX(                                                     \
            const __nv_bfloat16* q, const unsigned char* kc, const unsigned char* vc,          \
            const int* table, int max_blocks, int ring, const int* seq_len, int window,        \
            int kv_heads, float* part_acc, float* part_ml, float* out,                          \
            __nv_bfloat16* out_bf16) {                                                          \
        pdl_wait();                                                                             \
        pdl_launch_dependents();                                                                \
        attn_decode_tc<D, G, false, FP8>(q, kc, vc, table, max_blocks, ring, seq_len, window,  \
                                         kv_heads, nullptr, nullptr, part_acc, part_ml, out,    \
                                         out_bf16);                                             \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(Shape<D, true>::THREADS)                      \
        attn_decode_tc_keqv_d##D##_g##G##SUFFIX(                                                \
            const __nv_bfloat16* q, const unsigned char* base, const int* table,               \
            int max_blocks, int ring, const int* seq_len, int window, int kv_heads,            \
            const float* wk, const float* inv_freq, float* part_acc, float* part_ml,            \
            float* out, __nv_bfloat16* out_bf16) {                                              \
        pdl_wait();                                                                             \
        pdl_launch_dependents();                                                                \
        attn_decode_tc<D, G, true, FP8>(q, base, nullptr, table, max_blocks, ring, seq_len,    \
                                        window, kv_heads, wk, inv_freq, part_acc, part_ml,      \
                                        out, out_bf16);                                         \
    }
#define PREFILL_ENTRY(D, G)              \
    PREFILL_ENTRIES(D, G, , false)       \
    PREFILL_ENTRIES(D, G, _fp8, true)    \
    DECODE_TC_ENTRIES(D, G, , false)     \
    DECODE_TC_ENTRIES(D, G, _fp8, true)
PREFILL_ENTRY(32, 1)
PREFILL_ENTRY(32, 2)
PREFILL_ENTRY(32, 4)
PREFILL_ENTRY(32, 8)
PREFILL_ENTRY(32, 16)
PREFILL_ENTRY(64, 1)
PREFILL_ENTRY(64, 2)
PREFILL_ENTRY(64, 4)
PREFILL_ENTRY(64, 8)
PREFILL_ENTRY(64, 16)
PREFILL_ENTRY(128, 1)
PREFILL_ENTRY(128, 2)
PREFILL_ENTRY(128, 4)
PREFILL_ENTRY(128, 8)
PREFILL_ENTRY(128, 16)
PREFILL_ENTRY(256, 1)
PREFILL_ENTRY(256, 2)
PREFILL_ENTRY(256, 4)
PREFILL_ENTRY(256, 8)
PREFILL_ENTRY(256, 16)
PREFILL_ENTRY(512, 1)
PREFILL_ENTRY(512, 2)
PREFILL_ENTRY(512, 4)
PREFILL_ENTRY(512, 8)
PREFILL_ENTRY(512, 16)
