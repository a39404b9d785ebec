// The ops `dsv4 bench --op` times on their own (`--batch` sequences with `--context` tokens each):
//   indexer            index scores of one decode token per sequence against its `context` keys
//                      (ratio 1, MXFP4 key cache, FP4 queries), fp32 and bf16_rounding
//   indexer-prefill    index scores of a 2048-token chunk per sequence (the last 2048 positions of
//                      `context`, ratio 1) against the sequence's `context` keys, as `indexer`
//   topk               top-k (index_topk) of one score row of `context` entries per sequence
//   topk-blocks        the candidate blocks' top-k (candidate_topk_blocks) of one row of `context`
//                      block scores per sequence (a context of E entries has E / candidate_block_size)
//   attention-decode   sparse attention of one decode token per sequence: window rows (v41_fp8)
//                      plus index_topk picked entries (v41_fp4) out of `context`; a call per graph
//                      replay, then the steady state of many calls per graph on their own inputs
//                      (FLASHMLA_BASELINE.md's "graph" method)
//   attention-prefill  sparse attention of a `context`-token prefill chunk per sequence, each token
//                      attending its window and min(index_topk, p + 1) picked entries; with
//                      quantized caches also staged: both caches' pages decoded to bf16 pages
//                      first (cache_stage), then attended from them
//   compressor         the ratio-2 compressor of a `context`-token chunk per sequence: the fused
//                      [wkv; wgate] projection and the pooling with its state ring
//   linear             wq_b (q_lora_rank -> heads x head_dim) of a `context`-token chunk per
//                      sequence, fp8 weight with ue8m0 block scales (run_linear's choice of kernel)
//   linear-decode      wq_b and wo_b at 1, 16 and 64 tokens: the fp8_decode kernel's weight bytes
//                      per second against the copy ceiling
//   rope-heads         RoPE of q (heads x head_dim bf16) of a `context`-token chunk per sequence
//   cache-insert       the window insert of a `context`-token chunk per sequence: RMSNorm, RoPE,
//                      fp8 QAT and v41_fp8 encoding into a paged cache
// The attention and indexer ops read caches of the --kv-format set (v4.1-native by default: the
// formats named above; fp8_ds_mla: 584 B attention rows and 132 B index keys, as FlashMLA and
// DeepGEMM read them).
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <numeric>
#include <random>
#include <span>

#include "bench/bench.h"
#include "bench/device_inputs.h"
#include "dsv4/cuda/attention.h"
#include "dsv4/cuda/cache.h"
#include "dsv4/cuda/compressor.h"
#include "dsv4/cuda/indexer.h"
#include "dsv4/cuda/projection.h"
#include "dsv4/cuda/qkv.h"
#include "dsv4/kv_format.h"

