// The mixture-of-experts block of a Gemma 4 MoE layer (26B-A4B), all on the device so a decode
// step stays one CUDA graph: the expert ids never visit the host.
//
// moe_norms:      z[m]  = bf16(r[m] * rr * router_scale * router_mul)   (router input)
//                 x2[m] = bf16(r[m] * rr * w2)                          (expert input)
//                 rr = 1 / sqrt(mean(r[m]^2) + eps); one CTA per row, like norms.cu.
// moe_route:      softmax(logits[m]) over E experts (f32), top-K (ties: lower id), weights
//                 renormalised to sum 1 and times per_expert_scale[id] -> ids[m, K], wts[m, K].
//                 One warp per row, E <= 256.
// moe_gate_up:    for each (row m, slot j) with expert e = ids[m, j] and each i < I:
//                 hid[m, j, i] = bf16(gelu_tanh(sg[e, i] * W[e, i] . x[m])
//                                      * (sg[e, I + i] * W[e, I + i] . x[m]))
//                 W e4m3 [E, 2I, H] (gate rows first), sg f32 [E, 2I]. One warp per (m, j, i),
//                 reading the gate and the up row together; x (M <= 4 rows) staged in shared
//                 memory. Only the chosen experts' rows are read.
// moe_down:       y[m, n] = sum_j wts[m, j] * (sd[e_j, n] * D[e_j, n] . hid[m, j])
//                 D e4m3 [E, H, I], sd f32 [E, H]. One warp per (m, n) covers all K experts'
//                 rows, so the sum over experts is a fixed warp reduction: deterministic, no
//                 atomics. hid (M * K * I bf16) staged in shared memory.
// moe_branch_sum: out[m] = f[m] * rf * w1 + y[m] * ry * w2   (the dense and expert branches,
//                 each RMS-normalised; ops.ref_residual_rmsnorm of the fused IR)
//
// Prefill (M > 4 rows) groups the (row, slot) pairs by expert so each chosen expert's weights
// are streamed once per launch, not once per row:
// moe_sort:       order[P] = the pair indices p = m * K + j sorted by expert (stable), and
//                 offsets[E + 1] (expert e's pairs are order[offsets[e] : offsets[e + 1]]).
//                 One CTA; a warp per expert compacts with ballots: deterministic.
// moe_gate_up_grouped: hid[p, i] as moe_gate_up, for every pair p of expert e = blockIdx.y;
//                 a CTA owns GROUP_I outputs i of one expert and runs over its pairs PAIRS at a
//                 time, their x rows staged in shared memory.
// moe_down_grouped: part[p, n] = wts[p] * (sd[e, n] * D[e, n] . hid[p]), likewise per expert.
// moe_sum_pairs:  y[m, n] = sum over j in order of part[m * K + j, n] (deterministic).
// moe_router_rows: logits[m, e] = z[m] . Wr[e] (bf16 [M, H] x bf16 [E, H] -> f32), the router
//                 linear of a prefill chunk in one launch (decode uses gemv_bf16): a CTA per
//                 PAIRS rows staged in shared memory, a warp per expert.
// Elementwise steps round like the numpy references (no FMA contraction); dot products
// accumulate in f32 in a different order. Contract: H % 16 == 0, I % 16 == 0, rows 16-byte
// aligned, M <= 4 for moe_gate_up / moe_down.
#include "common.cuh"

namespace {
constexpr int NORM_THREADS = 512;
constexpr int NV = 4;  // float4 per thread in the norms: H <= 8192
constexpr int WARPS = 8;  // warps per block of the expert kernels
constexpr int UNROLL = 4;  // 16-byte loads in flight per lane (per row in moe_gate_up: 2)
constexpr int MAX_E_PER_LANE = 8;  // moe_route: E <= 256
constexpr int SORT_THREADS = 1024;
constexpr int PAIRS = 8;  // pairs per shared-memory group of the grouped kernels
constexpr int GROUP_I = 4 * WARPS;  // gate/up outputs per CTA of moe_gate_up_grouped
constexpr int GROUP_N = 4 * WARPS;  // down outputs per CTA of moe_down_grouped

// acc += 16 e4m3 weights . 16 bf16 activations
__device__ __forceinline__ float dot16(const uint4 w8, const __nv_bfloat16* __restrict__ x,
                                       float acc) {
    float w[16];
    fp8x16_to_f32(w8, w);
    const __nv_bfloat162* xv = reinterpret_cast<const __nv_bfloat162*>(x);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float2 xf = __bfloat1622float2(xv[j]);
        acc = fmaf(w[2 * j], xf.x, acc);
        acc = fmaf(w[2 * j + 1], xf.y, acc);
    }
    return acc;
}

