// Small row utilities of the schedule.
//
// select_rows_bf16(src bf16 [M, H], rows int32* [S], dst bf16 [S, H], S, H): dst[i] =
//   src[rows[i]], zeros where rows[i] < 0: the last real token row of each sequence a prefill
//   packs (the row indices are io inputs, so the launch is fixed). Grid: (H / 256, S).
// select_rows_f32: the same over float32 rows (the float32 plan).
// softcap_rows(x f32 [n], n, cap): x = cap * tanh(x / cap) in place (ops.SOFTCAP), for the
//   logits entry that returns every row's logits.
// decode_advance(sampled, tokens, positions, seq_len, step, budget, loop_step, history, B, L):
//   the last launch of a decode entry: moves each live lane (position >= 0, budget > 0) on to
//   its next step in the io fields and logs the step's tokens in history [L, B] (rows.py has
//   the exact rule), so the entry's CUDA graph can replay again with no host in between.
//   One CTA of up to 1024 threads, one lane each.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void select_rows(const T* __restrict__ src, const int* __restrict__ rows,
                                            T* __restrict__ dst, int S, int H) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
    if (i >= H || s >= S) return;
    const int r = rows[s];
    dst[(size_t)s * H + i] = r >= 0 ? src[(size_t)r * H + i] : T(0.f);
}

extern "C" __global__ void select_rows_bf16(const __nv_bfloat16* __restrict__ src,
                                            const int* __restrict__ rows,
                                            __nv_bfloat16* __restrict__ dst, int S, int H) {
    pdl_wait();
    pdl_launch_dependents();
    select_rows(src, rows, dst, S, H);
}

extern "C" __global__ void select_rows_f32(const float* __restrict__ src,
                                           const int* __restrict__ rows, float* __restrict__ dst,
                                           int S, int H) {
    pdl_wait();
    pdl_launch_dependents();
    select_rows(src, rows, dst, S, H);
}

extern "C" __global__ void softcap_rows(float* __restrict__ x, long long n, float cap) {
    pdl_wait();
    pdl_launch_dependents();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

extern "C" __global__ void decode_advance(const int* __restrict__ sampled, int* __restrict__ tokens,
                                          int* __restrict__ positions, int* __restrict__ seq_len,
                                          int* __restrict__ step, int* __restrict__ budget,
                                          int* __restrict__ loop_step, int* __restrict__ history,
                                          int B, int L) {
    pdl_wait();
    pdl_launch_dependents();
    const int it = loop_step[0];
    const int i = threadIdx.x;
    if (i < B) {
        const bool live = positions[i] >= 0 && budget[i] > 0;
        if (it < L) history[(size_t)it * B + i] = live ? sampled[i] : -1;
        if (live) {
            const int left = budget[i] - 1;
            budget[i] = left;
            if (left > 0) {
                tokens[i] = sampled[i];
                positions[i] += 1;
                seq_len[i] += 1;
                step[i] += 1;
            } else {
                positions[i] = -1;
                seq_len[i] = 1;
            }
        }
    }
    __syncthreads();  // every lane has read loop_step
    if (i == 0) loop_step[0] = it + 1;
}
