// CUTLASS 3.x sm90a GEMMs for the decode projections: out[M, N] = x[M, K] @ W[N, K]^T, bf16 in and out, fp32
// accumulate (issue 13, eleventh pass; a measured candidate against cuBLAS, not wired into the model).
//
// Swap-AB ("sw_"): CUTLASS computes out^T[N, M] = W[N, K] . x[M, K]^T, so the weight rows are the MMA's M side
// and the few batch rows its N side (a tile of 64-256 rows covers them all); out^T is column-major with ld = N,
// which is out[M, N] row-major. Plain ("pl_"): CUTLASS's A = x, B = W.
//
//   config        TMA + WGMMA, warp-specialized kernel; tile M' x N' x K'; cluster (multicast: 2x1 shares the
//                 N' operand between two M' tiles, 1x2 shares the M' operand)
//   sk_ kernels   Cooperative with the stream-K tile scheduler; `mode` picks its decomposition at run time
//                 (0 heuristic, 1 data-parallel, 2 split-K by `splits`, 3 stream-K), deterministic reduction
//   pp_ kernels   Ping-pong with the persistent scheduler (`mode`, `splits` ignored)
//
// C ABI, one function per config, for ctypes with torch data_ptrs and torch's current stream (CUDA-graph safe:
// no allocation, the workspace is the caller's):
//   int cutlass_gemm_<config>(x, w, out, M, N, K, workspace, workspace_bytes, mode, splits, stream)
//   returns 0, or 1 cannot implement, 2 workspace too small (cutlass_gemm_<config>_workspace gives the need),
//   3 initialize failed, 4 launch failed.
// The build compiles this file once per CFG_GROUP (0..3) in parallel and links the objects into one library.

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

#ifndef CFG_GROUP
#define CFG_GROUP -1  // all groups in one object
#endif

using namespace cute;

namespace {

using bf16 = cutlass::bfloat16_t;

template <int TM, int TN, int TK, int CM, int CN, bool Swap, bool Pingpong>
struct DecodeGemm {
  using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  using LayoutA = cutlass::layout::RowMajor;     // [M', K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // [N', K], K contiguous
  using LayoutD = std::conditional_t<Swap, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using KernelSchedule = std::conditional_t<Pingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                            cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<Pingpong, cutlass::epilogue::TmaWarpSpecialized,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using Scheduler = std::conditional_t<Pingpong, cutlass::gemm::PersistentScheduler,
                                       cutlass::gemm::StreamKScheduler>;
  static constexpr int kAlign = 8;  // 16 bytes of bf16

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, kAlign,  // no C source
      bf16, LayoutD, kAlign, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, LayoutA, kAlign, bf16, LayoutB, kAlign, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Op = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr bool kStreamK = !Pingpong;

  static typename Op::Arguments arguments(const void* x, const void* w, void* out, int M, int N, int K,
                                          int mode, int splits) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideC = typename Kernel::StrideC;
    using StrideD = typename Kernel::StrideD;
    const int pm = Swap ? N : M, pn = Swap ? M : N;  // CUTLASS's problem M', N'
    const bf16* a = static_cast<const bf16*>(Swap ? w : x);
    const bf16* b = static_cast<const bf16*>(Swap ? x : w);
    auto stride_a = cutlass::make_cute_packed_stride(StrideA{}, {pm, K, 1});
    auto stride_b = cutlass::make_cute_packed_stride(StrideB{}, {pn, K, 1});
    auto stride_d = cutlass::make_cute_packed_stride(StrideD{}, {pm, pn, 1});
    static int sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    cutlass::KernelHardwareInfo hw{0, sm_count};
    typename Op::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm, {pm, pn, K, 1}, {a, stride_a, b, stride_b},
        {{1.0f, 0.0f}, nullptr, StrideC{}, static_cast<bf16*>(out), stride_d}, hw};
    if constexpr (kStreamK) {
      using TileScheduler = typename Kernel::TileScheduler;
      args.scheduler.decomposition_mode = static_cast<typename TileScheduler::DecompositionMode>(mode);
      args.scheduler.splits = mode == 2 ? splits : 1;
      args.scheduler.reduction_mode = TileScheduler::ReductionMode::Deterministic;
    }
    (void)mode;
    (void)splits;
    return args;
  }

  static size_t workspace(int M, int N, int K, int mode, int splits) {
    return Op::get_workspace_size(arguments(nullptr, nullptr, nullptr, M, N, K, mode, splits));
  }

  static int run(const void* x, const void* w, void* out, int M, int N, int K, void* ws, size_t ws_bytes,
                 int mode, int splits, cudaStream_t stream) {
    auto args = arguments(x, w, out, M, N, K, mode, splits);
    Op op;
    if (op.can_implement(args) != cutlass::Status::kSuccess) return 1;
    if (Op::get_workspace_size(args) > ws_bytes) return 2;
    if (op.initialize(args, ws, stream) != cutlass::Status::kSuccess) return 3;
    if (op.run(stream) != cutlass::Status::kSuccess) return 4;
    return cudaPeekAtLastError() == cudaSuccess ? 0 : 4;
  }
};

}  // namespace

