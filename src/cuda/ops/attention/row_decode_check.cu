#include "cuda/ops/attention/row_decode_check.h"

#include "cuda/ops/attention/row_decode.cuh"

namespace dsv4::cuda {

std::array<uint32_t, 4> decode_e2m1x8_paired_on_host(uint32_t codes, uint8_t scale_code) {
  const uint4 pairs = row_decode::e2m1x8_to_bf16_paired_bits(codes, row_decode::e2m1_scale_times_2_119(scale_code));
  return {pairs.x, pairs.y, pairs.z, pairs.w};
}

}  // namespace dsv4::cuda
