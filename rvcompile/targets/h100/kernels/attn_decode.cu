// Paged split-KV decode attention (one query token per sequence), GQA-grouped: a CTA owns one
// (sequence, KV head, split) and reads each K/V row once for all G query heads of that KV head.
//
// q [B, KH*G, D] bf16; K/V pools [blocks, BS, KH, D] bf16; block_table [B, max_blocks] int32.
// Token t of sequence b lives in block table[b, (t / BS) % ring] (ring = max_blocks for full
// layers; sliding layers reuse a ring of blocks). The query sits at pos = seq_len[b] - 1 and sees
// keys max(0, pos - window + 1) .. pos (window 0: all). Scores use scale 1.0 (Gemma 4).
// Partial results (unnormalised acc, running max m, sum l) per split go to global memory;
// attn_decode_combine merges the splits into out [B, KH*G, D] float32. With out given (one split:
// grid x = 1), the kernel writes what the combine would, bit for bit, and no partials.
//
// Registers: each lane holds VEC = D/32 dims of q and acc for GW heads. When G*VEC > 64 the G
// heads are spread over HS warps (HS = G*VEC/64) and the remaining 4/HS warps split the keys.
// Head dims: 256 and 512 (Gemma 4) read a row share as 16-byte chunks; 32, 64 and 128 (the tiny
// test models) as one narrower load of VEC bf16 per lane. Groups: 1, 2, 4, 8, 16.
// The _fp8 entries read e4m3 pools (an FP8-KV build): one load of VEC bytes per lane and row,
// widened exactly to f32; everything after is the bf16 entries' math.
// The _f32 entries (the float32 plan) read q and the pools as float32 (16-byte chunks from D = 128
// up, else one load of VEC floats per lane); nothing is rounded. attn_prefill.cu is bf16/e4m3
// only (tensor cores), so the float32 plan runs prefill chunks through these, one row each.
#include "common.cuh"

