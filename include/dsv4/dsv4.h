/* The C API of dsv4: what the Python package and any other language binding use.
 *
 * Conventions (docs/python.md, "The C API"):
 *  - Every function returns a dsv4_status. On failure, dsv4_last_error() returns the message of
 *    the calling thread's last failed call ("dsv4: <operation>: <argument> ..."); it stays valid
 *    until that thread's next failing call. Outputs are written only on success.
 *  - Config, weights and engine are opaque handles made by *_create / *_load functions and freed
 *    by the matching *_destroy. A handle that was never made, was destroyed or is of another kind
 *    gives DSV4_ERROR_BAD_HANDLE (the library keeps a registry; it never dereferences such a
 *    pointer). An engine keeps its config and weights alive: they may be destroyed right after
 *    dsv4_engine_create.
 *  - Tensors are DLPack DLTensors (dlpack/dlpack.h, DLPack >= 0.6), borrowed for the call only.
 *    Strides may be NULL (compact row-major); the operations need compact row-major tensors.
 *  - The CUDA engine queues all its work on the stream given in dsv4_engine_options.cuda_stream
 *    (a cudaStream_t) and never synchronizes the device; order work after that stream before
 *    reading outputs.
 *  - Handles are not thread-safe: one thread at a time drives an engine.
 */
#ifndef DSV4_DSV4_H_
#define DSV4_DSV4_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_C_API_VERSION 1

typedef enum dsv4_status {
  DSV4_OK = 0,
  DSV4_ERROR_INVALID_ARGUMENT = 1, /* a value out of range, an unknown name, a protocol violation */
  DSV4_ERROR_BAD_HANDLE = 2,       /* NULL, destroyed, or a handle of another kind */
  DSV4_ERROR_BAD_SHAPE = 3,        /* a tensor's rank or sizes do not match the operation */
  DSV4_ERROR_BAD_DTYPE = 4,        /* a tensor's element type does not match the operation */
  DSV4_ERROR_BAD_DEVICE = 5,       /* a tensor on another device than the operation runs on */
  DSV4_ERROR_BAD_LAYOUT = 6,       /* a tensor that is not compact row-major */
  DSV4_ERROR_POOL_EXHAUSTED = 7,   /* a cache pool has too few free pages, or max_sequences sequences
                                      are live: nothing changed; release sequences and retry */
  DSV4_ERROR_IO = 8,               /* a file could not be read, written or parsed */
  DSV4_ERROR_UNSUPPORTED = 9,      /* e.g. the CUDA backend was not built */
  DSV4_ERROR_INTERNAL = 10,        /* anything else (a bug: please report the message) */
} dsv4_status;

/* "DSV4_OK", "DSV4_ERROR_BAD_SHAPE", ...; "DSV4_ERROR_UNKNOWN" for other values. */
const char* dsv4_status_name(dsv4_status status);
/* The calling thread's last error message ("" when none). */
const char* dsv4_last_error(void);
/* "0.1.0" */
const char* dsv4_version(void);
/* 1 when the library was built with the CUDA backend. */
int dsv4_has_cuda(void);

/* ------------------------------------------------------------------------------------------ */
/* Config */

typedef struct dsv4_config dsv4_config;

/* A preset ("v4.1-flash", "v4-flash", "v4-pro", "tiny-v4.1", "tiny-v4"). */
dsv4_status dsv4_config_from_preset(const char* name, dsv4_config** out);
/* Any of the config.json forms docs/config.md lists. */
dsv4_status dsv4_config_from_file(const char* path, dsv4_config** out);
dsv4_status dsv4_config_from_json(const char* json_text, dsv4_config** out);
dsv4_status dsv4_config_destroy(dsv4_config* config);
/* Preset names separated by '\n' into buf (capacity bytes, NUL-terminated); *needed (optional)
 * gets the bytes needed including the NUL. DSV4_ERROR_INVALID_ARGUMENT when capacity is too small. */
dsv4_status dsv4_preset_names(char* buf, size_t capacity, size_t* needed);
/* The config's name ("tiny-v4.1" or the file), same buffer convention. */
dsv4_status dsv4_config_name(const dsv4_config* config, char* buf, size_t capacity, size_t* needed);

