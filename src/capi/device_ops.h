// The C API's operations on CUDA tensors: the contracts of dsv4.h run by the CUDA ops of
// include/dsv4/cuda on the caller's stream (device_ops.cpp). capi.cpp checks what both devices
// share (ranks, the page geometry); these check the rest. Built without CUDA, each throws
// DSV4_ERROR_UNSUPPORTED.
#pragma once

#include <cstdint>

#include "dsv4/dsv4.h"
#include "dsv4/kv_format.h"

namespace dsv4::capi {

// True when t is on a CUDA device (the operation then runs there).
bool on_cuda(const DLTensor* t);

void cuda_kv_encode(const PageGeometry& g, const DLTensor* x, const DLTensor* slots, const DLTensor* pages,
                    float tensor_scale, Fp8ScaleFloor floor, void* stream);
void cuda_kv_decode(const PageGeometry& g, const DLTensor* pages, const DLTensor* slots, const DLTensor* out,
                    float tensor_scale, void* stream);

// Rows of an attention: `pages` [num_pages, g.page_stride] u8 (paged) or, with rows_as_pages, the
// bf16 rows [N, D] themselves read as pages of one row.
struct AttentionRows {
  PageGeometry geometry;
  const DLTensor* pages = nullptr;
  bool rows_as_pages = false;
  float tensor_scale = 1.0f;
};
void cuda_sparse_attention(const char* op, const DLTensor* q, const AttentionRows& rows, const DLTensor* indices,
                           const DLTensor* topk_length, const DLTensor* sink, float scale, bool bf16,
                           const DLTensor* out, const DLTensor* lse, void* stream);
void cuda_index_scores(const DLTensor* q, const DLTensor* weights, const DLTensor* keys,
                       const DLTensor* token_position, int32_t compress_ratio, bool bf16, const DLTensor* scores,
                       void* stream);
void cuda_topk(const DLTensor* scores, const DLTensor* token_position, int32_t compress_ratio, const DLTensor* picks,
               void* stream);

}  // namespace dsv4::capi
