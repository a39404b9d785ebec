#include "cuda/engine/layer_pipeline.h"

#include <algorithm>

#include "cuda/engine/glue.h"
#include "dsv4/cuda/attention.h"
#include "dsv4/cuda/cache.h"
#include "dsv4/cuda/compressor.h"
#include "dsv4/cuda/indexer.h"
#include "dsv4/cuda/projection.h"
#include "dsv4/parallel.h"

namespace dsv4::cuda {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows [first, first + count) of a contiguous view.
TensorView rows_of(const TensorView& v, int64_t first, int64_t count) {
  TensorView r = v;
  int64_t row_elements = 1;
  for (int d = 1; d < v.rank; ++d) row_elements *= v.shape[d];
  r.data = static_cast<std::byte*>(v.data) + first * row_elements * static_cast<int64_t>(dtype_size(v.dtype));
  r.shape[0] = count;
  return r;
}

// A projection without block scales (the fused compressor projections).
LinearParams linear_params(const TensorView& x, const TensorView& weight, const TensorView& y, const BlasLt* blas) {
  LinearParams p;
  p.x = x;
  p.weight = weight;
  p.y = y;
  p.blas = blas;
  return p;
}

// Projection `w` as the recipe stores it (e4m3 with its scales, act_quant, fp32 product).
LinearParams linear_params(const TensorView& x, const DeviceWeight& w, const TensorView& y, const BlasLt* blas) {
  LinearParams p = linear_params(x, w.view(), y, blas);
  p.weight_scale = w.scale_view();
  if (w.dtype == DType::e4m3) {
    p.block_out = w.block_out;
    p.block_in = w.block_in;
  }
  p.activation_block = w.activation_block;
  p.f32_product = w.f32_product;
  return p;
}

}  // namespace

LayerPipeline::LayerPipeline(const LayerPipelineInputs& in) : in_(in) {
  if (!in_.aux_stream) return;
  DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
}

LayerPipeline::~LayerPipeline() {
  if (fork_) cudaEventDestroy(fork_);
  if (join_) cudaEventDestroy(join_);
}

LayerPipeline::Lane LayerPipeline::aux_lane() const {
  return in_.aux_stream ? Lane{in_.aux_stream, in_.workspace->aux_scratch, in_.aux_blas} : main_lane();
}

TensorView LayerPipeline::view(void* data, DType dtype, const std::vector<int64_t>& shape) const {
  return TensorView::contiguous(data, dtype, shape, Device::cuda, in_.device);
}

TensorView LayerPipeline::rope_table(int layer) const {
  const DeviceBuffer& table = recipe(layer).plan.uses_compress_rope ? *in_.compress_rope : *in_.main_rope;
  return table.view(DType::f32, {in_.max_context, config().rope_head_dim});
}

void LayerPipeline::project(const TensorView& x, const DeviceWeight& w, const TensorView& y, const Lane& lane) const {
  run_linear(linear_params(x, w, y, lane.blas), lane.scratch, lane.stream);
}

CacheInsertParams LayerPipeline::insert_params(int layer, RowQuantizer quantizer, const TensorView& positions,
                                               const TensorView& slots, const PagedCache& cache) const {
  CacheInsertParams p;
  p.token_position = positions;
  p.rope_table = rope_table(layer);
  p.quant = quantizer;
  p.bf16_rounding = recipe(layer).round_bf16;
  p.slots = slots;
  p.cache = cache;
  return p;
}

OutputProjectionParams LayerPipeline::output_params(int layer, const TensorView& positions, const TensorView& o,
                                                    const TensorView& y) const {
  const int64_t G = config().o_groups, R = config().o_lora_rank, H = config().num_heads, D = config().head_dim;
  OutputProjectionParams p;
  p.o = o;
  p.token_position = positions;
  p.rope_table = rope_table(layer);
  const DeviceWeight& wo_a = weights(layer).get(WeightRole::wo_a);
  p.wo_a = wo_a.view({G, R, H * D / G});
  p.wo_a_scale = wo_a.scale_view();  // the checkpoint's blocks over all G·R rows (LinearParams)
  if (wo_a.dtype == DType::e4m3) {
    p.block_out = wo_a.block_out;
    p.block_in = wo_a.block_in;
  }
  p.f32_product = wo_a.f32_product;
  p.y = y;
  p.blas = in_.blas;
  return p;
}

