// Grouped e4m3 GEMM with row-wise scales for the MoE experts (sm90a), behind a C ABI.
//
//   D[rows of group g] = (A[rows of g] @ B[g]^T) * scale_a[row] * scale_b[g, col]   -> bf16
//
// or, with the SwiGLU epilogue (EPI 1), for B's rows stored in pairs (row 2j = x1's row j, row 2j + 1 =
// x2's row j, so each pair of adjacent output columns is one (x1, x2)):
//
//   a[r, j] = bf16(x1 * silu(x2)),  x1 = P[r, 2j], x2 = P[r, 2j + 1],  P = the scaled product above in fp32
//
// written as the two bytes of each bf16 into an 8-bit D of N columns: the same memory as a bf16 [R, N/2]
// row-major. That halves the GEMM's output and removes the separate SwiGLU pass over it.
//
// A [R, K] e4m3 row-major (the routed rows, grouped by expert), B [G, N, K] e4m3
// row-major (each expert's weight, the platform's documented [E, O, I] layout),
// scale_a [R] fp32, scale_b [G, N] fp32, offs [G] int32 cumulative group ends (on the
// device: nothing here reads them on the host, so a launch is capturable).
//
// Why our own build of CUTLASS's ptr-array kernel rather than torch._scaled_grouped_mm:
// torch compiles one tile per shape class (256x128, cluster 2x2 for these shapes with
// fast accumulation); the tile, cluster and schedule are template parameters here so the
// benchmark can pick the one that measures fastest on the released MoE shapes.
// A translation unit defines OMNI_GG_CONFIGS as OMNI_GG_EXPORT(...) lines and includes this
// file (platforms/cuda/cutlass_grouped.py writes it); each configuration is exported as
// omni_gg_<name>_run and omni_gg_<name>_scratch.
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
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

using namespace cute;

namespace omni {

using ElemA = cutlass::float_e4m3_t;
using ElemB = cutlass::float_e4m3_t;
using Problem = cutlass::gemm::GroupProblemShape<Shape<int32_t, int32_t, int32_t>>;

// The SwiGLU epilogue's last node: adjacent fp32 values (x1, x2) of one row -> the two bytes of
// bf16(x1 * silu(x2)). It relies on the accumulator fragment holding adjacent columns of one row at even and
// odd positions, as the wgmma accumulator layout does (two consecutive columns per thread, in order); the GPU
// test checks every output against the fp32 product.
struct SwiGluPack : cutlass::epilogue::fusion::Sm90VisitorImpl<> {
  using cutlass::epilogue::fusion::Sm90VisitorImpl<>::Sm90VisitorImpl;

  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<uint8_t, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int, int, int,
        cutlass::Array<ElementInput, FragmentSize> const& frg) {
      static_assert(FragmentSize % 2 == 0, "the SwiGLU epilogue needs column pairs in one fragment");
      cutlass::Array<uint8_t, FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        float x1 = static_cast<float>(frg[i]), x2 = static_cast<float>(frg[i + 1]);
        // __fdividef, not '/': the IEEE division made GEMM 1 17% slower (3.32 vs 2.84 ms at the released shapes);
        // its ~2 ulp error is far below the bf16 rounding that follows
        float a = x1 * __fdividef(x2, 1.0f + __expf(-x2));
        uint16_t bits = cutlass::bfloat16_t(a).raw();  // round to nearest even
        out[i] = static_cast<uint8_t>(bits & 0xff);  // little-endian: the low byte first
        out[i + 1] = static_cast<uint8_t>(bits >> 8);
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const&) {
    return ConsumerStoreCallbacks();
  }
};

// EPI 0: bf16 D of the scaled product; EPI 1: SwiGLU of column pairs, packed bf16 in an 8-bit D (above).
template <class Tile, class Cluster, bool Pingpong, bool FastAccum, int Epi>
struct GroupedFp8 {
  using ElemD = cute::conditional_t<Epi == 1, uint8_t, cutlass::bfloat16_t>;
  static constexpr int Align = 16 / sizeof(ElemD);  // elements per 16 bytes (TMA)
  using MainSchedule = cute::conditional_t<
      Pingpong,
      cute::conditional_t<FastAccum, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>,
      cute::conditional_t<FastAccum, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
  using EpiSchedule = cute::conditional_t<Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