namespace {
constexpr int BS = 16;
constexpr int WARPS = 4;

// The keys [s0, s1) split `split` of `splits` takes of sequence b's visible keys (its query at
// seq_len[b] - 1 sees the window before it; window 0: all): equal shares, the last one shorter
// or empty
__device__ __forceinline__ void split_keys(const int* __restrict__ seq_len, int b, int window,
                                           int split, int splits, int& s0, int& s1) {
    const int pos = seq_len[b] - 1;
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int per = (pos - lo + splits) / splits;
    s0 = lo + split * per;
    s1 = min(pos + 1, s0 + per);
}

template <int VEC>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* p, float out[VEC]) {
    if constexpr (VEC >= 8) {
#pragma unroll
        for (int c = 0; c < VEC / 8; ++c) {
            const uint4 v = *reinterpret_cast<const uint4*>(p + 8 * c);
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 f = __bfloat1622float2(h[j]);
                out[8 * c + 2 * j] = f.x;
                out[8 * c + 2 * j + 1] = f.y;
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[i] = __bfloat162float(p[i]);
    }
}

template <int VEC>
__device__ __forceinline__ void load_f32(const float* p, float out[VEC]) {
    if constexpr (VEC >= 4) {
#pragma unroll
        for (int c = 0; c < VEC / 4; ++c) {
            const float4 v = *reinterpret_cast<const float4*>(p + 4 * c);
            out[4 * c] = v.x;
            out[4 * c + 1] = v.y;
            out[4 * c + 2] = v.z;
            out[4 * c + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[i] = p[i];
    }
}

// VEC e4m3 bytes -> f32 (exact: e4m3 -> f16 is)
template <int VEC>
__device__ __forceinline__ void load_fp8(const unsigned char* p, float out[VEC]) {
    if constexpr (VEC == 1) {
        out[0] = __half2float(__half(__nv_cvt_fp8_to_halfraw(p[0], __NV_E4M3)));
    } else {
#pragma unroll
        for (int j = 0; j < VEC / 2; ++j) {
            const __nv_fp8x2_storage_t pair =
                *reinterpret_cast<const __nv_fp8x2_storage_t*>(p + 2 * j);
            const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
            out[2 * j] = f.x;
            out[2 * j + 1] = f.y;
        }
    }
}

// The raw type of one lane's share of a K/V row: 16-byte chunks from D = 256 up (VEC >= 8),
// else a single load of exactly VEC bf16 (D = 128, 64, 32). FP8: one load of VEC bytes.
template <int VEC, bool FP8 = false> struct LaneShare { using type = uint4; };
template <> struct LaneShare<4> { using type = uint2; };
template <> struct LaneShare<2> { using type = uint32_t; };
template <> struct LaneShare<1> { using type = uint16_t; };
template <> struct LaneShare<16, true> { using type = uint4; };
template <> struct LaneShare<8, true> { using type = uint2; };
template <> struct LaneShare<4, true> { using type = uint32_t; };
template <> struct LaneShare<2, true> { using type = uint16_t; };
template <> struct LaneShare<1, true> { using type = uint8_t; };

// float32 pools (F32): 16-byte chunks of 4 floats from VEC = 4 up, else one load of VEC floats
template <int VEC> struct F32Share { using type = uint4; };
template <> struct F32Share<2> { using type = uint2; };
template <> struct F32Share<1> { using type = uint32_t; };

template <bool B, typename T, typename F> struct Pick { using type = T; };
template <typename T, typename F> struct Pick<false, T, F> { using type = F; };

// a pool element: bf16, an e4m3 byte (FP8) or a float (F32); q is float32 for F32, else bf16
template <bool FP8, bool F32 = false> struct Elem { using type = __nv_bfloat16; };
template <> struct Elem<true> { using type = unsigned char; };
template <> struct Elem<false, true> { using type = float; };
template <bool F32> struct Query { using type = __nv_bfloat16; };
template <> struct Query<true> { using type = float; };

// One lane's share of a K/V row, as loaded (packed), widened to f32.
template <int VEC, bool FP8, bool F32, typename Raw>
__device__ __forceinline__ void widen(const Raw* raw, float out[VEC]) {
    if constexpr (FP8) {
        load_fp8<VEC>(reinterpret_cast<const unsigned char*>(raw), out);
    } else if constexpr (F32) {
        load_f32<VEC>(reinterpret_cast<const float*>(raw), out);
    } else {
        load_bf16<VEC>(reinterpret_cast<const __nv_bfloat16*>(raw), out);
    }
}

// The CTA's result from its warps' (m, l, acc): warp (hc, kl) holds the GW heads of chunk hc
// over its share of the keys, dims lane * VEC.. of each. Merges the KP warps that share a head
// chunk (kl = 0 keeps the result) and writes the split's partials, or with `out` (one split)
// what attn_decode_combine would, bit for bit.
template <int D, int G, int GW = G / ((G * D / 32 > 64) ? (G * D / 32 / 64) : 1)>
__device__ __forceinline__ void write_split(const float (&m)[GW], const float (&l)[GW],
                                            const float (&acc)[GW][D / 32], int b, int kh,
                                            int split, int splits, int kv_heads,
                                            float* __restrict__ part_acc,
                                            float* __restrict__ part_ml, float* __restrict__ out,
                                            __nv_bfloat16* __restrict__ out_bf16) {
    constexpr int VEC = D / 32;
    constexpr int HS = G / GW;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hc = warp % HS, kl = warp / HS;
    const int nh = kv_heads * G;
    __shared__ float s_ml[WARPS][GW][2];
    __shared__ float s_acc[WARPS][GW][D];
#pragma unroll
    for (int g = 0; g < GW; ++g) {
        if (lane == 0) {
            s_ml[warp][g][0] = m[g];
            s_ml[warp][g][1] = l[g];
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) s_acc[warp][g][lane * VEC + i] = acc[g][i];
    }
    __syncthreads();
    if (kl != 0) return;
#pragma unroll
    for (int g = 0; g < GW; ++g) {
        float mt = -INFINITY;
        for (int w = hc; w < WARPS; w += HS) mt = fmaxf(mt, s_ml[w][g][0]);
        float lt = 0.f, acc_out[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc_out[i] = 0.f;
        for (int w = hc; w < WARPS; w += HS) {
            const float f = s_ml[w][g][0] == -INFINITY ? 0.f : __expf(s_ml[w][g][0] - mt);
            lt += s_ml[w][g][1] * f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc_out[i] += s_acc[w][g][lane * VEC + i] * f;
        }
        const int head = kh * G + hc * GW + g;
        if (out) {  // one split: attn_decode_combine's result, bit for bit (its weight is 1)
            const float inv = 1.f / lt;
            const size_t at = ((size_t)b * nh + head) * D + lane * VEC;
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                out[at + i] = acc_out[i] * inv;
                if (out_bf16) out_bf16[at + i] = __float2bfloat16(acc_out[i] * inv);
            }
            continue;
        }
        const size_t base = ((size_t)b * nh + head) * splits + split;
        float* dst = part_acc + base * D + lane * VEC;
#pragma unroll
        for (int i = 0; i < VEC; ++i) dst[i] = acc_out[i];
        if (lane == 0) {
            part_ml[base * 2] = mt;
            part_ml[base * 2 + 1] = lt;
        }
    }
}

// KEQV: the pool `kc` holds each token's normalised base once (K=V layers); V = base and
// K = rope(base * wk, t) is derived here. The rope partner of dim i is i +- D/2, held by lane ^ 16
// at the same register index (D/2 = 16 lanes * VEC dims for every head dim).
template <int D, int G, bool KEQV, bool FP8, bool F32 = false>
__device__ void attn_partial(const typename Query<F32>::type* __restrict__ q,
                             const typename Elem<FP8, F32>::type* __restrict__ kc,
                             const typename Elem<FP8, F32>::type* __restrict__ vc,
                             const int* __restrict__ table, int max_blocks, int ring,
                             const int* __restrict__ seq_len, int window, int kv_heads,
                             const float* __restrict__ wk, const float* __restrict__ inv_freq,
                             float* __restrict__ part_acc, float* __restrict__ part_ml,
                             float* __restrict__ out, __nv_bfloat16* __restrict__ out_bf16) {
    constexpr int VEC = D / 32;
    constexpr int HS = (G * VEC > 64) ? (G * VEC / 64) : 1;
    constexpr int GW = G / HS;
    constexpr int KP = WARPS / HS;
    static_assert(HS <= WARPS && G % HS == 0, "group too large for one CTA");
    const int split = blockIdx.x, kh = blockIdx.y, b = blockIdx.z, splits = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hc = warp % HS, kl = warp / HS;
    const int nh = kv_heads * G;
    int s0, s1;
    split_keys(seq_len, b, window, split, splits, s0, s1);

    float qr[GW][VEC], acc[GW][VEC], m[GW], l[GW];
#pragma unroll
    for (int g = 0; g < GW; ++g) {
        const int head = kh * G + hc * GW + g;
        if constexpr (F32) {
            load_f32<VEC>(q + ((size_t)b * nh + head) * D + lane * VEC, qr[g]);
        } else {
            load_bf16<VEC>(q + ((size_t)b * nh + head) * D + lane * VEC, qr[g]);
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
    }
    // UNROLL keys' K and V rows are loaded (packed) before any is used, so several loads per
    // lane are in flight instead of one; then their scores are computed independently (UNROLL x
    // GW warp sums in flight, not one key's after the other's) and the running softmax is
    // updated once per UNROLL keys: one max and one rescale of acc, not one per key.
    constexpr int UNROLL = VEC == 16 ? 2 : 4;
    constexpr int CH = F32 ? (VEC >= 4 ? VEC / 4 : 1)
                           : (VEC >= 8 && !FP8) ? VEC / 8 : 1;  // loads per lane per row
    constexpr int STRIDE = F32 ? 4 : 8;  // pool elements per load when CH > 1
    using Raw = typename Pick<F32, typename F32Share<VEC>::type,
                              typename LaneShare<VEC, FP8>::type>::type;
    float wkr[KEQV ? VEC : 1];
    if constexpr (KEQV) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) wkr[i] = wk[lane * VEC + i];
    }
    // K=V: the rope's cos and sin for the tile's TILE keys, computed once per CTA (each
    // (key, frequency) by one thread) rather than by every warp and lane that reads the key:
    // the warps sharing a key (HS of them) and the rope partners (lanes l, l ^ 16) share one
    // frequency, and sincosf was most of the kernel's work.
    constexpr int TILE = KP * UNROLL;  // keys the CTA's warps take per pass of the loop
    constexpr int HALF = D / 2;
    __shared__ float s_cos[KEQV ? TILE : 1][KEQV ? HALF : 1];
    __shared__ float s_sin[KEQV ? TILE : 1][KEQV ? HALF : 1];
    const int* row_table = table + (size_t)b * max_blocks;
    // At head dim 512 the loads run one pass ahead: while a pass's keys are scored and summed,
    // the next pass's K and V rows (and their block-table entries) are already in flight
    // (the E4B's full layers 1.2-1.35x faster from 8 lanes up, H200). At 256 the extra
    // registers cost more than the overlap gains (0.9x at 256 lanes: the kernel is issue-bound).
    constexpr bool AHEAD = VEC == 16;
    Raw knext[UNROLL][CH], vnext[UNROLL][CH];
    const auto load_pass = [&](int tile) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = tile + kl + u * KP;
            if (t < s1) {
                const int block = row_table[(t / BS) % ring];
                const size_t off =
                    (((size_t)block * BS + t % BS) * kv_heads + kh) * D + lane * VEC;
#pragma unroll
                for (int c = 0; c < CH; ++c) {
                    knext[u][c] = *reinterpret_cast<const Raw*>(kc + off + STRIDE * c);
                    if constexpr (!KEQV)
                        vnext[u][c] = *reinterpret_cast<const Raw*>(vc + off + STRIDE * c);
                }
            }
        }
    };
    if constexpr (AHEAD) load_pass(s0);
    // The loop runs the same passes in every warp (the K=V tables' barriers need that); warp kl
    // takes keys tile + kl + u * KP.
    for (int tile = s0; tile < s1; tile += TILE) {
        if constexpr (KEQV) {
            __syncthreads();  // every warp is done with the last tile's table
            for (int j = threadIdx.x; j < TILE * HALF; j += WARPS * 32) {
                const int t = tile + j / HALF;
                const float f = inv_freq[j % HALF];
                float sn = 0.f, cs = 1.f;
                if (t < s1 && f != 0.f) sincosf(__fmul_rn((float)t, f), &sn, &cs);
                s_cos[j / HALF][j % HALF] = cs;
                s_sin[j / HALF][j % HALF] = sn;
            }
            __syncthreads();
        }
        if constexpr (!AHEAD) load_pass(tile);
        Raw kraw[UNROLL][CH], vraw[UNROLL][CH];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                kraw[u][c] = knext[u][c];
                if constexpr (!KEQV) vraw[u][c] = vnext[u][c];
            }
        }
        if constexpr (AHEAD) {
            if (tile + TILE < s1) load_pass(tile + TILE);
        }
        const int t0 = tile + kl;
        if (t0 >= s1) continue;
        // sc[u][g]: key u's score for head g, then its softmax weight
        float sc[UNROLL][GW];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const bool live = t0 + u * KP < s1;  // the same for every lane of the warp
            float k[VEC];
            widen<VEC, FP8, F32>(kraw[u], k);
            if constexpr (KEQV) {
                const float* cs = s_cos[kl + u * KP] + (lane * VEC) % HALF;
                const float* sn = s_sin[kl + u * KP] + (lane * VEC) % HALF;
#pragma unroll
                for (int i = 0; i < VEC; ++i) {
                    const float kw = __fmul_rn(k[i], wkr[i]);
                    const float partner = __shfl_xor_sync(0xffffffffu, kw, 16);
                    k[i] = kw * cs[i] + (lane < 16 ? -partner : partner) * sn[i];
                }
            }
