#include "reference/layer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "common/image_spans.h"
#include "dsv4/error.h"
#include "dsv4/parallel.h"

namespace dsv4::reference {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Weights

class LayerWeightReader {
 public:
  LayerWeightReader(const ModelConfig& config, const LayerPlan& plan, const LayerWeights& weights, bool bf16)
      : weights_(weights), layer_(plan.layer), bf16_(bf16) {
    for (const ExpectedWeight& e : expected_layer_weights(config, plan)) {
      const WeightTensor& w = weights.get(e.role);
      DSV4_CHECK(w.shape == e.shape, "engine: layer ", layer_, " weight '", weight_role_name(e.role), "' has shape ",
                 shape_string(w.shape), ", expected ", shape_string(e.shape));
      DSV4_CHECK(!w.is_fp8() || e.fp8_allowed, "engine: layer ", layer_, " weight '", weight_role_name(e.role),
                 "' is fp8, which the reference does not allow for this tensor");
    }
  }

  // fp32 values; `shape` is checked again because a role may be optional in the plan.
  std::vector<float> values(WeightRole role, const std::vector<int64_t>& shape) const {
    const WeightTensor& w = weights_.get(role);
    DSV4_CHECK(w.shape == shape, "engine: layer ", layer_, " weight '", weight_role_name(role), "' has shape ",
               shape_string(w.shape), ", expected ", shape_string(shape));
    const HostTensor t = w.to_f32();
    return std::vector<float>(t.as<float>(), t.as<float>() + t.numel());
  }

  // A projection [out, in]. In bf16 (reference) precision, fp8 weights are multiplied with
  // fp8-quantized activations (the reference's fp8 GEMM) where the recipe says so, else
  // dequantized and rounded to bf16.
  Projection projection(WeightRole role, int64_t out, int64_t in) const {
    Projection p;
    p.weight = values(role, {out, in});
    p.out = out;
    p.in = in;
    const WeightTensor& w = weights_.get(role);
    if (bf16_ && w.is_fp8()) {
      if (weight_recipe(role).fp8_activations)
        p.fp8_activation_block = w.block_in;
      else
        round_bf16(p.weight.data(), static_cast<int64_t>(p.weight.size()));
    }
    return p;
  }

  bool has(WeightRole role) const { return weights_.has(role); }

