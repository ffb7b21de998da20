// A prototype (bench/bench_cutlass_contiguous.py): the MoE's grouped e4m3 GEMM on CUTLASS's PLAIN sm90 kernel
// (GemmUniversal, not the ptr-array one) with a DeepGEMM-style contiguous layout, to tell whether grouped work can
// run at the plain kernel's rate (bench/csrc/dense_fp8_probe.cu) instead of the ptr-array kernel's
// (platforms/cuda/csrc/grouped_fp8.cu, ~15% slower on the same problem).
//
// The layout ("contiguous, 128-aligned"; ALIGN rows below, 128 x the cluster's M extent):
//   A [M_cap, K] e4m3 row-major: the routed rows sorted by expert; expert e's rows at [base_e, base_e + count_e),
//     base_e = sum over j < e of roundup(count_j, ALIGN), so every 128-row M tile belongs to one expert. Rows in
//     the padding are garbage; their outputs are never read.
//   B [E, N, K] e4m3 row-major (expert e's weight), sa [M_cap] fp32 per row, sb [E, N] fp32 per (expert, column).
//   D [M_cap, N] bf16 = bf16((A[row] @ B[e]^T) * sa[row] * sb[e, col]) for the rows of expert e.
//   tile_expert int32 [M_cap / 128]: the expert of each M tile, -1 for the tiles past the last expert's padded
//     end (the -1 entries must form a suffix). M_cap = roundup(R + E * (ALIGN - 1), ALIGN) for R routed rows is
//     fixed for a token count, and nothing is read on the host, so a launch is capturable.
//
// How: a batched GEMM of problem (M_cap, N, K, L = E) in which A, D and the row scale have a static stride-0
// batch mode (A(m, k, l) = A[m, k] for every l: CuTe's TMA drops static stride-0 modes, so their descriptors are
// the plain 2-D ones), B and the column scale have batch strides N*K and N, and a custom persistent tile scheduler
// (ContiguousTileScheduler, derived from PersistentTileSchedulerSm90) enumerates the tiles of the (M_cap, N) grid
// only (L = 1: its grid, tile count and params never multiply by E), sets each work tile's L_idx to
// tile_expert[M tile], and skips the tiles whose expert is -1.
//
// Clusters. The sm90 mainloop multicasts A along the cluster's N extent and B along its M extent, each CTA
// loading its own slice from its own (m, n, l) and sending it to its peers.
//   1x2: the two CTAs share the M tile, hence the expert; A is multicast (and does not depend on l anyway), B is
//        loaded by each CTA for itself: correct with the 128-aligned layout.
//   2x1: the two CTAs hold M tiles 2i and 2i+1 and multicast B(n, l) halves to each other; with the 128-aligned
//        layout the two tiles can belong to two experts, and each CTA would then compute half of its K slices
//        with the other expert's weight. No choice of tiles inside CUTLASS's scheduler contract avoids that
//        without duplicate work (an expert with an odd tile count leaves a tile whose peer has nothing of the
//        same expert to do), so the 2x1 configuration requires a 256-aligned layout (ALIGN = 256: every
//        cluster's pair of M tiles in one expert) and exports ALIGN so the caller builds it. Its scheduler takes
//        the expert (and the skip decision) from the cluster's first M tile, so the two CTAs always see the same
//        tiles (no deadlock on a wrong layout: only wrong numbers, which visits() below reports).
//
// Every warp role of the ping-pong kernel (the producer warp, which steps one tile at a time; the two consumer
// warp groups, which start one tile apart and step two; the epilogue load warp, idle with no C) walks its own
// copy of the scheduler, and advance_to_next_work(n) is n single steps, each to the next tile whose expert is
// not -1; so all roles walk the same sequence of valid tiles and none stops while valid tiles remain for its CTA.
// The peers of a cluster sit at the same cluster slot at every step (the grid is a multiple of the cluster), so
// they skip together. With the tiles rastered along N and no swizzle (the heuristic's choice on these shapes),
// the cluster's M tile never decreases along a CTA's walk, so the first -1 ends it (the -1s are a suffix);
// other orders step over the -1 tiles one by one. The reads of tile_expert (and expert_tiles) are plain device
// loads in the scheduler's constructor and steps; under programmatic dependent launch they would have to follow
// griddepcontrol.wait (not enabled here: GemmUniversalAdapter::run launches without PDL).
//
// The tile order. CUTLASS's heuristic rasters these shapes along N (M slowest): a wave of 132 CTAs then covers
// about 3 M-tile rows across all N, that is all of one or two experts' weights (24 MB each for gate_up).
// Raster 3 (expert-major) instead takes each expert's tiles together, M fastest, as the ptr-array kernel walks a
// group: a wave covers a few N columns of one or two experts. It needs expert_tiles [E + 1] (each expert's first
// M tile) besides tile_expert.
//
// Measured (H200, 2026-12-02, bench/bench_cutlass_contiguous.py, graphs of 8 calls, TFLOP/s of useful work):
// every output bit-identical to grouped_fp8.cu's and every scheduler check passing, but NOT at the plain rate.
// 1x2 in the heuristic order, gate_up: 1117-1144 even, 1080-1089 routed (the ptr-array kernel in the same runs
// 1231-1245, 1134-1163); down: 1179-1232 even, 1117-1173 routed (ptr-array 1193-1201, 1122-1130).
// Expert-major (one run): gate_up 1200 even, 1138 routed; down 1187, 1110. 2x1 (256-row padding: 11% padded
// rows on the routed split against 6% for 1x2) was no better. With every row in one expert (the plain probe's
// problem), 1228-1242 (gate_up) / 1257-1262 (down) against the plain kernel's 1305-1308 / 1357-1365 in the same
// session, and 1257 / 1291 without the table reads (a diagnostic build with the tile count compiled in).
//
// Exported per configuration: omni_cg_<name>_run (the tile order CUTLASS's heuristic picks, no swizzle, as the
// plain probe runs), omni_cg_<name>_run_sched (raster 0 heuristic / 1 along M / 2 along N, swizzle 1-8, or 3:
// the expert-major order, which also takes expert_tiles [E + 1], each expert's first M tile, cumulative),
// omni_cg_<name>_scratch, omni_cg_<name>_stages, omni_cg_<name>_align (ALIGN), omni_cg_<name>_grid (the launch
// grid and the scheduler's tile grid, host only: the benchmark's Python model of the enumeration uses it) and
// omni_cg_<name>_visits (a check kernel: the same scheduler, params and launch grid as the GEMM, walked by the
// three roles as the ping-pong kernel walks it, counting the visits of every tile and hashing each CTA's walk).
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
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