/* An integer field by name: "hidden_size", "num_layers", "num_mtp_layers", "total_layers",
 * "num_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
 * "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer",
 * "candidate_topk_blocks", "candidate_block_size", "family" (0: V4.0, 1: V4.1),
 * "tensor_parallel_size", "vision_max_n_token" (0: no image spans), "dspark_block_size",
 * "num_dspark_targets" (0: the MTP layers are no DSpark draft layers), "indexer_qat" (0 / 1). */
dsv4_status dsv4_config_get_int(const dsv4_config* config, const char* field, int64_t* value);

/* One layer's resolved role (SPEC §1.3). kind: 0 sliding, 1 compressed (V4.1), 2 csa, 3 hca. */
typedef struct dsv4_layer_plan {
  int32_t layer;
  int32_t kind;
  int32_t compress_ratio;
  int32_t is_mtp;
  int32_t uses_compress_rope;
  int32_t kv_source;    /* -1: none */
  int32_t index_source; /* -1: none */
  int32_t owns_compressor;
  int32_t owns_index_keys;
  int32_t owns_indexer;
  int32_t is_candidate_source;
  int32_t uses_candidates;
} dsv4_layer_plan;
dsv4_status dsv4_config_layer_plan(const dsv4_config* config, int32_t layer, dsv4_layer_plan* plan);

/* KV bytes a sequence of `context` tokens holds in all caches with the kv_format set `kv_format`
 * (NULL or "": the defaults of `precision`, "reference" or "fp32"), pages included. */
dsv4_status dsv4_config_kv_bytes(const dsv4_config* config, const char* kv_format, const char* precision,
                                 int64_t context, int64_t* bytes);

/* ------------------------------------------------------------------------------------------ */
/* Weights */

typedef struct dsv4_weights dsv4_weights;

/* A .safetensors file, a sharded checkpoint's index JSON or a directory (docs/weights.md). */
dsv4_status dsv4_weights_load(const dsv4_config* config, const char* path, dsv4_weights** out);
/* Deterministic random weights (fp8: e4m3 projections with block scales where the config has a
 * weight quantization). */
dsv4_status dsv4_weights_random(const dsv4_config* config, uint64_t seed, int fp8, dsv4_weights** out);
dsv4_status dsv4_weights_save(const dsv4_weights* weights, const char* path);
dsv4_status dsv4_weights_destroy(dsv4_weights* weights);

/* ------------------------------------------------------------------------------------------ */
/* Engine (include/dsv4/engine.h) */

typedef struct dsv4_engine dsv4_engine;

typedef struct dsv4_engine_options {
  const char* backend;       /* "cpu" or "cuda" */
  const char* precision;     /* "reference" or "fp32" */
  const char* cache_storage; /* "paged" or "float_rows" (cpu only) */
  const char* kv_format;     /* a kv_format set name, or "" for the precision's defaults */
  int64_t max_sequences;
  int64_t max_tokens_per_step;
  int64_t max_context;
  int32_t num_threads;       /* cpu: 0 = all cores */
  void* cuda_stream;         /* cuda: the caller's cudaStream_t; NULL: the engine makes its own */
  int64_t max_rollback;      /* speculative decoding: the most tokens one rollback takes back (0: none) */
  int64_t attention_stage_bytes; /* cuda on Hopper: memory for a prefill step's pages staged to bf16 (0: never) */
} dsv4_engine_options;

/* The defaults of dsv4::EngineOptions. */
void dsv4_engine_options_init(dsv4_engine_options* options);

dsv4_status dsv4_engine_create(const dsv4_config* config, const dsv4_weights* weights,
                               const dsv4_engine_options* options, dsv4_engine** out);
dsv4_status dsv4_engine_destroy(dsv4_engine* engine);

/* DSV4_ERROR_POOL_EXHAUSTED when max_sequences sequences are live (add and fork). */
dsv4_status dsv4_engine_add_sequence(dsv4_engine* engine, int64_t* sequence);
dsv4_status dsv4_engine_fork_sequence(dsv4_engine* engine, int64_t parent, int64_t* child);
dsv4_status dsv4_engine_release_sequence(dsv4_engine* engine, int64_t sequence);
dsv4_status dsv4_engine_sequence_length(const dsv4_engine* engine, int64_t sequence, int64_t* length);
/* Takes back the sequence's tokens from position new_length on (the drafts of a verify step that
 * were not accepted; dsv4::Engine::rollback_sequence): new_length in [longest - max_rollback,
 * length], between steps. */
