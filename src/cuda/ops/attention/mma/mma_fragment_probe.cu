#include "cuda/ops/attention/mma/mma_fragment_probe.h"

#include "cuda/ops/attention/mma/mma_fragments.cuh"
#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {
namespace {

constexpr int kProbeColumn = 48;  // chunks 6 and 7, swizzled differently on every row
constexpr int kProbeTileBytes = 16 * mma::kRowBytes;

__global__ void mma_fragment_probe_kernel(const uint16_t* a, const uint16_t* k, const uint16_t* v, float* s, float* o) {
  extern __shared__ __align__(128) uint8_t shared[];
  const int lane = static_cast<int>(threadIdx.x);
  const uint16_t* inputs[3] = {a, k, v};
  for (int m = 0; m < 3; ++m)
    for (int item = lane; item < 32; item += 32) {  // 16 rows x 2 chunks of 8
      const int r = item / 2, chunk = item % 2;
      *reinterpret_cast<uint4*>(shared + m * kProbeTileBytes + mma::tile_offset(r, kProbeColumn + chunk * 8)) =
          *reinterpret_cast<const uint4*>(inputs[m] + r * 16 + chunk * 8);
    }
  __syncwarp();
  const uint32_t base = shared_address(shared);
  uint32_t qa[4], kb[4], pa[4], vb[4];
  mma::load_a(qa, base, 0, kProbeColumn, lane);
  mma::load_b_keys(kb, base + kProbeTileBytes, 0, kProbeColumn, lane);
  float c[2][4] = {}, d[2][4] = {};
  mma::mma_bf16(c[0], qa, kb[0], kb[1]);
  mma::mma_bf16(c[1], qa, kb[2], kb[3]);
  mma::a_from_c(pa, c[0], c[1]);
  mma::load_b_values(vb, base + 2 * kProbeTileBytes, 0, kProbeColumn, lane);
  mma::mma_bf16(d[0], pa, vb[0], vb[1]);
  mma::mma_bf16(d[1], pa, vb[2], vb[3]);
  // C fragments: rows g and g + 8, columns 8j + 2c, 8j + 2c + 1.
  const int g = lane / 4, column = 2 * (lane % 4);
  for (int j = 0; j < 2; ++j)
    for (int e = 0; e < 4; ++e) {
      const int index = (g + 8 * (e / 2)) * 16 + 8 * j + column + (e % 2);
      s[index] = c[j][e];
      o[index] = d[j][e];
    }
}

}  // namespace

void run_mma_fragment_probe(const uint16_t* a, const uint16_t* k, const uint16_t* v, float* s, float* o,
                            cudaStream_t stream) {
  mma_fragment_probe_kernel<<<1, 32, 3 * kProbeTileBytes, stream>>>(a, k, v, s, o);
  check_launch("mma_fragment_probe");
}

}  // namespace dsv4::cuda