// The projections' workspace grows with the rows within each implementation's range, and
// run_linear switches implementation above kLinearFp8DecodeMaxRows rows: the largest step and
// the largest step fp8_decode takes bound every step.
size_t LayerPipeline::scratch_bytes(int64_t max_tokens) const {
  return std::max(scratch_bytes_at(max_tokens), scratch_bytes_at(std::min(max_tokens, kLinearFp8DecodeMaxRows)));
}

size_t LayerPipeline::scratch_bytes_at(int64_t T) const {
  const Workspace& ws = *in_.workspace;
  const int64_t hidden = config().hidden_size, H = config().num_heads, D = config().head_dim;
  const int64_t dI = config().index_head_dim, nI = config().index_n_heads;
  // The size queries read shapes only; the views point at the workspace.
  void* any = ws.memory.data();
  const auto rows_view = [&](int64_t cols) { return view(any, ws.rows, {T, cols}); };
  size_t scratch = 0;
  for (size_t l = 0; l < in_.recipes->size(); ++l) {
    const LayerRecipe& r = (*in_.recipes)[l];
    if (!(*in_.weights)[l]) continue;
    const DeviceLayerWeights& w = *(*in_.weights)[l];
    const auto measure = [&](const LinearParams& p) { scratch = std::max(scratch, linear_workspace_bytes(p)); };
    const auto measure_role = [&](const TensorView& x, WeightRole role, const TensorView& y) {
      measure(linear_params(x, w.get(role), y, in_.blas));
    };
    measure_role(rows_view(hidden), WeightRole::wq_a, rows_view(config().q_lora_rank));
    measure_role(rows_view(config().q_lora_rank), WeightRole::wq_b, rows_view(H * D));
    measure_role(rows_view(hidden), WeightRole::wkv, rows_view(D));
    measure_role(rows_view(config().o_groups * config().o_lora_rank), WeightRole::wo_b,
                 in_.communicator ? view(any, DType::f32, {T, hidden}) : rows_view(hidden));
    OutputProjectionParams output = output_params(static_cast<int>(l), view(any, DType::i32, {T}),
                                                  view(any, ws.rows, {T, H, D}),
                                                  view(any, ws.rows, {T, config().o_groups, config().o_lora_rank}));
    scratch = std::max(scratch, output_projection_workspace_bytes(output));
    if (r.compressor) {
      measure(linear_params(rows_view(hidden), w.fused(WeightRole::compressor_wkv, WeightRole::compressor_wgate),
                            view(any, DType::f32, {T, r.compressor->row_width()}), in_.blas));
      if (r.index_compressor)
        measure(linear_params(rows_view(hidden),
                              w.fused(WeightRole::indexer_compressor_wkv, WeightRole::indexer_compressor_wgate),
                              view(any, DType::f32, {T, r.index_compressor->row_width()}), in_.blas));
      else if (r.plan.owns_index_keys)
        measure_role(rows_view(D), WeightRole::indexer_wk, rows_view(dI));
    }
    if (r.plan.owns_indexer) {
      measure_role(rows_view(config().q_lora_rank), WeightRole::indexer_wq_b, rows_view(nI * dI));
      measure_role(rows_view(hidden), WeightRole::indexer_weights_proj, rows_view(nI));
    }
    if (r.plan.kind == AttentionKind::dspark) {
      measure_role(rows_view(hidden), WeightRole::wkv, rows_view(D));  // the context rows from main_x
      if (w.has(WeightRole::main_proj))
        measure_role(rows_view(config().dspark_main_width()), WeightRole::main_proj, rows_view(hidden));
    }
  }
  // A token attends its window (up to W + M rows in an image span) plus index_topk picks, on V4.0
  // HCA layers every entry (the workspace's entry_picks_capacity), in a draft block its block's rows.
  const int64_t max_picks = std::max<int64_t>({config().index_topk, ws.entry_picks_capacity,
                                               ws.main_x ? config().dspark_block_size : int64_t{0}});
  const int64_t max_window = config().sliding_window + config().vision_max_n_token;
  return std::max(scratch, sparse_attention_max_workspace_bytes(T, H, max_window + max_picks));
}