 private:
  const LayerWeights& weights_;
  int layer_;
  bool bf16_;
};

// A compressor's kv and gate projections fused into one [row_width, hidden] projection.
CompressorParameters read_compressor(const LayerWeightReader& r, const CompressorGeometry& g, int64_t hidden,
                                     WeightRole wkv, WeightRole wgate, WeightRole norm, WeightRole bias) {
  CompressorParameters c;
  c.geometry = g;
  const int64_t width = (g.overlap ? 2 : 1) * g.dim;
  c.projection = r.projection(wkv, width, hidden);
  if (g.gated) {
    const Projection gate = r.projection(wgate, width, hidden);
    c.projection.weight.insert(c.projection.weight.end(), gate.weight.begin(), gate.weight.end());
    c.projection.out += width;
  }
  c.norm = r.values(norm, {g.dim});
  if (r.has(bias)) c.position_bias = r.values(bias, {g.ratio, width});
  return c;
}

// ---------------------------------------------------------------------------------------------
// Step helpers

// `round_output` false keeps a bf16 projection's output in fp32 (a tensor-parallel partial sum).
void project(const float* x, int64_t n, const Projection& p, float* y, bool bf16, bool round_output = true) {
  linear(x, n, p.in, p.weight.data(), p.out, y, {.fp8_activation_block = bf16 ? p.fp8_activation_block : 0,
                                                 .bf16_output = bf16 && round_output});
}

void quantize_rows(RowQuantizer q, float* rows, int64_t n, int64_t dim, int64_t rope_dim) {
  switch (q) {
    case RowQuantizer::none: return;
    case RowQuantizer::fp8_e4m3_32: fake_quant_fp8_rows(rows, n, dim, dim, 32); return;
    case RowQuantizer::fp8_e4m3_nope_64: fake_quant_fp8_rows(rows, n, dim, dim - rope_dim, 64); return;
    case RowQuantizer::fp4_e4m3_16: fake_quant_fp4_e4m3_rows(rows, n, dim); return;
    case RowQuantizer::fp4_ue8m0_32: fake_quant_fp4_ue8m0_rows(rows, n, dim); return;
  }
}

// Compressed entries that close in this step, in step order (per chunk, ascending entry index).
struct NewEntries {
  std::vector<int32_t> chunk;        // [E]
  std::vector<int64_t> position;     // [E] RoPE position = entry · ratio
  std::vector<float> latent;         // [E, dim] normalized, pre-RoPE
};

// Runs a compressor of the layer over the step: pools every entry whose last token is in
// the step (reading earlier tokens' projected rows from the sequence's ring), then stores the
// step's rows in the ring for the entries still open.
NewEntries run_compressor(const LayerParameters& L, const CompressorParameters& c, const StepLayout& step,
                          CacheStore& caches, const float* x) {
  const CompressorGeometry& g = c.geometry;
  const int layer = L.recipe.plan.layer;
  const int64_t T = step.tokens(), width = g.row_width();
  std::vector<float> rows(static_cast<size_t>(T * width));
  // The reference projects in fp32 (ratio 2, V4.0) or in bf16 (ratio 1, no gate, where the
  // rounding happens below, before the norm).
  project(x, T, c.projection, rows.data(), false);

  NewEntries e;
  std::vector<int64_t> entry_index;
  for (size_t ci = 0; ci < step.chunks.size(); ++ci) {
    const StepChunk& ch = step.chunks[ci];
    // Entry w closes at position w·ratio + ratio − 1; the first one closing in the chunk is start / ratio.
    for (int64_t w = ch.start / g.ratio; (w + 1) * g.ratio <= ch.start + ch.tokens; ++w) {
      e.chunk.push_back(static_cast<int32_t>(ci));
      e.position.push_back(w * g.ratio);
      entry_index.push_back(w);
    }
  }
  const int64_t E = static_cast<int64_t>(entry_index.size());
  std::vector<float> pooled(static_cast<size_t>(E * g.dim));
#pragma omp parallel for schedule(static) if (E * g.span() * g.dim >= kMinParallelWork)
  for (int64_t i = 0; i < E; ++i) {
    const StepChunk& ch = step.chunks[static_cast<size_t>(e.chunk[i])];
    const float* ring = std::as_const(caches).compressor_state(ch.sequence, layer).data() + c.state_offset;
    // Earlier tokens of the entry's span were stored in the ring by previous steps.
    const auto row_at = [&](int64_t pos) {
      return pos >= ch.start ? rows.data() + (ch.first_token + pos - ch.start) * width : ring + (pos % g.ring_rows()) * width;
    };
    pool_compressed_entry(g, entry_index[i], row_at, c.position_bias.empty() ? nullptr : c.position_bias.data(),
                          pooled.data() + i * g.dim);
  }
  round_bf16(pooled.data(), E * g.dim, L.recipe.round_bf16);
  e.latent.resize(pooled.size());
  rms_norm(pooled.data(), E, g.dim, c.norm.data(), L.recipe.eps, e.latent.data(), L.recipe.round_bf16);

  for (const StepChunk& ch : step.chunks) {
    float* ring = caches.compressor_state(ch.sequence, layer).data() + c.state_offset;
    for (int64_t pos = std::max(ch.start, ch.start + ch.tokens - g.ring_rows()); pos < ch.start + ch.tokens; ++pos) {
      const float* src = rows.data() + (ch.first_token + pos - ch.start) * width;
      std::copy(src, src + width, ring + (pos % g.ring_rows()) * width);
    }
  }
  return e;
}

// Compressed rows and index keys of a kv-source layer for the entries closing in this step.
void update_compressed_caches(const ModelConfig& config, const LayerParameters& L, const StepLayout& step,
                              CacheStore& caches, const float* x) {
  const int layer = L.recipe.plan.layer;
  const int64_t D = config.head_dim, rd = config.rope_head_dim;
  NewEntries main = run_compressor(L, L.compressor, step, caches, x);
  const int64_t E = static_cast<int64_t>(main.chunk.size());

  // Index keys first: V4.1 derives them from the pre-RoPE latent (SPEC §4.1).
  std::vector<float> keys;
  const int64_t dI = config.index_head_dim;
  if (L.recipe.plan.owns_index_keys) {
    if (L.recipe.index_compressor) {
      NewEntries index = run_compressor(L, L.index_compressor, step, caches, x);
      keys = std::move(index.latent);
    } else {
      keys.resize(static_cast<size_t>(E * dI));
      project(main.latent.data(), E, L.indexer_wk, keys.data(), L.recipe.round_bf16);
      rms_norm(keys.data(), E, dI, L.indexer_k_norm.data(), L.recipe.eps, keys.data(), L.recipe.round_bf16);
    }
    apply_rope(keys.data(), E, 1, dI, L.recipe.rope_frequencies.data(), rd, main.position.data(), false, L.recipe.round_bf16);
    if (L.recipe.index_hadamard) hadamard_rows(keys.data(), E, dI, L.recipe.round_bf16);
    quantize_rows(L.recipe.index_rows, keys.data(), E, dI, rd);
  }

  std::vector<float>& rows = main.latent;  // rotated and quantized in place
  apply_rope(rows.data(), E, 1, D, L.recipe.rope_frequencies.data(), rd, main.position.data(), false, L.recipe.round_bf16);
  quantize_rows(L.recipe.compressed_rows, rows.data(), E, D, rd);

  // The entries of a chunk are consecutive in step order.
  for (int64_t i = 0; i < E;) {
    int64_t end = i;
    while (end < E && main.chunk[end] == main.chunk[i]) ++end;
    const SequenceId s = step.chunks[static_cast<size_t>(main.chunk[i])].sequence;
    caches.append_compressed_entries(s, layer, end - i, rows.data() + i * D);
    if (L.recipe.plan.owns_index_keys) caches.append_index_keys(s, layer, end - i, keys.data() + i * dI);
    i = end;
  }
}

// The indexer of an index-source layer: scores, candidate blocks, top-k picks (SPEC §4).
void run_indexer(const ModelConfig& config, const LayerParameters& L, const StepLayout& step,
                 const CacheStore& caches, const float* x, const float* qr, std::vector<LayerPublication>& published,
                 bool record_scores, const RankReduction& ranks) {
  const int layer = L.recipe.plan.layer, kv_src = L.recipe.plan.kv_source;
  const int64_t T = step.tokens(), nI = config.index_n_heads, dI = config.index_head_dim, k = config.index_topk;
  const int64_t ratio = L.recipe.plan.compress_ratio;
  std::vector<float> q(static_cast<size_t>(T * nI * dI)), w(static_cast<size_t>(T * nI));
  project(qr, T, L.indexer_wq_b, q.data(), L.recipe.round_bf16);
  apply_rope(q.data(), T, nI, dI, L.recipe.rope_frequencies.data(), config.rope_head_dim, step.positions.data(), false, L.recipe.round_bf16);
  if (L.recipe.index_hadamard) hadamard_rows(q.data(), T * nI, dI, L.recipe.round_bf16);
  quantize_rows(L.recipe.index_rows, q.data(), T * nI, dI, config.rope_head_dim);
  project(x, T, L.indexer_weights_proj, w.data(), L.recipe.round_bf16);
  for (float& v : w) v = L.recipe.round_bf16 ? round_to_bf16(v * L.recipe.index_weight_scale) : v * L.recipe.index_weight_scale;

  LayerPublication& out = published[static_cast<size_t>(layer)];
  const LayerPublication* candidates =
      L.recipe.plan.uses_candidates ? &published[static_cast<size_t>(config.candidate_source_layer)] : nullptr;
  // Every key of the kv source, per chunk, and ragged per-token rows over them.
  std::vector<std::vector<float>> keys(step.chunks.size());
  for (size_t c = 0; c < step.chunks.size(); ++c) {
    const SequenceId s = step.chunks[c].sequence;
    const int64_t n = caches.index_keys(s, kv_src);
    keys[c].resize(static_cast<size_t>(n * dI));
    caches.read_index_keys(s, kv_src, 0, n, keys[c].data());
  }
  std::vector<int64_t> offset(static_cast<size_t>(T) + 1, 0);
  for (int64_t t = 0; t < T; ++t)
    offset[t + 1] = offset[t] + static_cast<int64_t>(keys[static_cast<size_t>(step.chunk_of[t])].size()) / dI;
  if (candidates)
    DSV4_CHECK(candidates->candidate_mask.offset == offset, "engine: layer ", layer,
               " applies the candidates of layer ", config.candidate_source_layer,
               ", which were published over a different compressed cache");
  if (L.recipe.plan.is_candidate_source) out.candidate_mask = {offset, std::vector<uint8_t>(static_cast<size_t>(offset[T]))};
  out.picks.assign(static_cast<size_t>(T * k), -1);

  const auto visible = [&](int64_t t) { return std::min(offset[t + 1] - offset[t], (step.positions[t] + 1) / ratio); };
  // Candidate blocks and picks of token t from its scores (masked in place).
  const auto select = [&](int64_t t, float* scores) {
    const int64_t n = offset[t + 1] - offset[t], n_visible = visible(t);
    if (L.recipe.plan.is_candidate_source)
      select_candidate_blocks(scores, n, n_visible, config.candidate_block_size, config.candidate_topk_blocks,
                              out.candidate_mask.values.data() + offset[t]);
    if (candidates) {
      const uint8_t* keep = candidates->candidate_mask.row(t);
      for (int64_t j = 0; j < n; ++j)
        if (!keep[j]) scores[j] = -kInf;
    }
    select_topk(scores, n, n_visible, k, out.picks.data() + t * k);
  };
  // A split indexer's scores are partial sums over the rank's index heads: the whole step's are
  // summed over the ranks at once before any selection. Otherwise each token selects right away
  // from its own buffer, unless the scores are recorded.
  const bool split = ranks.split_indexer;
  RaggedRows<float> all_scores{offset, std::vector<float>(record_scores || split ? static_cast<size_t>(offset[T]) : 0)};
  const bool parallel = offset[T] * nI * dI >= kMinParallelWork;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = offset[t + 1] - offset[t];
    std::vector<float> local(static_cast<size_t>(all_scores.values.empty() ? n : 0));
    float* scores = all_scores.values.empty() ? local.data() : all_scores.values.data() + offset[t];
    index_scores(q.data() + t * nI * dI, w.data() + t * nI, nI, dI, keys[static_cast<size_t>(step.chunk_of[t])].data(),
                 n, visible(t), L.recipe.round_bf16, scores, split);
    if (!split) select(t, scores);
  }
  if (split) {
    DSV4_CHECK(ranks.communicator != nullptr, "engine: layer ", layer, ": a split indexer needs a communicator");
    ranks.communicator->all_reduce_sum(all_scores.values.data(), offset[T], nullptr);
    round_bf16(all_scores.values.data(), offset[T], L.recipe.round_bf16);
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
    for (int64_t t = 0; t < T; ++t) select(t, all_scores.values.data() + offset[t]);
  }
  if (record_scores) out.index_scores = std::move(all_scores);
}