  // epilogue: D = bf16((acc * scale_a[row]) * scale_b[col])
  using ScaleRow = cutlass::epilogue::fusion::Sm90ColBroadcast<0, Tile, float*, float, Stride<_1, _0, _0>>;
  using ScaleCol = cutlass::epilogue::fusion::Sm90RowBroadcast<0, Tile, float*, float, Stride<_0, _1, _0>>;
  using Mul = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                                     cutlass::FloatRoundStyle::round_to_nearest>;
  using ToBf16 = cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, cutlass::bfloat16_t, float,
                                                        cutlass::FloatRoundStyle::round_to_nearest>;
  using RowScaled = cutlass::epilogue::fusion::Sm90EVT<Mul, ScaleRow, cutlass::epilogue::fusion::Sm90AccFetch>;
  using Scaled = cutlass::epilogue::fusion::Sm90EVT<Mul, ScaleCol, RowScaled>;
  using Evt = cutlass::epilogue::fusion::Sm90EVT<cute::conditional_t<Epi == 1, SwiGluPack, ToBf16>, Scaled>;

  // The SwiGLU epilogue's choices, measured on the H200 (GEMM 1 at the released routed split, BENCHMARKS.md): no
  // source tensor C (void: no smem for it) and, in ping-pong, 64x32 epilogue subtiles instead of the 64x64 that
  // CUTLASS picks for 8-bit outputs: 2.80 ms against 2.84 with neither (the plain bf16 GEMM 1: 2.83 ms).
  using EpiTile = cute::conditional_t<Epi == 1 && Pingpong, Shape<_64, _32>,
                                      cutlass::epilogue::collective::EpilogueTileAuto>;
  using ElemC = cute::conditional_t<Epi == 1, void, ElemD>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      EpiTile, float, float, ElemC, cutlass::layout::RowMajor*, Align, ElemD,
      cutlass::layout::RowMajor*, Align, EpiSchedule, Evt>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElemA, cutlass::layout::RowMajor*, 16, ElemB,
      cutlass::layout::ColumnMajor*, 16, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// Per-group pointers, strides and shapes, laid out in one device buffer (the "args" buffer).
template <class K>
struct GroupArgs {
  using ElemD = typename K::ElemD;
  const ElemA** a;
  const ElemB** b;
  ElemD** d;
  float** sa;
  float** sb;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
  Problem::UnderlyingProblemShape* shape;

  // Rounded up to 256 bytes: CUTLASS's workspace follows, and the TMA descriptors in it must be 64-byte aligned
  // (an unaligned one faults with "misaligned address"); torch's allocator hands out 512-byte aligned blocks.
  static size_t bytes(int groups) {
    size_t raw = groups * (5 * sizeof(void*) + sizeof(typename K::StrideA) + sizeof(typename K::StrideB) +
                           sizeof(typename K::StrideD) + sizeof(Problem::UnderlyingProblemShape)) + 256;
    return (raw + 255) / 256 * 256;
  }
  GroupArgs(void* buf, int groups) {
    char* p = static_cast<char*>(buf);
    auto take = [&](auto*& field, size_t each) {
      field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(p);
      p += (groups * each + 15) / 16 * 16;  // 16-byte aligned pieces (TMA descriptors read the pointers)
    };
    take(a, sizeof(void*)); take(b, sizeof(void*)); take(d, sizeof(void*));
    take(sa, sizeof(void*)); take(sb, sizeof(void*));
    take(stride_a, sizeof(typename K::StrideA)); take(stride_b, sizeof(typename K::StrideB));
    take(stride_d, sizeof(typename K::StrideD)); take(shape, sizeof(Problem::UnderlyingProblemShape));
  }
};

// One thread per group: the group's row range from the cumulative ends, then its pointers.
template <class K>
__global__ void fill_group_args(GroupArgs<K> g, const ElemA* A, const ElemB* B, typename K::ElemD* D, float* sa,
                                float* sb,
                                const int32_t* offs, int groups, int N, int Kdim) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= groups) return;
  int start = e == 0 ? 0 : offs[e - 1];
  int rows = offs[e] - start;
  g.a[e] = A + int64_t(start) * Kdim;
  g.b[e] = B + int64_t(e) * N * Kdim;
  g.d[e] = D + int64_t(start) * N;
  g.sa[e] = sa + start;
  g.sb[e] = sb + int64_t(e) * N;
  g.stride_a[e] = cutlass::make_cute_packed_stride(typename K::StrideA{}, {rows, Kdim, 1});
  g.stride_b[e] = cutlass::make_cute_packed_stride(typename K::StrideB{}, {N, Kdim, 1});
  g.stride_d[e] = cutlass::make_cute_packed_stride(typename K::StrideD{}, {rows, N, 1});
  g.shape[e] = {rows, N, Kdim};
}

