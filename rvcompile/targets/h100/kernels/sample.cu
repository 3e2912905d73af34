// Device-side sampling: out[m] = ops.ref_sample of row m of softcap(logits), so that a decode step
// copies back token ids only. Reference steps per row: temperature <= 0 takes the argmax (lowest
// index on ties); otherwise the row is sorted descending (stable), w = exp(y / T - y_max / T),
// the top_k first tokens are kept (top_k <= 0 or >= V: all), then those whose mass BEFORE them is
// < top_p * Z (Z: the top_k mass), and the token where the kept mass first exceeds u * S (S: the
// kept mass) is picked, u = sampling_uniform(seed, step).
//
// Three launches on one stream share a workspace (layout: carve() and sample.py):
//   sample_prepare  grid (V / 4096, M): y = softcap(logits) (cap <= 0: none; -0 made +0) into
//                   the workspace and the maximum of every 128-element group; zeroes the row's
//                   counters and histogram.
//   sample_filter   grid (V / chunk, M), sampling rows only: beta = the L-th largest group maximum,
//                   L = min(top_k', CAND_RANK), so at least L elements are >= beta (the top L);
//                   every element >= beta is appended to the row's candidates (count, mass). When
//                   top_k' > CAND_RANK, the other elements go into a 4096-bucket (count, mass)
//                   histogram on their top 12 key bits.
//   sample_pick     grid (M): greedy rows write the row maximum. Sampling rows find Z (the mass at
//                   rank top_k' - 1), the top_p cut and the pick by walking the sorted candidates
//                   and then the histogram; a bucket over CAP elements is narrowed by 12-bit passes
//                   over y until at most CAP remain, which are gathered, sorted and scanned.
// Cost: the candidate path reads y once more in parallel; what goes past the candidates (top_k
// above CAND_RANK, or top_k = 0 with the top_p mass or u * S beyond them) costs sample_pick one or
// a few single-CTA passes over the row's y.
//
// Order: a composite key (float key of y << 32 | ~index) is unique and sorts like the reference
// (value descending, index ascending). Mass: W = floor(w * 2^42) in 64-bit integers, so every sum
// is exact, deterministic and independent of order; the cut is the first token whose mass up to
// and including it is >= P = ceil(top_p * Z), the pick the first whose is > t = floor(u * S). The
// result differs from the reference's float32 arithmetic only where that arithmetic is off.
// Contract: V % 128 == 0, V <= 2^19, finite logits and temperatures, the workspace of sample.py's
// workspace_bytes(M, V) (no state between calls). top_p <= 0 keeps the first token (the reference
// then clamps its empty kept set to the row's last sorted token).
#include "common.cuh"

