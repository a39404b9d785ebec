// Small element-wise kernels the engine needs between the operations of include/dsv4/cuda: dtype
// conversion of the layer input, the indexer head weights' scaling, and the pick lists of layers
// that attend every visible compressed entry. They take raw pointers: the engine sizes every
// buffer from validated step metadata.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dsv4/tensor.h"

namespace dsv4::cuda {

// out[i] = bf16(in[i]) for n f32 values (the reference rounds the layer input first).
void launch_f32_to_bf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);

// out[i] = in[i] · scale for n values of `in_dtype` (bf16 | f32); with `round_bf16` the product is
// rounded to bf16 (the reference's bf16 multiply of the indexer head weights, SPEC §4.2).
void launch_scale_to_f32(const void* in, DType in_dtype, float scale, bool round_bf16, float* out, int64_t n,
                         cudaStream_t stream);

// picks[t, j] = j for every token t < tokens and entry j < entries: every compressed entry is a
// candidate; the attention skips those a token cannot see yet (V4.0 HCA layers).
void launch_fill_entry_picks(int32_t* picks, int64_t tokens, int64_t entries, cudaStream_t stream);

}  // namespace dsv4::cuda