// What a chunk's tokens attend besides the step's own window rows: the window rows of earlier
// steps and the compressed entries of the kv source that any of its tokens selects.
struct ChunkAttendedRows {
  int64_t window_first = 0;            // position of window_rows' first row
  std::vector<float> window_rows;      // [start − window_first, D]
  std::vector<int64_t> entry_row;      // per kv-source entry: its row in `entries`, −1 if not read
  std::vector<float> entries;          // [read entries, D]
};

ChunkAttendedRows read_attended_rows(const ModelConfig& config, const LayerParameters& L, const CacheStore& caches,
                                     const StepChunk& ch, const std::vector<LayerPublication>& published) {
  const int64_t D = config.head_dim, k = config.index_topk;
  ChunkAttendedRows a;
  a.window_first = std::max<int64_t>(0, ch.start - config.sliding_window + 1);
  a.window_rows.resize(static_cast<size_t>((ch.start - a.window_first) * D));
  caches.read_window_rows(ch.sequence, L.recipe.plan.layer, a.window_first, ch.start - a.window_first, a.window_rows.data());
  const int kv_src = L.recipe.plan.kv_source;
  if (kv_src < 0) return a;
  const int64_t count = caches.compressed_entries(ch.sequence, kv_src);
  a.entry_row.assign(static_cast<size_t>(count), -1);
  if (L.recipe.plan.index_source >= 0) {
    const std::vector<int32_t>& picks = published[static_cast<size_t>(L.recipe.plan.index_source)].picks;
    for (int64_t t = ch.first_token; t < ch.first_token + ch.tokens; ++t)
      for (int64_t i = 0; i < k; ++i)
        if (const int32_t j = picks[t * k + i]; j >= 0) {
          DSV4_CHECK(j < count, "engine: layer ", L.recipe.plan.layer, ": pick ", j, " of index source ", L.recipe.plan.index_source,
                     " is beyond the ", count, " entries of kv source ", kv_src);
          a.entry_row[j] = 0;
        }
  } else {  // V4.0 HCA: every entry visible to the chunk's last token
    std::fill_n(a.entry_row.begin(), std::min(count, (ch.start + ch.tokens) / L.recipe.plan.compress_ratio), 0);
  }
  std::vector<int64_t> read;
  for (int64_t j = 0; j < count; ++j)
    if (a.entry_row[j] >= 0) {
      a.entry_row[j] = static_cast<int64_t>(read.size());
      read.push_back(j);
    }
  a.entries.resize(read.size() * static_cast<size_t>(D));
  caches.read_compressed_entries(ch.sequence, kv_src, read.data(), static_cast<int64_t>(read.size()), a.entries.data());
  return a;
}