namespace {
using u32 = unsigned int;
using u64 = unsigned long long;

constexpr int THREADS = 1024;
constexpr int WARPS = 32;
constexpr u32 FULL = 0xffffffffu;
constexpr int GROUP = 128;      // elements per group maximum: one warp's 32 float4 loads
constexpr int CAND_RANK = 1024;  // candidates cover at least the top min(top_k', CAND_RANK)
constexpr int CAP = 2048;       // longest list sorted in shared memory
constexpr int BUCKET_BITS = 12;
constexpr int BUCKETS = 4096;
constexpr int MAX_GROUPS = 4096;  // V <= 2^19
constexpr float WEIGHT_ONE = 4398046511104.0f;  // 2^42: V * 2^42 < 2^64
static_assert(WARPS * 32 == THREADS && CAP == 2 * THREADS && BUCKETS == 4 * THREADS, "layout");
static_assert(BUCKETS == 1 << BUCKET_BITS, "buckets");

struct Workspace {
    float* y;         // [M, V] softcapped logits
    u64* gmax;        // [M, V / GROUP] group maxima (composite keys)
    u64* cand;        // [M, CAP] the first CAP candidates, unordered
    u64* hist_mass;   // [M, BUCKETS]
    u64* cand_mass;   // [M]
    u64* beta;        // [M]
    u32* hist_count;  // [M, BUCKETS]
    u32* cand_count;  // [M] all candidates, also those past CAP
};

__device__ Workspace carve(void* base, int M, int V) {
    char* p = static_cast<char*>(base);
    Workspace w;
    w.y = reinterpret_cast<float*>(p);
    p += (size_t)M * V * sizeof(float);
    w.gmax = reinterpret_cast<u64*>(p);
    p += (size_t)M * (V / GROUP) * sizeof(u64);
    w.cand = reinterpret_cast<u64*>(p);
    p += (size_t)M * CAP * sizeof(u64);
    w.hist_mass = reinterpret_cast<u64*>(p);
    p += (size_t)M * BUCKETS * sizeof(u64);
    w.cand_mass = reinterpret_cast<u64*>(p);
    p += (size_t)M * sizeof(u64);
    w.beta = reinterpret_cast<u64*>(p);
    p += (size_t)M * sizeof(u64);
    w.hist_count = reinterpret_cast<u32*>(p);
    p += (size_t)M * BUCKETS * sizeof(u32);
    w.cand_count = reinterpret_cast<u32*>(p);
    return w;
}

__device__ __forceinline__ u64 max_u64(u64 a, u64 b) { return a > b ? a : b; }
__device__ __forceinline__ u64 min_u64(u64 a, u64 b) { return a < b ? a : b; }

__device__ __forceinline__ float softcapped(float x, float cap) {
    const float y = cap > 0.0f ? cap * tanhf(x / cap) : x;
    return y == 0.0f ? 0.0f : y;  // -0 ties with +0, as in the reference's comparisons
}

__device__ __forceinline__ u32 float_key(float y) {  // order-preserving
    const u32 b = __float_as_uint(y);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ u64 composite(float y, int i) {
    return ((u64)float_key(y) << 32) | (u32)~(u32)i;
}

__device__ __forceinline__ int composite_index(u64 c) { return (int)~(u32)c; }

__device__ __forceinline__ float composite_value(u64 c) {
    const u32 k = (u32)(c >> 32);
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// W = floor(2^42 * exp(y / T - s0)), s0 = y_max / T: the reference's probs before normalising.
__device__ __forceinline__ u64 fixed_weight(float y, float temperature, float s0) {
    const float w = expf(y / temperature - s0);
    return (u64)(w * WEIGHT_ONE);
}

__device__ __forceinline__ u32 mix32(u32 x) {  // ops.mix32
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

__device__ __forceinline__ float sampling_uniform(int seed, int step) {  // ops.sampling_uniform
    return (float)(mix32(mix32((u32)seed) ^ (u32)step) >> 8) * 5.9604644775390625e-08f;
}

__device__ __forceinline__ int kept_by_top_k(int top_k, int V) {
    return top_k > 0 && top_k < V ? top_k : V;
}

__device__ __forceinline__ u64 warp_max(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max_u64(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

__device__ __forceinline__ u64 warp_sum(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ u64 warp_inclusive_scan(u64 v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 w = __shfl_up_sync(FULL, v, o);
        if (lane >= o) v += w;
    }
    return v;
}

// Block-wide helpers: every thread calls them; `red` is WARPS + 1 shared words, free on return.
__device__ u64 block_max(u64 v, u64* red) {
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = warp_max(red[threadIdx.x & 31]);
    __syncthreads();
    return v;
}

__device__ u64 block_sum(u64 v, u64* red) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = warp_sum(red[threadIdx.x & 31]);
    __syncthreads();
    return v;
}

// The sum of v over the threads before this one; *total gets the sum over all.
__device__ u64 block_exclusive_scan(u64 v, u64* red, u64* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 incl = warp_inclusive_scan(v, lane);
    if (lane == 31) red[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const u64 w = red[lane];
        const u64 wi = warp_inclusive_scan(w, lane);
        red[lane] = wi - w;
        if (lane == 31) red[WARPS] = wi;
    }
    __syncthreads();
    const u64 before = red[warp] + incl - v;
    *total = red[WARPS];
    __syncthreads();
    return before;
}

// Bitonic sort of s[0, n2) descending, n2 a power of two.
__device__ void sort_descending(u64* s, int n2) {
    __syncthreads();
    for (int k = 2; k <= n2; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n2; i += THREADS) {
                const int p = i ^ j;
                if (p > i) {
                    const u64 a = s[i], b = s[p];
                    if ((i & k) == 0 ? a < b : a > b) {
                        s[i] = b;
                        s[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

__device__ __forceinline__ int ceil_pow2(int n) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}

// Appends c to list[*fill] for the lanes with `take`; one shared or global atomic per warp.
__device__ __forceinline__ void warp_append(bool take, u64 c, u32* fill, u64* list) {
    const u32 mask = __ballot_sync(FULL, take);
    if (mask == 0) return;
    const int lane = threadIdx.x & 31, leader = __ffs(mask) - 1;
    u32 base = 0;
    if (lane == leader) base = atomicAdd(fill, (u32)__popc(mask));
    base = __shfl_sync(FULL, base, leader);
    const u32 slot = base + __popc(mask & ((1u << lane) - 1u));
    if (take && slot < CAP) list[slot] = c;
}

// ---------------------------------------------------------------- sample_pick's search

enum Mode { RANK, MASS_AT_LEAST, MASS_ABOVE };

// Whether running totals (count and mass up to and including an element, in sorted order) have
// reached the target: RANK: more than `target` elements; MASS_AT_LEAST: mass >= target;
// MASS_ABOVE: mass > target. Monotone along the order, so the first element reaching it is unique.
__device__ __forceinline__ bool reached(int mode, u64 target, u64 count, u64 mass) {
    return mode == RANK ? count > target : mode == MASS_AT_LEAST ? mass >= target : mass > target;
}

struct Found {
    u64 c;     // composite key of the element
    u64 mass;  // mass up to and including it
};

struct PickShared {
    u64 list0[CAP], cum0[CAP];  // the candidates sorted, and the mass up to each
    u64 list1[CAP], cum1[CAP];  // a narrowed region, the same way
    u64 hmass[BUCKETS];         // narrowing histogram
    u64 red[WARPS + 1];
    u64 walk[2];                // (count, mass) before the bucket a walk found
    u32 hcount[BUCKETS];
    int found;
    u32 fill;
};

// The search of one row. Its larger steps are __noinline__: inlined into the three find()
// calls they made sample_pick four times larger and ~6 s slower to compile.
struct Picker {
    PickShared& sh;
    const float* y;  // the row's softcapped logits
    int V;
    float temperature, s0;
    u64 beta;
    u32 n0;     // elements >= beta: the candidates
    u64 mass0;  // their mass
    bool histogram;
    const u32* hist_count;  // the row's histogram of the elements < beta
    const u64* hist_mass;
    const u64* cand;
    bool list0_ready;

    // Sorts list[0, n), n <= CAP, and fills cum with the mass up to each element.
    __device__ __noinline__ void prepare(u64* list, u64* cum, int n, u64 mass_before) {
        const int n2 = ceil_pow2(n);
        for (int i = n + threadIdx.x; i < n2; i += THREADS) list[i] = 0;  // 0 sorts last
        sort_descending(list, n2);
        const int j = 2 * threadIdx.x;
        const u64 w0 = j < n ? fixed_weight(composite_value(list[j]), temperature, s0) : 0;
        const u64 w1 = j + 1 < n ? fixed_weight(composite_value(list[j + 1]), temperature, s0) : 0;
        u64 total;
        const u64 before = mass_before + block_exclusive_scan(w0 + w1, sh.red, &total);
        if (j < n) cum[j] = before + w0;
        if (j + 1 < n) cum[j + 1] = before + w0 + w1;
        __syncthreads();
    }

    // The first listed element reaching the target; the last one if none does (the reference's
    // clamp; unreachable with finite inputs).
    __device__ __noinline__ Found in_list(const u64* list, const u64* cum, int n,
                                          u64 count_before, int mode, u64 target) {
        if (threadIdx.x == 0) sh.found = -1;
        __syncthreads();
        for (int j = 2 * threadIdx.x; j < 2 * threadIdx.x + 2 && j < n; ++j) {
            const bool here = reached(mode, target, count_before + j + 1, cum[j]);
            const bool earlier = j > 0 && reached(mode, target, count_before + j, cum[j - 1]);
            if (here && !earlier) sh.found = j;
        }
        __syncthreads();
        const int j = sh.found >= 0 ? sh.found : n - 1;
        const Found f{list[j], cum[j]};
        __syncthreads();
        return f;
    }

    // Walks BUCKETS buckets from the highest: the first one whose running totals reach the target
    // (else the lowest non-empty one; -1 if all are empty). Updates the totals before it.
    __device__ __noinline__ int walk(const u32* cnt, const u64* mass, u64& count_before,
                                     u64& mass_before, int mode, u64 target) {
        const int top = BUCKETS - 1 - 4 * threadIdx.x;  // this thread's buckets: top .. top - 3
        u64 c[4], m[4], tc = 0, tm = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            c[k] = cnt[top - k];
            m[k] = mass[top - k];
            tc += c[k];
            tm += m[k];
        }
        if (threadIdx.x == 0) sh.found = -1;
        u64 total_c, total_m;
        u64 bc = count_before + block_exclusive_scan(tc, sh.red, &total_c);
        u64 bm = mass_before + block_exclusive_scan(tm, sh.red, &total_m);
        if (!reached(mode, target, bc, bm)) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                bc += c[k];
                bm += m[k];
                if (reached(mode, target, bc, bm)) {
                    sh.found = top - k;
                    sh.walk[0] = bc - c[k];
                    sh.walk[1] = bm - m[k];
                    break;
                }
            }
        }
        __syncthreads();
        int b = sh.found;
        if (b >= 0) {
            count_before = sh.walk[0];
            mass_before = sh.walk[1];
        } else {
            int low = -1;
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (c[k]) low = top - k;
            const u64 code = block_max(low >= 0 ? (u64)(BUCKETS - low) : 0, sh.red);
            if (code == 0) return -1;
            b = BUCKETS - (int)code;
            count_before += total_c - cnt[b];
            mass_before += total_m - mass[b];
        }
        __syncthreads();
        return b;
    }

    // Histogram of the elements in [lo, hi] on (c - lo) >> shift into sh.hcount / sh.hmass.
    __device__ void narrow_pass(u64 lo, u64 hi, int shift) {
        __syncthreads();
        for (int b = threadIdx.x; b < BUCKETS; b += THREADS) {
            sh.hcount[b] = 0;
            sh.hmass[b] = 0;
        }
        __syncthreads();
        const float4* y4 = reinterpret_cast<const float4*>(y);
        for (int i4 = threadIdx.x; i4 < V / 4; i4 += THREADS) {
            const float4 v = y4[i4];
            const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u64 c = composite(e[k], 4 * i4 + k);
                if (c >= lo && c <= hi) {
                    const int b = (int)((c - lo) >> shift);
                    atomicAdd(&sh.hcount[b], 1u);
                    atomicAdd(&sh.hmass[b], fixed_weight(e[k], temperature, s0));
                }
            }
        }
        __syncthreads();
    }

    // The elements in [lo, hi] (at most CAP) into sh.list1, unordered.
    __device__ void gather(u64 lo, u64 hi) {
        if (threadIdx.x == 0) sh.fill = 0;
        __syncthreads();
        const float4* y4 = reinterpret_cast<const float4*>(y);
        for (int i4 = threadIdx.x; i4 < V / 4; i4 += THREADS) {  // whole warps: V % 128 == 0
            const float4 v = y4[i4];
            const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u64 c = composite(e[k], 4 * i4 + k);
                warp_append(c >= lo && c <= hi, c, &sh.fill, sh.list1);
            }
        }
        __syncthreads();
    }

    // The first element of [lo, hi] (`count` elements, totals before it given) reaching the
    // target: 12-bit narrowing passes while more than CAP elements remain, then sort and scan.
    __device__ __noinline__ Found refine(u64 lo, u64 hi, u32 count, u64 count_before,
                                         u64 mass_before, int mode, u64 target) {
        while (count > CAP) {
            const int bits = 64 - __clzll((long long)(hi - lo));
            const int shift = bits > BUCKET_BITS ? bits - BUCKET_BITS : 0;
            narrow_pass(lo, hi, shift);
            const int b = walk(sh.hcount, sh.hmass, count_before, mass_before, mode, target);
            count = sh.hcount[b];
            lo += (u64)b << shift;
            const u64 span = (1ull << shift) - 1;  // compared, not added: hi may be 2^64 - 1
            if (hi - lo > span) hi = lo + span;
        }
        gather(lo, hi);
        prepare(sh.list1, sh.cum1, (int)count, mass_before);
        return in_list(sh.list1, sh.cum1, (int)count, count_before, mode, target);
    }

    __device__ Found in_candidates(int mode, u64 target) {
        if (n0 > CAP) return refine(beta, ~0ull, n0, 0, 0, mode, target);
        if (!list0_ready) {
            for (int j = threadIdx.x; j < (int)n0; j += THREADS) sh.list0[j] = cand[j];
            prepare(sh.list0, sh.cum0, (int)n0, 0);
            list0_ready = true;
        }
        return in_list(sh.list0, sh.cum0, (int)n0, 0, mode, target);
    }

    // The first element of the row's sorted order reaching the target.
    __device__ __noinline__ Found find(int mode, u64 target) {
        if (!histogram || reached(mode, target, n0, mass0)) return in_candidates(mode, target);
        u64 count_before = n0, mass_before = mass0;
        const int b = walk(hist_count, hist_mass, count_before, mass_before, mode, target);
        if (b < 0) return in_candidates(mode, target);  // nothing below beta: clamp there
        const u64 lo = (u64)b << (64 - BUCKET_BITS);
        const u64 hi = min_u64(lo + ((1ull << (64 - BUCKET_BITS)) - 1), beta - 1);
        return refine(lo, hi, hist_count[b], count_before, mass_before, mode, target);
    }
};
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
sample_prepare(const float* __restrict__ logits, int M, int V, float cap, void* workspace) {
    pdl_wait();
    pdl_launch_dependents();
    const Workspace ws = carve(workspace, M, V);
    const int row = blockIdx.y;
    if (blockIdx.x == 0) {
        for (int b = threadIdx.x; b < BUCKETS; b += THREADS) {
            ws.hist_count[(size_t)row * BUCKETS + b] = 0;
            ws.hist_mass[(size_t)row * BUCKETS + b] = 0;
        }
        if (threadIdx.x == 0) {
            ws.cand_count[row] = 0;
            ws.cand_mass[row] = 0;
        }
    }
    const int c4 = blockIdx.x * THREADS + threadIdx.x;  // float4 index in the row
    if (c4 >= V / 4) return;                             // whole warps: V % 128 == 0
    const float4 x = __ldg(reinterpret_cast<const float4*>(logits + (size_t)row * V) + c4);
    const float4 y = make_float4(softcapped(x.x, cap), softcapped(x.y, cap),
                                 softcapped(x.z, cap), softcapped(x.w, cap));
    reinterpret_cast<float4*>(ws.y + (size_t)row * V)[c4] = y;
    u64 best = max_u64(max_u64(composite(y.x, 4 * c4), composite(y.y, 4 * c4 + 1)),
                       max_u64(composite(y.z, 4 * c4 + 2), composite(y.w, 4 * c4 + 3)));
    best = warp_max(best);
    if ((threadIdx.x & 31) == 0) ws.gmax[(size_t)row * (V / GROUP) + c4 / 32] = best;
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_filter(int M, int V, int chunk, const float* __restrict__ temperature,
              const int* __restrict__ top_k, void* workspace) {
    pdl_wait();
    pdl_launch_dependents();
    const int row = blockIdx.y;
    const float T = temperature[row];
    if (T <= 0.0f) return;  // greedy row
    extern __shared__ u64 smem[];
    u64* keys = smem;                   // [MAX_GROUPS]
    u64* hmass = keys + MAX_GROUPS;     // [BUCKETS]
    u64* red = hmass + BUCKETS;         // [WARPS + 1]
    u32* hcount = reinterpret_cast<u32*>(red + WARPS + 1);  // [BUCKETS]
    const Workspace ws = carve(workspace, M, V);
    const int groups = V / GROUP, n2 = ceil_pow2(groups);
    const int keff = kept_by_top_k(top_k[row], V);
    const int rank = keff < CAND_RANK ? keff : CAND_RANK;
    const bool histogram = keff > CAND_RANK;
    for (int g = threadIdx.x; g < n2; g += THREADS)
        keys[g] = g < groups ? ws.gmax[(size_t)row * groups + g] : 0;
    if (histogram) {
        for (int b = threadIdx.x; b < BUCKETS; b += THREADS) {
            hcount[b] = 0;
            hmass[b] = 0;
        }
    }
    sort_descending(keys, n2);
    const float s0 = composite_value(keys[0]) / T;
    // `rank` groups have a maximum >= beta: at least `rank` elements are >= beta
    const u64 beta = rank <= groups ? keys[rank - 1] : 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) ws.beta[row] = beta;
    const float4* y4 = reinterpret_cast<const float4*>(ws.y + (size_t)row * V);
    u64* cand = ws.cand + (size_t)row * CAP;
    const int end4 = (blockIdx.x * chunk + chunk < V ? blockIdx.x * chunk + chunk : V) / 4;
    u64 cand_w = 0;
    for (int i4 = blockIdx.x * (chunk / 4) + threadIdx.x; i4 < end4; i4 += THREADS) {  // warps
        const float4 v = y4[i4];
        const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u64 c = composite(e[k], 4 * i4 + k);
            const bool take = c >= beta;
            warp_append(take, c, &ws.cand_count[row], cand);
            if (take) {
                cand_w += fixed_weight(e[k], T, s0);
            } else if (histogram) {
                const int b = (int)(float_key(e[k]) >> (32 - BUCKET_BITS));
                atomicAdd(&hcount[b], 1u);
                atomicAdd(&hmass[b], fixed_weight(e[k], T, s0));
            }
        }
    }
    const u64 total = block_sum(cand_w, red);  // also orders the histogram updates before the flush
    if (threadIdx.x == 0 && total) atomicAdd(&ws.cand_mass[row], total);
    if (histogram) {
        for (int b = threadIdx.x; b < BUCKETS; b += THREADS) {
            if (hcount[b]) {
                atomicAdd(&ws.hist_count[(size_t)row * BUCKETS + b], hcount[b]);
                atomicAdd(&ws.hist_mass[(size_t)row * BUCKETS + b], hmass[b]);
            }
        }
    }
}

// sample_pick's row; DIST (sample_pick_dist): also the row's record for the speculative ratio
// rule (spec_ratio, below): {cut, S, s0} where the kept tokens are those whose composite key is
// >= cut (0: every token), S their fixed-point mass and s0 = y_max / T (bits of the float), so
// the sampling distribution is p(x) = W(x) / S on the kept set; a greedy row's is {the argmax's
// key, 0, 0}.
template <bool DIST>
__device__ __forceinline__ void pick_row(int V, const float* __restrict__ temperature,
                                         const int* __restrict__ top_k,
                                         const float* __restrict__ top_p,
                                         const int* __restrict__ seed,
                                         const int* __restrict__ step, const Workspace& ws,
                                         int* __restrict__ out, u64* __restrict__ dist,
                                         PickShared& sh) {
    const int row = blockIdx.x, groups = V / GROUP;
    u64 best = 0;
    for (int g = threadIdx.x; g < groups; g += THREADS)
        best = max_u64(best, ws.gmax[(size_t)row * groups + g]);
    const u64 top = block_max(best, sh.red);
    const float T = temperature[row];
    if (T <= 0.0f) {
        if (threadIdx.x == 0) {
            out[row] = composite_index(top);
            if (DIST) {
                dist[3 * row] = top;
                dist[3 * row + 1] = 0;
                dist[3 * row + 2] = 0;
            }
        }
        return;
    }
    const int keff = kept_by_top_k(top_k[row], V);
    Picker p{sh,
             ws.y + (size_t)row * V,
             V,
             T,
             composite_value(top) / T,
             ws.beta[row],
             ws.cand_count[row],
             ws.cand_mass[row],
             keff > CAND_RANK,
             ws.hist_count + (size_t)row * BUCKETS,
             ws.hist_mass + (size_t)row * BUCKETS,
             ws.cand + (size_t)row * CAP,
             false};
    u64 z;        // the mass of the top_k' first tokens
    u64 last = 0;  // the last kept token's key (0: every token is kept)
    if (keff == V) {
        u64 h = 0;
        if (p.histogram) {
            for (int b = threadIdx.x; b < BUCKETS; b += THREADS) h += p.hist_mass[b];
        }
        z = p.mass0 + block_sum(h, sh.red);
    } else {
        const Found k = p.find(RANK, (u64)(keff - 1));
        z = k.mass;
        last = k.c;
    }
    u64 s = z;  // the kept mass
    const float tp = top_p[row];
    if (tp < 1.0f) {  // keep while the mass before a token is < top_p * Z
        const double want = ceil((double)tp * (double)z);
        const u64 cut = want <= 0.0 ? 0 : min_u64((u64)want, z);
        const Found c = p.find(MASS_AT_LEAST, cut);
        s = c.mass;
        last = c.c;
    }
    const u64 t = (u64)((double)sampling_uniform(seed[row], step[row]) * (double)s);
    const Found f = p.find(MASS_ABOVE, t);
    if (threadIdx.x == 0) {
        out[row] = composite_index(f.c);
        if (DIST) {
            dist[3 * row] = last;
            dist[3 * row + 1] = s;
            dist[3 * row + 2] = __float_as_uint(p.s0);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_pick(int M, int V, const float* __restrict__ temperature, const int* __restrict__ top_k,
            const float* __restrict__ top_p, const int* __restrict__ seed,
            const int* __restrict__ step, void* workspace, int* __restrict__ out) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ u64 smem[];
    pick_row<false>(V, temperature, top_k, top_p, seed, step, carve(workspace, M, V), out,
                    nullptr, *reinterpret_cast<PickShared*>(smem));
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_pick_dist(int M, int V, const float* __restrict__ temperature,
                 const int* __restrict__ top_k, const float* __restrict__ top_p,
                 const int* __restrict__ seed, const int* __restrict__ step, void* workspace,
                 int* __restrict__ out, void* dist) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ u64 smem[];
    pick_row<true>(V, temperature, top_k, top_p, seed, step, carve(workspace, M, V), out,
                   static_cast<u64*>(dist), *reinterpret_cast<PickShared*>(smem));
}

// ---------------------------------------------------------------- the speculative ratio rule
// spec_ratio grid (lanes), after sample_pick_dist over the rows of a verify call (issue 15;
// ratio.py). Lane l = lanes[4 l .. 4 l + 3] = {row0, n, q_at, q_stride}: its token and n drafts
// are rows row0 .. row0 + n (draft d(i+1) = tokens[row0 + i + 1]), row i's target distribution
// p_i is the record dist[row0 + i] over y (the sampler's workspace), and the drafter's q_i the
// record q_dist[j] over q_logits[j] (j = q_at + i * q_stride: the draft entry's step i of its
// lane), both at the row's temperature. n <= 0 (or a greedy row) leaves the lane's tokens as the
// pick wrote them (exact match). Down the rows, d = d(i+1) is accepted where u q_i(d) < p_i(d),
// u = the uniform of stream ACCEPT at (seed, step) of row i; at the first other row m the
// residual r(x) = max(0, p_m(x) - q_m(x)) is summed over the vocabulary: no mass (p_m <= q_m
// everywhere) accepts d too, else the token is the first x in vocabulary order whose running sum
// of r exceeds floor(w R) (R the sum, w stream RESIDUAL's uniform at row m's (seed, step)).
// The lane's rows then hold the accepted drafts, the new token (all n accepted: the pick's token
// after row n, as it stands) and -1 for the rest.
// Arithmetic, exactly as ratio.py's reference: p(x) = double(W(x)) * (1 / double(S)) on the
// kept set (W the sampler's fixed-point weight), r(x) = floor(2^52 max(0, p(x) - q(x))) as
// a 64-bit integer (sums exact), every double step rounded on its own (no FMA contraction).
constexpr u32 ACCEPT = 1, RESIDUAL = 2;  // uniform streams, as targets/xla/rejection.py's
constexpr double RESIDUAL_ONE = 4503599627370496.0;  // 2^52
constexpr int RATIO_TILE = 4 * THREADS;  // elements per tile of the residual's sums
constexpr int MAX_TILES = MAX_GROUPS * GROUP / RATIO_TILE;

__device__ __forceinline__ float stream_uniform(int seed, int step, u32 stream) {
    return (float)(mix32(mix32(mix32((u32)seed) ^ (u32)step) ^ stream) >> 8) *
           5.9604644775390625e-08f;
}

struct Dist {
    u64 cut;     // kept: composite key >= cut
    double inv;  // 1 / S
    float s0;
    bool sampled;
};

__device__ __forceinline__ Dist load_dist(const u64* __restrict__ d) {
    const u64 mass = d[1];
    return Dist{d[0], mass ? __ddiv_rn(1.0, __ull2double_rn(mass)) : 0.0,
                __uint_as_float((u32)d[2]), mass != 0};
}

__device__ __forceinline__ double prob(float y, int x, float T, const Dist& d) {
    if (composite(y, x) < d.cut) return 0.0;
    return __dmul_rn(__ull2double_rn(fixed_weight(y, T, d.s0)), d.inv);
}

__device__ __forceinline__ u64 residual_weight(double p, double q) {
    const double r = __dsub_rn(p, q);
    return r > 0.0 ? __double2ull_rz(__dmul_rn(r, RESIDUAL_ONE)) : 0;
}

// The residual weights of this thread's 4 elements of tile t (0 past the row), their sum.
__device__ __forceinline__ u64 residual_four(const float* yp, const float* yq, int V, int t,
                                             float T, const Dist& dp, const Dist& dq, u64* w) {
    const int i4 = t * THREADS + threadIdx.x;
    u64 sum = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = 0;
    if (i4 < V / 4) {
        const float4 a = reinterpret_cast<const float4*>(yp)[i4];
        const float4 b = reinterpret_cast<const float4*>(yq)[i4];
        const float ea[4] = {a.x, a.y, a.z, a.w};
        const float eb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int x = 4 * i4 + k;
            w[k] = residual_weight(prob(ea[k], x, T, dp), prob(softcapped(eb[k], 0.0f), x, T, dq));
            sum += w[k];
        }
    }
    return sum;
}

extern "C" __global__ void __launch_bounds__(THREADS)
spec_ratio(int M, int V, const void* workspace, const void* dist,
           const float* __restrict__ q_logits, const void* q_dist, const int* __restrict__ tokens,
           const float* __restrict__ temperature, const int* __restrict__ seed,
           const int* __restrict__ step, const int* __restrict__ lanes, int* __restrict__ out) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ u64 red[WARPS + 1];
    __shared__ u64 tile_sum[MAX_TILES];
    __shared__ u64 found_before;
    __shared__ int found_tile, found;
    const int* lane = lanes + 4 * blockIdx.x;
    const int row0 = lane[0], n = lane[1], q_at = lane[2], q_stride = lane[3];
    if (n <= 0 || row0 < 0 || row0 + n >= M) return;
    const float T = temperature[row0];
    if (T <= 0.0f) return;  // greedy: exact match
    const Workspace ws = carve(const_cast<void*>(workspace), M, V);
    const u64* pd_all = static_cast<const u64*>(dist);
    const u64* qd_all = static_cast<const u64*>(q_dist);
    const int tiles = (V + RATIO_TILE - 1) / RATIO_TILE;
    for (int i = 0; i < n; ++i) {  // a greedy record (no mass): not this rule's lane
        if (!pd_all[3 * (size_t)(row0 + i) + 1] || !qd_all[3 * (size_t)(q_at + i * q_stride) + 1])
            return;
    }
    int m = n, next = -1;
    for (int i = 0; i < n; ++i) {  // every thread takes the same branches
        const int r = row0 + i, j = q_at + i * q_stride, d = tokens[r + 1];
        const Dist dp = load_dist(pd_all + 3 * (size_t)r), dq = load_dist(qd_all + 3 * (size_t)j);
        const float* yp = ws.y + (size_t)r * V;
        const float* yq = q_logits + (size_t)j * V;
        const bool in = d >= 0 && d < V;
        const double p = in ? prob(yp[d], d, T, dp) : 0.0;
        const double q = in ? prob(softcapped(yq[d], 0.0f), d, T, dq) : 0.0;
        if (__dmul_rn((double)stream_uniform(seed[r], step[r], ACCEPT), q) < p) continue;
        u64 w[4];
        for (int t = 0; t < tiles; ++t) {
            const u64 sum = block_sum(residual_four(yp, yq, V, t, T, dp, dq, w), red);
            if (threadIdx.x == 0) tile_sum[t] = sum;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 total = 0;
            for (int t = 0; t < tiles; ++t) total += tile_sum[t];
            found_tile = -1;
            if (total) {
                const u64 target = __double2ull_rz(__dmul_rn(
                    (double)stream_uniform(seed[r], step[r], RESIDUAL), __ull2double_rn(total)));
                u64 before = 0;
                for (int t = 0; t < tiles && found_tile < 0; ++t) {
                    if (before + tile_sum[t] > target) {
                        found_tile = t;
                        found_before = target - before;  // what the tile's running sum passes
                    }
                    before += tile_sum[t];
                }
            }
            found = -1;
        }
        __syncthreads();
        if (found_tile < 0) continue;  // no residual mass: p <= q, d accepted
        const u64 mine = residual_four(yp, yq, V, found_tile, T, dp, dq, w);
        u64 all;
        u64 cum = block_exclusive_scan(mine, red, &all);
        const u64 target = found_before;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (cum <= target && cum + w[k] > target)
                found = 4 * (found_tile * THREADS + threadIdx.x) + k;
            cum += w[k];
        }
        __syncthreads();
        m = i;
        next = found;
        break;
    }
    for (int i = threadIdx.x; i <= n; i += THREADS) {
        if (i < m) {
            out[row0 + i] = tokens[row0 + i + 1];
        } else if (i == m) {
            if (m < n) out[row0 + i] = next;  // else the pick's token after row n stays
        } else {
            out[row0 + i] = -1;
        }
    }
}

// ---------------------------------------------------------------- the sampler's extras
// Sampled entry points (issue 16; sample.py) run sample_logprob_stats, sample_penalize and
// sample_mask between sample_prepare and sample_filter, and sample_logprobs after sample_pick:
//   sample_logprob_stats grid (V / 4096, M), rows with n_top >= 0: per 4096 elements of
//                   y = softcap(logits) (the model's own, unpenalized) the maximum and the sum of
//                   exp(y - that maximum), and every group's maximum, into the logprobs scratch
//                   (layout: lp_carve() and sample.py's logprob_scratch_bytes).
//   sample_penalize grid (M): the ids listed for the row (pairs (id, count) at pool + pen_at[row],
//                   pen_n[row] of them, each id once) penalized in y as ops.ref_penalize: a
//                   positive y divided by the repetition penalty, another multiplied, then
//                   frequency * count and presence * (count > 0) subtracted, each step rounded
//                   (no fused multiply-add), -0 made +0.
//   sample_mask     grid (V / 4096, M): on a row with a mask (mask_at[row] >= 0: V / 32 words at
//                   pool + mask_at[row], bit j of word w allows token 32 w + j) every token whose
//                   bit is 0 gets y = -inf; on a row with a mask or penalties the group maxima are
//                   recomputed. Other rows keep what sample_prepare wrote.
//   sample_logprobs grid (M): log_softmax(y) (before penalties, mask and temperature) from the
//                   stats: the sampled token's log-probability and the K likeliest (id,
//                   log-probability), most likely first (ties: the lower index), on rows with
//                   n_top >= 0 (the top ones where n_top > 0; zeros otherwise). The K likeliest
//                   lie in the K groups of 128 with the largest maxima, at or above the K-th of
//                   those maxima: only those elements are gathered and sorted.
// A row must allow at least one token (the host refuses an empty mask).
constexpr int MAX_TOP = 32;  // K <= MAX_TOP: the top groups' elements fit the group-key array
constexpr int LP_CHUNK = 4 * THREADS;  // elements per sample_logprob_stats CTA
static_assert(MAX_TOP * GROUP <= MAX_GROUPS, "the top groups' elements reuse the key array");

struct LpScratch {
    float2* part;  // [M, V / LP_CHUNK (rounded up)]: (maximum, sum of exp(y - maximum))
    u64* gmax;     // [M, V / GROUP] group maxima (composite keys) of the unpenalized y
};

__device__ LpScratch lp_carve(void* base, int M, int V) {
    const int chunks = (V + LP_CHUNK - 1) / LP_CHUNK;
    LpScratch s;
    s.part = static_cast<float2*>(base);
    const size_t parts = (size_t)M * chunks * sizeof(float2);
    s.gmax = reinterpret_cast<u64*>(static_cast<char*>(base) + parts);
    return s;
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_penalize(int M, int V, const int* __restrict__ pool, const int* __restrict__ pen_at,
                const int* __restrict__ pen_n, const float* __restrict__ presence,
                const float* __restrict__ frequency, const float* __restrict__ repetition,
                void* workspace) {
    pdl_wait();
    pdl_launch_dependents();
    const int row = blockIdx.x;
    const int n = pen_n[row];
    if (n <= 0) return;
    const Workspace ws = carve(workspace, M, V);
    float* y = ws.y + (size_t)row * V;
    const int* pairs = pool + pen_at[row];
    const float p = presence[row], f = frequency[row], r = repetition[row];
    for (int i = threadIdx.x; i < n; i += THREADS) {
        const int t = pairs[2 * i], c = pairs[2 * i + 1];
        if (t < 0 || t >= V) continue;
        float x = y[t];
        x = x > 0.0f ? __fdiv_rn(x, r) : __fmul_rn(x, r);
        x = __fsub_rn(__fsub_rn(x, __fmul_rn(f, (float)c)), __fmul_rn(p, c > 0 ? 1.0f : 0.0f));
        y[t] = x == 0.0f ? 0.0f : x;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_mask(int M, int V, const int* __restrict__ pool, const int* __restrict__ mask_at,
            const int* __restrict__ pen_n, void* workspace) {
    pdl_wait();
    pdl_launch_dependents();
    const int row = blockIdx.y;
    const int at = mask_at[row];
    if (at < 0 && pen_n[row] <= 0) return;  // y and its group maxima as sample_prepare left them
    const Workspace ws = carve(workspace, M, V);
    const int c4 = blockIdx.x * THREADS + threadIdx.x;  // float4 index in the row
    if (c4 >= V / 4) return;                             // whole warps: V % 128 == 0
    float4* y4 = reinterpret_cast<float4*>(ws.y + (size_t)row * V) + c4;
    float4 y = *y4;
    if (at >= 0) {
        const u32 bits = (u32)pool[at + c4 / 8] >> ((4 * c4) & 31);
        const float ninf = __int_as_float(0xff800000);
        if (!(bits & 1u)) y.x = ninf;
        if (!(bits & 2u)) y.y = ninf;
        if (!(bits & 4u)) y.z = ninf;
        if (!(bits & 8u)) y.w = ninf;
        *y4 = y;
    }
    u64 best = max_u64(max_u64(composite(y.x, 4 * c4), composite(y.y, 4 * c4 + 1)),
                       max_u64(composite(y.z, 4 * c4 + 2), composite(y.w, 4 * c4 + 3)));
    best = warp_max(best);
    if ((threadIdx.x & 31) == 0) ws.gmax[(size_t)row * (V / GROUP) + c4 / 32] = best;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ float warp_max_f32(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_logprob_stats(const float* __restrict__ logits, int M, int V, float cap,
                     const int* __restrict__ n_top, void* scratch) {
    pdl_wait();
    pdl_launch_dependents();
    const int row = blockIdx.y;
    if (n_top[row] < 0) return;
    __shared__ float fred[WARPS];
    __shared__ double dred[WARPS];
    const LpScratch sc = lp_carve(scratch, M, V);
    const int chunks = (V + LP_CHUNK - 1) / LP_CHUNK;
    const int i4 = blockIdx.x * THREADS + threadIdx.x;  // float4 index in the row
    const bool in = i4 < V / 4;                          // whole warps: V % 128 == 0
    const float ninf = __int_as_float(0xff800000);
    float e[4] = {ninf, ninf, ninf, ninf};
    if (in) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(logits + (size_t)row * V) + i4);
        e[0] = softcapped(v.x, cap);
        e[1] = softcapped(v.y, cap);
        e[2] = softcapped(v.z, cap);
        e[3] = softcapped(v.w, cap);
        u64 g = max_u64(max_u64(composite(e[0], 4 * i4), composite(e[1], 4 * i4 + 1)),
                        max_u64(composite(e[2], 4 * i4 + 2), composite(e[3], 4 * i4 + 3)));
        g = warp_max(g);  // a warp's 32 float4 are one group of 128
        if ((threadIdx.x & 31) == 0) sc.gmax[(size_t)row * (V / GROUP) + i4 / 32] = g;
    }
    float m = warp_max_f32(fmaxf(fmaxf(e[0], e[1]), fmaxf(e[2], e[3])));
    if ((threadIdx.x & 31) == 0) fred[threadIdx.x >> 5] = m;
    __syncthreads();
    m = warp_max_f32(fred[threadIdx.x & 31]);  // the CTA's maximum (finite: one warp is in)
    double sum = 0.0;
    if (in) {
#pragma unroll
        for (int k = 0; k < 4; ++k) sum += (double)expf(e[k] - m);
    }
    sum = warp_sum_f64(sum);
    if ((threadIdx.x & 31) == 0) dred[threadIdx.x >> 5] = sum;
    __syncthreads();
    sum = warp_sum_f64(dred[threadIdx.x & 31]);
    if (threadIdx.x == 0) sc.part[(size_t)row * chunks + blockIdx.x] = make_float2(m, (float)sum);
}

// Appends c to list[*fill] for the lanes with `take` (at most `cap` kept); one atomic per warp.
__device__ __forceinline__ void warp_append_cap(bool take, u64 c, u32* fill, u64* list,
                                                u32 cap) {
    const u32 mask = __ballot_sync(FULL, take);
    if (mask == 0) return;
    const int lane = threadIdx.x & 31, leader = __ffs(mask) - 1;
    u32 base = 0;
    if (lane == leader) base = atomicAdd(fill, (u32)__popc(mask));
    base = __shfl_sync(FULL, base, leader);
    const u32 slot = base + __popc(mask & ((1u << lane) - 1u));
    if (take && slot < cap) list[slot] = c;
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_logprobs(const float* __restrict__ logits, int M, int V, float cap,
                const int* __restrict__ tokens, const int* __restrict__ n_top, int K,
                const void* scratch, float* __restrict__ logprob, int* __restrict__ top_ids,
                float* __restrict__ top_logprobs) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ u64 keys[MAX_GROUPS];  // group maxima; then the gathered elements
    __shared__ float fred[WARPS];
    __shared__ double dred[WARPS];
    __shared__ int chosen[MAX_TOP];
    __shared__ u32 fill;
    const int row = blockIdx.x, want = n_top[row];
    if (want <= 0) {
        for (int j = threadIdx.x; j < K; j += THREADS) {
            top_ids[(size_t)row * K + j] = 0;
            top_logprobs[(size_t)row * K + j] = 0.0f;
        }
        if (want < 0) {
            if (threadIdx.x == 0) logprob[row] = 0.0f;
            return;
        }
    }
    const LpScratch sc = lp_carve(const_cast<void*>(scratch), M, V);
    const int chunks = (V + LP_CHUNK - 1) / LP_CHUNK;
    const float ninf = __int_as_float(0xff800000);
    // chunks <= MAX_GROUPS / 32 = 128 < THREADS: one partial per thread
    const float2 part = threadIdx.x < chunks ? sc.part[(size_t)row * chunks + threadIdx.x]
                                             : make_float2(ninf, 0.0f);
    float ymax = warp_max_f32(part.x);
    if ((threadIdx.x & 31) == 0) fred[threadIdx.x >> 5] = ymax;
    __syncthreads();
    ymax = warp_max_f32(fred[threadIdx.x & 31]);
    double sum = threadIdx.x < chunks ? (double)part.y * exp((double)part.x - (double)ymax) : 0.0;
    sum = warp_sum_f64(sum);
    if ((threadIdx.x & 31) == 0) dred[threadIdx.x >> 5] = sum;
    __syncthreads();
    const float lse = (float)log(warp_sum_f64(dred[threadIdx.x & 31]));
    const float* x = logits + (size_t)row * V;
    if (threadIdx.x == 0) {
        const float yt = softcapped(x[tokens[row]], cap);
        logprob[row] = __fsub_rn(__fsub_rn(yt, ymax), lse);
    }
    if (want <= 0) return;
    const int groups = V / GROUP, n2 = ceil_pow2(groups);
    for (int g = threadIdx.x; g < n2; g += THREADS)
        keys[g] = g < groups ? sc.gmax[(size_t)row * groups + g] : 0;
    sort_descending(keys, n2);  // opens and ends with __syncthreads
    const int kg = K < groups ? K : groups;
    // every one of the K likeliest is >= the K-th largest group maximum (with fewer groups
    // than K, take every element)
    const u64 beta = K < groups ? keys[K - 1] : 0;
    if (threadIdx.x < kg) chosen[threadIdx.x] = composite_index(keys[threadIdx.x]) / GROUP;
    if (threadIdx.x == 0) fill = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < kg * GROUP; i += THREADS) {  // whole warps: 128 per group
        const int t = chosen[i / GROUP] * GROUP + i % GROUP;
        const u64 c = composite(softcapped(x[t], cap), t);
        warp_append_cap(c >= beta, c, &fill, keys, MAX_TOP * GROUP);
    }
    __syncthreads();
    const int n = (int)fill, m2 = ceil_pow2(n);  // K <= n <= kg * GROUP
    for (int i = n + threadIdx.x; i < m2; i += THREADS) keys[i] = 0;
    sort_descending(keys, m2);
    for (int j = threadIdx.x; j < K; j += THREADS) {
        top_ids[(size_t)row * K + j] = composite_index(keys[j]);
        top_logprobs[(size_t)row * K + j] =
            __fsub_rn(__fsub_rn(composite_value(keys[j]), ymax), lse);
    }
}
