// D[m, n] = (sum_k A[m, k] * B[n, k]) * b_scale[n] * a_scale[m]   (float32)
//   FP8 entries (gemm_fp8_tc_*), the linears:
//     A: e4m3 [M, K] row-major (activations, one float32 scale per row / token),
//     B: e4m3 [N, K] row-major (weights, one float32 scale per row of B = output column / channel);
//   bf16 entries (gemm_bf16_tc_*), the tied head: A bf16 [M, K] (the normed hidden rows), B bf16
//     [N, K] (the embedding table), both scale vectors all ones (the same epilogue: x * 1.0f is x);
//   D: float32 [M, N] row-major (what the kernels reading a linear's output take: the h100
//      lowering's consumers of a GEMV's output read float32).
//
// Tensor-core GEMM from CUTLASS 3.x's SM90 collective builders: TMA loads into a multi-stage
// shared-memory pipeline, wgmma (QGMMA / HGMMA in SASS) by warp-specialized consumer warpgroups, a
// persistent tile scheduler, and an epilogue visitor tree that multiplies the float32
// accumulator by b_scale[n] and then by a_scale[m] (float32, round to nearest), stored through
// TMA. One entry per (element type, tile configuration) (gemm_tc.py picks one per M bucket);
// each entry is CUTLASS's device_kernel body behind the PDL prologue.
//
// Kernel parameter: CUTLASS's `Params` struct, by value (__grid_constant__). It holds the TMA
// descriptors of A, B and D, the scale pointers and the problem-dependent scheduler values. The
// runtime never runs CUTLASS host code: at build, the probe below (this file compiled for the
// host with -DGEMM_TC_PROBE) builds the Params for one (entry, M, N, K) with sentinel
// pointers and a stub cuTensorMapEncodeTiled that records its arguments, and prints the bytes,
// the place of every descriptor with the arguments that encode it, and the place of every
// pointer; at load, the runtime encodes the descriptors for the real addresses with
// cuTensorMapEncodeTiled and patches them and the pointers in (runtime/executors/tma.py).
//
// Contract: K % 16 == 0 and N % 8 == 0 (16-byte TMA row strides); A, B, D and both scale
// vectors 16-byte aligned; any M >= 1 (TMA zero-fills the rows past M and clips the stores).
// Launch: the grid, 384 (cooperative) or 384 (ping-pong) threads and the dynamic shared memory
// the probe reports; the cluster shape is compiled in (__cluster_dims__).
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "common.cuh"

namespace gemm_tc {
using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

using E4m3 = cutlass::float_e4m3_t;
using Bf16 = cutlass::bfloat16_t;
using ElementD = float;
using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // CUTLASS's K x N view of the [N, K] weights
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignD = 4;

using Round = cutlass::FloatRoundStyle;
constexpr Round kRn = Round::round_to_nearest;

// One configuration: the element type of A and B, CTA tile TM x TN x TK, cluster CM x CN, kernel
// and epilogue schedule.
template <class Element_, int TM, int TN, int TK, int CM, int CN, class KernelSchedule,
          class EpilogueSchedule>
struct Config {
    using Element = Element_;
    static constexpr int kAlignAB = 16 / sizeof(Element);  // elements per 16 bytes
    static constexpr int kClusterM = CM;
    static constexpr int kClusterN = CN;
    using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
    using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;

    // (acc * b_scale[n]) * a_scale[m], float32
    using BScale = fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, _0>>;
    using AScale = fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<_1, _0, _0>>;
    using AccTimesB = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRn>,
                                      fusion::Sm90AccFetch, BScale>;
    using Epilogue = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, ElementD, float,
                                                         kRn>,
                                     AccTimesB, AScale>;

    using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        void, LayoutD, kAlignD,  // no source C
        ElementD, LayoutD, kAlignD, EpilogueSchedule, Epilogue>::CollectiveOp;

    using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlignAB,
        Element, LayoutB, kAlignAB, float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<
            static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
        KernelSchedule>::CollectiveOp;

