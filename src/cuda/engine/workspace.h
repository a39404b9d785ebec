// The CUDA engine's device memory besides weights and caches: every buffer a layer writes in a
// step, carved from one allocation made when the engine is created and sized for the largest step
// (max_tokens_per_step tokens, the longest compressed caches max_context allows). Nothing is
// allocated afterwards, so a step's layers can be captured into a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/engine/device_caches.h"
#include "cuda/engine/step_metadata.h"
#include "dsv4/cuda/runtime.h"
#include "dsv4/engine.h"
#include "model/layer_recipe.h"

namespace dsv4::cuda {

// Room for one layer's attended pages staged to bf16 (EngineOptions::attention_stage_bytes; the
// step metadata says which layers stage): the window's staged pages, then the kv source's, each
// cache with the block table of its staged pages by step sequence (launch_staged_pages).
struct AttentionStage {
  struct Table {
    DeviceBuffer source_pages;  // [most staged pages] i32: the pool page of each staged page
    DeviceBuffer table;         // [most step sequences, widest table] i32
    DeviceBuffer first;         // [most step sequences] i32
  };
  DeviceBuffer pages;  // [staging budget] u8 (attention_stage_bytes, at most what one layer stages)
  Table window, compressed;

  size_t device_bytes() const;
};

// Sized for the pools `metadata` may stage and its staging budget; empty when it stages none.
AttentionStage make_attention_stage(const DeviceCaches& caches, const StepMetadata& metadata, int64_t max_tokens);

// Row buffers that Precision::fp32 keeps in f32 are sized for f32.
struct Workspace {
  DeviceBuffer memory;
  DType rows = DType::bf16;         // dtype of the intermediate rows (f32 in Precision::fp32)
  float* staged_in = nullptr;       // [T, hidden] f32: host hidden_in
  float* staged_out = nullptr;      // [T, hidden] f32: host attn_out
  void* x = nullptr;                // [T, hidden] rows (the layer input, rounded to bf16 unless fp32)
  void* qr = nullptr;               // [T, q_lora] rows
  void* q = nullptr;                // [T, H, D] rows
  void* kv = nullptr;               // [T, D] rows
  void* o = nullptr;                // [T, H, D] rows
  void* y = nullptr;                // [T, G, R] rows
  void* out = nullptr;              // [T, hidden] rows
  float* compressor_rows = nullptr; // [T, max row width] f32
  void* latent = nullptr;           // [T, D] rows
  void* index_latent = nullptr;     // [T, index_dim] rows (V4.0 CSA)
  void* keys = nullptr;             // [T, index_dim] rows
  void* index_q = nullptr;          // [T, index_heads, index_dim] rows
  void* index_w_raw = nullptr;      // [T, index_heads] rows
  float* index_w = nullptr;         // [T, index_heads] f32
  float* scores = nullptr;          // [score_floats] f32
  float* block_scores = nullptr;    // [score_floats] f32
  int64_t score_floats = 0;
  int32_t* candidates = nullptr;    // [T, candidate_topk_blocks] i32
  std::vector<int32_t*> picks;      // per layer: [T, index_topk] i32 for index sources
  int32_t* entry_picks = nullptr;   // [T, max HCA entries] i32
  int64_t entry_picks_capacity = 0; // entries per token
  // DSpark draft layers (make_workspace's draft_window given):
  void* main_hidden = nullptr;      // [T, hidden · targets] rows: run_draft_context's input
  void* main_x = nullptr;           // [T, hidden] rows: main_norm(main_proj(main_hidden)), every stage's context
  PagedCache block_keys;            // flat (no block table), T rows in the draft windows' format: a draft
                                    // block's own keys (SPEC §13.1 step 3), slot = block row
  // Scratch of one op at a time (run_linear, run_output_projection, run_sparse_attention's row
  // split): the ops run in order on the engine's stream, so they share it. cuBLASLt's workspace is
  // not part of it: it is the BlasLt's alone.
  DeviceBuffer scratch_memory;
  void* scratch = nullptr;
  DeviceBuffer aux_scratch_memory;  // the aux lane's (LayerPipelineInputs::aux_stream), as large
  void* aux_scratch = nullptr;
  AttentionStage attention_stage;

  size_t device_bytes() const {
    return memory.bytes() + scratch_memory.bytes() + aux_scratch_memory.bytes() + attention_stage.device_bytes();
  }
};

// Carves every buffer but the scratch (its size depends on the GEMMs: LayerPipeline::scratch_bytes).
// draft_window: when the engine runs DSpark draft layers, one of their window pools (its geometry
// and tensor scale give the block keys' format); else nullptr.
Workspace make_workspace(const ModelConfig& config, const std::vector<LayerRecipe>& recipes,
                         const EngineOptions& options, const PagedCache* draft_window);

}  // namespace dsv4::cuda