namespace dsv4::bench {
namespace {

using cuda::DeviceBuffer;
using cuda::inputs::device_array;
using cuda::inputs::DeviceTensor;
using cuda::inputs::poisoned_tensor;
using cuda::inputs::random_device_tensor;

// A paged cache of `sequences` x `rows` rows: every sequence owns its pages (in a shuffled order);
// the pages hold random rows encoded on the host (a block of distinct pages, repeated).
struct Cache {
  DeviceTensor pages, block_table;
  cuda::PagedCache view;
};

Cache random_cache(KvRowFormat format, int64_t dims, int64_t sequences, int64_t rows, uint32_t seed) {
  const PageGeometry g = page_geometry(format, dims, default_rows_per_page(format));
  const int64_t per_sequence = (rows + g.rows_per_page - 1) / g.rows_per_page;
  const int64_t num_pages = sequences * per_sequence;
  constexpr int64_t kDistinctPages = 16;
  const int64_t distinct = std::min(num_pages, kDistinctPages);
  std::vector<std::byte> block(static_cast<size_t>(distinct * g.page_stride));
  std::vector<float> values(static_cast<size_t>(distinct * g.rows_per_page * dims));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (float& v : values) v = dist(rng);
  std::vector<int64_t> slots(static_cast<size_t>(distinct * g.rows_per_page));
  std::iota(slots.begin(), slots.end(), 0);
  encode_rows(g, values.data(), static_cast<int64_t>(slots.size()), slots.data(), std::span<std::byte>(block));
  Cache c;
  c.pages = poisoned_tensor(DType::u8, {num_pages, g.page_stride});
  for (int64_t p = 0; p < num_pages; p += distinct) {
    const int64_t n = std::min(distinct, num_pages - p);
    cuda::copy_to_device(static_cast<std::byte*>(c.pages.buffer.data()) + p * g.page_stride, block.data(),
                         static_cast<size_t>(n * g.page_stride), nullptr);
  }
  std::vector<int32_t> table(static_cast<size_t>(num_pages));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  c.block_table = device_array(table, DType::i32, {sequences, per_sequence});
  c.view.pages = c.pages.view;
  c.view.block_table = c.block_table.view;
  c.view.geometry = g;
  return c;
}

// The formats of the caches the attention and indexer ops read.
KvFormatSet cache_formats(const BenchOptions& o) {
  return kv_format_set(o.kv_format.empty() ? "v4.1-native" : o.kv_format);
}

// Tokens of `sequences` sequences, `per_sequence` each, at positions start ... start + per_sequence - 1.
struct Tokens {
  DeviceTensor sequence, position;
  int64_t count = 0;
};

Tokens make_tokens(int64_t sequences, int64_t per_sequence, int64_t start) {
  std::vector<int32_t> seq, pos;
  for (int64_t s = 0; s < sequences; ++s)
    for (int64_t t = 0; t < per_sequence; ++t) {
      seq.push_back(static_cast<int32_t>(s));
      pos.push_back(static_cast<int32_t>(start + t));
    }
  const int64_t n = static_cast<int64_t>(seq.size());
  return {device_array(seq, DType::i32, {n}), device_array(pos, DType::i32, {n}), n};
}

// Per token at position p: min(k, p + 1) distinct entries below p + 1, ascending, -1 padded.
DeviceTensor random_picks(const std::vector<int64_t>& positions, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> picks;
  std::vector<int32_t> pool;
  for (int64_t p : positions) {
    pool.resize(static_cast<size_t>(p + 1));
    std::iota(pool.begin(), pool.end(), 0);
    const int64_t take = std::min(k, p + 1);
    for (int64_t i = 0; i < take; ++i) std::swap(pool[static_cast<size_t>(i)], pool[static_cast<size_t>(i + rng() % (p + 1 - i))]);
    std::sort(pool.begin(), pool.begin() + take);
    picks.insert(picks.end(), pool.begin(), pool.begin() + take);
    picks.insert(picks.end(), static_cast<size_t>(k - take), -1);
  }
  return device_array(picks, DType::i32, {static_cast<int64_t>(positions.size()), k});
}

constexpr int64_t kPrefillChunk = 2048;  // indexer-prefill: tokens per sequence

// FP4 queries as the indexer's QAT leaves them (SPEC §4.2): normal values fake-quantized per 32
// channels, in bf16.
DeviceTensor fp4_queries(int64_t tokens, int64_t heads, int64_t dim, uint32_t seed) {
  std::vector<float> q(static_cast<size_t>(tokens * heads * dim));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (float& v : q) v = dist(rng);
  for (size_t i = 0; i + 32 <= q.size(); i += 32) fake_quant_fp4_ue8m0(q.data() + i, q.data() + i, 32);
  return cuda::inputs::device_tensor(q, DType::bf16, {tokens, heads, dim});
}

// Index scores of `per_sequence` tokens per sequence at the last positions of `context` (ratio 1)
// against the sequence's `context` MXFP4 keys, in fp32 and in bf16_rounding.
// Index scores of `per_sequence` tokens at the end of each of `batch` sequences of `context`
// index_mxfp4 keys (token at p sees p + 1 entries), FP4 queries: what --op indexer, indexer-prefill
// and index-topk time.
struct IndexScoresSetup {
  Cache keys;
  Tokens tokens;
  DeviceTensor q, weights, scores;
  cuda::IndexScoresParams params;
  int64_t B = 0, L = 0, E = 0, T = 0;
  double key_bytes = 0, visible = 0;