#pragma unroll
            for (int g = 0; g < GW; ++g) {
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < VEC; ++i) s = fmaf(qr[g][i], k[i], s);
                sc[u][g] = live ? s : 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int g = 0; g < GW; ++g) sc[u][g] = warp_sum(sc[u][g]);
        }
#pragma unroll
        for (int g = 0; g < GW; ++g) {
            float mn = m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (t0 + u * KP < s1) mn = fmaxf(mn, sc[u][g]);
            const float alpha = __expf(m[g] - mn);
            l[g] *= alpha;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[g][i] *= alpha;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                sc[u][g] = t0 + u * KP < s1 ? __expf(sc[u][g] - mn) : 0.f;
                l[g] += sc[u][g];
            }
            m[g] = mn;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (t0 + u * KP >= s1) break;
            float v[VEC];  // K=V: V is the stored base itself
            if constexpr (KEQV) {
                widen<VEC, FP8, F32>(kraw[u], v);
            } else {
                widen<VEC, FP8, F32>(vraw[u], v);
            }
#pragma unroll
            for (int g = 0; g < GW; ++g) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[g][i] = fmaf(sc[u][g], v[i], acc[g][i]);
            }
        }
    }
    write_split<D, G>(m, l, acc, b, kh, split, splits, kv_heads, part_acc, part_ml, out,
                      out_bf16);
}

