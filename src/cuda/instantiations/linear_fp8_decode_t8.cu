// fp8_decode projection kernel (fp8 weights, tensor cores) for up to 64 tokens: 8 token tile(s) of 8.
#include "cuda/ops/projection/fp8_decode/linear_fp8_decode_kernel.cuh"

namespace dsv4::cuda {
template void launch_linear_fp8_decode<8>(const Fp8DecodeLaunch&, cudaStream_t);
}  // namespace dsv4::cuda