  IndexScoresSetup(const BenchOptions& o, const ModelConfig& c, int64_t per_sequence)
      : keys(random_cache(cache_formats(o).index_keys, c.index_head_dim, o.batch, o.context, 1)),
        tokens(make_tokens(o.batch, std::min(per_sequence, o.context), o.context - std::min(per_sequence, o.context))),
        B(o.batch), L(std::min(per_sequence, o.context)), E(o.context), T(o.batch * L) {
    q = fp4_queries(T, c.index_n_heads, c.index_head_dim, 2);
    // bf16 values, as the engine's weights projection gives them (f32 storage).
    std::vector<float> w = cuda::inputs::random_floats(T * c.index_n_heads, 3);
    for (float& x : w) x = round_to_bf16(x);
    weights = cuda::inputs::device_tensor(w, DType::f32, {T, c.index_n_heads});
    scores = poisoned_tensor(DType::f32, {T, E});
    params.q = q.view;
    params.weights = weights.view;
    params.keys = keys.view;
    params.token_sequence = tokens.sequence.view;
    params.token_position = tokens.position.view;
    params.compress_ratio = 1;
    params.scores = scores.view;
    params.fp4_queries = true;
    key_bytes = static_cast<double>(keys.view.geometry.row.row_bytes());
    visible = static_cast<double>(B) * static_cast<double>(L * E - L * (L - 1) / 2);  // Σ (p + 1)
  }
  std::string what(const ModelConfig& c) const {
    return format_string("%" PRId64 " x %" PRId64 " tokens x %" PRId64 " %s keys (%d B/row), FP4 q, %d heads, "
                         "%s scores", B, L, E, kv_row_format_name(keys.view.geometry.format), static_cast<int>(key_bytes),
                         static_cast<int>(c.index_n_heads), params.bf16_rounding ? "bf16-rounded" : "fp32");
  }
  double key_read_bytes() const { return static_cast<double>(B * E) * key_bytes; }
  double flops(const ModelConfig& c) const { return 2.0 * visible * static_cast<double>(c.index_n_heads * c.index_head_dim); }
};

void bench_index_scores(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream, int64_t per_sequence) {
  IndexScoresSetup s(o, c, per_sequence);
  for (const bool bf16_rounding : {false, true}) {
    s.params.bf16_rounding = bf16_rounding;
    const std::vector<double> us = time_runs(o, stream.get(), [&] { run_index_scores(s.params, stream.get()); });
    Workload w;
    w.what = s.what(c);
    w.bytes = s.key_read_bytes() + static_cast<double>(s.T * s.E) * 4 +
              static_cast<double>(s.T * c.index_n_heads) * (c.index_head_dim * 2 + 4);
    w.bytes_note = "keys read once per sequence, scores written";
    w.flops = s.flops(c);  // fp8 MMA work of the visible keys
    w.implementation = cuda::index_scores_implementation(s.params);
    print_result(o, c, w, us);
  }
}

// The decode indexer as the engine runs it: index scores, then the index_topk picks of every
// token's visible entries (two kernels; the scores make one round trip through HBM).
void bench_index_topk(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream) {
  IndexScoresSetup s(o, c, 1);
  DeviceTensor picks = poisoned_tensor(DType::i32, {s.T, c.index_topk});
  cuda::TopkParams topk;
  topk.scores = s.scores.view;
  topk.token_position = s.tokens.position.view;
  topk.compress_ratio = 1;
  topk.picks = picks.view;
  for (const bool bf16_rounding : {false, true}) {
    s.params.bf16_rounding = bf16_rounding;
    const std::vector<double> us = time_runs(o, stream.get(), [&] {
      run_index_scores(s.params, stream.get());
      run_topk(topk, stream.get());
    });
    Workload w;
    w.what = s.what(c) + format_string(", then top %d", static_cast<int>(c.index_topk));
    w.bytes = s.key_read_bytes() + static_cast<double>(s.T * c.index_topk) * 4;
    w.bytes_note = "keys read once per sequence, picks written (the scores' round trip not counted)";
    w.flops = s.flops(c);
    w.implementation = std::string(cuda::index_scores_implementation(s.params)) + " + " + cuda::topk_implementation(topk);
    print_result(o, c, w, us);
  }
}

// Rows of random scores in [-1, 1), whole rows eligible; k: index_topk or candidate_topk_blocks.
void bench_topk(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream, int64_t k) {
  const int64_t B = o.batch, E = o.context;
  DeviceTensor scores = random_device_tensor(DType::f32, {B, E}, 4), picks = poisoned_tensor(DType::i32, {B, k});
  cuda::TopkParams p;
  p.scores = scores.view;
  p.picks = picks.view;
  const std::vector<double> us = time_runs(o, stream.get(), [&] { run_topk(p, stream.get()); });
  Workload w;
  w.what = format_string("%" PRId64 " rows of %" PRId64 " fp32 scores, top %" PRId64, B, E, k);
  w.bytes = static_cast<double>(B * E) * 4 + static_cast<double>(B * k) * 4;
  w.bytes_note = "scores read once, picks written";
  w.flops = 0;
  w.implementation = cuda::topk_implementation(p);
  print_result(o, c, w, us);
}

// Decode calls as a serving loop issues them from a graph, FLASHMLA_BASELINE.md's "graph" method
// (the figures it gives for FlashMLA): R calls back to back in one graph, each on its own inputs
// (q, picks, and a window that ends at another position), R such that together they touch more
// than 3x the L2; the time per call is a replay's / R. A replay of one call (above) also holds the
// graph's launch and runs on inputs the previous replay left in the L2.
void bench_attention_steady_state(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream,
                                  const cuda::SparseAttentionParams& p, const Workload& one_call, void* workspace,
                                  double call_cache_bytes) {
  const int64_t B = o.batch, L = o.context, H = c.num_heads, D = c.head_dim, W = c.sliding_window, k = c.index_topk;
  int device = 0, l2_bytes = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&device));
  DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const int64_t R = std::max<int64_t>(2, static_cast<int64_t>(std::ceil(3.0 * l2_bytes / call_cache_bytes)));
  struct Call {
    Tokens tokens;
    DeviceTensor q, picks;
    cuda::SparseAttentionParams params;
  };
  std::vector<Call> calls(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    // Windows that end W rows apart, over the second half of the context.
    const int64_t span = std::max<int64_t>(1, L / 2), position = L - 1 - (r * W) % span;
    Call& call = calls[static_cast<size_t>(r)];
    call.tokens = make_tokens(B, 1, position);
    call.q = random_device_tensor(DType::bf16, {B, H, D}, static_cast<uint32_t>(1000 + r));
    call.picks = random_picks(std::vector<int64_t>(static_cast<size_t>(B), position), k, static_cast<uint32_t>(5000 + r));
    call.params = p;
    call.params.q = call.q.view;
    call.params.token_sequence = call.tokens.sequence.view;
    call.params.token_position = call.tokens.position.view;
    call.params.picks = call.picks.view;
  }
  std::vector<double> us = time_runs(o, stream.get(), [&] {
    for (const Call& call : calls) run_sparse_attention(call.params, workspace, stream.get());
  });
  for (double& t : us) t /= static_cast<double>(R);
  Workload w = one_call;
  w.what += format_string("; steady state: %" PRId64 " calls per graph on their own inputs (%.0f MB, %.1fx the L2), "
                          "time per call",
                          R, static_cast<double>(R) * call_cache_bytes / 1e6, static_cast<double>(R) * call_cache_bytes / l2_bytes);
  print_result(o, c, w, us);
}