using namespace cute;

namespace omni_cg {

// The scheduler tag GemmUniversal takes as its fourth parameter (mapped below by TileSchedulerSelector).
struct ContiguousScheduler {};

template <class ClusterShape>
class ContiguousTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using BaseParams = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;
  static constexpr int ClusterM = cute::size<0>(ClusterShape{});
  static constexpr int ClusterN = cute::size<1>(ClusterShape{});

 public:
  using WorkTileInfo = Base::WorkTileInfo;
  using RasterOrder = Base::RasterOrder;
  using RasterOrderOptions = Base::RasterOrderOptions;

  struct Arguments : Base::Arguments {
    int32_t const* tile_expert = nullptr;  // [tiles_m]: the expert of each M tile, -1 past the last one
    // the expert-major order (expert_major): [E + 1] each expert's first M tile (cumulative; the last entry the
    // end of the last expert's tiles)
    int32_t const* expert_tiles = nullptr;
    bool expert_major = false;
  };

  struct Params : BaseParams {
    int32_t const* tile_expert = nullptr;
    int32_t const* expert_tiles = nullptr;
    int32_t tiles_m = 0;       // entries of tile_expert: ceil(M / tile M)
    int32_t cluster_cols = 0;  // the expert-major order's clusters along N: ceil(ceil(N / tile N) / cluster N)
    bool expert_major = false;
  };

