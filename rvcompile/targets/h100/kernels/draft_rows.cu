// Row packing of the assistant drafter's draft entries (targets/h100/draft.py).
//
// draft_concat_bf16(a f32 [M, Ha], b f32 [M, Hb], out bf16 [M, Ha + Hb], M, Ha, Hb):
//   out[m, :] = bf16([a[m, :], b[m, :]]), the drafter's pre_projection input (the target's
//   embedding of the token beside the state) as the quantized plan's GEMVs read it.
// draft_concat_f32: the same into float32 rows (the float32 plan).
// One thread per output element; grid (ceil((Ha + Hb) / 256), M).
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
