// Reading rows back out of a paged cache on the GPU: kv_format.h's decode_rows for device pages
// (inspection, tests, the Python package's kv_decode). Rows are written by run_cache_insert (qkv.h).
#pragma once

#include "dsv4/cuda/runtime.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda {

// out[i] = the exact value of every channel of the row at slots[i] (code × scale, as decode_rows);
// a negative slot, or one whose page lies outside `pages`, gives a row of zeros.
struct CacheDecodeParams {
  PagedCache cache;   // any row format; rows addressed by slot (its block table is not read)
  TensorView slots;   // [rows] i64
  TensorView out;     // [rows, cache.geometry.row.dims] f32
};

void validate_cache_decode(const CacheDecodeParams& p);
void run_cache_decode(const CacheDecodeParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
