// The row kernel behind rms_norm, rope_heads, cache_insert and the output projection's inverse
// RoPE: per row, load -> [RMSNorm] -> [RoPE] -> [Hadamard] -> [QAT] -> [plain output] [cache row].
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/common/paged_rows.h"
#include "dsv4/cuda/qkv.h"

namespace dsv4::cuda {

struct RowPipelineLaunch {
  const void* in = nullptr;               // [tokens, heads, dims]
  DType in_dtype = DType::bf16;
  int64_t tokens = 0;
  int heads = 1;                          // rows per token
  int dims = 0;
  bool normalize = false;
  const void* norm_weight = nullptr;      // [dims] or null (weightless)
  DType norm_weight_dtype = DType::bf16;
  float eps = 0.0f;
  const float* rope_table = nullptr;      // [rope_positions, rope_dim]; null: no RoPE
  int64_t rope_positions = 0;
  int rope_dim = 0;
  bool inverse_rope = false;
  const int32_t* token_position = nullptr;
  int64_t position_offset = 0;
  bool bf16_rounding = true;
  bool hadamard = false;                  // dims a power of two
  RowQuantizer quant = RowQuantizer::none;
  void* out = nullptr;                    // [tokens, heads, dims] or null
  DType out_dtype = DType::bf16;
  DeviceRows cache;                       // written when slots != null (heads == 1)
  const int64_t* slots = nullptr;

  // The fields a validated view gives. Input rows: [tokens, dims] or [tokens, heads, dims].
  void set_input(const TensorView& rows) {
    in = rows.data;
    in_dtype = rows.dtype;
    tokens = rows.shape[0];
    heads = rows.rank == 3 ? static_cast<int>(rows.shape[1]) : 1;
    dims = static_cast<int>(rows.shape[rows.rank - 1]);
  }
  // RMSNorm with this weight (an absent view: weightless).
  void set_norm(const TensorView& weight, float epsilon) {
    normalize = true;
    if (is_present(weight)) {
      norm_weight = weight.data;
      norm_weight_dtype = weight.dtype;
    }
    eps = epsilon;
  }
  // RoPE from this table ([positions, rope_dim] f32) at the tokens' positions ([tokens] i32).
  void set_rope(const TensorView& table, const TensorView& positions) {
    rope_table = table.ptr<const float>();
    rope_positions = table.shape[0];
    rope_dim = static_cast<int>(table.shape[1]);
    token_position = positions.ptr<const int32_t>();
  }
};

void launch_row_pipeline(const RowPipelineLaunch& a, cudaStream_t stream, const char* op);

// Channels the quantizer covers and its tile (quant != none).
int quantized_channels(RowQuantizer quant, int dims, int rope_dim);
int quant_tile(RowQuantizer quant);

}  // namespace dsv4::cuda