void bench_attention(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream, bool prefill) {
  const int64_t B = o.batch, L = o.context, H = c.num_heads, D = c.head_dim, W = c.sliding_window, k = c.index_topk;
  // Decode: one token per sequence at position L - 1; prefill: a chunk of L tokens from position 0.
  const int64_t per_sequence = prefill ? L : 1, start = prefill ? 0 : L - 1;
  Tokens tokens = make_tokens(B, per_sequence, start);
  std::vector<int64_t> positions;
  for (int64_t s = 0; s < B; ++s)
    for (int64_t t = 0; t < per_sequence; ++t) positions.push_back(start + t);
  const KvFormatSet formats = cache_formats(o);
  Cache window = random_cache(formats.window, D, B, L, 5);
  Cache compressed = random_cache(formats.compressed, D, B, L, 6);
  DeviceTensor picks = random_picks(positions, k, 7);
  DeviceTensor q = random_device_tensor(DType::bf16, {tokens.count, H, D}, 8), sink = random_device_tensor(DType::f32, {H}, 9);
  DeviceTensor out = poisoned_tensor(DType::bf16, {tokens.count, H, D});
  cuda::SparseAttentionParams p;
  p.q = q.view;
  p.token_sequence = tokens.sequence.view;
  p.token_position = tokens.position.view;
  p.window = window.view;
  p.window_size = W;
  p.compressed = compressed.view;
  p.picks = picks.view;
  p.compress_ratio = 1;
  p.sink = sink.view;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  p.out = out.view;
  p.bf16_rounding = true;  // reference precision, as the engine runs it by default
  // Small steps split each token's rows over several blocks, as the engine's do (given a workspace).
  DeviceBuffer workspace(cuda::sparse_attention_workspace_bytes(p));
  const std::vector<double> us =
      time_runs(o, stream.get(), [&] { run_sparse_attention(p, workspace.data(), stream.get()); });
  double rows = 0;
  for (int64_t pos : positions) rows += static_cast<double>(std::min(W, pos + 1) + std::min(k, pos + 1));
  // Distinct cache rows a sequence's tokens read: its window rows and its picked entries (a
  // prefill chunk reads every row of both caches).
  const double window_rows = static_cast<double>(prefill ? L : std::min(W, L));
  const double picked_rows = static_cast<double>(prefill ? L : std::min(k, L));
  const double cache_bytes = static_cast<double>(B) * (window_rows * static_cast<double>(window.view.geometry.row.row_bytes()) +
                                                       picked_rows * static_cast<double>(compressed.view.geometry.row.row_bytes()));
  Workload w;
  w.what = format_string("%" PRId64 " tokens x %" PRId64 " heads, window %" PRId64 " (%s) + %" PRId64
                         " picks (%s), bf16 q and out",
                         tokens.count, H, W, kv_row_format_name(formats.window), k, kv_row_format_name(formats.compressed));
  w.bytes = cache_bytes + static_cast<double>(tokens.count * H * D) * 4 +
            static_cast<double>(tokens.count * k) * 4;
  w.bytes_note = prefill ? "every cache row of the chunk once, q, out, picks" : "attended rows once, q, out, picks";
  w.flops = 4.0 * static_cast<double>(H * D) * rows;  // q·row and p·row per head and row
  w.implementation = cuda::sparse_attention_implementation(p);
  print_result(o, c, w, us);
  if (!prefill) {
    bench_attention_steady_state(o, c, stream, p, w, workspace.data(), cache_bytes);
    return;
  }
  if (formats.window == KvRowFormat::bf16 && formats.compressed == KvRowFormat::bf16) return;

  // The same chunk with its caches' pages decoded once into bf16 pages (run_cache_stage; page i
  // into staged page i, so the block tables stay), then attended from them: a prefill that decodes
  // each row once instead of once per token that attends it.
  const cuda::inputs::StagedCache staged_window = cuda::inputs::staged_cache(window.view),
                                  staged_compressed = cuda::inputs::staged_cache(compressed.view);
  cuda::SparseAttentionParams from_staged = p;
  from_staged.window = staged_window.stage.staged;
  from_staged.compressed = staged_compressed.stage.staged;
  DeviceBuffer staged_workspace(cuda::sparse_attention_workspace_bytes(from_staged));
  const std::vector<double> staged_us = time_runs(o, stream.get(), [&] {
    run_cache_stage(staged_window.stage, stream.get());
    run_cache_stage(staged_compressed.stage, stream.get());
    run_sparse_attention(from_staged, staged_workspace.data(), stream.get());
  });
  auto page_bytes = [](const cuda::PagedCache& cache) {
    return static_cast<double>(cache.pages.shape[0] * cache.geometry.page_stride);
  };
  const double staged_bytes = page_bytes(staged_window.stage.staged) + page_bytes(staged_compressed.stage.staged);
  Workload ws = w;
  ws.what += ", the caches' pages staged to bf16 first (cache_stage)";
  ws.bytes += 2 * staged_bytes;
  ws.bytes_note += ", bf16 pages written and read once";
  ws.implementation = std::string("cache_stage + ") + cuda::sparse_attention_implementation(from_staged);
  print_result(o, c, ws, staged_us);
}

