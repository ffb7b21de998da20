// A diagnostic probe (bench/bench_cutlass_dense.py): a PLAIN CUTLASS sm90a e4m3 GEMM with row-wise scales, behind
// a C ABI, to tell whether CUTLASS's non-grouped kernel reaches cuBLAS's rate on the MoE shapes where our grouped
// ptr-array kernel (platforms/cuda/csrc/grouped_fp8.cu) does not.
//
//   D[M, N] = bf16((A[M, K] @ B[N, K]^T) * scale_a[row] * scale_b[col])
//
// A [M, K] e4m3 row-major, B [N, K] e4m3 row-major (column-major K x N, as cuBLAS's "TN" fp8 GEMM takes it),
// scale_a [M] fp32, scale_b [N] fp32, D [M, N] bf16 row-major. The same epilogue tree as grouped_fp8.cu's EPI 0,
// with plain pointers instead of per-group pointer arrays; no source tensor C; fast accumulation (as
// torch._scaled_mm(use_fast_accum=True) and our grouped kernel's "_fast" configurations).
//
// Unlike grouped_fp8.cu, the configurations are exported from this file itself (OMNI_DP_CONFIGS at the bottom):
// omni_dp_<name>_run, omni_dp_<name>_scratch and omni_dp_<name>_stages (the mainloop's pipeline stage count).
#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

using namespace cute;

namespace omni_dp {

using ElemA = cutlass::float_e4m3_t;
using ElemB = cutlass::float_e4m3_t;
using ElemD = cutlass::bfloat16_t;
using Problem = Shape<int, int, int, int>;  // M, N, K, L (L = 1)

template <class Tile, class Cluster, bool Pingpong>
struct DenseFp8 {
  static constexpr int Align = 16 / sizeof(ElemD);  // elements per 16 bytes (TMA)
  using MainSchedule = cute::conditional_t<Pingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                                           cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum>;
  using EpiSchedule = cute::conditional_t<Pingpong, cutlass::epilogue::TmaWarpSpecialized,
                                          cutlass::epilogue::TmaWarpSpecializedCooperative>;

  // epilogue: D = bf16((acc * scale_a[row]) * scale_b[col]), as grouped_fp8.cu's EPI 0
  using RowStride = Stride<_1, _0, int64_t>;  // scale_a: one value per row (M), broadcast along N
  using ColStride = Stride<_0, _1, int64_t>;  // scale_b: one value per column (N), broadcast along M
  using ScaleRow = cutlass::epilogue::fusion::Sm90ColBroadcast<0, Tile, float, float, RowStride>;
  using ScaleCol = cutlass::epilogue::fusion::Sm90RowBroadcast<0, Tile, float, float, ColStride>;
  using Mul = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                                     cutlass::FloatRoundStyle::round_to_nearest>;
  using ToBf16 = cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElemD, float,
                                                        cutlass::FloatRoundStyle::round_to_nearest>;
  using RowScaled = cutlass::epilogue::fusion::Sm90EVT<Mul, ScaleRow, cutlass::epilogue::fusion::Sm90AccFetch>;
  using Scaled = cutlass::epilogue::fusion::Sm90EVT<Mul, ScaleCol, RowScaled>;
  using Evt = cutlass::epilogue::fusion::Sm90EVT<ToBf16, Scaled>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, Align, ElemD,
      cutlass::layout::RowMajor, Align, EpiSchedule, Evt>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElemA, cutlass::layout::RowMajor, 16, ElemB,
      cutlass::layout::ColumnMajor, 16, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
  static constexpr int Stages = Mainloop::DispatchPolicy::Stages;
};

template <class K>
typename K::Gemm::Arguments make_args(const void* A, const void* B, void* D, const float* sa, const float* sb, int M,
                                      int N, int Kdim, int sms) {
  auto stride_a = cutlass::make_cute_packed_stride(typename K::StrideA{}, {M, Kdim, 1});
  auto stride_b = cutlass::make_cute_packed_stride(typename K::StrideB{}, {N, Kdim, 1});
  auto stride_c = cutlass::make_cute_packed_stride(typename K::StrideC{}, {M, N, 1});  // no C is read (void)
  auto stride_d = cutlass::make_cute_packed_stride(typename K::StrideD{}, {M, N, 1});
  typename K::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {M, N, Kdim, 1},
      {static_cast<const ElemA*>(A), stride_a, static_cast<const ElemB*>(B), stride_b},
      {{},  // the fusion tree's arguments, set below
       nullptr, stride_c, static_cast<const ElemD*>(D), stride_d}};
  // tree: ToBf16(Mul(ScaleCol, Mul(ScaleRow, acc))); each node's arguments are its children's, then its own
  args.epilogue.thread = {
      {                                                          // Mul: scale_b[col] * (...)
       {sb, 0.f, typename K::ColStride{_0{}, _1{}, int64_t(N)}},  // ScaleCol (row broadcast of scale_b)
       {                                                         // Mul: scale_a[row] * acc
        {sa, 0.f, typename K::RowStride{_1{}, _0{}, int64_t(M)}},  // ScaleRow (column broadcast of scale_a)
        {},                                                      // acc
        {}},
       {}},
      {}};  // ToBf16
  args.hw_info.sm_count = sms;
  return args;
}