// ------------------------------------------------------------------ tensor-core scores
// Entries at head dim 256 (MMA_SCORES below: the sliding layers of Gemma 4's sizes but the E2B)
// score their keys on tensor cores: a warp takes 16 keys at a time
// (one cache block), and one mma.sync m16n8k16 per 16 dims gives S^T = K . Q^T (keys x the
// group's heads, columns beyond G zero). bf16 pools feed K and q to a bf16 mma as they are;
// e4m3 pools widen K to f16 exactly, and q's bf16 is exact in f16 in f16's normal range
// (2^-14 .. 65504; q is RMS-normed). Products are exact and summed in f32, so the scores are
// the f32 loop's to rounding. P.V stays on CUDA cores (every lane its 8 dims of each key) with
// each key's weights broadcast from the fragment that holds them. This replaces the f32 loop's
// per-key widening, 16 FMAs and two 32-lane sums per head with (at most) 4 conversions and one
// mma per 16 keys: that loop was issue-bound (71% of the SMs' issue slots at 256 lanes, e4m3,
// H200 ncu).
// A thread's k-step s takes dims 64t + 4s .. 64t + 4s + 3 of its keys and of q (t = lane % 4):
// the fragments' column order permuted the same way on both sides, so each thread reads its
// keys' 64 contiguous dims instead of 2-dim pieces.
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t two) {  // the low 16 bits, exactly
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ uint32_t bf16x2_f16x2(uint32_t two) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&two));
    const __half2 h = __floats2half2_rn(f.x, f.y);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Which entries take it: e4m3 pools at groups 1, 2, 4 (1.2-1.7x the f32 loop from 8 lanes up,
// H200); bf16 pools at group 4 only (the E4B's sliding layers: up to 1.7x at 256 lanes), as
// bf16 group 2 (the 31B's) holds 223 registers, 2 CTAs an SM, and lost to the f32 loop at short
// contexts (0.82x at 256 lanes of 129 tokens; 1.06x at 1200)
template <int D, int G, bool FP8, bool F32>
constexpr bool MMA_SCORES = !F32 && D == 256 && (FP8 ? G <= 4 : G == 4);
// CTAs an SM must hold (launch bounds): 3 for the tensor-core-scored e4m3 entries, whose group
// 4 would otherwise take 179 registers and fit 2; none (0: the compiler's choice) for the rest
template <int D, int G, bool FP8, bool F32>
constexpr int SPLIT_CTAS = MMA_SCORES<D, G, FP8, F32> && FP8 ? 3 : 0;

// One lane's 8 dims of one key of V, as loaded: 8 bytes of e4m3 or 16 of bf16
template <bool FP8> struct VShare { using type = uint4; };
template <> struct VShare<true> { using type = uint2; };

template <int G, bool FP8>
__device__ void attn_partial_mma(const __nv_bfloat16* __restrict__ q,
                                 const typename Elem<FP8>::type* __restrict__ kc,
                                 const typename Elem<FP8>::type* __restrict__ vc,
                                 const int* __restrict__ table, int max_blocks, int ring,
                                 const int* __restrict__ seq_len, int window, int kv_heads,
                                 float* __restrict__ part_acc, float* __restrict__ part_ml,
                                 float* __restrict__ out, __nv_bfloat16* __restrict__ out_bf16) {
    constexpr int D = 256, VEC = 8;
    constexpr int KW = FP8 ? 4 : 8;  // 16-byte loads of a key's 64 dims
    // e4m3 tiles are small enough to read one ahead (the next tile's K during this tile's
    // softmax and P.V, its V during the next scores); bf16 ones (twice the registers) are read
    // when their tile starts, 16 KB a warp in flight
    constexpr bool AHEAD = FP8;
    using VRaw = typename VShare<FP8>::type;
    const int split = blockIdx.x, kh = blockIdx.y, b = blockIdx.z, splits = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nh = kv_heads * G;
    int s0, s1;
    split_keys(seq_len, b, window, split, splits, s0, s1);

    const int* row_table = table + (size_t)b * max_blocks;
    // keys outside [s0, s1) are not read: K's give no score and V's are zeros, so stale or
    // poisoned cache bytes never meet a weight
    uint4 kr[2][KW];  // keys g and g + 8 of the tile, dims 64t .. 64t + 63
    VRaw vr[BS];      // every key of the tile, dims 8 lane .. 8 lane + 7
    const auto load_k = [&](int jb) {
        const size_t block = row_table[jb % ring];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = g + 8 * h, key = jb * BS + r;
            const uint4* src = reinterpret_cast<const uint4*>(
                kc + ((block * BS + r) * kv_heads + kh) * D + 64 * t);
#pragma unroll
            for (int c = 0; c < KW; ++c)
                kr[h][c] = key >= s0 && key < s1 ? src[c] : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    const auto load_v = [&](int jb) {
        const size_t block = row_table[jb % ring];
#pragma unroll
        for (int r = 0; r < BS; ++r) {
            const int key = jb * BS + r;
            vr[r] = key >= s0 && key < s1
                        ? *reinterpret_cast<const VRaw*>(
                              vc + ((block * BS + r) * kv_heads + kh) * D + lane * VEC)
                        : VRaw{};
        }
    };
    // warp w takes the blocks s0 / BS + w, + WARPS, ...: each holds at least one key of
    // [s0, s1), so every tile's max is finite. The first tile is read before q (whose
    // conversion would otherwise hold the issue of these loads until q arrives).
    const int last = s1 > s0 ? (s1 - 1) / BS : -1;
    int jb = s0 / BS + warp;
    if (jb <= last) {
        load_k(jb);
        load_v(jb);
    }
    // q's B fragments: column g is head g of the group (zeros from G); k-step s, dims
    // 64t + 4s .. + 1 (b0) and + 2 .. + 3 (b1); f16 for the e4m3 entries' mma
    uint32_t qf[16][2];
    {
        const bool head = g < G;
        const uint4* row = reinterpret_cast<const uint4*>(
            q + ((size_t)b * nh + kh * G + (head ? g : 0)) * D + 64 * t);
        const auto operand = [](uint32_t w) { return FP8 ? bf16x2_f16x2(w) : w; };
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const uint4 w = head ? row[c] : make_uint4(0u, 0u, 0u, 0u);
            qf[2 * c][0] = operand(w.x);
            qf[2 * c][1] = operand(w.y);
            qf[2 * c + 1][0] = operand(w.z);
            qf[2 * c + 1][1] = operand(w.w);
        }
    }
    float m[G], l[G], acc[G][VEC];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[h][i] = 0.f;
    }
    // the running max of the fragment's heads 2t and 2t + 1: m[2t], m[2t + 1] as every lane
    // keeps them (the same fmaxf of the same values), held here without indexing m by lane
    float mf[2] = {-INFINITY, -INFINITY};
    for (; jb <= last; jb += WARPS) {
        if constexpr (!AHEAD) {
            if (jb != s0 / BS + warp) {
                load_k(jb);
                load_v(jb);
            }
        }
        float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // two mma chains
#pragma unroll
        for (int s = 0; s < 16; ++s) {
            if constexpr (FP8) {
                const uint32_t k0 = reinterpret_cast<const uint32_t*>(kr[0])[s];
                const uint32_t k8 = reinterpret_cast<const uint32_t*>(kr[1])[s];
                const uint32_t a[4] = {e4m3x2_f16x2(k0), e4m3x2_f16x2(k8),
                                       e4m3x2_f16x2(k0 >> 16), e4m3x2_f16x2(k8 >> 16)};
                mma_f16(c[s % 2], a, qf[s][0], qf[s][1]);
            } else {
                const uint32_t* k0 = reinterpret_cast<const uint32_t*>(kr[0]) + 2 * s;
                const uint32_t* k8 = reinterpret_cast<const uint32_t*>(kr[1]) + 2 * s;
                const uint32_t a[4] = {k0[0], k8[0], k0[1], k8[1]};
                mma_bf16(c[s % 2], a, qf[s][0], qf[s][1]);
            }
        }
        if constexpr (AHEAD) {
            if (jb + WARPS <= last) load_k(jb + WARPS);
        }
        // c: keys g (e < 2) and g + 8, heads 2t + e % 2
        const int key0 = jb * BS + g;
        float sc[4], mx[2];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key0 + 8 * (e / 2);
            sc[e] = key >= s0 && key < s1 ? c[0][e] + c[1][e] : -INFINITY;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            mx[e] = fmaxf(sc[e], sc[e + 2]);
#pragma unroll
            for (int o = 4; o < 32; o <<= 1)
                mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], o));
            mf[e] = fmaxf(mf[e], mx[e]);
        }
        float pf[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) pf[e] = __expf(sc[e] - mf[e % 2]);
        // head h's new max from the fragment lane that holds it (lane h / 2: g = 0, t = h / 2)
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const float mn = __shfl_sync(0xffffffffu, mf[h % 2], h / 2);
            const float alpha = __expf(m[h] - mn);
            m[h] = mn;
            l[h] *= alpha;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[h][i] *= alpha;
        }
        // P.V: key r's weight for head h from lane 4 (r % 8) + h / 2
#pragma unroll
        for (int r = 0; r < BS; ++r) {
            float v[VEC];
            widen<VEC, FP8, false>(&vr[r], v);
#pragma unroll
            for (int h = 0; h < G; ++h) {
                const float p = __shfl_sync(0xffffffffu, pf[(r / 8) * 2 + h % 2],
                                            4 * (r % 8) + h / 2);
                l[h] += p;
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[h][i] = fmaf(p, v[i], acc[h][i]);
            }
        }
        if constexpr (AHEAD) {
            if (jb + WARPS <= last) load_v(jb + WARPS);
        }
    }
    write_split<D, G>(m, l, acc, b, kh, split, splits, kv_heads, part_acc, part_ml, out,
                      out_bf16);
}