    using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                        CollectiveMainloop, CollectiveEpilogue>;
    using Params = typename Kernel::Params;
};

using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
// FP8 without fast accumulation: each 128-deep k tile's wgmma partial sums are added into a
// separate float32 accumulator (CUTLASS's mma promotion) instead of accumulating all of K in the
// tensor core's own, less precise, accumulator. A second accumulator: 128 x 256 tiles spill.
using CooperativePromoted = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
// bf16 accumulates in float32 in the tensor core: the plain schedules.
using PingpongBf16 = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using CooperativeBf16 = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpiPingpong = cutlass::epilogue::TmaWarpSpecialized;
using EpiCooperative = cutlass::epilogue::TmaWarpSpecializedCooperative;

// The tiles default_entry chooses among, and the promoted variant; 64 x 64 doubles the CTAs that
// stream a narrow output's weights at few rows (N = 5376: 84 tiles on 132 SMs where 64 x 128
// makes 42). (Measured and dropped: 2 x 1
// clusters with the weight tile multicast, 256 x 128 tiles with 1 x 2 clusters and a 128 x 128
// ping-pong were no faster at the 31B shapes; docs/BENCHMARKS.md.) The bf16 tiles are 64 deep:
// 128 bytes of K per row, the TMA swizzle's width, as the FP8 tiles' 128.
using Tc64x64 = Config<E4m3, 64, 64, 128, 1, 1, Pingpong, EpiPingpong>;
using Tc64x128 = Config<E4m3, 64, 128, 128, 1, 1, Pingpong, EpiPingpong>;
using Tc64x256 = Config<E4m3, 64, 256, 128, 1, 1, Pingpong, EpiPingpong>;
using Tc128x128 = Config<E4m3, 128, 128, 128, 1, 1, Cooperative, EpiCooperative>;
using Tc128x256 = Config<E4m3, 128, 256, 128, 1, 1, Cooperative, EpiCooperative>;
using Tc128x128p = Config<E4m3, 128, 128, 128, 1, 1, CooperativePromoted, EpiCooperative>;
using Bf16x64x256 = Config<Bf16, 64, 256, 64, 1, 1, PingpongBf16, EpiPingpong>;
using Bf16x128x256 = Config<Bf16, 128, 256, 64, 1, 1, CooperativeBf16, EpiCooperative>;
}  // namespace gemm_tc

// X(entry name, configuration): every entry of the module. Names must match gemm_tc.py.
#define GEMM_TC_CONFIGS(X)                                    \
    X(gemm_fp8_tc_64x64, gemm_tc::Tc64x64)                    \
    X(gemm_fp8_tc_64x128, gemm_tc::Tc64x128)                  \
    X(gemm_fp8_tc_64x256, gemm_tc::Tc64x256)                  \
    X(gemm_fp8_tc_128x128, gemm_tc::Tc128x128)                \
    X(gemm_fp8_tc_128x256, gemm_tc::Tc128x256)                \
    X(gemm_fp8_tc_128x128_promoted, gemm_tc::Tc128x128p)      \
    X(gemm_bf16_tc_64x256, gemm_tc::Bf16x64x256)              \
    X(gemm_bf16_tc_128x256, gemm_tc::Bf16x128x256)

#ifndef GEMM_TC_PROBE

// CUTLASS's device_kernel, behind the project's PDL prologue (common.cuh). CUTLASS's own
// griddepcontrol hooks stay off (CUTLASS_ENABLE_GDC_FOR_SM90 is not defined): the prologue has
// already waited for the previous kernel before any global memory is touched.
#define GEMM_TC_ENTRY(NAME, CFG)                                                       \
    extern "C" __global__ void __cluster_dims__(CFG::kClusterM, CFG::kClusterN, 1)          \
    __launch_bounds__(CFG::Kernel::MaxThreadsPerBlock, CFG::Kernel::MinBlocksPerMultiprocessor) \
    NAME(const __grid_constant__ CFG::Params params) {                                       \
        pdl_wait();                                                                          \
        pdl_launch_dependents();                                                             \
        extern __shared__ char smem[];                                                       \
        CFG::Kernel op;                                                                      \
        op(params, smem);                                                                    \
    }
GEMM_TC_CONFIGS(GEMM_TC_ENTRY)

#else  // the build-time host probe: prints one configuration's Params template as JSON

#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {
// Sentinel base addresses, one per buffer role: their upper 32 bits are what the probe looks
// for in the Params bytes; each is 4 GiB away from the next, so base + offset stays in its role.
struct Role {
    const char* name;
    uint64_t base;
};
constexpr Role kRoles[] = {
    {"a", 0x00007a1100000000ull},        {"b", 0x00007b2200000000ull},
    {"d", 0x00007d4400000000ull},        {"a_scale", 0x00007e5500000000ull},
    {"b_scale", 0x00007f6600000000ull},
};
constexpr uint64_t kDescMark = 0xd35c000000000000ull;  // | call << 8 | word