dsv4_status dsv4_engine_rollback_sequence(dsv4_engine* engine, int64_t sequence, int64_t new_length);
dsv4_status dsv4_engine_sequence_cache_bytes(const dsv4_engine* engine, int64_t sequence, int64_t* bytes);

/* Starts a step: sequences[i] gets num_tokens[i] tokens. DSV4_ERROR_POOL_EXHAUSTED when a cache
 * pool cannot hold them: then nothing changed (release or shorten and try again). */
dsv4_status dsv4_engine_begin_step(dsv4_engine* engine, const int64_t* sequences, const int64_t* num_tokens,
                                   int64_t count);
/* The same with image spans (SPEC §14, docs/reference.md "Image spans"): entry i carries
 * image_span_counts[i] spans, taken in entry order from image_spans, [sum of the counts, 2] int64:
 * the first and last position (absolute, inclusive) of each span. image_span_counts NULL: none. */
dsv4_status dsv4_engine_begin_step_with_image_spans(dsv4_engine* engine, const int64_t* sequences,
                                                   const int64_t* num_tokens, int64_t count,
                                                   const int64_t* image_span_counts, const int64_t* image_spans);
/* hidden_in, attn_out: [step_tokens, hidden_size] float32 on the engine's device (they may be the
 * same memory). */
dsv4_status dsv4_engine_run_layer(dsv4_engine* engine, int32_t layer, const DLTensor* hidden_in,
                                  const DLTensor* attn_out);
/* The picks an index-source layer published in this step: *rows x *cols int32 (rows = step tokens,
 * cols = index_topk; 0 x 0 before the layer ran). */
dsv4_status dsv4_engine_layer_picks_shape(const dsv4_engine* engine, int32_t layer, int64_t* rows, int64_t* cols);
/* Copies them into picks: [rows, cols] int32 on the CPU. */
dsv4_status dsv4_engine_layer_picks(const dsv4_engine* engine, int32_t layer, const DLTensor* picks);
dsv4_status dsv4_engine_end_step(dsv4_engine* engine);

typedef struct dsv4_engine_memory {
  int64_t weights;
  int64_t caches;
  int64_t workspace;
} dsv4_engine_memory;
dsv4_status dsv4_engine_memory_usage(const dsv4_engine* engine, dsv4_engine_memory* memory);
/* The stream the engine queues on (NULL for the cpu backend). */
dsv4_status dsv4_engine_cuda_stream(const dsv4_engine* engine, void** stream);
/* The engine's config (a new handle the caller destroys). */
dsv4_status dsv4_engine_config(const dsv4_engine* engine, dsv4_config** out);

/* ------------------------------------------------------------------------------------------ */
/* Operations on tensors (docs/python.md lists shapes). Each runs where its tensors are: all on the
 * CPU (the reference), or all on one CUDA device (the CUDA ops of include/dsv4/cuda), queued on
 * `cuda_stream` (a cudaStream_t; NULL: the legacy default stream, ignored on the CPU) without
 * allocating or synchronizing, so that the calls can be captured in a CUDA graph. Tensors are
 * compact row-major. On the GPU, slots and indices are not checked against the pages (that would
 * need a synchronization): a row out of range is skipped (attention, scores, encode) or reads as
 * zeros (decode). */

/* Page geometry of a KV row format ("bf16", "fp8_per_tensor", "v41_fp8", "v41_fp4", "fp8_ds_mla",
 * "index_mxfp4", "index_fp8", "f32") with `dims` channels, `rows_per_page` rows a page (0: the
 * format's default), placement "segregated" or "interleaved" (NULL: segregated). */
typedef struct dsv4_page_geometry {
  int64_t dims;
  int64_t rows_per_page;
  int64_t page_stride; /* bytes per page */
  int64_t row_bytes;   /* data + scale bytes per row */
  int64_t data_bytes;
  int64_t scale_bytes;
} dsv4_page_geometry;
dsv4_status dsv4_kv_page_geometry(const char* format, int64_t dims, int64_t rows_per_page, const char* placement,
                                  dsv4_page_geometry* geometry);

/* Encodes x [n, dims] f32 into pages [num_pages, page_stride] u8 at slots [n] i64
 * (slot = page * rows_per_page + row; < 0: skipped). fp8_scale_floor: "amax" (default, NULL) or
 * "ratio" (vLLM's V4.1 insert and FlashMLA's quantizers). tensor_scale: fp8_per_tensor only. */