// ------------------------------------------------------------------ K=V layers on tensor cores
// The K=V entries at head dim 512 with groups 8 and 16 (the full layers of the 31B, 26B-A4B and
// 12B), `attn_decode_keqv_mma_*`: attn_decode_keqv's contract with one precondition, that only
// the first D / 8 rope pairs rotate (inv_freq[i] = 0 from i = 64: Gemma 4's partial rotary 0.25;
// the lowering checks it, the reference refuses anything else). Registers hold all but the
// rotated pairs' K:
// - Scores S = Q . K^T per 16-key cache block, mma.sync m16n8k16 (rows: the group's heads, for
//   group 8 rows 8-15 zero; columns: the block's keys; f32 sums). The CTA's 4 warps each take a
//   quarter of the 256 rope pairs (a pair: dim i and its partner i + 256; thread t of a warp 16
//   of them, 16 contiguous dims and their partners) and sum their partial scores through shared
//   memory, one barrier a block. Three warps hold unrotated pairs, where K = base * wk: wk is
//   folded into q once (q * wk in f32, split hi + lo), so the stored base meets q's two halves
//   as it is (e4m3 widened to f16 exactly; bf16 pools in a bf16 mma). The fourth warp (a
//   different one per CTA, so an SM's CTAs spread their work over its four schedulers) holds
//   the rotated pairs and reads their K from shared memory, where the whole CTA derived it a
//   block ahead: K = rope(base * wk, t) in f32, products and sums rounded as ops.ref_rope's, sin
//   and cos of the same f32 angle to about 6e-7 (rope_sincos), split hi + lo. (One warp deriving
//   its own K left the other three waiting at the barrier: 5.5 barrier stalls an issue, H200.)
// - P.V as O^T = V^T . P^T (rows: dims, 16 per m-tile; columns: heads, 8 per n-tile; k: the 16
//   keys), the C fragments of S being exactly P^T's B fragments; P split hi + lo. Each warp owns
//   128 output dims, so no merge: every warp computes the same softmax from the same summed
//   scores. V^T's A fragments pair two keys' bytes of one dim (a byte permute of two loads).
// This replaces attn_prefill.cu's tensor-core decode tile loop for these layers, which derived
// K for all 512 dims through shared memory tiles (12.5% occupancy, 3.5-7% of DRAM, H200 ncu).

// sin and cos of x = a position times a rope frequency (0 <= x < 2^17) to about 6e-7: x less
// k = rint(x / 2 pi) times 2 pi in three parts (k * 6.28125 and x - k * 6.28125 exact for
// k < 2^16), then the SFU's sin and cos on [-pi, pi] (absolute error 2^-21.4). sincosf costs
// several times as many instructions, and the K=V entries derive 64 rotations a key.
__device__ __forceinline__ void rope_sincos(float x, float& s, float& c) {
    const float k = rintf(x * 0.15915494f);
    float r = fmaf(-k, 6.28125f, x);
    r = fmaf(-k, 1.9353071693331003e-3f, r);
    r = fmaf(-k, 1.0253131677018246e-11f, r);
    __sincosf(r, &s, &c);
}

template <bool FP8>
__device__ __forceinline__ void mma16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) {
    if constexpr (FP8) {
        mma_f16(c, a, b0, b1);
    } else {
        mma_bf16(c, a, b0, b1);
    }
}

// (x, y) as the mma's 16-bit pair (f16 for the e4m3 entries, bf16 for the bf16 ones) and what
// that rounding left out, likewise rounded
template <bool FP8>
__device__ __forceinline__ void split_pair(float x, float y, uint32_t& hi, uint32_t& lo) {
    if constexpr (FP8) {
        const __half2 h = __floats2half2_rn(x, y);
        const float2 back = __half22float2(h);
        const __half2 r = __floats2half2_rn(x - back.x, y - back.y);
        hi = *reinterpret_cast<const uint32_t*>(&h);
        lo = *reinterpret_cast<const uint32_t*>(&r);
    } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
        const float2 back = __bfloat1622float2(h);
        const __nv_bfloat162 r = __floats2bfloat162_rn(x - back.x, y - back.y);
        hi = *reinterpret_cast<const uint32_t*>(&h);
        lo = *reinterpret_cast<const uint32_t*>(&r);
    }
}

// Four pool elements (one 4-byte word of e4m3, two of bf16) -> the mma's two 16-bit pairs
template <bool FP8>
__device__ __forceinline__ void pool_pairs(const uint32_t* words, uint32_t& p01, uint32_t& p23) {
    if constexpr (FP8) {
        p01 = e4m3x2_f16x2(words[0]);
        p23 = e4m3x2_f16x2(words[0] >> 16);
    } else {
        p01 = words[0];
        p23 = words[1];
    }
}

__device__ __forceinline__ float2 pair_f32(uint32_t p, bool fp8) {
    return fp8 ? __half22float2(*reinterpret_cast<const __half2*>(&p))
               : __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p));
}

template <int G, bool FP8>
__device__ void attn_keqv_mma(const __nv_bfloat16* __restrict__ q,
                              const typename Elem<FP8>::type* __restrict__ base,
                              const int* __restrict__ table, int max_blocks, int ring,
                              const int* __restrict__ seq_len, int window, int kv_heads,
                              const float* __restrict__ wk, const float* __restrict__ inv_freq,
                              float* __restrict__ part_acc, float* __restrict__ part_ml,
                              float* __restrict__ out, __nv_bfloat16* __restrict__ out_bf16) {
    constexpr int D = 512, HALF = 256;
    constexpr int HT = G / 8;                    // 8-head tiles (P.V's n-tiles, S's row halves)
    constexpr int PIECES = FP8 ? 1 : 2;          // 16-byte loads of 16 pool elements
    constexpr int WORDS = 4 * PIECES;            // their 4-byte words
    static_assert(G == 8 || G == 16, "K=V tensor-core decode takes groups 8 and 16");
    using E = typename Elem<FP8>::type;
    const int split = blockIdx.x, kh = blockIdx.y, b = blockIdx.z, splits = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nh = kv_heads * G;
    // role 0 derives the rotated pairs' K; warp w of a CTA issues from scheduler w
    const int role = (warp + blockIdx.x + blockIdx.y + blockIdx.z) & 3;
    const bool derive = role == 0;
    const int chunk = 4 * role + t;  // rope pairs 16 chunk .. 16 chunk + 15
    int s0, s1;
    split_keys(seq_len, b, window, split, splits, s0, s1);
    const int* row_table = table + (size_t)b * max_blocks;

    // q's A fragments, k-step s: dims 16 chunk + 4s .. + 3 (s < 4), else their partners;
    // [s][row half r: heads g + 8r][0: dims +0 +1, 1: +2 +3][0: hi (derive: q), 1: lo]
    uint32_t qa[8][HT][2][2];
#pragma unroll
    for (int r = 0; r < HT; ++r) {
        const __nv_bfloat16* qrow = q + ((size_t)b * nh + kh * G + g + 8 * r) * D;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int d0 = half * HALF + 16 * chunk;
            const uint4* src = reinterpret_cast<const uint4*>(qrow + d0);
            const uint4 raw[2] = {src[0], src[1]};
            const uint32_t* w = reinterpret_cast<const uint32_t*>(raw);
#pragma unroll
            for (int i = 0; i < 8; ++i) {  // dims d0 + 2i, + 1
                const int s = 4 * half + i / 2, j = i % 2;
                if (derive) {
                    qa[s][r][j][0] = FP8 ? bf16x2_f16x2(w[i]) : w[i];
                    qa[s][r][j][1] = 0u;
                } else {
                    const float2 x = __bfloat1622float2(
                        *reinterpret_cast<const __nv_bfloat162*>(&w[i]));
                    const float2 k = __ldg(reinterpret_cast<const float2*>(wk + d0 + 2 * i));
                    split_pair<FP8>(x.x * k.x, x.y * k.y, qa[s][r][j][0], qa[s][r][j][1]);
                }
            }
        }
    }
    const auto a_frag = [&](int s, int v, uint32_t (&a)[4]) {
        a[0] = qa[s][0][0][v];
        a[1] = HT > 1 ? qa[s][HT - 1][0][v] : 0u;
        a[2] = qa[s][0][1][v];
        a[3] = HT > 1 ? qa[s][HT - 1][1][v] : 0u;
    };

    // O^T [m-tile mt: dims 128 warp + 16 g + 2 mt (c0, c1) and + 1 (c2, c3)][head tile][c]:
    // heads 8 ht + 2t, + 1
    float o[8][HT][4];
    float m[HT], l[HT];  // heads g + 8r: running max, this lane's share of the sum