  // The base's params for the (M, N) grid with L = 1, plus the table: the batch mode (the expert) is chosen per
  // tile, not enumerated, so nothing here multiplies by L.
  template <class ProblemShapeMNKL, class TileShape, class ClusterShapeT>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShapeT cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& arguments, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    auto mnk1 = cute::make_shape(int(cute::get<0>(problem_shape_mnkl)), int(cute::get<1>(problem_shape_mnkl)),
                                 int(cute::get<2>(problem_shape_mnkl)), 1);
    Params params;
    static_cast<BaseParams&>(params) = Base::to_underlying_arguments(
        mnk1, tile_shape, cluster_shape, hw_info, static_cast<typename Base::Arguments const&>(arguments),
        workspace, epilogue_subtile, ktile_start_alignment_count);
    params.tile_expert = arguments.tile_expert;
    params.expert_tiles = arguments.expert_tiles;
    params.expert_major = arguments.expert_major;
    params.tiles_m = int32_t((int(cute::get<0>(problem_shape_mnkl)) + int(cute::size<0>(tile_shape)) - 1) /
                             int(cute::size<0>(tile_shape)));
    int const tiles_n = (int(cute::get<1>(problem_shape_mnkl)) + int(cute::size<1>(tile_shape)) - 1) /
                        int(cute::size<1>(tile_shape));
    params.cluster_cols = int32_t((tiles_n + ClusterN - 1) / ClusterN);
    return params;
  }

  // The launch grid, for the (M, N) grid with L = 1 as well.
  template <class ProblemShapeMNKL, class BlockShape, class ClusterShapeT>
  static dim3 get_grid_shape(Params const& params, ProblemShapeMNKL problem_shape_mnk, BlockShape cta_shape,
                             ClusterShapeT cluster_shape, cutlass::KernelHardwareInfo hw_info,
                             Arguments arguments = Arguments{}, bool truncate_by_problem_size = true) {
    auto mnk1 = cute::make_shape(int(cute::get<0>(problem_shape_mnk)), int(cute::get<1>(problem_shape_mnk)),
                                 int(cute::get<2>(problem_shape_mnk)), 1);
    return Base::get_grid_shape(static_cast<BaseParams const&>(params), mnk1, cta_shape, cluster_shape, hw_info,
                                static_cast<typename Base::Arguments const&>(arguments), truncate_by_problem_size);
  }

  static bool can_implement(Arguments const& args) {
    return Base::can_implement(static_cast<typename Base::Arguments const&>(args)) && args.tile_expert != nullptr &&
           (!args.expert_major || args.expert_tiles != nullptr);
  }

  CUTLASS_HOST_DEVICE ContiguousTileScheduler() {}

  CUTLASS_DEVICE explicit ContiguousTileScheduler(Params const& params)
      : Base(static_cast<BaseParams const&>(params)), tile_expert_(params.tile_expert),
        expert_tiles_(params.expert_tiles), tiles_m_(params.tiles_m), cluster_cols_(params.cluster_cols),
        expert_major_(params.expert_major) {
#if defined(__CUDA_ARCH__)
    if (expert_major_) {
      // one index per cluster: the cluster's position in the grid, stepping by the number of clusters
      auto [cta_m, cta_n, cta_l] = cute::block_id_in_cluster();
      cta_m_ = int32_t(cta_m);
      cta_n_ = int32_t(cta_n);
      idx_ = uint64_t(blockIdx.x / ClusterM) + uint64_t(blockIdx.y / ClusterN) * uint64_t(gridDim.x / ClusterM);
      stride_ = uint64_t(gridDim.x / ClusterM) * uint64_t(gridDim.y / ClusterN) * uint64_t(gridDim.z);
      settle();
      return;
    }
    // the base's first tile and stride (its own copies are private)
    if (params.raster_order_ == RasterOrder::AlongN) {
      idx_ = uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * uint64_t(gridDim.x);
    } else {
      idx_ = uint64_t(blockIdx.x) * uint64_t(gridDim.y) + uint64_t(blockIdx.y);
    }
    stride_ = uint64_t(gridDim.x) * uint64_t(gridDim.y) * uint64_t(gridDim.z);
    // along N without swizzle, a CTA's cluster M tile never decreases: the first -1 (a suffix) ends the walk
    monotone_ = params.raster_order_ == RasterOrder::AlongN && params.log_swizzle_size_ == 0;
    settle();
#endif
  }

  template <class ClusterShapeT>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShapeT) { return current_; }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return current_; }

  // n single steps, each to the next tile of an expert: a consumer's step of 2 skips exactly the one valid tile
  // the other consumer takes, as the producer's two steps of 1 do.
  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) {
    for (uint32_t i = 0; i < advance_count; ++i) {
      idx_ += stride_;
      settle();
    }
  }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t advance_count = 1) const {
    ContiguousTileScheduler next = *this;
    next.advance_to_next_work(advance_count);
    return !next.current_.is_valid();
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(current_, true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

 private:
  // From idx_ on, the first tile whose cluster's M tile has an expert (idx_ left there), or the end.
  CUTLASS_DEVICE void settle() {
    if (expert_major_) {
      settle_expert_major();
      return;
    }
    uint64_t const end = scheduler_params.blocks_per_problem_;
    while (idx_ < end) {
      WorkTileInfo work = Base::get_current_work_for_linear_idx(idx_);  // L_idx = 0: the grid has L = 1
      int32_t const lead = work.M_idx - work.M_idx % ClusterM;          // the cluster's first M tile
      int32_t const expert = lead < tiles_m_ ? __ldg(tile_expert_ + lead) : -1;
      if (expert >= 0) {
        work.L_idx = expert;
        current_ = work;
        return;
      }
      if (monotone_) {
        idx_ = end;
        break;
      }
      idx_ += stride_;
    }
    current_ = WorkTileInfo::invalid_work_tile();
  }

  // The expert-major order, in clusters: expert e's tiles [t_e, t_e + c_e) (multiples of the cluster's M extent)
  // take cluster indices [t_e / CM * cols, (t_e + c_e) / CM * cols), M fastest inside (as the ptr-array grouped
  // kernel walks a group), so a wave of clusters covers a few N columns of one or two experts: their A rows and
  // B columns stay in L2. Cluster index j's row j / cols lies in its expert's range (the layout is contiguous),
  // so tile_expert[that row's first tile] names the expert; the rows past the last expert end the walk.
  CUTLASS_DEVICE void settle_expert_major() {
    uint64_t const end = uint64_t((tiles_m_ + ClusterM - 1) / ClusterM) * uint64_t(cluster_cols_);
    if (idx_ < end) {
      int32_t const lead = int32_t(idx_ / uint64_t(cluster_cols_)) * ClusterM;
      int32_t const expert = __ldg(tile_expert_ + lead);
      if (expert >= 0) {
        int32_t const first = __ldg(expert_tiles_ + expert);
        int32_t const rows = (__ldg(expert_tiles_ + expert + 1) - first) / ClusterM;  // cluster rows of the expert
        int32_t const local = int32_t(idx_ - uint64_t(first / ClusterM) * uint64_t(cluster_cols_));
        current_ = {first + (local % rows) * ClusterM + cta_m_, (local / rows) * ClusterN + cta_n_, expert, true};
        return;
      }
      idx_ = end;  // the -1 tiles are a suffix: nothing valid follows
    }
    current_ = WorkTileInfo::invalid_work_tile();
  }

  int32_t const* tile_expert_ = nullptr;
  int32_t const* expert_tiles_ = nullptr;
  int32_t tiles_m_ = 0;
  int32_t cluster_cols_ = 0;
  int32_t cta_m_ = 0;
  int32_t cta_n_ = 0;
  bool expert_major_ = false;
  uint64_t idx_ = 0;
  uint64_t stride_ = 1;
  bool monotone_ = false;
  WorkTileInfo current_ = WorkTileInfo::invalid_work_tile();
};

}  // namespace omni_cg

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<omni_cg::ContiguousScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = omni_cg::ContiguousTileScheduler<ClusterShape>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace omni_cg {

using ElemA = cutlass::float_e4m3_t;
using ElemB = cutlass::float_e4m3_t;
using ElemD = cutlass::bfloat16_t;
using Problem = Shape<int, int, int, int>;  // M_cap, N, K, L = E

template <class Tile, class Cluster>
struct ContiguousFp8 {
  static constexpr int Align = 16 / sizeof(ElemD);                      // elements per 16 bytes (TMA)
  static constexpr int RowAlign = size<0>(Tile{}) * size<0>(Cluster{});  // rows an expert's block rounds to
  using MainSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
  using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;

  using StrideA = Stride<int64_t, _1, _0>;        // one A for every expert (l)
  using StrideB = Stride<int64_t, _1, int64_t>;   // B[e]: batch stride N * K
  using StrideD = Stride<int64_t, _1, _0>;        // one D for every expert

  // epilogue: D = bf16((acc * sa[row]) * sb[e, col]), as dense_fp8_probe.cu (and grouped_fp8.cu's EPI 0)
  using RowStride = Stride<_1, _0, _0>;      // sa: one value per row (M), broadcast along N, the same for every l
  using ColStride = Stride<_0, _1, int64_t>;  // sb: one value per column (N) of expert l, batch stride N
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
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, StrideD, Align, ElemD, StrideD, Align,
      EpiSchedule, Evt>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElemA, StrideA, 16, ElemB, StrideB, 16, float, Tile,
      Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue, ContiguousScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Scheduler = typename Kernel::TileScheduler;
  static_assert(cute::is_same_v<Scheduler, ContiguousTileScheduler<Cluster>>, "the custom scheduler is not used");
  static_assert(cute::is_same_v<typename Kernel::StrideA, StrideA> && cute::is_same_v<typename Kernel::StrideB,
                StrideB> && cute::is_same_v<typename Kernel::StrideD, StrideD>, "unexpected strides");
  static constexpr int Stages = Mainloop::DispatchPolicy::Stages;
};

inline cutlass::gemm::kernel::detail::RasterOrderOptions raster_option(int raster) {
  using R = cutlass::gemm::kernel::detail::RasterOrderOptions;
  return raster == 1 ? R::AlongM : raster == 2 ? R::AlongN : R::Heuristic;
}

template <class K>
typename K::Gemm::Arguments make_args(const void* A, const void* B, void* D, const float* sa, const float* sb,
                                      const int32_t* tile_expert, const int32_t* expert_tiles, int m_cap, int N,
                                      int Kdim, int E, int sms, int raster, int swizzle) {
  auto stride_a = typename K::StrideA{int64_t(Kdim), _1{}, _0{}};
  auto stride_b = typename K::StrideB{int64_t(Kdim), _1{}, int64_t(N) * Kdim};
  auto stride_d = typename K::StrideD{int64_t(N), _1{}, _0{}};
  typename K::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kBatched,
      {m_cap, N, Kdim, E},
      {static_cast<const ElemA*>(A), stride_a, static_cast<const ElemB*>(B), stride_b},
      {{},  // the fusion tree's arguments, set below
       nullptr, stride_d, static_cast<const ElemD*>(D), stride_d}};
  // tree: ToBf16(Mul(ScaleCol, Mul(ScaleRow, acc))); each node's arguments are its children's, then its own
  args.epilogue.thread = {
      {                                                            // Mul: sb[e, col] * (...)
       {sb, 0.f, typename K::ColStride{_0{}, _1{}, int64_t(N)}},  // ScaleCol (row broadcast of sb[l])
       {                                                           // Mul: sa[row] * acc
        {sa, 0.f, typename K::RowStride{}},                        // ScaleRow (column broadcast of sa)
        {},                                                        // acc
        {}},
       {}},
      {}};  // ToBf16
  args.hw_info.sm_count = sms;
  args.scheduler.tile_expert = tile_expert;
  args.scheduler.expert_tiles = expert_tiles;
  args.scheduler.expert_major = raster == 3;
  args.scheduler.raster_order = raster_option(raster);
  args.scheduler.max_swizzle_size = swizzle;
  return args;
}