// C is never read (the EVT fetches no source); a kernel built with a void C takes no pointer at all.
template <class K>
auto source_ptrs(GroupArgs<K> g) {
  if constexpr (cute::is_void_v<typename K::ElemC>) {
    return static_cast<void const**>(nullptr);
  } else {
    return const_cast<const typename K::ElemD**>(g.d);
  }
}

// raster: 0 walks tiles along M first (CUTLASS's default for groups), 1 along N; swizzle: 1, 2, 4 or 8.
template <class K>
typename K::Gemm::Arguments make_args(GroupArgs<K> g, int groups, int sms, int raster = 0, int swizzle = 1) {
  typename K::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, g.shape, nullptr},
      {g.a, g.stride_a, g.b, g.stride_b},
      {{{{g.sb}, {{g.sa}, {}, {}}, {}}, {}}, source_ptrs<K>(g), g.stride_d, g.d, g.stride_d}};
  args.hw_info.sm_count = sms;
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.raster_order = raster == 1 ? Raster::AlongN : Raster::AlongM;
  args.scheduler.max_swizzle_size = swizzle;
  return args;
}

// Bytes of device scratch a call needs: the per-group args, then CUTLASS's workspace.
template <class K>
size_t scratch_bytes(int groups, int sms) {
  GroupArgs<K> g(nullptr, groups);
  return GroupArgs<K>::bytes(groups) + K::Gemm::get_workspace_size(make_args<K>(g, groups, sms));
}

template <class K>
int run(const void* A, const void* B, void* D, const float* sa, const float* sb, const int32_t* offs, int groups,
        int N, int Kdim, int sms, int raster, int swizzle, void* scratch, cudaStream_t stream) {
  GroupArgs<K> g(scratch, groups);
  fill_group_args<K><<<(groups + 127) / 128, 128, 0, stream>>>(
      g, static_cast<const ElemA*>(A), static_cast<const ElemB*>(B), static_cast<typename K::ElemD*>(D),
      const_cast<float*>(sa), const_cast<float*>(sb), offs, groups, N, Kdim);
  auto args = make_args<K>(g, groups, sms, raster, swizzle);
  typename K::Gemm gemm;
  void* workspace = static_cast<char*>(scratch) + GroupArgs<K>::bytes(groups);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 2;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
  return cudaGetLastError() == cudaSuccess ? 0 : 4;
}

}  // namespace omni

#define OMNI_GG_EXPORT(NAME, TM, TN, TK, CM, CN, PONG, FAST, EPI)                                                 \
  using NAME##_t = omni::GroupedFp8<Shape<_##TM, _##TN, _##TK>, Shape<_##CM, _##CN, _1>, PONG, FAST, EPI>;         \
  extern "C" size_t omni_gg_##NAME##_scratch(int groups, int sms) { return omni::scratch_bytes<NAME##_t>(groups, sms); } \
  extern "C" int omni_gg_##NAME##_run(const void* A, const void* B, void* D, const float* sa, const float* sb,  \
                                      const int32_t* offs, int groups, int N, int K, int sms, int raster,        \
                                      int swizzle, void* scratch, cudaStream_t stream) {                         \
    return omni::run<NAME##_t>(A, B, D, sa, sb, offs, groups, N, K, sms, raster, swizzle, scratch, stream);       \
  }

#ifndef OMNI_GG_CONFIGS
#error "define OMNI_GG_CONFIGS as OMNI_GG_EXPORT(name, tile_m, tile_n, tile_k, cluster_m, cluster_n, pingpong, fast, epi) lines"
#endif
OMNI_GG_CONFIGS