LayerPipeline::Activations LayerPipeline::load_input(const char* operation, int layer, const TensorView& hidden_in,
                                                     const TensorView& attn_out, int64_t T) {
  Workspace& ws = *in_.workspace;
  const int64_t hidden = config().hidden_size;
  for (const TensorView* v : {&hidden_in, &attn_out})
    DSV4_CHECK(v->device == Device::cpu || v->device_index == in_.device, "engine: ", operation, ": layer ", layer,
               " activations are on cuda device ", v->device_index, ", the engine runs on device ", in_.device);
  const float* in = hidden_in.device == Device::cpu ? ws.staged_in : hidden_in.ptr<float>();
  if (hidden_in.device == Device::cpu)
    DSV4_CUDA_CHECK(cudaMemcpyAsync(ws.staged_in, hidden_in.data, static_cast<size_t>(T * hidden) * 4,
                                    cudaMemcpyHostToDevice, in_.stream));
  // The reference rounds x to bf16; Precision::fp32 keeps it (its GEMMs are fp32).
  if (ws.rows == DType::f32)
    DSV4_CUDA_CHECK(cudaMemcpyAsync(ws.x, in, static_cast<size_t>(T * hidden) * 4, cudaMemcpyDeviceToDevice, in_.stream));
  else
    launch_f32_to_bf16(in, static_cast<uint16_t*>(ws.x), T * hidden, in_.stream);
  return {view(ws.x, ws.rows, {T, hidden}), attn_out.device == Device::cpu ? ws.staged_out : attn_out.ptr<float>()};
}

// Queries (SPEC §2.2 steps 1-4; V4.0 §12 adds the per-head normalization) into ws.q, q_norm's
// output in ws.qr.
void LayerPipeline::project_queries(int layer, const TensorView& x, const TensorView& positions) {
  Workspace& ws = *in_.workspace;
  const LayerRecipe& r = recipe(layer);
  const DeviceLayerWeights& w = weights(layer);
  const int64_t T = x.shape[0], H = config().num_heads, D = config().head_dim;
  const TensorView qr = view(ws.qr, ws.rows, {T, config().q_lora_rank});
  project(x, w.get(WeightRole::wq_a), qr);
  RmsNormParams q_norm;
  q_norm.x = q_norm.out = qr;
  q_norm.weight = w.get(WeightRole::q_norm).view();
  q_norm.eps = r.eps;
  run_rms_norm(q_norm, in_.stream);
  // The indexer branch needs x and qr only: from here it may run beside the rest (run()).
  if (fork_) DSV4_CUDA_CHECK(cudaEventRecord(fork_, in_.stream));
  project(qr, w.get(WeightRole::wq_b), view(ws.q, ws.rows, {T, H * D}));
  RopeHeadsParams q_rope;
  q_rope.x = q_rope.out = view(ws.q, ws.rows, {T, H, D});
  q_rope.token_position = positions;
  q_rope.rope_table = rope_table(layer);
  q_rope.head_norm = r.q_head_norm;
  q_rope.eps = r.eps;
  run_rope_heads(q_rope, in_.stream);
}

// Window rows of x (steps 5-6: wkv, kv_norm, RoPE at the positions, the row quantizer) into
// `cache` at `slots`.
void LayerPipeline::insert_window_rows(int layer, const TensorView& x, const TensorView& positions,
                                       const TensorView& slots, const PagedCache& cache) {
  const LayerRecipe& r = recipe(layer);
  const DeviceLayerWeights& w = weights(layer);
  const TensorView kv = view(in_.workspace->kv, in_.workspace->rows, {x.shape[0], config().head_dim});
  project(x, w.get(WeightRole::wkv), kv);
  CacheInsertParams window = insert_params(layer, r.window_rows, positions, slots, cache);
  window.rows = kv;
  window.norm_weight = w.get(WeightRole::kv_norm).view();
  window.eps = r.eps;
  run_cache_insert(window, in_.stream);
}