void bench_compressor(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream) {
  const int64_t B = o.batch, L = o.context, hidden = c.hidden_size, D = c.head_dim;
  constexpr int kRatio = 2;
  const int64_t width = 2 * D;  // [kv | gate]
  Tokens tokens = make_tokens(B, L, 0);
  const int64_t T = tokens.count;
  std::vector<int32_t> slots(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) slots[static_cast<size_t>(t)] = static_cast<int32_t>(t / L);
  DeviceTensor state_slot = device_array(slots, DType::i32, {T});
  DeviceTensor x = random_device_tensor(DType::bf16, {T, hidden}, 10), weight = random_device_tensor(DType::bf16, {width, hidden}, 11);
  DeviceTensor rows = poisoned_tensor(DType::f32, {T, width}), state = poisoned_tensor(DType::f32, {B, kRatio, width});
  DeviceTensor norm = random_device_tensor(DType::f32, {D}, 12), latent = poisoned_tensor(DType::bf16, {T, D});
  cuda::BlasLt blas;
  cuda::LinearParams lp;
  lp.x = x.view;
  lp.weight = weight.view;
  lp.y = rows.view;
  lp.blas = &blas;
  DeviceBuffer workspace(cuda::linear_workspace_bytes(lp));
  cuda::CompressorPoolParams pp;
  pp.rows = rows.view;
  pp.token_position = tokens.position.view;
  pp.state_slot = state_slot.view;
  pp.state = state.view;
  pp.norm_weight = norm.view;
  pp.eps = static_cast<float>(c.rms_norm_eps);
  pp.ratio = kRatio;
  pp.latent = latent.view;
  const std::vector<double> us = time_runs(o, stream.get(), [&] {
    run_linear(lp, workspace.data(), stream.get());
    run_compressor_pool(pp, stream.get());
  });
  Workload w;
  w.what = format_string("%" PRId64 " tokens, ratio %d: [wkv; wgate] %" PRId64 " x %" PRId64
                         " bf16 GEMM to fp32, softmax pooling, RMSNorm",
                         T, kRatio, width, hidden);
  w.bytes = static_cast<double>(T * hidden) * 2 + static_cast<double>(width * hidden) * 2 +
            static_cast<double>(T * width) * 4 * 2 + static_cast<double>(T * D) * 2;
  w.bytes_note = "x, weights, projected rows written and read, latents";
  w.flops = 2.0 * static_cast<double>(T * width * hidden);
  print_result(o, c, w, us);
}

