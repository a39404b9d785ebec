// Probe: where a block of the wgmma sparse attention spends its time, phase by phase (bench/RESULTS.md,
// twentieth session). This translation unit replaces the library's native-rows, bf16-output
// instantiation with one built with DSV4_PHASE_STAMPS (src/cuda/common/phase_stamps.cuh): every
// launch records the SM clock at each PhaseStamp of sparse_attention_wgmma_kernel.cuh per block and
// warpgroup, and at exit this prints the medians over the blocks (the split merge's phases as 10th,
// 50th and 90th percentiles), in us from the first consumer warpgroup's start at an assumed 1.98 GHz
// (relative figures; the clock is the SM's). Each block's slot keeps the latest launch that had it,
// so run one shape per process (as `dsv4 bench` does).
// Not part of the build. From build/ (a configured Release tree), a `dsv4` that prints them:
//   nvcc --options-file CMakeFiles/dsv4.dir/includes_CUDA.rsp -O3 -DNDEBUG -std=c++20 \
//     --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -c \
//     ../bench/probes/attention_phase_stamps.cu -o sparse_attention_wgmma_d512_v41_native_bf16.cu.o
//   cp libdsv4.a stamps.a && ar r stamps.a sparse_attention_wgmma_d512_v41_native_bf16.cu.o
//   sed 's# libdsv4.a # stamps.a #g; s#-o dsv4 #-o dsv4_stamps #' CMakeFiles/dsv4_cli.dir/link.txt | sh
//   ./dsv4_stamps bench --op attention-decode --batch 128 --context 32768
#define DSV4_PHASE_STAMPS 1
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "cuda/ops/attention/wgmma/sparse_attention_wgmma_kernel.cuh"

namespace dsv4::cuda {
template void launch_sparse_attention_wgmma<uint16_t, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4>(SparseAttentionLaunch,
                                                                                                 int64_t, bool, cudaStream_t);
namespace {
using namespace attention_wgmma;
constexpr double kClocksPerUs = 1980.0;  // the assumed SM clock (1.98 GHz)
long long stamps[kStampBlocks][kStampWarpgroups][kStampsPerWarpgroup];
int blocks = 0;

// The q-quantile over the blocks of stamp (wg, k) less stamp (base_wg, base_k), in us; < 0 when
// never stamped.
double quantile(double q, int wg, int k, int base_wg, int base_k) {
  std::vector<long long> v;
  for (int b = 0; b < blocks; ++b)
    if (stamps[b][wg][k] != 0 && stamps[b][base_wg][base_k] != 0) v.push_back(stamps[b][wg][k] - stamps[b][base_wg][base_k]);
  if (v.empty()) return -1.0;
  const auto at = v.begin() + static_cast<std::ptrdiff_t>(q * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), at, v.end());
  return static_cast<double>(*at) / kClocksPerUs;
}
double median(int wg, int k, int base_wg, int base_k) { return quantile(0.5, wg, k, base_wg, base_k); }

void dump() {
  if (cudaDeviceSynchronize() != cudaSuccess || cudaMemcpyFromSymbol(stamps, g_phase_stamps, sizeof(stamps)) != cudaSuccess) {
    std::printf("phase stamps: not read\n");
    return;
  }
  for (int b = 0; b < kStampBlocks; ++b)
    if (stamps[b][0][kStampStart] != 0) blocks = b + 1;
  std::printf("phase stamps: %d blocks, us from consumer warpgroup 0's start\n", blocks);
  const char* names[] = {"ready", "scored", "P stored", "P", "next decoded", "P.V done"};
  for (int wg = 0; wg < 2; ++wg) {
    std::printf("consumers %d: Q %.2f, tile 0 decoded %.2f, end %.2f\n", wg, median(wg, kStampQLanded, 0, kStampStart),
                median(wg, kStampFirstDecoded, 0, kStampStart), median(wg, kStampEnd, 0, kStampStart));
    for (int i = 0; i < kStampedTiles && median(wg, tile_stamp(i, kTileReady), 0, kStampStart) >= 0; ++i) {
      std::printf("  tile %d:", i);
      for (int k = kTileReady; k <= kPvDone; ++k)
        std::printf(" %s %.2f", names[k], median(wg, tile_stamp(i, static_cast<TileStamp>(k)), 0, kStampStart));
      std::printf("\n");
    }
  }
  // The merge's phases as the 10th, 50th and 90th percentiles over the blocks: a token's split
  // blocks wait for its slowest at the first cluster barrier.
  const std::pair<const char*, int> merge[] = {{"partials shared", kStampMergeShared},
                                               {"weights", kStampMergeWeights},
                                               {"pieces merged", kStampMergePieces},
                                               {"end", kStampEnd}};
  // Small launches block by block: a split block's wait at the first cluster barrier (partials
  // shared less its last P·V done) is short for the cluster's slowest block. SM clocks differ
  // between SMs, so only intervals within a block are compared.
  if (blocks <= 40)
    for (int b = 0; b < blocks; ++b) {
      int last = 0;
      while (last + 1 < kStampedTiles && stamps[b][0][tile_stamp(last + 1, kPvDone)] != 0) ++last;
      const auto at = [&](int k) { return stamps[b][0][k] ? (stamps[b][0][k] - stamps[b][0][kStampStart]) / kClocksPerUs : -1.0; };
      std::printf("  block %2d: tile 0 decoded %.2f, last P.V done %.2f, partials shared %.2f (waited %.2f), end %.2f\n", b,
                  at(kStampFirstDecoded), at(tile_stamp(last, kPvDone)), at(kStampMergeShared),
                  at(kStampMergeShared) - at(tile_stamp(last, kPvDone)), at(kStampEnd));
    }
  std::printf("merge (split blocks), p10 / p50 / p90:");
  for (const auto& [name, k] : merge)
    std::printf(" %s %.2f / %.2f / %.2f;", name, quantile(0.1, 0, k, 0, kStampStart), median(0, k, 0, kStampStart),
                quantile(0.9, 0, k, 0, kStampStart));
  std::printf("\n");
  std::printf("producer: token rows %.2f, first pages %.2f\n  copies issued:", median(2, kStampTokenRows, 0, kStampStart),
              median(2, kStampFirstPages, 0, kStampStart));
  for (int u = 0; kStampCopiesIssued + u < kStampEnd && median(2, kStampCopiesIssued + u, 0, kStampStart) >= 0; ++u)
    std::printf(" %.2f", median(2, kStampCopiesIssued + u, 0, kStampStart));
  std::printf("\n");
}
}  // namespace

void register_phase_stamps_dump() {
  (void)cudaFree(nullptr);  // the runtime's own exit handlers first registered: ours then run before them
  std::atexit(dump);
}
}  // namespace dsv4::cuda