// Bytes of device scratch a call needs: CUTLASS's workspace (none for this scheduler; kept for the ABI).
template <class K>
size_t scratch_bytes(int m_cap, int N, int Kdim, int E, int sms) {
  return K::Gemm::get_workspace_size(
      make_args<K>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, m_cap, N, Kdim, E, sms, 0, 1));
}

template <class K>
int run(const void* A, const void* B, void* D, const float* sa, const float* sb, const int32_t* tile_expert,
        const int32_t* expert_tiles, int m_cap, int N, int Kdim, int E, int sms, int raster, int swizzle,
        void* scratch, cudaStream_t stream) {
  if (m_cap % K::RowAlign != 0) return 1;  // the layout's contract: whole clusters of M tiles
  auto args = make_args<K>(A, B, D, sa, sb, tile_expert, expert_tiles, m_cap, N, Kdim, E, sms, raster, swizzle);
  typename K::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(args, scratch, stream) != cutlass::Status::kSuccess) return 2;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
  return cudaGetLastError() == cudaSuccess ? 0 : 4;
}

// The scheduler's params and the launch grid exactly as GemmUniversal computes them for these arguments
// (Kernel::to_underlying_arguments and Kernel::get_grid_shape, which read only the problem, hw_info and these).
template <class K>
typename K::Kernel::Params sched_params(const int32_t* tile_expert, const int32_t* expert_tiles, int m_cap, int N,
                                        int Kdim, int E, int sms, int raster, int swizzle) {
  auto args = make_args<K>(nullptr, nullptr, nullptr, nullptr, nullptr, tile_expert, expert_tiles, m_cap, N, Kdim, E,
                           sms, raster, swizzle);
  typename K::Kernel::Params p{};
  p.problem_shape = args.problem_shape;
  p.hw_info = cutlass::KernelHardwareInfo{args.hw_info.device_id, sms, 0};
  p.scheduler = K::Scheduler::to_underlying_arguments(append<4>(args.problem_shape, 1),
                                                      typename K::Kernel::TileShape{},
                                                      typename K::Kernel::ClusterShape{}, p.hw_info, args.scheduler,
                                                      nullptr, 1);
  return p;
}

