// A self-check of the fragment layouts the mma_bf16 attention relies on, for the tests: one warp
// computes s = a·kᵀ and o = bf16(s)·v through the kernel's own helpers (load_a, load_b_keys,
// a_from_c, load_b_values, mma_bf16), with the three 16 x 16 matrices placed at channels 48 … 63
// of swizzled 512-channel rows as the kernel places its tiles. A layout bug shows up here as a
// wrong element of a 16 x 16 product instead of a wrong attention output.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dsv4::cuda {

// Device arrays, row major: a [16, 16] (heads x channels), k [16, 16] (keys x channels), v [16, 16]
// (keys x channels), all bf16; s [16, 16] f32 (heads x keys), o [16, 16] f32 (heads x channels).
void run_mma_fragment_probe(const uint16_t* a, const uint16_t* k, const uint16_t* v, float* s, float* o,
                            cudaStream_t stream);

}  // namespace dsv4::cuda