// The rows token t attends: its window (earlier steps, then this step's `kv`, which inside an
// image span reaches past t to the span's later positions in the chunk) and its entries.
void gather_attended_rows(const ModelConfig& config, const LayerParameters& L, const StepLayout& step, int64_t t,
                          const float* kv, const ChunkAttendedRows& a, const std::vector<LayerPublication>& published,
                          std::vector<const float*>& rows) {
  const StepChunk& ch = step.chunks[static_cast<size_t>(step.chunk_of[t])];
  const int64_t p = step.positions[t], D = config.head_dim;
  rows.clear();
  const WindowRange window = token_window(step, t, config.sliding_window);  // wider in image spans
  for (int64_t pos = window.first; pos <= window.last; ++pos)
    rows.push_back(pos >= ch.start ? kv + (ch.first_token + pos - ch.start) * D
                                   : a.window_rows.data() + (pos - a.window_first) * D);
  if (L.recipe.plan.kv_source < 0) return;
  const auto entry = [&](int64_t j) { return a.entries.data() + a.entry_row[j] * D; };
  if (L.recipe.plan.index_source >= 0) {
    const int32_t* picks = published[static_cast<size_t>(L.recipe.plan.index_source)].picks.data() + t * config.index_topk;
    for (int64_t i = 0; i < config.index_topk; ++i)
      if (picks[i] >= 0) rows.push_back(entry(picks[i]));
  } else {
    const int64_t n_visible = std::min(static_cast<int64_t>(a.entry_row.size()), (p + 1) / L.recipe.plan.compress_ratio);
    for (int64_t j = 0; j < n_visible; ++j) rows.push_back(entry(j));
  }
}