// A projection of the preset with its e4m3 weight and block scales (random codes in a finite
// range) over T tokens, timed as run_linear picks its implementation.
void time_fp8_linear(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream, const char* name, int64_t T,
                     int64_t out, int64_t in) {
  const int block = c.weight_quantization ? c.weight_quantization->block_out : 128;
  const int64_t scale_rows = (out + block - 1) / block, scale_cols = (in + block - 1) / block;
  HostTensor codes(DType::e4m3, {out, in}), scales(DType::ue8m0, {scale_rows, scale_cols});
  std::mt19937 rng(14);
  for (int64_t i = 0; i < codes.numel(); ++i) codes.as<uint8_t>()[i] = static_cast<uint8_t>(rng() % 0x70);
  for (int64_t i = 0; i < scales.numel(); ++i) scales.as<uint8_t>()[i] = static_cast<uint8_t>(110 + rng() % 8);
  DeviceTensor weight = cuda::inputs::device_tensor(codes), weight_scale = cuda::inputs::device_tensor(scales);
  DeviceTensor x = random_device_tensor(DType::bf16, {T, in}, 15), y = poisoned_tensor(DType::bf16, {T, out});
  cuda::BlasLt blas;
  const cuda::LinearParams p{.x = x.view, .weight = weight.view, .weight_scale = weight_scale.view, .block_out = block,
                             .block_in = block, .y = y.view, .blas = &blas};
  DeviceBuffer workspace(cuda::linear_workspace_bytes(p));
  const std::vector<double> us = time_runs(o, stream.get(), [&] { run_linear(p, workspace.data(), stream.get()); });
  Workload w;
  w.implementation = cuda::linear_implementation(p);
  const bool in_registers = w.implementation == "fp8_decode";
  w.what = format_string("%" PRId64 " tokens: %s %" PRId64 " x %" PRId64 " e4m3 weight (block %d, ue8m0 scales), %s, "
                         "bf16 out", T, name, out, in, block,
                         in_registers ? "converted to bf16 in registers" : "dequantized to bf16, bf16 GEMM");
  const double x_y_bytes = static_cast<double>(T * in) * 2 + static_cast<double>(T * out) * 2;
  w.bytes = static_cast<double>(out * in) * (in_registers ? 1 : 1 + 2 * 2) + x_y_bytes;
  w.bytes_note = in_registers ? "e4m3 weight read once, x, y" : "e4m3 weight read, bf16 weight written and read, x, y";
  w.flops = 2.0 * static_cast<double>(T * out * in);
  print_result(o, c, w, us);
}