template <class K>
int grid_info(int m_cap, int N, int Kdim, int E, int sms, int raster, int swizzle, int64_t* out) {
  auto p = sched_params<K>(nullptr, nullptr, m_cap, N, Kdim, E, sms, raster, swizzle);
  dim3 grid = K::Kernel::get_grid_shape(p);
  auto const& s = p.scheduler;
  out[0] = grid.x;
  out[1] = grid.y;
  out[2] = grid.z;
  out[3] = s.raster_order_ == cutlass::gemm::kernel::detail::RasterOrder::AlongN ? 1 : 0;
  out[4] = s.log_swizzle_size_;
  out[5] = int64_t(s.problem_tiles_m_) * s.cluster_shape_m_;  // CTA tiles along M the scheduler enumerates
  out[6] = int64_t(s.problem_tiles_n_) * s.cluster_shape_n_;
  out[7] = int64_t(s.blocks_per_problem_);
  out[8] = s.tiles_m;
  out[9] = size<0>(typename K::Kernel::ClusterShape{});
  out[10] = size<1>(typename K::Kernel::ClusterShape{});
  out[11] = s.cluster_cols;
  return 0;
}

// The check kernel: the GEMM's scheduler walked by its three roles exactly as the ping-pong kernel walks it
// (producer: one step at a time; consumer 0: from the first tile, two steps; consumer 1: one step ahead, two
// steps). counts[role][m][n] += 1 per visit; per CTA (blockIdx.x + blockIdx.y * gridDim.x) 8 ints: the tiles of
// each role, a hash of each role's (cluster M tile, expert) sequence, and the visits whose expert differs from
// tile_expert[M] or whose tile falls outside counts, and a spare.
__device__ inline uint32_t walk_hash(uint32_t h, int32_t lead, int32_t expert) {
  return (h * 16777619u) ^ (uint32_t(lead) * 131u + uint32_t(expert) + 1u);
}