dsv4_status dsv4_kv_encode(const char* format, int64_t rows_per_page, const char* placement, const DLTensor* x,
                           const DLTensor* slots, const DLTensor* pages, float tensor_scale,
                           const char* fp8_scale_floor, void* cuda_stream);
/* Decodes out [n, dims] f32 from pages at slots [n] i64 (slot < 0: a row of zeros). */
dsv4_status dsv4_kv_decode(const char* format, int64_t rows_per_page, const char* placement, const DLTensor* pages,
                           const DLTensor* slots, const DLTensor* out, float tensor_scale, void* cuda_stream);

/* Sparse MQA attention with a per-head sink (SPEC §5.2): for every query token t and head h,
 *   out[t,h] = Σ_i e_i kv[idx[t,i]] / (Σ_i e_i + exp(sink[h] − m)),  e_i = exp(scale q[t,h]·kv[idx] − m),
 * over the indices of t that are >= 0 and among the first topk_length[t] of its list.
 * q [T, H, D] and kv [N, D]: bf16, or f32 on the CPU (the GPU kernels take bf16, D = 512);
 * indices [T, K] i32, topk_length [T] i32 or NULL (all K), sink [H] f32 or NULL (no sink),
 * out [T, H, D] f32; lse [T, H] f32 or NULL: log Σ_i exp(scale q·kv_i) without the sink (−inf when
 * no index is valid). bf16: the reference kernel's roundings (SPEC §5.2: exp-scores rounded to
 * bf16 before P·V); the GPU kernels need bf16 = 1 for their tensor-core path and run fp32 SIMT
 * otherwise. */
dsv4_status dsv4_sparse_attention(const DLTensor* q, const DLTensor* kv, const DLTensor* indices,
                                  const DLTensor* topk_length, const DLTensor* sink, float scale, int bf16,
                                  const DLTensor* out, const DLTensor* lse, void* cuda_stream);

/* The same over the rows of paged caches, read in their byte format: pages [num_pages,
 * page_stride] u8 of `format` (attention formats: bf16, fp8_per_tensor, v41_fp8, v41_fp4,
 * fp8_ds_mla; D = 512), rows_per_page and placement as for dsv4_kv_page_geometry; indices [T, K]
 * i32 are flat slots page * rows_per_page + row (FlashMLA's indices), −1 invalid. */
dsv4_status dsv4_paged_sparse_attention(const DLTensor* q, const char* format, int64_t rows_per_page,
                                        const char* placement, const DLTensor* pages, float tensor_scale,
                                        const DLTensor* indices, const DLTensor* topk_length, const DLTensor* sink,
                                        float scale, int bf16, const DLTensor* out, const DLTensor* lse,
                                        void* cuda_stream);

/* Index scores (SPEC §4): q [T, H, D] bf16 (or f32 on the CPU), weights [T, H] f32, keys [N, D]
 * bf16 (or f32 on the CPU), token_position [T] i32, scores [T, N] f32:
 *   scores[t, j] = Σ_h weights[t,h] · relu(q[t,h]·keys[j]) for j < n_visible(t), −inf beyond,
 * n_visible(t) = (token_position[t] + 1) / compress_ratio (compress_ratio >= 1; 0 for a negative
 * position). bf16: the reference's bf16 rounding sequence (SPEC §4.3). */
dsv4_status dsv4_index_scores(const DLTensor* q, const DLTensor* weights, const DLTensor* keys,
                              const DLTensor* token_position, int32_t compress_ratio, int bf16,
                              const DLTensor* scores, void* cuda_stream);

/* Top-k (SPEC §4.6): scores [T, N] f32, picks [T, k] i32: the k best entries j < n_visible(t)
 * (as for dsv4_index_scores; token_position NULL: the whole row) whose score is not −inf,
 * ascending, padded with −1; NaN ranks below every number, ties: lower index first. */
dsv4_status dsv4_topk(const DLTensor* scores, const DLTensor* token_position, int32_t compress_ratio,
                      const DLTensor* picks, void* cuda_stream);

/* Compressor pooling (SPEC §3), CPU only: kv, score [E, S, D] f32, bias [S, D] or NULL, pooled
 * [E, D]: pooled[e,c] = Σ_s softmax_s(score[e,s,c] + bias[s,c]) · kv[e,s,c]. */
dsv4_status dsv4_compressor_pool(const DLTensor* kv, const DLTensor* score, const DLTensor* bias,
                                 const DLTensor* pooled);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* DSV4_DSV4_H_ */