// Queries (SPEC §2.2 steps 1-4; V4.0 §12 adds the per-head normalization): qr [T, q_lora], q [T, H, D].
void project_queries(const ModelConfig& config, const LayerParameters& L, const float* x, int64_t T,
                     const int64_t* positions, std::vector<float>& qr, std::vector<float>& q) {
  const int64_t H = config.num_heads, D = config.head_dim;
  const bool bf16 = L.recipe.round_bf16;
  qr.assign(static_cast<size_t>(T * config.q_lora_rank), 0.0f);
  q.assign(static_cast<size_t>(T * H * D), 0.0f);
  project(x, T, L.wq_a, qr.data(), bf16);
  rms_norm(qr.data(), T, config.q_lora_rank, L.q_norm.data(), L.recipe.eps, qr.data(), bf16);
  project(qr.data(), T, L.wq_b, q.data(), bf16);
  if (L.recipe.q_head_norm) rms_norm(q.data(), T * H, D, nullptr, L.recipe.eps, q.data(), bf16);
  apply_rope(q.data(), T, H, D, L.recipe.rope_frequencies.data(), config.rope_head_dim, positions, false, bf16);
}

// Window rows of T tokens (steps 5-6), as the layer's window cache returns them: [T, D].
std::vector<float> window_rows_of(const ModelConfig& config, const LayerParameters& L, const float* x, int64_t T,
                                  const int64_t* positions, const CacheStore& caches) {
  const int64_t D = config.head_dim, rd = config.rope_head_dim;
  const bool bf16 = L.recipe.round_bf16;
  std::vector<float> kv(static_cast<size_t>(T * D));
  project(x, T, L.wkv, kv.data(), bf16);
  rms_norm(kv.data(), T, D, L.kv_norm.data(), L.recipe.eps, kv.data(), bf16);
  apply_rope(kv.data(), T, 1, D, L.recipe.rope_frequencies.data(), rd, positions, false, bf16);
  quantize_rows(L.recipe.window_rows, kv.data(), T, D, rd);
  caches.round_trip_window_rows(L.recipe.plan.layer, kv.data(), T);
  return kv;
}