// Bytes of device scratch a call needs: CUTLASS's workspace (the persistent tile scheduler's).
template <class K>
size_t scratch_bytes(int M, int N, int Kdim, int sms) {
  return K::Gemm::get_workspace_size(make_args<K>(nullptr, nullptr, nullptr, nullptr, nullptr, M, N, Kdim, sms));
}

template <class K>
int run(const void* A, const void* B, void* D, const float* sa, const float* sb, int M, int N, int Kdim, int sms,
        void* scratch, cudaStream_t stream) {
  auto args = make_args<K>(A, B, D, sa, sb, M, N, Kdim, sms);
  typename K::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(args, scratch, stream) != cutlass::Status::kSuccess) return 2;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
  return cudaGetLastError() == cudaSuccess ? 0 : 4;
}

}  // namespace omni_dp

// PONG: true for the ping-pong schedule (KernelTmaWarpSpecializedPingpongFP8FastAccum + TmaWarpSpecialized),
// false for the cooperative one (KernelTmaWarpSpecializedCooperativeFP8FastAccum + TmaWarpSpecializedCooperative).
#define OMNI_DP_EXPORT(NAME, TM, TN, TK, CM, CN, PONG)                                                             \
  using NAME##_t = omni_dp::DenseFp8<Shape<_##TM, _##TN, _##TK>, Shape<_##CM, _##CN, _1>, PONG>;                 \
  extern "C" size_t omni_dp_##NAME##_scratch(int M, int N, int K, int sms) {                                     \
    return omni_dp::scratch_bytes<NAME##_t>(M, N, K, sms);                                                       \
  }                                                                                                              \
  extern "C" int omni_dp_##NAME##_run(const void* A, const void* B, void* D, const float* sa, const float* sb,  \
                                      int M, int N, int K, int sms, void* scratch, cudaStream_t stream) {        \
    return omni_dp::run<NAME##_t>(A, B, D, sa, sb, M, N, K, sms, scratch, stream);                               \
  }                                                                                                              \
  extern "C" int omni_dp_##NAME##_stages() { return NAME##_t::Stages; }

#define OMNI_DP_CONFIGS                                  \
  OMNI_DP_EXPORT(pong_128x128_c1x2, 128, 128, 128, 1, 2, true) \
  OMNI_DP_EXPORT(pong_128x128_c2x1, 128, 128, 128, 2, 1, true) \
  OMNI_DP_EXPORT(coop_128x256_c2x1, 128, 256, 128, 2, 1, false)

OMNI_DP_CONFIGS
