// Small row utilities of the schedule.
//
// select_row_bf16(src bf16 [M, H], row int32* [1], dst bf16 [1, H], H): dst = src[*row], the
//   prefill's last real token row (the row index is an io input, so the launch is fixed).
// select_row_f32: the same over float32 rows (the float32 plan).
// softcap_rows(x f32 [n], n, cap): x = cap * tanh(x / cap) in place (ops.SOFTCAP), for the
//   logits entry that returns every row's logits.
#include "common.cuh"

extern "C" __global__ void select_row_bf16(const __nv_bfloat16* __restrict__ src,
                                           const int* __restrict__ row,
                                           __nv_bfloat16* __restrict__ dst, int H) {
    pdl_wait();
    pdl_launch_dependents();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < H) dst[i] = src[(size_t)row[0] * H + i];
}

extern "C" __global__ void select_row_f32(const float* __restrict__ src,
                                          const int* __restrict__ row, float* __restrict__ dst,
                                          int H) {
    pdl_wait();
    pdl_launch_dependents();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < H) dst[i] = src[(size_t)row[0] * H + i];
}

extern "C" __global__ void softcap_rows(float* __restrict__ x, long long n, float cap) {
    pdl_wait();
    pdl_launch_dependents();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}