// Output projection (SPEC §6) of the attention output o [T, H, D] (rotated back in place).
void project_output(const ModelConfig& config, const LayerParameters& L, std::vector<float>& o, int64_t T,
                    const int64_t* positions, float* attn_out, const RankReduction& ranks) {
  const int64_t H = config.num_heads, D = config.head_dim, G = config.o_groups, R = config.o_lora_rank;
  const bool bf16 = L.recipe.round_bf16;
  apply_rope(o.data(), T, H, D, L.recipe.rope_frequencies.data(), config.rope_head_dim, positions, true, bf16);
  std::vector<float> y(static_cast<size_t>(T * G * R));
  grouped_linear(o.data(), T, G, H / G * D, L.wo_a.weight.data(), R, y.data(), bf16);
  // A tensor-parallel rank's output is a partial sum over its heads: fp32 until the ranks' partial
  // sums are added up, then rounded as the whole output is.
  project(y.data(), T, L.wo_b, attn_out, bf16, ranks.communicator == nullptr);
  if (ranks.communicator) {
    ranks.communicator->all_reduce_sum(attn_out, T * config.hidden_size, nullptr);
    round_bf16(attn_out, T * config.hidden_size, bf16);
  }
}

}  // namespace

LayerParameters prepare_layer(const ModelConfig& config, const LayerRecipe& recipe, const LayerWeights& weights) {
  LayerParameters L;
  L.recipe = recipe;
  const LayerPlan& plan = recipe.plan;
  const int64_t hidden = config.hidden_size, H = config.num_heads, D = config.head_dim, G = config.o_groups;
  const LayerWeightReader r(config, plan, weights, recipe.round_bf16);

  L.wq_a = r.projection(WeightRole::wq_a, config.q_lora_rank, hidden);
  L.q_norm = r.values(WeightRole::q_norm, {config.q_lora_rank});
  L.wq_b = r.projection(WeightRole::wq_b, H * D, config.q_lora_rank);
  L.wkv = r.projection(WeightRole::wkv, D, hidden);
  L.kv_norm = r.values(WeightRole::kv_norm, {D});
  L.wo_a = r.projection(WeightRole::wo_a, G * config.o_lora_rank, H * D / G);
  L.wo_b = r.projection(WeightRole::wo_b, hidden, G * config.o_lora_rank);
  L.attn_sink = r.values(WeightRole::attn_sink, {H});
  if (recipe.compressor)
    L.compressor = read_compressor(r, *recipe.compressor, hidden, WeightRole::compressor_wkv,
                                   WeightRole::compressor_wgate, WeightRole::compressor_norm, WeightRole::compressor_ape);
  const int64_t nI = config.index_n_heads, dI = config.index_head_dim;
  if (plan.owns_index_keys) {
    if (recipe.index_compressor) {
      L.index_compressor = read_compressor(r, *recipe.index_compressor, hidden, WeightRole::indexer_compressor_wkv,
                                           WeightRole::indexer_compressor_wgate, WeightRole::indexer_compressor_norm,
                                           WeightRole::indexer_compressor_ape);
      L.index_compressor.state_offset = L.compressor.state_floats();  // its ring follows the main one
    } else {
      L.indexer_wk = r.projection(WeightRole::indexer_wk, dI, D);
      L.indexer_k_norm = r.values(WeightRole::indexer_k_norm, {dI});
    }
  }
  if (plan.owns_indexer) {
    L.indexer_wq_b = r.projection(WeightRole::indexer_wq_b, nI * dI, config.q_lora_rank);
    L.indexer_weights_proj = r.projection(WeightRole::indexer_weights_proj, nI, hidden);
  }
  if (plan.dspark_stage == 0) {
    L.main_proj = r.projection(WeightRole::main_proj, hidden, config.dspark_main_width());
    L.main_norm = r.values(WeightRole::main_norm, {hidden});
  }
  return L;
}