// wq_b (q_lora_rank -> heads x head_dim) of a `context`-token chunk per sequence.
void bench_linear(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream) {
  time_fp8_linear(o, c, stream, "wq_b", o.batch * o.context, c.num_heads * c.head_dim, c.q_lora_rank);
}

// The decode projections that read the most weight bytes, wq_b and wo_b (groups x o_lora_rank ->
// hidden), at 1, 16 and 64 tokens (a decode step of that many sequences; --batch and --context
// are not used): the weight bytes per microsecond against the copy ceiling.
void bench_linear_decode(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream) {
  for (const int64_t T : {1, 16, 64}) {
    time_fp8_linear(o, c, stream, "wq_b", T, c.num_heads * c.head_dim, c.q_lora_rank);
    time_fp8_linear(o, c, stream, "wo_b", T, c.hidden_size, c.o_groups * c.o_lora_rank);
  }
}

// A RoPE table of the preset's rotated dims for every position of the chunk.
DeviceTensor rope_table_tensor(const ModelConfig& c, int64_t positions) {
  std::vector<float> frequencies(static_cast<size_t>(c.rope_head_dim / 2));
  for (size_t i = 0; i < frequencies.size(); ++i)
    frequencies[i] = static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(c.rope_head_dim)));
  return cuda::inputs::device_tensor(cuda::rope_table(frequencies, positions));
}

void bench_rope_heads(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream) {
  const int64_t L = o.context, H = c.num_heads, D = c.head_dim;
  Tokens tokens = make_tokens(o.batch, L, 0);
  const int64_t T = tokens.count;
  DeviceTensor table = rope_table_tensor(c, L);
  DeviceTensor q = random_device_tensor(DType::bf16, {T, H, D}, 16);
  const cuda::RopeHeadsParams p{.x = q.view, .token_position = tokens.position.view, .rope_table = table.view,
                                .out = q.view};
  const std::vector<double> us = time_runs(o, stream.get(), [&] { run_rope_heads(p, stream.get()); });
  Workload w;
  w.what = format_string("%" PRId64 " tokens x %" PRId64 " heads x %" PRId64 " bf16 q, RoPE of the last %" PRId64
                         " dims in place", T, H, D, c.rope_head_dim);
  w.bytes = static_cast<double>(T * H * D) * 2 * 2;
  w.bytes_note = "q read and written";
  w.flops = 0;
  print_result(o, c, w, us);
}

