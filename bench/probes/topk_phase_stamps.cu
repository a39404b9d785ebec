// Probe: where a CTA of the radix top-k spends its time, phase by phase. This translation unit
// replaces one of the library's instantiations (src/cuda/instantiations/topk_radix_*.cu: by
// default topk_radix_t1024.cu; -DDSV4_TOPK_PROBE_THREADS=512 -DDSV4_TOPK_PROBE_STREAMED=1 for
// topk_radix_streamed_t512.cu, and so on) with one built with DSV4_PHASE_STAMPS
// (src/cuda/common/phase_stamps.cuh): every launch records the SM clock at each TopkStamp of
// radix_select.cuh per CTA, and at exit this prints their 10th, 50th and 90th percentiles over the
// CTAs, in us from the CTA's start at an assumed 1.98 GHz (relative figures; the clock is the
// SM's). Each CTA's slot keeps the latest launch that had it, so run one shape per process (as
// `dsv4 bench` does), and a shape whose split takes the replaced instantiation (4 x 128K on an
// H100 takes resident 1024-thread CTAs, 64 x 128K streamed 512-thread ones:
// bench/probes/topk_split_table.cu prints what split_rows weighs).
// Not part of the build. From build/ (a configured Release tree), a `dsv4` that prints them:
//   I=topk_radix_streamed_t512   # the instantiation replaced
//   nvcc --options-file CMakeFiles/dsv4.dir/includes_CUDA.rsp -O3 -DNDEBUG -std=c++20 \
//     --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
//     -DDSV4_TOPK_PROBE_THREADS=512 -DDSV4_TOPK_PROBE_STREAMED=1 -c \
//     ../bench/probes/topk_phase_stamps.cu -o $I.cu.o
//   cp libdsv4.a stamps.a && ar r stamps.a $I.cu.o
//   sed 's# libdsv4.a # stamps.a #g; s#-o dsv4 #-o dsv4_stamps #' CMakeFiles/dsv4_cli.dir/link.txt | sh
//   ./dsv4_stamps bench --op index-topk --batch 64 --context 131072
#define DSV4_PHASE_STAMPS 1
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "cuda/ops/indexer/radix/topk_radix_kernel.cuh"

#ifndef DSV4_TOPK_PROBE_THREADS
#define DSV4_TOPK_PROBE_THREADS 1024
#endif
#ifndef DSV4_TOPK_PROBE_STREAMED
#define DSV4_TOPK_PROBE_STREAMED 0
#endif

namespace dsv4::cuda {
inline constexpr RadixRows kProbeRows = DSV4_TOPK_PROBE_STREAMED ? RadixRows::streamed : RadixRows::resident;
template void launch_topk_radix<DSV4_TOPK_PROBE_THREADS, kProbeRows>(const RadixTopkLaunch&, int64_t, cudaStream_t);
template int topk_radix_resident_rows<DSV4_TOPK_PROBE_THREADS, kProbeRows>(int64_t, int, int);
namespace {
using namespace radix_topk;
constexpr double kClocksPerUs = 1980.0;  // the assumed SM clock (1.98 GHz)
long long stamps[kStampBlocks][kStampWarpgroups][kStampsPerWarpgroup];

// The q-quantile over the CTAs that recorded stamp k of stamp k less their start, in us, and how
// many did; (-1, 0) when none.
std::pair<double, int> quantile(double q, int k) {
  std::vector<long long> v;
  for (int b = 0; b < kStampBlocks; ++b)
    if (stamps[b][0][k] != 0 && stamps[b][0][kTopkStampStart] != 0) v.push_back(stamps[b][0][k] - stamps[b][0][kTopkStampStart]);
  if (v.empty()) return {-1.0, 0};
  const auto at = v.begin() + static_cast<std::ptrdiff_t>(q * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), at, v.end());
  return {static_cast<double>(*at) / kClocksPerUs, static_cast<int>(v.size())};
}

void dump() {
  if (cudaDeviceSynchronize() != cudaSuccess || cudaMemcpyFromSymbol(stamps, g_phase_stamps, sizeof(stamps)) != cudaSuccess) {
    std::printf("phase stamps: not read\n");
    return;
  }
  std::printf("top-k phase stamps, us from the CTA's start, p10 / p50 / p90 (CTAs):\n");
  const std::pair<const char*, int> phases[] = {
      {"loaded", kTopkStampLoaded},        {"pass 0 counted", kTopkStampCounted},
      {"pass 0 threshold", kTopkStampThreshold}, {"gathered", kTopkStampGathered},
      {"pass 1 counted", kTopkStampCounted + 1},
      {"pass 1 threshold", kTopkStampThreshold + 1}, {"pass 2 counted", kTopkStampCounted + 2},
      {"pass 2 threshold", kTopkStampThreshold + 2}, {"totals shared", kTopkStampTotals},
      {"picks written", kTopkStampWritten}, {"end", kTopkStampEnd}};
  for (const auto& [name, k] : phases) {
    const auto [p50, ctas] = quantile(0.5, k);
    if (ctas == 0) continue;
    std::printf("  %-17s %7.2f / %7.2f / %7.2f  (%d)\n", name, quantile(0.1, k).first, p50, quantile(0.9, k).first, ctas);
  }
}
}  // namespace

void register_phase_stamps_dump() {
  (void)cudaFree(nullptr);  // the runtime's own exit handlers first registered: ours then run before them
  std::atexit(dump);
}
}  // namespace dsv4::cuda