LayerCacheShape layer_cache_shape(const ModelConfig& config, const LayerParameters& L) {
  LayerCacheShape s;
  s.window = config.sliding_window;
  s.row_dim = config.head_dim;
  s.compress_ratio = L.recipe.plan.compress_ratio;
  s.has_compressed = L.recipe.plan.owns_compressor;
  if (L.recipe.plan.owns_index_keys) s.index_key_dim = config.index_head_dim;
  for (const CompressorParameters* c : {&L.compressor, &L.index_compressor})
    if (c->geometry.ratio > 0) s.compressor_floats = std::max(s.compressor_floats, c->state_offset + c->state_floats());
  return s;
}

void run_layer_step(const ModelConfig& config, const LayerParameters& L, const StepLayout& step, CacheStore& caches,
                    const float* hidden_in, float* attn_out, std::vector<LayerPublication>& published,
                    bool record_index_scores, const RankReduction& ranks) {
  const int64_t T = step.tokens(), hidden = config.hidden_size, H = config.num_heads, D = config.head_dim;
  const bool bf16 = L.recipe.round_bf16;

  std::vector<float> x(hidden_in, hidden_in + T * hidden);
  round_bf16(x.data(), T * hidden, bf16);

  std::vector<float> qr, q;
  project_queries(config, L, x.data(), T, step.positions.data(), qr, q);
  const std::vector<float> kv = window_rows_of(config, L, x.data(), T, step.positions.data(), caches);

  if (L.recipe.plan.owns_compressor) update_compressed_caches(config, L, step, caches, x.data());
  if (L.recipe.plan.owns_indexer)
    run_indexer(config, L, step, caches, x.data(), qr.data(), published, record_index_scores, ranks);

  // Sparse attention (SPEC §5).
  std::vector<float> o(static_cast<size_t>(T * H * D));
  const float scale = L.recipe.softmax_scale;
  std::vector<ChunkAttendedRows> attended;
  for (const StepChunk& ch : step.chunks) attended.push_back(read_attended_rows(config, L, caches, ch, published));
  const int64_t attended_rows = T * (config.sliding_window + (L.recipe.plan.kv_source >= 0 ? config.index_topk : 0));
#pragma omp parallel for schedule(dynamic, 1) if (attended_rows * H * D >= kMinParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    std::vector<const float*> rows;
    gather_attended_rows(config, L, step, t, kv.data(), attended[static_cast<size_t>(step.chunk_of[t])], published, rows);
    sparse_attention(q.data() + t * H * D, H, D, rows.data(), static_cast<int64_t>(rows.size()), L.attn_sink.data(),
                     scale, bf16, o.data() + t * H * D);
  }
  for (const StepChunk& ch : step.chunks)
    caches.write_window_rows(ch.sequence, L.recipe.plan.layer, ch.start, ch.tokens, kv.data() + ch.first_token * D);

  project_output(config, L, o, T, step.positions.data(), attn_out, ranks);
  published[static_cast<size_t>(L.recipe.plan.layer)].ran = true;
}

