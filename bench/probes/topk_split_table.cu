// Probe: the clusters of the radix top-k the device runs at once (topk_radix_resident_rows, what
// split_rows in topk_radix.cu weighs) for each split of a row of --n keys (default 131072), so that
// the split chosen for a shape can be worked out by hand. Not part of the build. From the
// repository root:
//   nvcc -std=c++20 --expt-relaxed-constexpr -O3 -I include -I src \
//     -gencode arch=compute_90a,code=sm_90a bench/probes/topk_split_table.cu build/libdsv4.a -lcublasLt -lcuda -o topk_split_table
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

#include "cuda/ops/indexer/radix/topk_radix_kernel.cuh"

int main(int argc, char** argv) {
  using namespace dsv4::cuda;
  const long n = argc > 1 ? std::atol(argv[1]) : 131072;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  std::printf("rows of %ld keys, %d SMs: resident rows per split (cluster x threads, keys per CTA)\n", n, sms);
  for (int cluster = 1; cluster <= radix_topk::kMaxCluster; ++cluster) {
    long chunk = (n + cluster - 1) / cluster;
    chunk = (chunk + radix_topk::kTileKeys - 1) / radix_topk::kTileKeys * radix_topk::kTileKeys;
    if (chunk * 4 > 227 * 1024 - 16 * 1024) continue;
    for (const int threads : {512, 1024}) {
      const int rows = threads == 512 ? topk_radix_resident_rows<512, RadixRows::resident>(chunk, cluster, sms)
                                      : topk_radix_resident_rows<1024, RadixRows::resident>(chunk, cluster, sms);
      std::printf("  %d x %4d  chunk %6ld  keys/thread %3ld  resident %3d\n", cluster, threads, chunk,
                  (chunk + threads - 1) / threads, rows);
    }
  }
}