// Output projection (SPEC §6) of the attention output in ws.o into `out` [T, hidden] f32, then
// to attn_out when that is host memory.
void LayerPipeline::project_output(int layer, const TensorView& positions, float* out, const TensorView& attn_out) {
  Workspace& ws = *in_.workspace;
  const cudaStream_t stream = in_.stream;
  const DeviceLayerWeights& w = weights(layer);
  const int64_t T = positions.shape[0], hidden = config().hidden_size, H = config().num_heads, D = config().head_dim;
  const int64_t G = config().o_groups, R = config().o_lora_rank;
  const auto rows = [&](void* data, std::vector<int64_t> shape) { return view(data, ws.rows, shape); };
  const TensorView y = rows(ws.y, {T, G, R});
  run_output_projection(output_params(layer, positions, rows(ws.o, {T, H, D}), y), ws.scratch, stream);
  // The reference's output is bf16: widen it into attn_out (fp32 precision writes f32 directly).
  // A tensor-parallel rank's output is a partial sum over its heads: f32 until the ranks' partial
  // sums are added up, then rounded as the whole output is.
  const TensorView y_flat = rows(ws.y, {T, G * R});
  const TensorView out_f32 = view(out, DType::f32, {T, hidden});
  if (in_.communicator) {
    project(y_flat, w.get(WeightRole::wo_b), out_f32);
    in_.communicator->all_reduce_sum(out, T * hidden, stream);
    if (ws.rows != DType::f32) launch_scale_to_f32(out, DType::f32, 1.0f, true, out, T * hidden, stream);
  } else if (ws.rows == DType::f32) {
    project(y_flat, w.get(WeightRole::wo_b), out_f32);
  } else {
    project(y_flat, w.get(WeightRole::wo_b), rows(ws.out, {T, hidden}));
    launch_scale_to_f32(ws.out, ws.rows, 1.0f, false, out, T * hidden, stream);
  }
  if (attn_out.device == Device::cpu) {
    DSV4_CUDA_CHECK(
        cudaMemcpyAsync(attn_out.data, out, static_cast<size_t>(T * hidden) * 4, cudaMemcpyDeviceToHost, stream));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
}

void LayerPipeline::run(int layer, const TensorView& hidden_in, const TensorView& attn_out) {
  const LayerRecipe& r = recipe(layer);
  const LayerStep& ls = in_.step->layer(layer);
  const TensorView& positions = in_.step->token_position();
  const Activations a = load_input("run_layer", layer, hidden_in, attn_out, in_.step->tokens());
  const bool branch = r.plan.owns_compressor || r.plan.owns_indexer;
  // The compressor and the indexer (SPEC §3, §4) read x and q_norm's output and write buffers of
  // their own: on the aux lane they overlap q's projection and RoPE and the window insert (as
  // vLLM's aux stream does), joining before the attention reads their entries and picks.
  project_queries(layer, a.x, positions);
  const Lane lane = aux_lane();
  if (branch && fork_) {
    DSV4_CUDA_CHECK(cudaStreamWaitEvent(lane.stream, fork_, 0));
    if (r.plan.owns_compressor) compress(layer, lane);
    if (r.plan.owns_indexer) index(layer, lane);
    DSV4_CUDA_CHECK(cudaEventRecord(join_, lane.stream));
  }
  // The step's window rows, stored before the attention reads them.
  insert_window_rows(layer, a.x, positions, ls.window_slots, ls.window);
  if (branch && fork_) {
    DSV4_CUDA_CHECK(cudaStreamWaitEvent(in_.stream, join_, 0));
  } else {
    if (r.plan.owns_compressor) compress(layer, lane);
    if (r.plan.owns_indexer) index(layer, lane);
  }
  attend(layer);
  project_output(layer, positions, a.out, attn_out);
}

void LayerPipeline::run_draft_context(const TensorView& main_hidden) {
  Workspace& ws = *in_.workspace;
  const cudaStream_t stream = in_.stream;
  const int first = config().num_layers;
  const int64_t T = in_.step->tokens(), width = config().dspark_main_width(), hidden = config().hidden_size;
  DSV4_CHECK(main_hidden.device == Device::cpu || main_hidden.device_index == in_.device,
             "engine: run_draft_context: main_hidden is on cuda device ", main_hidden.device_index,
             ", the engine runs on device ", in_.device);
  // main_hidden to bf16 (the reference rounds it first; Precision::fp32 keeps it f32); host rows
  // in bf16 through the staging buffer, a part of them at a time.
  const size_t main_bytes = static_cast<size_t>(T * width) * 4;
  uint16_t* main_bf16 = static_cast<uint16_t*>(ws.main_hidden);
  if (ws.rows == DType::f32) {
    DSV4_CUDA_CHECK(cudaMemcpyAsync(ws.main_hidden, main_hidden.data, main_bytes,
                                    main_hidden.device == Device::cpu ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToDevice,
                                    stream));
  } else if (main_hidden.device == Device::cpu) {
    const int64_t chunk = in_.max_tokens * hidden;  // the floats ws.staged_in holds
    const float* host = static_cast<const float*>(main_hidden.data);
    for (int64_t done = 0; done < T * width; done += chunk) {
      const int64_t n = std::min(chunk, T * width - done);
      DSV4_CUDA_CHECK(cudaMemcpyAsync(ws.staged_in, host + done, static_cast<size_t>(n) * 4,
                                      cudaMemcpyHostToDevice, stream));
      launch_f32_to_bf16(ws.staged_in, main_bf16 + done, n, stream);
    }
  } else {
    launch_f32_to_bf16(main_hidden.ptr<float>(), main_bf16, T * width, stream);
  }
  // main_x = main_norm(main_proj(main_hidden)), stage 0's weights (SPEC §13.1 step 1).
  const TensorView main_x = view(ws.main_x, ws.rows, {T, hidden});
  project(view(ws.main_hidden, ws.rows, {T, width}), weights(first).get(WeightRole::main_proj), main_x);
  RmsNormParams norm;
  norm.x = norm.out = main_x;
  norm.weight = weights(first).get(WeightRole::main_norm).view();
  norm.eps = recipe(first).eps;
  run_rms_norm(norm, stream);
  // Every stage's window rows of the step's tokens, from the same main_x.
  for (int l = first; l < static_cast<int>(in_.recipes->size()); ++l) {
    const LayerStep& ls = in_.step->layer(l);
    insert_window_rows(l, main_x, in_.step->token_position(), ls.window_slots, ls.window);
  }
}

void LayerPipeline::run_draft_block(int layer, const TensorView& hidden_in, const TensorView& attn_out) {
  Workspace& ws = *in_.workspace;
  const DraftBlockMetadata& block = *in_.draft_block;
  const LayerRecipe& r = recipe(layer);
  const int64_t T = block.tokens(), H = config().num_heads, D = config().head_dim;
  const TensorView& positions = block.token_position();
  const Activations a = load_input("run_draft_block", layer, hidden_in, attn_out, T);
  project_queries(layer, a.x, positions);
  // The block's own keys, rounded as the window format stores rows, into the flat block-key
  // cache (never into the window, SPEC §13.1 step 5).
  insert_window_rows(layer, a.x, positions, block.block_slot(), ws.block_keys);
  // The committed window rows up to p0, then every row of the token's block (itself and the later
  // ones: non-causal), as picks of the block-key cache.
  SparseAttentionParams attention;
  attention.q = view(ws.q, ws.rows, {T, H, D});
  attention.token_sequence = block.token_sequence();
  attention.token_position = positions;
  attention.window_last = block.window_last();
  attention.window = block.window();
  attention.window_size = config().sliding_window;
  attention.compressed = ws.block_keys;
  attention.picks = block.block_rows();
  attention.sink = weights(layer).get(WeightRole::attn_sink).view();
  attention.scale = r.softmax_scale;
  attention.out = view(ws.o, ws.rows, {T, H, D});
  attention.bf16_rounding = r.round_bf16;
  run_sparse_attention(attention, ws.scratch, in_.stream);
  project_output(layer, positions, a.out, attn_out);
}

// Compressed entries and index keys of a kv-source layer for the groups closing in this step
// (SPEC §3, §4.1; V4.0 §12), in the pipeline compressor.h describes.
void LayerPipeline::compress(int layer, const Lane& lane) {
  Workspace& ws = *in_.workspace;
  const cudaStream_t stream = lane.stream;
  const LayerRecipe& r = recipe(layer);
  const DeviceLayerWeights& w = weights(layer);
  const LayerStep& ls = in_.step->layer(layer);
  const int64_t T = in_.step->tokens(), D = config().head_dim, dI = config().index_head_dim;
  const TensorView x = view(ws.x, ws.rows, {T, config().hidden_size});

  // Projects the step's tokens and pools every group that closes in it into `latent`.
  const auto pool = [&](const CompressorGeometry& c, int ring, WeightRole wkv, WeightRole wgate, WeightRole norm,
                        WeightRole bias, void* latent) {
    const TensorView projected = view(ws.compressor_rows, DType::f32, {T, c.row_width()});
    run_linear(linear_params(x, w.fused(wkv, wgate), projected, lane.blas), lane.scratch, stream);
    CompressorPoolParams p;
    p.rows = projected;
    p.token_position = in_.step->token_position();
    p.state_slot = in_.step->state_slot();
    p.state = in_.caches->compressor_ring(layer, ring, c.ring_rows(), c.row_width());
    if (w.has(bias)) p.position_bias = w.get(bias).view();
    p.norm_weight = w.get(norm).view();
    p.eps = r.eps;
    p.ratio = static_cast<int>(c.ratio);
    p.overlap = c.overlap;
    p.gated = c.gated;
    p.latent = view(latent, ws.rows, {T, c.dim});
    run_compressor_pool(p, stream);
  };
  pool(*r.compressor, 0, WeightRole::compressor_wkv, WeightRole::compressor_wgate, WeightRole::compressor_norm,
       WeightRole::compressor_ape, ws.latent);
  const TensorView latent = view(ws.latent, ws.rows, {T, D});
  const int64_t entry_offset = 1 - r.plan.compress_ratio;  // an entry rotates at its group's first position

  // Index keys first: V4.1 derives them from the pre-RoPE latent (SPEC §4.1).
  if (r.plan.owns_index_keys) {
    CacheInsertParams keys =
        insert_params(layer, r.index_rows, in_.step->token_position(), ls.index_key_slots, ls.index_keys);
    keys.position_offset = entry_offset;
    keys.hadamard = r.index_hadamard;
    if (r.index_compressor) {
      pool(*r.index_compressor, 1, WeightRole::indexer_compressor_wkv, WeightRole::indexer_compressor_wgate,
           WeightRole::indexer_compressor_norm, WeightRole::indexer_compressor_ape, ws.index_latent);
      keys.rows = view(ws.index_latent, ws.rows, {T, dI});
    } else {
      keys.rows = view(ws.keys, ws.rows, {T, dI});
      project(latent, w.get(WeightRole::indexer_wk), keys.rows, lane);
      keys.norm_weight = w.get(WeightRole::indexer_k_norm).view();
      keys.eps = r.eps;
    }
    run_cache_insert(keys, stream);
  }
  CacheInsertParams entries =
      insert_params(layer, r.compressed_rows, in_.step->token_position(), ls.compressed_slots, ls.compressed);
  entries.rows = latent;
  entries.position_offset = entry_offset;
  run_cache_insert(entries, stream);
}

// The indexer of an index-source layer: scores over its kv source's keys, candidate blocks, top-k
// picks (SPEC §4), in token chunks that fit the score buffer.
void LayerPipeline::index(int layer, const Lane& lane) {
  Workspace& ws = *in_.workspace;
  const cudaStream_t stream = lane.stream;
  const LayerRecipe& r = recipe(layer);
  const LayerPlan& plan = r.plan;
  const DeviceLayerWeights& w = weights(layer);
  const LayerStep& source = in_.step->layer(plan.kv_source);
  const int64_t T = in_.step->tokens(), nI = config().index_n_heads, dI = config().index_head_dim;
  const int64_t k = config().index_topk;

  // Queries and head weights (SPEC §4.2).
  const TensorView q = view(ws.index_q, ws.rows, {T, nI, dI});
  project(view(ws.qr, ws.rows, {T, config().q_lora_rank}), w.get(WeightRole::indexer_wq_b),
          view(ws.index_q, ws.rows, {T, nI * dI}), lane);
  RopeHeadsParams rope;
  rope.x = rope.out = q;
  rope.token_position = in_.step->token_position();
  rope.rope_table = rope_table(layer);
  rope.hadamard = r.index_hadamard;
  rope.quant = r.index_rows;
  run_rope_heads(rope, stream);
  project(view(ws.x, ws.rows, {T, config().hidden_size}), w.get(WeightRole::indexer_weights_proj),
          view(ws.index_w_raw, ws.rows, {T, nI}), lane);
  launch_scale_to_f32(ws.index_w_raw, ws.rows, r.index_weight_scale, r.round_bf16, ws.index_w, T * nI, stream);
  const TensorView weights = view(ws.index_w, DType::f32, {T, nI});

  const int64_t entries = source.entries, block_size = config().candidate_block_size;
  const int ratio = plan.compress_ratio;
  const TensorView picks = view(ws.picks[static_cast<size_t>(layer)], DType::i32, {T, k});
  const TensorView candidates =
      ws.candidates ? view(ws.candidates, DType::i32, {T, config().candidate_topk_blocks}) : TensorView{};
  const int64_t chunk = std::max<int64_t>(1, ws.score_floats / std::max<int64_t>(entries, 1));
  for (int64_t first = 0; first < T; first += chunk) {
    const int64_t n = std::min(chunk, T - first);
    const TensorView positions = rows_of(in_.step->token_position(), first, n);
    IndexScoresParams scores;
    scores.q = rows_of(q, first, n);
    scores.weights = rows_of(weights, first, n);
    scores.keys = source.index_keys;
    scores.token_sequence = rows_of(in_.step->token_sequence(), first, n);
    scores.token_position = positions;
    scores.compress_ratio = ratio;
    if (plan.uses_candidates) {
      scores.candidates = rows_of(candidates, first, n);
      scores.candidate_block_size = block_size;
    }
    scores.scores = view(ws.scores, DType::f32, {n, entries});
    scores.bf16_rounding = r.round_bf16;
    scores.partial = in_.split_indexer;
    scores.fp4_queries = r.index_rows == RowQuantizer::fp4_ue8m0_32;  // run_rope_heads' QAT above
    run_index_scores(scores, stream);
    // Split indexer: the partial sums over the rank's heads are summed over the ranks, then
    // rounded as the reference rounds the whole sum.
    if (in_.split_indexer) {
      in_.communicator->all_reduce_sum(ws.scores, n * entries, stream);
      if (r.round_bf16) launch_scale_to_f32(ws.scores, DType::f32, 1.0f, true, ws.scores, n * entries, stream);
    }
    TopkParams topk;
    topk.token_position = positions;
    topk.compress_ratio = ratio;
    if (plan.is_candidate_source) {
      // Published over the candidate source's entries; the source itself does not apply them.
      CandidateBlockScoresParams blocks;
      blocks.scores = scores.scores;
      blocks.token_position = positions;
      blocks.compress_ratio = ratio;
      blocks.block_size = block_size;
      blocks.block_scores = view(ws.block_scores, DType::f32, {n, ceil_div(entries, block_size)});
      run_candidate_block_scores(blocks, stream);
      topk.scores = blocks.block_scores;
      topk.group_size = block_size;
      topk.picks = rows_of(candidates, first, n);
      run_topk(topk, stream);
    }
    topk.scores = scores.scores;
    topk.group_size = 1;
    topk.picks = rows_of(picks, first, n);
    run_topk(topk, stream);
  }
}

// Sparse attention over the layer's window and the picked entries of its kv source (SPEC §5).
void LayerPipeline::attend(int layer) {
  Workspace& ws = *in_.workspace;
  const LayerRecipe& r = recipe(layer);
  const LayerPlan& plan = r.plan;
  const int64_t T = in_.step->tokens(), H = config().num_heads, D = config().head_dim;
  SparseAttentionParams a;
  a.q = view(ws.q, ws.rows, {T, H, D});
  a.token_sequence = in_.step->token_sequence();
  a.token_position = in_.step->token_position();
  a.window = in_.step->layer(layer).window;
  a.window_size = config().sliding_window;
  a.window_first = in_.step->window_first();  // image spans widen some tokens' windows
  a.window_last = in_.step->window_last();
  a.max_window_rows = in_.step->max_window_rows();
  a.sink = weights(layer).get(WeightRole::attn_sink).view();
  a.scale = r.softmax_scale;
  a.out = view(ws.o, ws.rows, {T, H, D});
  a.bf16_rounding = r.round_bf16;
  if (plan.kv_source >= 0) {
    const LayerStep& source = in_.step->layer(plan.kv_source);
    a.compressed = source.compressed;
    a.compress_ratio = plan.compress_ratio;
    if (plan.index_source >= 0) {
      a.picks = view(ws.picks[static_cast<size_t>(plan.index_source)], DType::i32, {T, config().index_topk});
    } else {  // V4.0 HCA: every visible entry
      DSV4_CHECK(source.entries <= ws.entry_picks_capacity, "engine: layer ", layer, ": ", source.entries,
                 " compressed entries exceed the ", ws.entry_picks_capacity, " planned at create");
      launch_fill_entry_picks(ws.entry_picks, T, source.entries, in_.stream);
      a.picks = view(ws.entry_picks, DType::i32, {T, source.entries});
    }
  }
  if (in_.step->layer(layer).stages_attention) stage_attended_pages(layer, a);
  run_sparse_attention(a, ws.scratch, in_.stream);
}

void LayerPipeline::stage_attended_pages(int layer, SparseAttentionParams& a) {
  const KvCacheManager& manager = in_.caches->manager();
  const AttentionStage& stage = in_.workspace->attention_stage;
  const int window = manager.pool_index(CacheKind::window, layer);
  const size_t window_bytes = staged_pages_bytes(a.window.geometry, in_.step->staged_pool(window).pages);
  a.window = stage_pool(window, a.window, stage.window, static_cast<std::byte*>(stage.pages.data()));
  const int source = recipe(layer).plan.kv_source;
  if (source >= 0) {
    a.compressed = stage_pool(manager.pool_index(CacheKind::compressed, source), a.compressed, stage.compressed,
                              static_cast<std::byte*>(stage.pages.data()) + window_bytes);
  }
  a.token_sequence = in_.step->step_sequence();
}

PagedCache LayerPipeline::stage_pool(int pool, const PagedCache& source, const AttentionStage::Table& table,
                                     std::byte* pages) {
  const StagedPool& staged_pool = in_.step->staged_pool(pool);
  const DevicePoolTable& mirror = in_.caches->pool_tables()[static_cast<size_t>(pool)];
  const int64_t S = in_.step->sequences();
  launch_staged_pages(mirror, source.pages.shape[0], static_cast<const StagedRun*>(staged_pool.runs.data), S,
                      static_cast<int32_t*>(table.source_pages.data()), static_cast<int32_t*>(table.table.data()),
                      static_cast<int32_t*>(table.first.data()), in_.stream);
  CacheStageParams stage;
  stage.source = source;
  stage.pages = view(table.source_pages.data(), DType::i32, {staged_pool.pages});
  stage.staged.geometry = staged_page_geometry(source.geometry);
  stage.staged.pages = view(pages, DType::u8, {staged_pool.pages, stage.staged.geometry.page_stride});
  stage.staged.block_table = view(table.table.data(), DType::i32, {S, mirror.width});
  stage.staged.first_logical_page = view(table.first.data(), DType::i32, {S});
  run_cache_stage(stage, in_.stream);
  return stage.staged;
}

}  // namespace dsv4::cuda