#define CONFIG(group, name, TM, TN, TK, CM, CN, SWAP, PINGPONG)                                               \
  extern "C" int cutlass_gemm_##name(const void* x, const void* w, void* out, int M, int N, int K, void* ws, \
                                     size_t ws_bytes, int mode, int splits, cudaStream_t stream) {           \
    return DecodeGemm<TM, TN, TK, CM, CN, SWAP, PINGPONG>::run(x, w, out, M, N, K, ws, ws_bytes, mode,       \
                                                               splits, stream);                              \
  }                                                                                                          \
  extern "C" size_t cutlass_gemm_##name##_workspace(int M, int N, int K, int mode, int splits) {            \
    return DecodeGemm<TM, TN, TK, CM, CN, SWAP, PINGPONG>::workspace(M, N, K, mode, splits);                 \
  }

#define IN_GROUP(g) (CFG_GROUP < 0 || CFG_GROUP == (g))

// kernels/cutlass_gemm.py's KERNELS mirrors this list (its load() looks up every symbol).
#if IN_GROUP(0)
CONFIG(0, sw_sk_128x64x64_1x1, 128, 64, 64, 1, 1, true, false)
CONFIG(0, sw_sk_128x64x128_1x1, 128, 64, 128, 1, 1, true, false)
CONFIG(0, sw_sk_128x64x64_2x1, 128, 64, 64, 2, 1, true, false)
CONFIG(0, sw_pp_64x64x128_1x1, 64, 64, 128, 1, 1, true, true)
#endif
#if IN_GROUP(1)
CONFIG(1, sw_sk_128x128x64_1x1, 128, 128, 64, 1, 1, true, false)
CONFIG(1, sw_sk_128x128x64_2x1, 128, 128, 64, 2, 1, true, false)
CONFIG(1, sw_sk_128x128x64_1x2, 128, 128, 64, 1, 2, true, false)
CONFIG(1, sw_pp_64x128x64_1x1, 64, 128, 64, 1, 1, true, true)
#endif
#if IN_GROUP(2)
CONFIG(2, sw_sk_128x192x64_1x1, 128, 192, 64, 1, 1, true, false)
CONFIG(2, sw_sk_128x192x64_2x1, 128, 192, 64, 2, 1, true, false)
CONFIG(2, sw_pp_64x192x64_1x1, 64, 192, 64, 1, 1, true, true)
CONFIG(2, pl_sk_128x128x64_2x1, 128, 128, 64, 2, 1, false, false)
#endif
#if IN_GROUP(3)
CONFIG(3, sw_sk_128x256x64_1x1, 128, 256, 64, 1, 1, true, false)
CONFIG(3, sw_sk_128x256x64_2x1, 128, 256, 64, 2, 1, true, false)
CONFIG(3, sw_pp_64x256x64_1x1, 64, 256, 64, 1, 1, true, true)
CONFIG(3, sw_sk_256x128x64_1x2, 256, 128, 64, 1, 2, true, false)
#endif