struct EncodeCall {
    CUtensorMapDataType dtype;
    cuuint32_t rank;
    uint64_t address;
    cuuint64_t dims[5];
    cuuint64_t strides[4];
    cuuint32_t box[5];
    cuuint32_t elem_strides[5];
    int interleave, swizzle, l2_promotion, oob_fill;
};
std::vector<EncodeCall> g_calls;

// Fills the stack below the caller with `pattern`, so what the next call leaves unset shows.
__attribute__((noinline)) void scrub_stack(unsigned char pattern) {
    volatile unsigned char area[1 << 18];
    for (size_t i = 0; i < sizeof area; ++i) area[i] = pattern;
}

void print_u64s(const cuuint64_t* v, int n) {
    printf("[");
    for (int i = 0; i < n; ++i) printf("%s%llu", i ? ", " : "", (unsigned long long)v[i]);
    printf("]");
}
void print_u32s(const cuuint32_t* v, int n) {
    printf("[");
    for (int i = 0; i < n; ++i) printf("%s%u", i ? ", " : "", (unsigned)v[i]);
    printf("]");
}

template <class Stride>
Stride row_major(int64_t rows, int64_t cols) {  // a packed (rows, cols, 1) matrix
    Stride s{};
    cute::get<0>(s) = cols;
    cute::get<2>(s) = rows * cols;
    return s;
}

template <class Cfg>
int probe(int m, int n, int k, int sm_count, int raster, int swizzle) {
    using Kernel = typename Cfg::Kernel;
    using Params = typename Cfg::Params;
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    auto ptr = [](int role) { return kRoles[role].base; };
    typename Kernel::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {reinterpret_cast<const typename Cfg::Element*>(ptr(0)), row_major<StrideA>(m, k),
         reinterpret_cast<const typename Cfg::Element*>(ptr(1)), row_major<StrideB>(n, k)},
        {{}, nullptr, row_major<StrideD>(m, n),
         reinterpret_cast<gemm_tc::ElementD*>(ptr(2)), row_major<StrideD>(m, n)},
    };
    args.hw_info.device_id = 0;
    args.hw_info.sm_count = sm_count;
    using Raster = typename Kernel::TileScheduler::RasterOrderOptions;
    args.scheduler.raster_order = raster == 1 ? Raster::AlongM
                                  : raster == 2 ? Raster::AlongN : Raster::Heuristic;
    args.scheduler.max_swizzle_size = swizzle;
    // thread = {op_0: {op_0: acc, op_1: b_scale, op_2: multiply}, op_1: a_scale, op_2: multiply}
    auto& thread = args.epilogue.thread;
    thread.op_0.op_1.ptr_row = reinterpret_cast<const float*>(ptr(4));
    thread.op_1.ptr_col = reinterpret_cast<const float*>(ptr(3));
    if (!Kernel::can_implement(args)) {
        fprintf(stderr, "CUTLASS cannot implement M=%d N=%d K=%d with this configuration\n", m,
                n, k);
        return 2;
    }
    if (Kernel::get_workspace_size(args) != 0) {
        fprintf(stderr, "configuration needs a workspace\n");
        return 2;
    }
    // Params is built twice, over stack and storage filled with 0x00 and then 0xff: the bytes the
    // two images disagree on are padding or otherwise never set (the build zeroes them).
    alignas(64) static unsigned char storage[sizeof(Params)];
    static unsigned char first[sizeof(Params)];
    Params* params = nullptr;
    for (int pass = 0; pass < 2; ++pass) {
        g_calls.clear();
        scrub_stack(pass ? 0xff : 0x00);
        memset(storage, pass ? 0xff : 0x00, sizeof storage);
        params = new (storage) Params(Kernel::to_underlying_arguments(args, nullptr));
        if (pass == 0) memcpy(first, storage, sizeof first);
    }
    const dim3 grid = Kernel::get_grid_shape(*params);
    const auto offset_of = [&](const void* field) {
        return (long)(reinterpret_cast<const unsigned char*>(field) - storage);
    };
    printf("{\"size\": %zu, \"align\": %zu, \"grid\": [%u, %u, %u], \"block\": [%u, 1, 1], "
           "\"smem\": %d, \"cluster\": [%d, %d, 1],\n",
           sizeof(Params), alignof(Params), grid.x, grid.y, grid.z,
           (unsigned)Kernel::MaxThreadsPerBlock, (int)Kernel::SharedStorageSize, Cfg::kClusterM,
           Cfg::kClusterN);
    printf(" \"known_descriptors\": {\"a\": %ld, \"b\": %ld, \"d\": %ld},\n",
           offset_of(params->mainloop.tma_load_a.get_tma_descriptor()),
           offset_of(params->mainloop.tma_load_b.get_tma_descriptor()),
           offset_of(params->epilogue.tma_store_d.get_tma_descriptor()));
    printf(" \"roles\": {");
    for (int r = 0; r < 5; ++r)
        printf("%s\"%s\": %llu", r ? ", " : "", kRoles[r].name,
               (unsigned long long)kRoles[r].base);
    printf("},\n \"descriptor_mark\": %llu,\n \"encodes\": [", (unsigned long long)kDescMark);
    for (size_t i = 0; i < g_calls.size(); ++i) {
        const EncodeCall& c = g_calls[i];
        printf("%s\n  {\"dtype\": %d, \"rank\": %u, \"address\": %llu, \"dims\": ", i ? "," : "",
               (int)c.dtype, c.rank, (unsigned long long)c.address);
        print_u64s(c.dims, c.rank);
        printf(", \"strides\": ");
        print_u64s(c.strides, c.rank - 1);
        printf(", \"box\": ");
        print_u32s(c.box, c.rank);
        printf(", \"elem_strides\": ");
        print_u32s(c.elem_strides, c.rank);
        printf(", \"interleave\": %d, \"swizzle\": %d, \"l2_promotion\": %d, \"oob_fill\": %d}",
               c.interleave, c.swizzle, c.l2_promotion, c.oob_fill);
    }
    printf("],\n \"bytes\": \"");
    for (size_t i = 0; i < sizeof(Params); ++i) printf("%02x", first[i]);
    printf("\",\n \"bytes_alt\": \"");
    for (size_t i = 0; i < sizeof(Params); ++i) printf("%02x", storage[i]);
    printf("\"}\n");
    return 0;
}
}  // namespace

