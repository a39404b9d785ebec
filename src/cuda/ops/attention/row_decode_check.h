// The V4.1 native rows' e2m1 decode (row_decode.cuh: codes moved into bf16 bits, no table) run on the
// host, for the tests: cuda_bf16's host multiply rounds as the device's does, so a machine without a
// GPU checks the decode's arithmetic against the row codec (the attention tests check it on the GPU).
#pragma once

#include <array>
#include <cstdint>

namespace dsv4::cuda {

// Eight e2m1 codes (the nibbles of `codes`, the first lowest) times the e4m3 scale `scale_code` as the
// kernels decode them in paired order: bf16 pairs of codes (0, 4), (1, 5), (2, 6), (3, 7), the first
// of each in the low half, the values times 2^-7 (row_decode::kPairedValueScale).
std::array<uint32_t, 4> decode_e2m1x8_paired_on_host(uint32_t codes, uint8_t scale_code);

}  // namespace dsv4::cuda