void bench_cache_insert(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream) {
  const int64_t B = o.batch, L = o.context, D = c.head_dim;
  Tokens tokens = make_tokens(B, L, 0);
  const int64_t T = tokens.count;
  Cache window = random_cache(KvRowFormat::v41_fp8, D, B, L, 17);
  // Token t of sequence s goes to row t of the sequence's pages (slot = page · rows_per_page + row).
  const std::vector<int32_t> table = cuda::inputs::download_as<int32_t>(window.block_table.view);
  const int64_t rows_per_page = window.view.geometry.rows_per_page, per_sequence = window.block_table.view.shape[1];
  std::vector<int64_t> slots;
  for (int64_t s = 0; s < B; ++s)
    for (int64_t t = 0; t < L; ++t)
      slots.push_back(table[static_cast<size_t>(s * per_sequence + t / rows_per_page)] * rows_per_page + t % rows_per_page);
  DeviceTensor dslots = device_array(slots, DType::i64, {T});
  DeviceTensor table_tensor = rope_table_tensor(c, L);
  DeviceTensor rows = random_device_tensor(DType::bf16, {T, D}, 18), norm = random_device_tensor(DType::bf16, {D}, 19);
  const cuda::CacheInsertParams p{.rows = rows.view, .norm_weight = norm.view, .eps = static_cast<float>(c.rms_norm_eps),
                                  .token_position = tokens.position.view, .rope_table = table_tensor.view,
                                  .quant = RowQuantizer::fp8_e4m3_32, .slots = dslots.view, .cache = window.view, .out = {}};
  const std::vector<double> us = time_runs(o, stream.get(), [&] { run_cache_insert(p, stream.get()); });
  Workload w;
  w.what = format_string("%" PRId64 " bf16 rows of %" PRId64 ": RMSNorm, RoPE, fp8 QAT, v41_fp8 encode (%d B/row)", T, D,
                         static_cast<int>(window.view.geometry.row.row_bytes()));
  w.bytes = static_cast<double>(T * D) * 2 + static_cast<double>(T) * (8 + static_cast<double>(window.view.geometry.row.row_bytes()));
  w.bytes_note = "rows and slots read, encoded rows written";
  w.flops = 0;
  print_result(o, c, w, us);
}

}  // namespace

const std::vector<BenchOp>& bench_ops() {
  static const std::vector<BenchOp> ops = {
      {"indexer", true, [](const BenchOptions& o, const ModelConfig& c, cuda::Stream& s) { bench_index_scores(o, c, s, 1); }},
      {"index-topk", true, &bench_index_topk},
      {"indexer-prefill", false, [](const BenchOptions& o, const ModelConfig& c, cuda::Stream& s) { bench_index_scores(o, c, s, kPrefillChunk); }},
      {"topk", true, [](const BenchOptions& o, const ModelConfig& c, cuda::Stream& s) { bench_topk(o, c, s, c.index_topk); }},
      {"topk-blocks", true, [](const BenchOptions& o, const ModelConfig& c, cuda::Stream& s) {
         bench_topk(o, c, s, c.candidate_topk_blocks);
       }},
      {"attention-decode", true, [](const BenchOptions& o, const ModelConfig& c, cuda::Stream& s) { bench_attention(o, c, s, false); }},
      {"attention-prefill", false, [](const BenchOptions& o, const ModelConfig& c, cuda::Stream& s) { bench_attention(o, c, s, true); }},
      {"compressor", false, &bench_compressor},
      {"linear", false, &bench_linear},
      {"linear-decode", true, &bench_linear_decode},
      {"rope-heads", false, &bench_rope_heads},
      {"cache-insert", false, &bench_cache_insert},
  };
  return ops;
}

}  // namespace dsv4::bench