#pragma unroll
    for (int r = 0; r < HT; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.f;
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) o[mt][r][0] = o[mt][r][1] = o[mt][r][2] = o[mt][r][3] = 0.f;
    }
    __shared__ float4 red[2][WARPS][HT][32];
    // K of the rotated pairs for one block's keys, [buffer][hi, lo][key][dim]: dims 0 .. 63 then
    // their partners 256 .. 319, rows padded to 132 (conflict-free 8-byte fragment reads),
    // derived by the whole CTA one block ahead of its use (loads of block jb + 1 issued before
    // block jb's scores, the derivation after them, the scores' barrier publishing it)
    constexpr int KROW = 132;
    __shared__ __align__(16) uint16_t krot[2][2][BS][KROW];
    using RotRaw = typename Pick<FP8, uint2, uint4>::type;  // 8 pool elements
    const int rk = threadIdx.x >> 3, rp = 8 * (threadIdx.x & 7);  // key rk, pairs rp .. rp + 7
    const auto rot_load = [&](int jb, RotRaw (&raw)[2]) {
        const int key = jb * BS + rk;
        const E* src = base + (((size_t)row_table[jb % ring] * BS + rk) * kv_heads + kh) * D + rp;
        const bool vis = key >= s0 && key < s1;
        raw[0] = vis ? *reinterpret_cast<const RotRaw*>(src) : RotRaw{};
        raw[1] = vis ? *reinterpret_cast<const RotRaw*>(src + HALF) : RotRaw{};
    };
    const auto rot_derive = [&](int jb, const RotRaw (&raw)[2], int buf) {
        const float tpos = (float)(jb * BS + rk);
        const auto elems = [](const RotRaw& r, int w) {  // elements 2w and 2w + 1, widened
            const uint32_t word = reinterpret_cast<const uint32_t*>(&r)[FP8 ? w / 2 : w];
            return FP8 ? pair_f32(e4m3x2_f16x2(word >> (16 * (w % 2))), true)
                       : pair_f32(word, false);
        };
        uint32_t out[2][2][4];  // [low dims or partners][hi, lo][pairs of dims]
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // pairs rp + 2w, + 1
            const float2 x = elems(raw[0], w), y = elems(raw[1], w);
            const float xs[2] = {x.x, x.y}, ys[2] = {y.x, y.y};
            float kl[2], kp[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = rp + 2 * w + e;
                const float xk = __fmul_rn(xs[e], __ldg(wk + i));
                const float yk = __fmul_rn(ys[e], __ldg(wk + HALF + i));
                const float f = __ldg(inv_freq + i);
                float sn = 0.f, cs = 1.f;
                if (f != 0.f) rope_sincos(__fmul_rn(tpos, f), sn, cs);
                kl[e] = __fsub_rn(__fmul_rn(xk, cs), __fmul_rn(yk, sn));
                kp[e] = __fadd_rn(__fmul_rn(yk, cs), __fmul_rn(xk, sn));
            }
            split_pair<FP8>(kl[0], kl[1], out[0][0][w], out[0][1][w]);
            split_pair<FP8>(kp[0], kp[1], out[1][0][w], out[1][1][w]);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int v = 0; v < 2; ++v) {
                uint2* dst = reinterpret_cast<uint2*>(&krot[buf][v][rk][64 * half + rp]);
                dst[0] = make_uint2(out[half][v][0], out[half][v][1]);
                dst[1] = make_uint2(out[half][v][2], out[half][v][3]);
            }
        }
    };
    // keys outside [s0, s1) are not read (zeros): stale or poisoned cache bytes meet no weight
    const int first = s0 / BS, last = s1 > s0 ? (s1 - 1) / BS : -1;
    if (first <= last) {
        RotRaw raw[2];
        rot_load(first, raw);
        rot_derive(first, raw, 0);
        __syncthreads();
    }
    for (int jb = first, it = 0; jb <= last; ++jb, it ^= 1) {
        const size_t block = row_table[jb % ring];
        const int key0 = jb * BS;
        const auto row = [&](int r) { return base + ((block * BS + r) * kv_heads + kh) * D; };
        // the scores' keys g and g + 8: the chunk's 16 dims and their partners (the derived
        // warp reads its K from krot)
        uint4 kr[2][2][PIECES];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            const int key = key0 + g + 8 * n;
            const bool vis = !derive && key >= s0 && key < s1;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const uint4* src =
                    reinterpret_cast<const uint4*>(row(g + 8 * n) + half * HALF + 16 * chunk);
#pragma unroll
                for (int p = 0; p < PIECES; ++p)
                    kr[n][half][p] = vis ? src[p] : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        RotRaw next[2];
        if (jb < last) rot_load(jb + 1, next);

        // the warp's partial scores: [key n-tile][0: hi chain, 1: lo chain][c]
        float sc[2][2][4] = {};
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            uint32_t ahi[4], alo[4];
            a_frag(s, 0, ahi);
            a_frag(s, 1, alo);
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                if (derive) {  // K hi and lo of dims 16t + 4s .. (s < 4), else their partners
                    const int d = 64 * (s / 4) + 16 * t + 4 * (s % 4);
                    const uint2 khi = *reinterpret_cast<const uint2*>(&krot[it][0][g + 8 * n][d]);
                    const uint2 klo = *reinterpret_cast<const uint2*>(&krot[it][1][g + 8 * n][d]);
                    mma16<FP8>(sc[n][0], ahi, khi.x, khi.y);
                    mma16<FP8>(sc[n][1], ahi, klo.x, klo.y);
                } else {
                    uint32_t b0, b1;
                    pool_pairs<FP8>(reinterpret_cast<const uint32_t*>(kr[n][s / 4]) +
                                        (s % 4) * PIECES,
                                    b0, b1);
                    mma16<FP8>(sc[n][0], ahi, b0, b1);
                    mma16<FP8>(sc[n][1], alo, b0, b1);
                }
            }
        }
        if (jb < last) rot_derive(jb + 1, next, it ^ 1);
        // the CTA's scores: the four warps' partial sums, in the same order in every warp
#pragma unroll
        for (int r = 0; r < HT; ++r)
            red[it][warp][r][lane] =
                make_float4(sc[0][0][2 * r] + sc[0][1][2 * r], sc[0][0][2 * r + 1] + sc[0][1][2 * r + 1],
                            sc[1][0][2 * r] + sc[1][1][2 * r], sc[1][0][2 * r + 1] + sc[1][1][2 * r + 1]);
        __syncthreads();  // red[it] is next written two blocks on, after the next barrier
        // P.V's keys 2t, 2t + 1, 2t + 8, 2t + 9: dims 128 warp + 16 g .. + 15, which the CTA's
        // score loads brought into L1 (loaded here, not with them, to keep the scores' registers
        // free)
        uint4 vr[4][PIECES];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const int r = 2 * t + (kk & 1) + 8 * (kk >> 1), key = key0 + r;
            const uint4* src = reinterpret_cast<const uint4*>(row(r) + 128 * warp + 16 * g);