__device__ __forceinline__ void stage(void* dst, const void* src, int nbytes) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int i = threadIdx.x; i < nbytes / 16; i += blockDim.x) d[i] = s[i];
    __syncthreads();
}

// float4 c of a row stored as bf16 (rounded) or float32
__device__ __forceinline__ void store4_at(__nv_bfloat16* row, int c, const float4 o) {
    store_bf16x4(row + 4 * c, o);
}

__device__ __forceinline__ void store4_at(float* row, int c, const float4 o) {
    reinterpret_cast<float4*>(row)[c] = o;
}

// One row of moe_norms / moe_norms_f32, z and x2 stored as Out (bf16, or f32 unrounded)
template <typename Out>
__device__ __forceinline__ void norms_row(const float* __restrict__ r,
                                          const float* __restrict__ router_scale,
                                          float router_mul, const float* __restrict__ w2,
                                          Out* __restrict__ z, Out* __restrict__ x2, int H,
                                          float eps) {
    __shared__ float red[32];
    const int n4 = H / 4;
    const size_t row = (size_t)blockIdx.x * H;
    float4 v[NV];
    const float rr = load_row_rms<NORM_THREADS, NV>(r + row, v, n4, H, eps, red);
    const float4* rs4 = reinterpret_cast<const float4*>(router_scale);
    const float4* w4 = reinterpret_cast<const float4*>(w2);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * NORM_THREADS;
        if (c < n4) {
            const float4 n = mul4(v[i], rr);
            store4_at(z + row, c, mul4(mul4(n, __ldg(rs4 + c)), router_mul));
            store4_at(x2 + row, c, mul4(n, __ldg(w4 + c)));
        }
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
moe_norms(const float* __restrict__ r, const float* __restrict__ router_scale, float router_mul,
          const float* __restrict__ w2, __nv_bfloat16* __restrict__ z,
          __nv_bfloat16* __restrict__ x2, int H, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    norms_row(r, router_scale, router_mul, w2, z, x2, H, eps);
}

extern "C" __global__ void __launch_bounds__(32)
moe_route(const float* __restrict__ logits, const float* __restrict__ per_expert_scale,
          int* __restrict__ ids, float* __restrict__ wts, int E, int K) {
    pdl_wait();
    pdl_launch_dependents();
    const int lane = threadIdx.x;
    const float* l = logits + (size_t)blockIdx.x * E;
    float p[MAX_E_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int s = 0; s < MAX_E_PER_LANE; ++s) {
        const int e = lane + 32 * s;
        p[s] = e < E ? l[e] : -INFINITY;
        mx = fmaxf(mx, p[s]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < MAX_E_PER_LANE; ++s) {
        p[s] = lane + 32 * s < E ? expf(__fsub_rn(p[s], mx)) : 0.f;
        sum += p[s];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int s = 0; s < MAX_E_PER_LANE; ++s) {
        p[s] = lane + 32 * s < E ? __fdiv_rn(p[s], sum) : -1.f;  // -1: never chosen
    }
    float chosen = 0.f, total = 0.f;  // lane j keeps the j-th pick's probability
    int chosen_id = 0;
    for (int j = 0; j < K; ++j) {
        float best = -1.f;
        int best_id = E;
#pragma unroll
        for (int s = 0; s < MAX_E_PER_LANE; ++s) {
            const int e = lane + 32 * s;
            if (p[s] > best || (p[s] == best && e < best_id)) {
                best = p[s];
                best_id = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
            if (ob > best || (ob == best && oi < best_id)) {
                best = ob;
                best_id = oi;
            }
        }
        best_id = min(best_id, E - 1);  // NaN logits: still a valid expert to read
#pragma unroll
        for (int s = 0; s < MAX_E_PER_LANE; ++s) {
            if (lane + 32 * s == best_id) p[s] = -2.f;  // taken
        }
        total = __fadd_rn(total, best);
        if (lane == j) {
            chosen = best;
            chosen_id = best_id;
        }
    }
    if (lane < K) {
        const size_t at = (size_t)blockIdx.x * K + lane;
        ids[at] = chosen_id;
        wts[at] = __fmul_rn(__fdiv_rn(chosen, total), per_expert_scale[chosen_id]);
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)
moe_gate_up(const uint8_t* __restrict__ W, const float* __restrict__ scale,
            const __nv_bfloat16* __restrict__ x, const int* __restrict__ ids,
            __nv_bfloat16* __restrict__ hid, int M, int K, int I, int H) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    stage(xs, x, M * H * 2);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = H / 16;
    const int tasks = M * K * I;
    for (int t = blockIdx.x * WARPS + warp; t < tasks; t += gridDim.x * WARPS) {
        const int pair = t / I, i = t - pair * I;  // pair = m * K + j
        const int m = pair / K;
        const int e = __ldg(ids + pair);
        const size_t gate_row = (size_t)e * 2 * I + i, up_row = gate_row + I;
        const uint4* wg = reinterpret_cast<const uint4*>(W + gate_row * H);
        const uint4* wu = reinterpret_cast<const uint4*>(W + up_row * H);
        const __nv_bfloat16* xm = xs + (size_t)m * H;
        float ag = 0.f, au = 0.f;
        for (int base = lane; base < chunks; base += 32 * (UNROLL / 2)) {
            uint4 g[UNROLL / 2], u[UNROLL / 2];
#pragma unroll
            for (int s = 0; s < UNROLL / 2; ++s) {
                const int c = base + 32 * s;
                g[s] = c < chunks ? __ldg(wg + c) : make_uint4(0, 0, 0, 0);
                u[s] = c < chunks ? __ldg(wu + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int s = 0; s < UNROLL / 2; ++s) {
                const int c = base + 32 * s;
                if (c < chunks) {
                    ag = dot16(g[s], xm + 16 * c, ag);
                    au = dot16(u[s], xm + 16 * c, au);
                }
            }
        }
        ag = warp_sum(ag);
        au = warp_sum(au);
        if (lane == 0) {
            const float gv = __fmul_rn(ag, __ldg(scale + gate_row));
            const float uv = __fmul_rn(au, __ldg(scale + up_row));
            hid[(size_t)pair * I + i] = __float2bfloat16_rn(__fmul_rn(gelu_tanh(gv), uv));
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)
moe_down(const uint8_t* __restrict__ D, const float* __restrict__ scale,
         const __nv_bfloat16* __restrict__ hid, const int* __restrict__ ids,
         const float* __restrict__ wts, float* __restrict__ y, int M, int K, int I, int H) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* hs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    stage(hs, hid, M * K * I * 2);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per_row = I / 16;  // 16-byte chunks of one expert's row
    const int chunks = K * per_row;
    for (int t = blockIdx.x * WARPS + warp; t < M * H; t += gridDim.x * WARPS) {
        const int m = t / H, n = t - m * H;
        float acc = 0.f;
        for (int base = lane; base < chunks; base += 32 * UNROLL) {
            uint4 v[UNROLL];
            int e[UNROLL], j[UNROLL], c[UNROLL];
#pragma unroll
            for (int s = 0; s < UNROLL; ++s) {
                const int q = base + 32 * s;
                j[s] = q / per_row;
                c[s] = q - j[s] * per_row;
                e[s] = q < chunks ? __ldg(ids + m * K + j[s]) : 0;
                v[s] = q < chunks ? __ldg(reinterpret_cast<const uint4*>(
                                        D + ((size_t)e[s] * H + n) * I) + c[s])
                                  : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int s = 0; s < UNROLL; ++s) {
                if (base + 32 * s < chunks) {
                    const int pair = m * K + j[s];
                    const float part = dot16(v[s], hs + (size_t)pair * I + 16 * c[s], 0.f);
                    const float coef = __fmul_rn(__ldg(scale + (size_t)e[s] * H + n),
                                                 __ldg(wts + pair));
                    acc = fmaf(part, coef, acc);
                }
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) y[(size_t)m * H + n] = acc;
    }
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
moe_branch_sum(const float* __restrict__ f, const float* __restrict__ w1,
               const float* __restrict__ y, const float* __restrict__ w2,
               float* __restrict__ out, int H, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ float red[32];
    const int n4 = H / 4;
    const size_t row = (size_t)blockIdx.x * H;
    float4 a[NV], b[NV];
    const float rf = load_row_rms<NORM_THREADS, NV>(f + row, a, n4, H, eps, red);
    const float ry = load_row_rms<NORM_THREADS, NV>(y + row, b, n4, H, eps, red);
    const float4* w14 = reinterpret_cast<const float4*>(w1);
    const float4* w24 = reinterpret_cast<const float4*>(w2);
    float4* o4 = reinterpret_cast<float4*>(out + row);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * NORM_THREADS;
        if (c < n4) {
            const float4 p = mul4(mul4(a[i], rf), __ldg(w14 + c));
            const float4 q = mul4(mul4(b[i], ry), __ldg(w24 + c));
            o4[c] = make_float4(__fadd_rn(p.x, q.x), __fadd_rn(p.y, q.y), __fadd_rn(p.z, q.z),
                                __fadd_rn(p.w, q.w));
        }
    }
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
moe_sort(const int* __restrict__ ids, int* __restrict__ order, int* __restrict__ offsets, int P,
         int E) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ int start[MAX_E_PER_LANE * 32 + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = SORT_THREADS / 32;
    const unsigned below = (1u << lane) - 1;
    for (int e = warp; e < E; e += warps) {
        int count = 0;
        for (int base = 0; base < P; base += 32) {
            const int p = base + lane;
            count += __popc(__ballot_sync(0xffffffffu, p < P && __ldg(ids + p) == e));
        }
        if (lane == 0) start[e + 1] = count;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        start[0] = 0;
        for (int e = 0; e < E; ++e) start[e + 1] += start[e];
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += SORT_THREADS) offsets[e] = start[e];
    for (int e = warp; e < E; e += warps) {
        int at = start[e];
        for (int base = 0; base < P; base += 32) {
            const int p = base + lane;
            const bool mine = p < P && __ldg(ids + p) == e;
            const unsigned mask = __ballot_sync(0xffffffffu, mine);
            if (mine) order[at + __popc(mask & below)] = p;
            at += __popc(mask);
        }
    }
}

namespace {
// Stage the rows src[row_of(order[first + r])] (r < n, `cols` bf16 each) into dst[r]; rows
// beyond n are left as they are (their results are never stored).
__device__ __forceinline__ void stage_rows(__nv_bfloat16* dst, const __nv_bfloat16* src,
                                           const int* __restrict__ order, int first, int n,
                                           int divide, int cols) {
    const int per_row = cols / 8;  // 16-byte chunks
    for (int q = threadIdx.x; q < n * per_row; q += blockDim.x) {
        const int r = q / per_row, c = q - r * per_row;
        const int row = __ldg(order + first + r) / divide;
        reinterpret_cast<uint4*>(dst + (size_t)r * cols)[c] =
            __ldg(reinterpret_cast<const uint4*>(src + (size_t)row * cols) + c);
    }
}

// Every lane gets the warp sums of acc[0..PAIRS).
__device__ __forceinline__ void warp_sums(float (&acc)[PAIRS]) {
#pragma unroll
    for (int r = 0; r < PAIRS; ++r) acc[r] = warp_sum(acc[r]);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
moe_gate_up_grouped(const uint8_t* __restrict__ W, const float* __restrict__ scale,
                    const __nv_bfloat16* __restrict__ x, const int* __restrict__ order,
                    const int* __restrict__ offsets, __nv_bfloat16* __restrict__ hid, int K,
                    int I, int H) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [PAIRS][H]
    const int e = blockIdx.y;
    const int first = __ldg(offsets + e), count = __ldg(offsets + e + 1) - first;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = H / 16;
    for (int g0 = 0; g0 < count; g0 += PAIRS) {
        const int n = min(PAIRS, count - g0);
        __syncthreads();  // the previous group's rows are no longer read
        stage_rows(xs, x, order, first + g0, n, K, H);
        __syncthreads();
        for (int i = blockIdx.x * GROUP_I + warp; i < min(I, (blockIdx.x + 1) * GROUP_I);
             i += WARPS) {
            const size_t gate_row = (size_t)e * 2 * I + i, up_row = gate_row + I;
            const uint4* wg = reinterpret_cast<const uint4*>(W + gate_row * H);
            const uint4* wu = reinterpret_cast<const uint4*>(W + up_row * H);
            float ag[PAIRS], au[PAIRS];
#pragma unroll
            for (int r = 0; r < PAIRS; ++r) ag[r] = au[r] = 0.f;
            for (int c = lane; c < chunks; c += 32) {
                float g[16], u[16];
                fp8x16_to_f32(__ldg(wg + c), g);
                fp8x16_to_f32(__ldg(wu + c), u);
#pragma unroll
                for (int r = 0; r < PAIRS; ++r) {
                    const __nv_bfloat162* xv =
                        reinterpret_cast<const __nv_bfloat162*>(xs + (size_t)r * H + 16 * c);
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        const float2 xf = __bfloat1622float2(xv[q]);
                        ag[r] = fmaf(g[2 * q], xf.x, ag[r]);
                        ag[r] = fmaf(g[2 * q + 1], xf.y, ag[r]);
                        au[r] = fmaf(u[2 * q], xf.x, au[r]);
                        au[r] = fmaf(u[2 * q + 1], xf.y, au[r]);
                    }
                }
            }
            warp_sums(ag);
            warp_sums(au);
            const float sg = __ldg(scale + gate_row), su = __ldg(scale + up_row);
#pragma unroll
            for (int r = 0; r < PAIRS; ++r) {
                if (lane == r && r < n) {
                    const int p = __ldg(order + first + g0 + r);
                    const float gv = __fmul_rn(ag[r], sg), uv = __fmul_rn(au[r], su);
                    hid[(size_t)p * I + i] = __float2bfloat16_rn(__fmul_rn(gelu_tanh(gv), uv));
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
moe_down_grouped(const uint8_t* __restrict__ D, const float* __restrict__ scale,
                 const __nv_bfloat16* __restrict__ hid, const int* __restrict__ order,
                 const int* __restrict__ offsets, const float* __restrict__ wts,
                 float* __restrict__ part, int I, int H) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* hs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [PAIRS][I]
    const int e = blockIdx.y;
    const int first = __ldg(offsets + e), count = __ldg(offsets + e + 1) - first;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = I / 16;
    for (int g0 = 0; g0 < count; g0 += PAIRS) {
        const int n = min(PAIRS, count - g0);
        __syncthreads();
        stage_rows(hs, hid, order, first + g0, n, 1, I);
        __syncthreads();
        for (int o = blockIdx.x * GROUP_N + warp; o < min(H, (blockIdx.x + 1) * GROUP_N);
             o += WARPS) {
            const uint4* wd = reinterpret_cast<const uint4*>(D + ((size_t)e * H + o) * I);
            float acc[PAIRS];
#pragma unroll
            for (int r = 0; r < PAIRS; ++r) acc[r] = 0.f;
            for (int c = lane; c < chunks; c += 32) {
                const uint4 v = __ldg(wd + c);
#pragma unroll
                for (int r = 0; r < PAIRS; ++r) {
                    acc[r] = dot16(v, hs + (size_t)r * I + 16 * c, acc[r]);
                }
            }
            warp_sums(acc);
            const float sd = __ldg(scale + (size_t)e * H + o);
#pragma unroll
            for (int r = 0; r < PAIRS; ++r) {
                if (lane == r && r < n) {
                    const int p = __ldg(order + first + g0 + r);
                    part[(size_t)p * H + o] = __fmul_rn(__fmul_rn(acc[r], sd), __ldg(wts + p));
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
moe_sum_pairs(const float* __restrict__ part, float* __restrict__ y, int K, int H) {
    pdl_wait();
    pdl_launch_dependents();
    const int m = blockIdx.y;
    const int c = blockIdx.x * 256 + threadIdx.x;  // float4 column
    if (c >= H / 4) return;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j = 0; j < K; ++j) {
        const float4* row = reinterpret_cast<const float4*>(part + ((size_t)m * K + j) * H);
        const float4 v = __ldg(row + c);
        s = make_float4(__fadd_rn(s.x, v.x), __fadd_rn(s.y, v.y), __fadd_rn(s.z, v.z),
                        __fadd_rn(s.w, v.w));
    }
    reinterpret_cast<float4*>(y + (size_t)m * H)[c] = s;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
moe_router_rows(const __nv_bfloat16* __restrict__ z, const __nv_bfloat16* __restrict__ Wr,
                float* __restrict__ logits, int M, int E, int H) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* zs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [PAIRS][H]
    const int r0 = blockIdx.x * PAIRS, n = min(PAIRS, M - r0);
    stage(zs, z + (size_t)r0 * H, n * H * 2);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = H / 8;  // 16-byte chunks of bf16
    for (int e = warp; e < E; e += WARPS) {
        const uint4* wr = reinterpret_cast<const uint4*>(Wr + (size_t)e * H);
        float acc[PAIRS];
#pragma unroll
        for (int r = 0; r < PAIRS; ++r) acc[r] = 0.f;
        for (int c = lane; c < chunks; c += 32) {
            const uint4 wv = __ldg(wr + c);
            const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
            float w[8];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float2 f = __bfloat1622float2(w2[q]);
                w[2 * q] = f.x;
                w[2 * q + 1] = f.y;
            }
#pragma unroll
            for (int r = 0; r < PAIRS; ++r) {
                const uint4 xv = reinterpret_cast<const uint4*>(zs + (size_t)r * H)[c];
                const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float2 f = __bfloat1622float2(x2[q]);
                    acc[r] = fmaf(w[2 * q], f.x, acc[r]);
                    acc[r] = fmaf(w[2 * q + 1], f.y, acc[r]);
                }
            }
        }
        warp_sums(acc);
#pragma unroll
        for (int r = 0; r < PAIRS; ++r) {
            if (lane == r && r < n) logits[(size_t)(r0 + r) * E + e] = acc[r];
        }
    }
}

// The float32 plan's MoE entries (h100-f32: float32 weights, no scales, nothing rounded).
// moe_norms_f32: moe_norms with z and x2 float32.
// moe_gate_up_f32: hid[m, j, i] = gelu_tanh(W[e, i, :] . x[m]) * (W[e, I + i, :] . x[m]),
//   e = ids[m, j]; W f32 [E, 2I, H], x f32 [M, H], hid f32 [M, K, I]; a warp per (m, j, i).
// moe_down_f32: y[m, n] = sum_j wts[m, j] * (D[e_j, n, :] . hid[m, j]); D f32 [E, H, I]; a
//   warp per (m, n), the K experts summed in slot order. Neither stages anything, so any M
//   (prefill chunks too). Contract: H % 4 == 0, I % 4 == 0, 16-byte aligned rows.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
moe_norms_f32(const float* __restrict__ r, const float* __restrict__ router_scale,
              float router_mul, const float* __restrict__ w2, float* __restrict__ z,
              float* __restrict__ x2, int H, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    norms_row(r, router_scale, router_mul, w2, z, x2, H, eps);
}

namespace {
// a . b over n floats (n % 4 == 0), lane-strided float4s, summed over the warp
__device__ __forceinline__ float warp_dot_f32(const float* __restrict__ a,
                                              const float* __restrict__ b, int n) {
    const int lane = threadIdx.x & 31;
    float acc = 0.f;
    for (int c = lane; c < n / 4; c += 32) {
        const float4 x = __ldg(reinterpret_cast<const float4*>(a) + c);
        const float4 y = __ldg(reinterpret_cast<const float4*>(b) + c);
        acc = fmaf(x.x, y.x, acc);
        acc = fmaf(x.y, y.y, acc);
        acc = fmaf(x.z, y.z, acc);
        acc = fmaf(x.w, y.w, acc);
    }
    return warp_sum(acc);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)
moe_gate_up_f32(const float* __restrict__ W, const float* __restrict__ x,
                const int* __restrict__ ids, float* __restrict__ hid, int M, int K, int I,
                int H) {
    pdl_wait();
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tasks = M * K * I;
    for (int t = blockIdx.x * WARPS + warp; t < tasks; t += gridDim.x * WARPS) {
        const int pair = t / I, i = t - pair * I;  // pair = m * K + j
        const int m = pair / K;
        const int e = __ldg(ids + pair);
        const size_t gate_row = (size_t)e * 2 * I + i, up_row = gate_row + I;
        const float* xm = x + (size_t)m * H;
        const float gv = warp_dot_f32(W + gate_row * H, xm, H);
        const float uv = warp_dot_f32(W + up_row * H, xm, H);
        if (lane == 0) hid[(size_t)pair * I + i] = __fmul_rn(gelu_tanh(gv), uv);
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)
moe_down_f32(const float* __restrict__ D, const float* __restrict__ hid,
             const int* __restrict__ ids, const float* __restrict__ wts, float* __restrict__ y,
             int M, int K, int I, int H) {
    pdl_wait();
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int t = blockIdx.x * WARPS + warp; t < M * H; t += gridDim.x * WARPS) {
        const int m = t / H, n = t - m * H;
        float acc = 0.f;
        for (int j = 0; j < K; ++j) {
            const int pair = m * K + j;
            const int e = __ldg(ids + pair);
            const float part = warp_dot_f32(D + ((size_t)e * H + n) * I, hid + (size_t)pair * I, I);
            acc = fmaf(part, __ldg(wts + pair), acc);
        }
        if (lane == 0) y[(size_t)m * H + n] = acc;
    }
}
