// Radix top-k, resident rows, 256 threads per CTA.
#include "cuda/ops/indexer/radix/topk_radix_kernel.cuh"

namespace dsv4::cuda {
template void launch_topk_radix<256, RadixRows::resident>(const RadixTopkLaunch&, int64_t, cudaStream_t);
template int topk_radix_resident_rows<256, RadixRows::resident>(int64_t, int, int);
}  // namespace dsv4::cuda