#pragma unroll
            for (int p = 0; p < PIECES; ++p)
                vr[kk][p] = key >= s0 && key < s1 ? src[p] : make_uint4(0u, 0u, 0u, 0u);
        }
        // p[r][e]: head g + 8r, key 2t + (e & 1) + 8 (e >> 1) of the block
        float p[HT][4], alpha[HT];
#pragma unroll
        for (int r = 0; r < HT; ++r) {
            float4 sum = red[it][0][r][lane];
#pragma unroll
            for (int w = 1; w < WARPS; ++w) {
                const float4 x = red[it][w][r][lane];
                sum.x += x.x;
                sum.y += x.y;
                sum.z += x.z;
                sum.w += x.w;
            }
            p[r][0] = sum.x;
            p[r][1] = sum.y;
            p[r][2] = sum.z;
            p[r][3] = sum.w;
            float mx = -INFINITY;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + 2 * t + (e & 1) + 8 * (e >> 1);
                if (!(key >= s0 && key < s1)) p[r][e] = -INFINITY;
                mx = fmaxf(mx, p[r][e]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[r], mx);  // finite: every block holds a visible key
            alpha[r] = __expf(m[r] - mn);
            m[r] = mn;
            l[r] *= alpha[r];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                p[r][e] = __expf(p[r][e] - mn);
                l[r] += p[r][e];
            }
        }
        // P^T's B fragments (column: head g + 8 ht) and O^T's rescale (columns: heads 2t, + 1)
        uint32_t pb[HT][2][2];  // [ht][b0, b1][hi, lo]
#pragma unroll
        for (int ht = 0; ht < HT; ++ht) {
            split_pair<FP8>(p[ht][0], p[ht][1], pb[ht][0][0], pb[ht][0][1]);
            split_pair<FP8>(p[ht][2], p[ht][3], pb[ht][1][0], pb[ht][1][1]);
            const float a0 = __shfl_sync(0xffffffffu, alpha[ht], 8 * t);
            const float a1 = __shfl_sync(0xffffffffu, alpha[ht], 8 * t + 4);
#pragma unroll
            for (int mt = 0; mt < 8; ++mt) {
                o[mt][ht][0] *= a0;
                o[mt][ht][1] *= a1;
                o[mt][ht][2] *= a0;
                o[mt][ht][3] *= a1;
            }
        }
        // V^T's A fragments: two keys' element of one dim per 16-bit pair
#pragma unroll
        for (int i = 0; i < WORDS; ++i) {
            const uint32_t w0 = reinterpret_cast<const uint32_t*>(vr[0])[i];
            const uint32_t w1 = reinterpret_cast<const uint32_t*>(vr[1])[i];
            const uint32_t w8 = reinterpret_cast<const uint32_t*>(vr[2])[i];
            const uint32_t w9 = reinterpret_cast<const uint32_t*>(vr[3])[i];
            // the word's dims j (of the thread's 16): e4m3 4i .. 4i + 3, bf16 2i, 2i + 1; dim j
            // is row g + 8 (j % 2) of m-tile j / 2
            uint32_t a[FP8 ? 2 : 1][4];
            if constexpr (FP8) {
                const uint32_t lo = __byte_perm(w0, w1, 0x5140), hi = __byte_perm(w0, w1, 0x7362);
                const uint32_t lo8 = __byte_perm(w8, w9, 0x5140), hi8 = __byte_perm(w8, w9, 0x7362);
                a[0][0] = e4m3x2_f16x2(lo);
                a[0][1] = e4m3x2_f16x2(lo >> 16);
                a[0][2] = e4m3x2_f16x2(lo8);
                a[0][3] = e4m3x2_f16x2(lo8 >> 16);
                a[1][0] = e4m3x2_f16x2(hi);
                a[1][1] = e4m3x2_f16x2(hi >> 16);
                a[1][2] = e4m3x2_f16x2(hi8);
                a[1][3] = e4m3x2_f16x2(hi8 >> 16);
            } else {
                a[0][0] = __byte_perm(w0, w1, 0x5410);
                a[0][1] = __byte_perm(w0, w1, 0x7632);
                a[0][2] = __byte_perm(w8, w9, 0x5410);
                a[0][3] = __byte_perm(w8, w9, 0x7632);
            }
#pragma unroll
            for (int u = 0; u < (FP8 ? 2 : 1); ++u) {
                const int mt = (FP8 ? 2 : 1) * i + u;
#pragma unroll
                for (int ht = 0; ht < HT; ++ht) {
                    mma16<FP8>(o[mt][ht], a[u], pb[ht][0][0], pb[ht][1][0]);
                    mma16<FP8>(o[mt][ht], a[u], pb[ht][0][1], pb[ht][1][1]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < HT; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    // heads 8 ht + 2t + e: their (m, l) from lane 4 (2t + e), dims 128 warp + 16 g + j
#pragma unroll
    for (int ht = 0; ht < HT; ++ht) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float mh = __shfl_sync(0xffffffffu, m[ht], 4 * (2 * t + e));
            const float lh = __shfl_sync(0xffffffffu, l[ht], 4 * (2 * t + e));
            const size_t qrow = (size_t)b * nh + kh * G + 8 * ht + 2 * t + e;
            float v[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) v[j] = o[j / 2][ht][e + 2 * (j % 2)];
            const int d0 = 128 * warp + 16 * g;
            if (out) {  // one split: attn_decode_combine's result, bit for bit (its weight is 1)
                const float inv = 1.f / lh;
#pragma unroll
                for (int j = 0; j < 16; ++j) v[j] *= inv;
#pragma unroll
                for (int j = 0; j < 16; j += 4)
                    *reinterpret_cast<float4*>(out + qrow * D + d0 + j) =
                        make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
                if (out_bf16) {
#pragma unroll
                    for (int j = 0; j < 16; j += 8) {
                        uint4 h;
                        uint32_t* hw = reinterpret_cast<uint32_t*>(&h);
#pragma unroll
                        for (int k = 0; k < 4; ++k) {
                            const __nv_bfloat162 x = __floats2bfloat162_rn(v[j + 2 * k], v[j + 2 * k + 1]);
                            hw[k] = *reinterpret_cast<const uint32_t*>(&x);
                        }
                        *reinterpret_cast<uint4*>(out_bf16 + qrow * D + d0 + j) = h;
                    }
                }
                continue;
            }
            const size_t part = qrow * splits + split;
#pragma unroll
            for (int j = 0; j < 16; j += 4)
                *reinterpret_cast<float4*>(part_acc + part * D + d0 + j) =
                    make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
            if (warp == 0 && g == 0) {
                part_ml[part * 2] = mh;
                part_ml[part * 2 + 1] = lh;
            }
        }
    }
}

// A split entry: the tensor-core scores where they apply, else the f32 loop.
template <int D, int G, bool FP8, bool F32>
__device__ __forceinline__ void attn_split(const typename Query<F32>::type* __restrict__ q,
                                           const typename Elem<FP8, F32>::type* __restrict__ kc,
                                           const typename Elem<FP8, F32>::type* __restrict__ vc,
                                           const int* __restrict__ table, int max_blocks,
                                           int ring, const int* __restrict__ seq_len,
                                           int window, int kv_heads, float* part_acc,
                                           float* part_ml, float* out, __nv_bfloat16* out_bf16) {
    if constexpr (MMA_SCORES<D, G, FP8, F32>) {
        attn_partial_mma<G, FP8>(q, kc, vc, table, max_blocks, ring, seq_len, window, kv_heads,
                                 part_acc, part_ml, out, out_bf16);
    } else {
        attn_partial<D, G, false, FP8, F32>(q, kc, vc, table, max_blocks, ring, seq_len, window,
                                            kv_heads, nullptr, nullptr, part_acc, part_ml, out,
                                            out_bf16);
    }
}
}  // namespace