template <class K>
__global__ void __launch_bounds__(384, 1) visit_kernel(typename K::Scheduler::Params params, int counts_m,
                                                       int counts_n, int32_t* counts, int32_t* per_cta) {
  using Sched = typename K::Scheduler;
  constexpr int ClusterM = size<0>(typename K::Kernel::ClusterShape{});
  int role = threadIdx.x == 0 ? 0 : threadIdx.x == 128 ? 1 : threadIdx.x == 256 ? 2 : -1;
  if (role < 0) return;
  Sched scheduler{params};
  if (role == 2) scheduler.advance_to_next_work();  // as the kernel's Consumer1 before its first tile
  auto work = scheduler.initial_work_tile_info(typename K::Kernel::ClusterShape{});
  int32_t n = 0, bad = 0;
  uint32_t h = 0;
  while (work.is_valid()) {
    int32_t lead = work.M_idx - work.M_idx % ClusterM;
    h = walk_hash(h, lead, work.L_idx);
    ++n;
    if (work.M_idx >= params.tiles_m || params.tile_expert[work.M_idx] != work.L_idx) ++bad;
    if (work.M_idx < counts_m && work.N_idx < counts_n) {
      atomicAdd(counts + (size_t(role) * counts_m + work.M_idx) * counts_n + work.N_idx, 1);
    } else {
      ++bad;
    }
    scheduler.advance_to_next_work(role == 0 ? 1 : 2);
    work = scheduler.get_current_work();
  }
  int32_t* mine = per_cta + size_t(blockIdx.x + blockIdx.y * gridDim.x) * 8;
  mine[role] = n;
  mine[3 + role] = int32_t(h);
  atomicAdd(mine + 6, bad);
}

