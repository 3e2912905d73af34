// Row packing of the assistant drafter's draft entries (targets/h100/draft.py).
//
// draft_concat_bf16(a f32 [M, Ha], b f32 [M, Hb], out bf16 [M, Ha + Hb], M, Ha, Hb):
//   out[m, :] = bf16([a[m, :], b[m, :]]), the drafter's pre_projection input (the target's
//   embedding of the token beside the state) as the quantized plan's GEMVs read it.
// draft_concat_f32: the same into float32 rows (the float32 plan).
//   One thread per output element; grid (ceil((Ha + Hb) / 256), M).
// The centroid-masked head (ops.CENTROID_HEAD, the small models' drafters), three launches:
// centroid_select(cl f32 [M, C], ordering int32 [C * T], ids int32 [M, top_k * T], C, T, top_k):
//   per row the top_k clusters by logit (ties: the lower cluster), best first, and their T
//   tokens each from ordering's rows. One CTA of 256 threads per row, C floats and C flags of
//   dynamic shared memory.
// centroid_score_bf16(h bf16 [M, D], table bf16 [V, D], ids [M, N], sel f32 [M, N], N, D):
//   sel[m, n] = h[m] . table[ids[m, n]] in float32; a warp per token, 8 a CTA, grid
//   (ceil(N / 8), M). centroid_score_f32: float32 h and table.
// centroid_fill(sel f32 [M, N], ids [M, N], logits f32 [M, V], N, V): logits[m, :] =
//   min(sel[m]) - 1, then logits[m, ids[m, n]] = sel[m, n]. One CTA of 1024 threads per row.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
draft_concat_bf16(const float* __restrict__ a, const float* __restrict__ b,
                  __nv_bfloat16* __restrict__ out, int M, int Ha, int Hb) {
    pdl_wait();
    pdl_launch_dependents();
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y;
    const int w = Ha + Hb;
    if (m >= M || j >= w) return;
    const float x = j < Ha ? a[(size_t)m * Ha + j] : b[(size_t)m * Hb + (j - Ha)];
    out[(size_t)m * w + j] = __float2bfloat16_rn(x);
}

extern "C" __global__ void __launch_bounds__(256)
draft_concat_f32(const float* __restrict__ a, const float* __restrict__ b,
                 float* __restrict__ out, int M, int Ha, int Hb) {
    pdl_wait();
    pdl_launch_dependents();
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y;
    const int w = Ha + Hb;
    if (m >= M || j >= w) return;
    out[(size_t)m * w + j] = j < Ha ? a[(size_t)m * Ha + j] : b[(size_t)m * Hb + (j - Ha)];
}

extern "C" __global__ void __launch_bounds__(256)
centroid_select(const float* __restrict__ cl, const int* __restrict__ ordering,
                int* __restrict__ ids, int C, int T, int top_k) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ float smem[];
    float* v = smem;                                          // [C]
    unsigned char* taken = reinterpret_cast<unsigned char*>(smem + C);  // [C]
    __shared__ float best_v[8];
    __shared__ int best_i[8];
    __shared__ int chosen;
    const int m = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        v[c] = cl[(size_t)m * C + c];
        taken[c] = 0;
    }
    __syncthreads();
    for (int r = 0; r < top_k; ++r) {
        // argmax over the clusters not taken: the larger logit, on a tie the lower index
        float bv = -INFINITY;
        int bi = C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            if (!taken[c] && (v[c] > bv || (v[c] == bv && c < bi) || bi == C)) {
                bv = v[c];
                bi = c;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi != C && (bi == C || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            best_v[warp] = bv;
            best_i[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float cv = best_v[0];
            int ci = best_i[0];
            for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
                if (best_i[w] != C && (ci == C || best_v[w] > cv
                                       || (best_v[w] == cv && best_i[w] < ci))) {
                    cv = best_v[w];
                    ci = best_i[w];
                }
            }
            chosen = ci;
            taken[ci] = 1;
        }
        __syncthreads();
        const int c = chosen;
        for (int t = threadIdx.x; t < T; t += blockDim.x)
            ids[((size_t)m * top_k + r) * T + t] = ordering[(size_t)c * T + t];
        __syncthreads();  // chosen and the flags are read again next round
    }
}

namespace {
__device__ __forceinline__ float as_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float as_f32(float x) { return x; }

// sel[m, n] = h[m, :] . table[ids[m, n], :], a warp per (row, candidate), 8 a CTA.
template <typename T>
__device__ __forceinline__ void centroid_score(const T* __restrict__ h,
                                               const T* __restrict__ table,
                                               const int* __restrict__ ids,
                                               float* __restrict__ sel, int N, int D) {
    const int m = blockIdx.y;
    const int n = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (n >= N) return;
    const T* row = table + (size_t)ids[(size_t)m * N + n] * D;
    const T* x = h + (size_t)m * D;
    float acc = 0.f;
    for (int k = lane; k < D; k += 32) acc = fmaf(as_f32(x[k]), as_f32(row[k]), acc);
    acc = warp_sum(acc);
    if (lane == 0) sel[(size_t)m * N + n] = acc;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256)
centroid_score_bf16(const __nv_bfloat16* __restrict__ h, const __nv_bfloat16* __restrict__ table,
                    const int* __restrict__ ids, float* __restrict__ sel, int N, int D) {
    pdl_wait();
    pdl_launch_dependents();
    centroid_score(h, table, ids, sel, N, D);
}

extern "C" __global__ void __launch_bounds__(256)
centroid_score_f32(const float* __restrict__ h, const float* __restrict__ table,
                   const int* __restrict__ ids, float* __restrict__ sel, int N, int D) {
    pdl_wait();
    pdl_launch_dependents();
    centroid_score(h, table, ids, sel, N, D);
}

extern "C" __global__ void __launch_bounds__(1024)
centroid_fill(const float* __restrict__ sel, const int* __restrict__ ids,
              float* __restrict__ logits, int N, int V) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ float red[32];
    const int m = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float lo = INFINITY;
    for (int n = threadIdx.x; n < N; n += blockDim.x) lo = fminf(lo, sel[(size_t)m * N + n]);
    for (int o = 16; o > 0; o >>= 1) lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    if (lane == 0) red[warp] = lo;
    __syncthreads();
    lo = lane < (int)(blockDim.x >> 5) ? red[lane] : INFINITY;
    for (int o = 16; o > 0; o >>= 1) lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    const float rest = lo - 1.f;
    float* out = logits + (size_t)m * V;
    for (int v = threadIdx.x; v < V; v += blockDim.x) out[v] = rest;
    __syncthreads();  // the fill before the scores land on it
    for (int n = threadIdx.x; n < N; n += blockDim.x)
        out[ids[(size_t)m * N + n]] = sel[(size_t)m * N + n];
}