// The stub the probe links instead of the driver's: records the call, marks the descriptor.
extern "C" CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* map, CUtensorMapDataType dtype, cuuint32_t rank, void* address,
    const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
    const cuuint32_t* elem_strides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion l2_promotion, CUtensorMapFloatOOBfill oob_fill) {
    if (rank < 1 || rank > 5) return CUDA_ERROR_INVALID_VALUE;
    EncodeCall c{};
    c.dtype = dtype;
    c.rank = rank;
    c.address = reinterpret_cast<uint64_t>(address);
    for (cuuint32_t i = 0; i < rank; ++i) {
        c.dims[i] = dims[i];
        c.box[i] = box[i];
        c.elem_strides[i] = elem_strides[i];
        if (i + 1 < rank) c.strides[i] = strides[i];
    }
    c.interleave = interleave;
    c.swizzle = swizzle;
    c.l2_promotion = l2_promotion;
    c.oob_fill = oob_fill;
    uint64_t* words = reinterpret_cast<uint64_t*>(map);
    for (int w = 0; w < 16; ++w) words[w] = kDescMark | (g_calls.size() << 8) | w;
    g_calls.push_back(c);
    return CUDA_SUCCESS;
}

int main(int argc, char** argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s ENTRY M N K SM_COUNT RASTER(0 heuristic, 1 along M, 2 along N) "
                "SWIZZLE\n", argv[0]);
        return 2;
    }
    const std::string entry = argv[1];
    const int m = atoi(argv[2]), n = atoi(argv[3]), k = atoi(argv[4]), sms = atoi(argv[5]);
    const int raster = atoi(argv[6]), swizzle = atoi(argv[7]);
#define GEMM_TC_PROBE_CASE(NAME, CFG) \
    if (entry == #NAME) return probe<CFG>(m, n, k, sms, raster, swizzle);
    GEMM_TC_CONFIGS(GEMM_TC_PROBE_CASE)
    fprintf(stderr, "unknown entry %s\n", entry.c_str());
    return 2;
}

#endif  // GEMM_TC_PROBE