template <class K>
int visits(const int32_t* tile_expert, const int32_t* expert_tiles, int m_cap, int N, int Kdim, int E, int sms,
           int raster, int swizzle, int32_t* counts, int counts_m, int counts_n, int32_t* per_cta,
           cudaStream_t stream) {
  auto p = sched_params<K>(tile_expert, expert_tiles, m_cap, N, Kdim, E, sms, raster, swizzle);
  cudaLaunchConfig_t config{};
  config.gridDim = K::Kernel::get_grid_shape(p);
  config.blockDim = dim3(384, 1, 1);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = size<0>(typename K::Kernel::ClusterShape{});
  attribute[0].val.clusterDim.y = size<1>(typename K::Kernel::ClusterShape{});
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  if (cudaLaunchKernelEx(&config, visit_kernel<K>, p.scheduler, counts_m, counts_n, counts, per_cta) !=
      cudaSuccess) {
    return 5;
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 4;
}

}  // namespace omni_cg

#define OMNI_CG_EXPORT(NAME, TM, TN, TK, CM, CN)                                                                  \
  using NAME##_t = omni_cg::ContiguousFp8<Shape<_##TM, _##TN, _##TK>, Shape<_##CM, _##CN, _1>>;                 \
  extern "C" size_t omni_cg_##NAME##_scratch(int m_cap, int N, int K, int E, int sms) {                         \
    return omni_cg::scratch_bytes<NAME##_t>(m_cap, N, K, E, sms);                                               \
  }                                                                                                             \
  extern "C" int omni_cg_##NAME##_run_sched(const void* A, const void* B, void* D, const float* sa,            \
                                            const float* sb, const int32_t* tile_expert,                        \
                                            const int32_t* expert_tiles, int m_cap, int N, int K, int E,        \
                                            int sms, int raster, int swizzle, void* scratch,                    \
                                            cudaStream_t stream) {                                              \
    return omni_cg::run<NAME##_t>(A, B, D, sa, sb, tile_expert, expert_tiles, m_cap, N, K, E, sms, raster,     \
                                  swizzle, scratch, stream);                                                    \
  }                                                                                                             \
  extern "C" int omni_cg_##NAME##_run(const void* A, const void* B, void* D, const float* sa, const float* sb, \
                                      const int32_t* tile_expert, int m_cap, int N, int K, int E, int sms,      \
                                      void* scratch, cudaStream_t stream) {                                     \
    return omni_cg::run<NAME##_t>(A, B, D, sa, sb, tile_expert, nullptr, m_cap, N, K, E, sms, 0, 1, scratch,   \
                                  stream);                                                                      \
  }                                                                                                             \
  extern "C" int omni_cg_##NAME##_stages() { return NAME##_t::Stages; }                                         \
  extern "C" int omni_cg_##NAME##_align() { return NAME##_t::RowAlign; }                                        \
  extern "C" int omni_cg_##NAME##_grid(int m_cap, int N, int K, int E, int sms, int raster, int swizzle,        \
                                       int64_t* out) {                                                          \
    return omni_cg::grid_info<NAME##_t>(m_cap, N, K, E, sms, raster, swizzle, out);                             \
  }                                                                                                             \
  extern "C" int omni_cg_##NAME##_visits(const int32_t* tile_expert, const int32_t* expert_tiles, int m_cap,    \
                                         int N, int K, int E, int sms, int raster, int swizzle, int32_t* counts, \
                                         int counts_m, int counts_n, int32_t* per_cta, cudaStream_t stream) {   \
    return omni_cg::visits<NAME##_t>(tile_expert, expert_tiles, m_cap, N, K, E, sms, raster, swizzle, counts,   \
                                     counts_m, counts_n, per_cta, stream);                                      \
  }

// c1x2: the brief's 128-aligned layout. c2x1: needs the 256-aligned layout (see the top of the file).
#ifndef OMNI_CG_CONFIGS
#define OMNI_CG_CONFIGS                                \
  OMNI_CG_EXPORT(pong_128x128_c1x2, 128, 128, 128, 1, 2) \
  OMNI_CG_EXPORT(pong_128x128_c2x1, 128, 128, 128, 2, 1)
#endif

OMNI_CG_CONFIGS