#define ATTN_ENTRIES(D, G, SUFFIX, FP8, F32)                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, SPLIT_CTAS<D, G, FP8, F32>)        \
        attn_decode_d##D##_g##G##SUFFIX(                                                        \
        const Query<F32>::type* q, const Elem<FP8, F32>::type* kc,                            \
        const Elem<FP8, F32>::type* vc, const int* table, int max_blocks, int ring,           \
        const int* seq_len, int window, int kv_heads, float* part_acc, float* part_ml,        \
        float* out, __nv_bfloat16* out_bf16) {                                                \
        pdl_wait();                                                                           \
        pdl_launch_dependents();                                                              \
        attn_split<D, G, FP8, F32>(q, kc, vc, table, max_blocks, ring, seq_len, window,        \
                                   kv_heads, part_acc, part_ml, out, out_bf16);                \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                   \
        attn_decode_keqv_d##D##_g##G##SUFFIX(                                                   \
            const Query<F32>::type* q, const Elem<FP8, F32>::type* base, const int* table,     \
            int max_blocks, int ring, const int* seq_len, int window, int kv_heads,            \
            const float* wk, const float* inv_freq, float* part_acc, float* part_ml,           \
            float* out, __nv_bfloat16* out_bf16) {                                             \
        pdl_wait();                                                                            \
        pdl_launch_dependents();                                                               \
        attn_partial<D, G, true, FP8, F32>(q, base, nullptr, table, max_blocks, ring, seq_len,  \
                                           window, kv_heads, wk, inv_freq, part_acc, part_ml,  \
                                           out, out_bf16);                                     \
    }
#define ATTN_ENTRY(D, G)                   \
    ATTN_ENTRIES(D, G, , false, false)     \
    ATTN_ENTRIES(D, G, _fp8, true, false)  \
    ATTN_ENTRIES(D, G, _f32, false, true)
ATTN_ENTRY(32, 1)
ATTN_ENTRY(32, 2)
ATTN_ENTRY(32, 4)
ATTN_ENTRY(32, 8)
ATTN_ENTRY(32, 16)
ATTN_ENTRY(64, 1)
ATTN_ENTRY(64, 2)
ATTN_ENTRY(64, 4)
ATTN_ENTRY(64, 8)
ATTN_ENTRY(64, 16)
ATTN_ENTRY(128, 1)
ATTN_ENTRY(128, 2)
ATTN_ENTRY(128, 4)
ATTN_ENTRY(128, 8)
ATTN_ENTRY(128, 16)
ATTN_ENTRY(256, 1)
ATTN_ENTRY(256, 2)
ATTN_ENTRY(256, 4)
ATTN_ENTRY(256, 8)
ATTN_ENTRY(256, 16)
ATTN_ENTRY(512, 1)
ATTN_ENTRY(512, 2)
ATTN_ENTRY(512, 4)
ATTN_ENTRY(512, 8)
ATTN_ENTRY(512, 16)

// the K=V tensor-core entries (attn_keqv_mma): head dim 512, groups 8 and 16; group 8 held to 3
// CTAs an SM (168 registers; 184 unbounded: 2 CTAs); group 16 as the compiler chooses
template <int G>
constexpr int KEQV_MMA_CTAS = G == 8 ? 3 : 0;
#define KEQV_MMA_ENTRY(G, SUFFIX, FP8)                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, KEQV_MMA_CTAS<G>)                 \
        attn_decode_keqv_mma_d512_g##G##SUFFIX(                                                 \
            const __nv_bfloat16* q, const Elem<FP8, false>::type* base, const int* table,      \
            int max_blocks, int ring, const int* seq_len, int window, int kv_heads,            \
            const float* wk, const float* inv_freq, float* part_acc, float* part_ml,            \
            float* out, __nv_bfloat16* out_bf16) {                                              \
        pdl_wait();                                                                             \
        pdl_launch_dependents();                                                                \
        attn_keqv_mma<G, FP8>(q, base, table, max_blocks, ring, seq_len, window, kv_heads, wk,  \
                              inv_freq, part_acc, part_ml, out, out_bf16);                      \
    }
KEQV_MMA_ENTRY(8, , false)
KEQV_MMA_ENTRY(8, _fp8, true)
KEQV_MMA_ENTRY(16, , false)
KEQV_MMA_ENTRY(16, _fp8, true)

// out[b, h, :] = sum_s acc_s * e^(m_s - M) / sum_s l_s * e^(m_s - M); one CTA of d threads per
// (b, h), d >= 32 (every head dim above). Warp 0 turns the splits' (m, l) into weights once;
// every thread then sums its column.
// out_bf16, when not null, also receives the result rounded to bf16: the o projection's input.
extern "C" __global__ void attn_decode_combine(const float* __restrict__ part_acc,
                                               const float* __restrict__ part_ml, int splits,
                                               int d, float* __restrict__ out,
                                               __nv_bfloat16* __restrict__ out_bf16) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ float weight[];  // [splits]
    __shared__ float inv_sum;
    const size_t bh = blockIdx.x;
    const float* ml = part_ml + bh * splits * 2;
    if (threadIdx.x < 32) {
        float mt = -INFINITY;
        for (int s = threadIdx.x; s < splits; s += 32) mt = fmaxf(mt, ml[2 * s]);
        mt = warp_max(mt);
        float lt = 0.f;
        for (int s = threadIdx.x; s < splits; s += 32) {
            const float w = ml[2 * s] == -INFINITY ? 0.f : __expf(ml[2 * s] - mt);
            weight[s] = w;
            lt += ml[2 * s + 1] * w;
        }
        lt = warp_sum(lt);
        if (threadIdx.x == 0) inv_sum = 1.f / lt;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float o = 0.f;
#pragma unroll 8
        for (int s = 0; s < splits; ++s) o += part_acc[(bh * splits + s) * d + i] * weight[s];
        out[bh * d + i] = o * inv_sum;
        if (out_bf16) out_bf16[bh * d + i] = __float2bfloat16(o * inv_sum);
    }
}