void draft_main_input(const ModelConfig& config, const LayerParameters& stage0, int64_t T, const float* main_hidden,
                      float* main_x) {
  DSV4_CHECK(stage0.recipe.plan.dspark_stage == 0, "engine: layer ", stage0.recipe.plan.layer,
             " is not DSpark stage 0, which holds main_proj and main_norm");
  const bool bf16 = stage0.recipe.round_bf16;
  const int64_t width = config.dspark_main_width();
  // The reference's main_hidden is the bf16 mean of bf16 residual copies.
  std::vector<float> h(main_hidden, main_hidden + T * width);
  round_bf16(h.data(), T * width, bf16);
  project(h.data(), T, stage0.main_proj, main_x, bf16);
  rms_norm(main_x, T, config.hidden_size, stage0.main_norm.data(), stage0.recipe.eps, main_x, bf16);
}

void write_draft_context(const ModelConfig& config, const LayerParameters& L, const StepLayout& step,
                         CacheStore& caches, const float* main_x) {
  const int64_t T = step.tokens(), D = config.head_dim;
  std::vector<float> x(main_x, main_x + T * config.hidden_size);
  round_bf16(x.data(), T * config.hidden_size, L.recipe.round_bf16);
  const std::vector<float> kv = window_rows_of(config, L, x.data(), T, step.positions.data(), caches);
  for (const StepChunk& ch : step.chunks)
    caches.write_window_rows(ch.sequence, L.recipe.plan.layer, ch.start, ch.tokens, kv.data() + ch.first_token * D);
}

void run_draft_block(const ModelConfig& config, const LayerParameters& L, const std::vector<DraftBlock>& blocks,
                     const CacheStore& caches, const float* hidden_in, float* attn_out) {
  const int64_t B = config.dspark_block_size, W = config.sliding_window;
  const int64_t T = static_cast<int64_t>(blocks.size()) * B, hidden = config.hidden_size;
  const int64_t H = config.num_heads, D = config.head_dim;
  const bool bf16 = L.recipe.round_bf16;
  // Block row j of a sequence of committed length n sits at position n + j (p0 = n − 1).
  std::vector<int64_t> positions(static_cast<size_t>(T));
  for (size_t b = 0; b < blocks.size(); ++b)
    for (int64_t j = 0; j < B; ++j) positions[b * B + j] = blocks[b].length + j;

  std::vector<float> x(hidden_in, hidden_in + T * hidden);
  round_bf16(x.data(), T * hidden, bf16);
  std::vector<float> qr, q;
  project_queries(config, L, x.data(), T, positions.data(), qr, q);
  // The block's keys, rounded as the window format stores rows; never stored (SPEC §13.1 step 5).
  const std::vector<float> block_kv = window_rows_of(config, L, x.data(), T, positions.data(), caches);

  std::vector<float> o(static_cast<size_t>(T * H * D));
  for (size_t b = 0; b < blocks.size(); ++b) {
    // Context: the committed window rows p0 − W + 1 … p0; then every row of the block, non-causally.
    const int64_t p0 = blocks[b].length - 1, first = std::max<int64_t>(0, p0 - W + 1), n_window = p0 - first + 1;
    std::vector<float> window(static_cast<size_t>(n_window * D));
    caches.read_window_rows(blocks[b].sequence, L.recipe.plan.layer, first, n_window, window.data());
    std::vector<const float*> rows;
    for (int64_t i = 0; i < n_window; ++i) rows.push_back(window.data() + i * D);
    for (int64_t j = 0; j < B; ++j) rows.push_back(block_kv.data() + (static_cast<int64_t>(b) * B + j) * D);
#pragma omp parallel for schedule(static) if (B * static_cast<int64_t>(rows.size()) * H * D >= kMinParallelWork)
    for (int64_t j = 0; j < B; ++j) {
      const int64_t t = static_cast<int64_t>(b) * B + j;
      sparse_attention(q.data() + t * H * D, H, D, rows.data(), static_cast<int64_t>(rows.size()), L.attn_sink.data(),
                       L.recipe.softmax_scale, bf16, o.data() + t * H * D);
    }
  }
  project_output(config, L, o, T, positions.data(), attn_out, {});
}

}  // namespace dsv4::reference
