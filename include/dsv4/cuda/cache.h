// Reading rows back out of a paged cache on the GPU: kv_format.h's decode_rows for device pages
// (inspection, tests, the Python package's kv_decode), and whole pages decoded into bf16 pages
// (run_cache_stage). Rows are written by run_cache_insert (qkv.h).
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

// Whole pages of a quantized 512-dim cache decoded into bf16 pages, the codec's exact values:
// what a prefill chunk's attention can read instead of decoding the same rows once per token
// (vLLM gathers a prefill's rows to bf16 the same way). Staged page i receives source page
// pages[i] (a negative id, or one outside the source's pages, gives a page of zeros); the staged
// cache is read through a block table of staged page ids (the source's own when pages[i] = i).
struct CacheStageParams {
  PagedCache source;  // pages [num_pages, page_stride] u8: v41_fp8, v41_fp4, fp8_ds_mla or bf16, dims 512,
                      // 16-byte aligned rows (its block table is not read)
  TensorView pages;   // [n] i32: the source page of each staged page
  PagedCache staged;  // pages [>= n, page_stride] u8: bf16, dims 512, the source's rows_per_page
};

void validate_cache_stage(const CacheStageParams& p);
void run_cache_stage(const CacheStageParams& p, cudaStream_t stream);
// The bf16 page run_cache_stage writes for a page of `source`.
PageGeometry staged_page_geometry(const PageGeometry& source);

}  // namespace dsv4::cuda
