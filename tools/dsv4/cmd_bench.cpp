// dsv4 bench: times single GPU operations at a preset's dimensions (default: the released
// V4.1-Flash: 64 heads x 512, window 128, top-k 512, indexer 32 heads x 128) with CUDA events:
// warm-up runs, then timed runs, each bracketed by its own pair of events. Prints the median and
// the spread, the bytes the operation must move and the work it does, next to the H200 ceilings.
//
// Operations (`--batch` sequences with `--context` tokens of context each):
//   indexer            index scores of one decode token per sequence against its `context` keys
//                      (ratio 1, MXFP4 key cache)
//   topk               top-k (index_topk) of one score row of `context` entries per sequence
//   attention-decode   sparse attention of one decode token per sequence: window rows (v41_fp8)
//                      plus index_topk picked entries (v41_fp4) out of `context`
//   attention-prefill  sparse attention of a `context`-token prefill chunk per sequence, each token
//                      attending its window and min(index_topk, p + 1) picked entries
//   compressor         the ratio-2 compressor of a `context`-token chunk per sequence: the fused
//                      [wkv; wgate] projection and the pooling with its state ring
//   layer              one decode step of a whole ratio-1 layer (kv source, index source, candidate
//                      source) through the CUDA engine, after prefilling `context` tokens per
//                      sequence; run_layer is captured in a CUDA graph and the graph is replayed.
//                      With --tp N, N rank processes (one GPU each) run their shards of the layer
//                      with the NCCL all-reduces inside the graph (docs/parallel.md).
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dsv4/command.h"
#include "dsv4/config.h"
#include "dsv4/error.h"
#include "dsv4/tensor_parallel.h"

#ifdef DSV4_WITH_CUDA
#include "dsv4/cuda/attention.h"
#include "dsv4/cuda/compressor.h"
#include "dsv4/cuda/indexer.h"
#include "dsv4/cuda/projection.h"
#include "dsv4/cuda/runtime.h"
#include "dsv4/engine.h"
#include "dsv4/kv_format.h"
#include "dsv4/weights.h"
#endif

namespace dsv4::cli {
namespace {

const std::vector<std::string> kOps = {"indexer", "topk", "attention-decode", "attention-prefill", "compressor",
                                       "layer"};

struct BenchOptions {
  std::string op;
  std::string preset = "v4.1-flash";
  int64_t batch = 0;    // 0: the operation's default
  int64_t context = 0;  // 0: the operation's default
  int iters = 50;
  int warmup = 5;
  TensorParallelFlags parallel;  // --op layer only
};

#ifdef DSV4_WITH_CUDA
// H200 ceilings the results are compared with.
constexpr double kCopyBytesPerSecond = 4.2e12;  // HBM3e, read + write
constexpr double kBf16FlopsPerSecond = 760e12;  // dense bf16 tensor-core GEMM
constexpr double kFp8FlopsPerSecond = 1350e12;  // dense fp8 tensor-core GEMM

// What one operation was timed at and what a run of it moves and computes.
struct Workload {
  std::string what;        // one line: shapes and formats
  double bytes = 0;        // bytes a run must read and write at least
  std::string bytes_note;  // which bytes are counted
  double flops = 0;        // multiply-adds x 2
};

double percentile(std::vector<double> sorted, double q) {
  std::sort(sorted.begin(), sorted.end());
  const double at = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(at)), hi = static_cast<size_t>(std::ceil(at));
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (at - static_cast<double>(lo));
}

void print_result(const BenchOptions& o, const ModelConfig& c, const Workload& w, const std::vector<double>& us) {
  std::printf("dsv4 bench: op %s, preset %s (%d heads x %" PRId64 ", window %" PRId64 ", top-k %" PRId64
              ", index %d heads x %" PRId64 "), batch %" PRId64 ", context %" PRId64 "\n",
              o.op.c_str(), c.name.c_str(), c.num_heads, c.head_dim, c.sliding_window, c.index_topk, c.index_n_heads,
              c.index_head_dim, o.batch, o.context);
  std::printf("  workload  %s\n", w.what.c_str());
  const double median = percentile(us, 0.5);
  std::printf("  time      median %.2f us   p10 %.2f   p90 %.2f   min %.2f   max %.2f   (%d runs after %d warm-up)\n",
              median, percentile(us, 0.1), percentile(us, 0.9), *std::min_element(us.begin(), us.end()),
              *std::max_element(us.begin(), us.end()), o.iters, o.warmup);
  const double seconds = median * 1e-6;
  std::printf("  memory    %.3f MB counted (%s) -> %.1f GB/s = %.1f%% of the %.1f TB/s copy ceiling\n", w.bytes * 1e-6,
              w.bytes_note.c_str(), w.bytes / seconds * 1e-9, 100.0 * w.bytes / seconds / kCopyBytesPerSecond,
              kCopyBytesPerSecond * 1e-12);
  std::printf("  compute   %.3f GFLOP -> %.2f TFLOP/s = %.2f%% of bf16 GEMM %.0f TFLOP/s (%.2f%% of fp8 %.0f)\n",
              w.flops * 1e-9, w.flops / seconds * 1e-12, 100.0 * w.flops / seconds / kBf16FlopsPerSecond,
              kBf16FlopsPerSecond * 1e-12, 100.0 * w.flops / seconds / kFp8FlopsPerSecond, kFp8FlopsPerSecond * 1e-12);
}

using cuda::DeviceBuffer;

// Times `launch` (which queues one run on `stream`): warm-up runs, then one event pair per run.
template <class Launch>
std::vector<double> time_runs(const BenchOptions& o, cudaStream_t stream, const Launch& launch) {
  for (int i = 0; i < o.warmup; ++i) launch();
  std::vector<cudaEvent_t> events(static_cast<size_t>(2 * o.iters));
  for (cudaEvent_t& e : events) DSV4_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < o.iters; ++i) {
    DSV4_CUDA_CHECK(cudaEventRecord(events[static_cast<size_t>(2 * i)], stream));
    launch();
    DSV4_CUDA_CHECK(cudaEventRecord(events[static_cast<size_t>(2 * i + 1)], stream));
  }
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> us;
  for (int i = 0; i < o.iters; ++i) {
    float ms = 0;
    DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, events[static_cast<size_t>(2 * i)], events[static_cast<size_t>(2 * i + 1)]));
    us.push_back(1000.0 * ms);
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  return us;
}

// A device tensor with its buffer.
struct Tensor {
  DeviceBuffer buffer;
  TensorView view;
};

Tensor device_tensor(DType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  Tensor t{DeviceBuffer(static_cast<size_t>(n) * dtype_size(dtype)), {}};
  t.view = t.buffer.view(dtype, shape);
  return t;
}

template <class T>
Tensor upload(const std::vector<T>& values, DType dtype, const std::vector<int64_t>& shape) {
  Tensor t = device_tensor(dtype, shape);
  t.buffer.upload(values.data(), values.size() * sizeof(T));
  return t;
}

// Random values of a bf16 (bits) / f32 tensor.
Tensor random_tensor(DType dtype, const std::vector<int64_t>& shape, uint32_t seed) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  if (dtype == DType::bf16) {
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    for (uint16_t& b : bits) b = float_to_bf16_bits(dist(rng));
    return upload(bits, dtype, shape);
  }
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = dist(rng);
  return upload(values, dtype, shape);
}

// A paged cache of `sequences` x `rows` rows: every sequence owns its pages (in a shuffled order);
// the pages hold random rows encoded on the host (a block of distinct pages, repeated).
struct Cache {
  Tensor pages, block_table;
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
  c.pages = device_tensor(DType::u8, {num_pages, g.page_stride});
  for (int64_t p = 0; p < num_pages; p += distinct) {
    const int64_t n = std::min(distinct, num_pages - p);
    cuda::copy_to_device(static_cast<std::byte*>(c.pages.buffer.data()) + p * g.page_stride, block.data(),
                         static_cast<size_t>(n * g.page_stride));
  }
  std::vector<int32_t> table(static_cast<size_t>(num_pages));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  c.block_table = upload(table, DType::i32, {sequences, per_sequence});
  c.view.pages = c.pages.view;
  c.view.block_table = c.block_table.view;
  c.view.geometry = g;
  return c;
}

// Tokens of `sequences` sequences, `per_sequence` each, at positions start ... start + per_sequence - 1.
struct Tokens {
  Tensor sequence, position;
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
  return {upload(seq, DType::i32, {n}), upload(pos, DType::i32, {n}), n};
}

// Per token at position p: min(k, p + 1) distinct entries below p + 1, ascending, -1 padded.
Tensor random_picks(const std::vector<int64_t>& positions, int64_t k, uint32_t seed) {
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
  return upload(picks, DType::i32, {static_cast<int64_t>(positions.size()), k});
}

std::string format_string(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format_string(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

void bench_indexer(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream) {
  const int64_t B = o.batch, E = o.context, nI = c.index_n_heads, dI = c.index_head_dim;
  Cache keys = random_cache(KvRowFormat::index_mxfp4, dI, B, E, 1);
  Tokens tokens = make_tokens(B, 1, E - 1);  // ratio 1: the token sees all E entries
  Tensor q = random_tensor(DType::bf16, {B, nI, dI}, 2), weights = random_tensor(DType::f32, {B, nI}, 3);
  Tensor scores = device_tensor(DType::f32, {B, E});
  cuda::IndexScoresParams p;
  p.q = q.view;
  p.weights = weights.view;
  p.keys = keys.view;
  p.token_sequence = tokens.sequence.view;
  p.token_position = tokens.position.view;
  p.compress_ratio = 1;
  p.scores = scores.view;
  const std::vector<double> us = time_runs(o, stream.get(), [&] { run_index_scores(p, stream.get()); });
  const double key_bytes = static_cast<double>(keys.view.geometry.row.row_bytes());
  Workload w;
  w.what = format_string("%" PRId64 " decode tokens x %" PRId64 " index_mxfp4 keys (%d B/row), fp32 scores", B, E,
                         static_cast<int>(key_bytes));
  w.bytes = static_cast<double>(B * E) * (key_bytes + 4) + static_cast<double>(B * nI) * (dI * 2 + 4);
  w.bytes_note = "keys read once, scores written";
  w.flops = 2.0 * static_cast<double>(B * E * nI * dI);
  print_result(o, c, w, us);
}

void bench_topk(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream) {
  const int64_t B = o.batch, E = o.context, k = c.index_topk;
  Tensor scores = random_tensor(DType::f32, {B, E}, 4), picks = device_tensor(DType::i32, {B, k});
  cuda::TopkParams p;
  p.scores = scores.view;
  p.picks = picks.view;
  const std::vector<double> us = time_runs(o, stream.get(), [&] { run_topk(p, stream.get()); });
  Workload w;
  w.what = format_string("%" PRId64 " rows of %" PRId64 " fp32 scores, top %" PRId64, B, E, k);
  w.bytes = static_cast<double>(B * E) * 4 + static_cast<double>(B * k) * 4;
  w.bytes_note = "scores read once, picks written";
  w.flops = 0;
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
  Cache window = random_cache(KvRowFormat::v41_fp8, D, B, L, 5);
  Cache compressed = random_cache(KvRowFormat::v41_fp4, D, B, L, 6);
  Tensor picks = random_picks(positions, k, 7);
  Tensor q = random_tensor(DType::bf16, {tokens.count, H, D}, 8), sink = random_tensor(DType::f32, {H}, 9);
  Tensor out = device_tensor(DType::bf16, {tokens.count, H, D});
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
  // Small steps split each token's rows over several blocks (the engine does the same).
  const size_t workspace_bytes = cuda::sparse_attention_workspace_bytes(p);
  DeviceBuffer workspace(workspace_bytes);
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
  w.what = format_string("%" PRId64 " tokens x %" PRId64 " heads, window %" PRId64 " (v41_fp8) + %" PRId64
                         " picks (v41_fp4), bf16 q and out%s",
                         tokens.count, H, W, k, workspace_bytes > 0 ? ", rows split over blocks" : "");
  w.bytes = cache_bytes + static_cast<double>(tokens.count * H * D) * 4 +
            static_cast<double>(tokens.count * k) * 4;
  w.bytes_note = prefill ? "every cache row of the chunk once, q, out, picks" : "attended rows once, q, out, picks";
  w.flops = 4.0 * static_cast<double>(H * D) * rows;  // q·row and p·row per head and row
  print_result(o, c, w, us);
}

void bench_compressor(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream) {
  const int64_t B = o.batch, L = o.context, hidden = c.hidden_size, D = c.head_dim;
  constexpr int kRatio = 2;
  const int64_t width = 2 * D;  // [kv | gate]
  Tokens tokens = make_tokens(B, L, 0);
  const int64_t T = tokens.count;
  std::vector<int32_t> slots(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) slots[static_cast<size_t>(t)] = static_cast<int32_t>(t / L);
  Tensor state_slot = upload(slots, DType::i32, {T});
  Tensor x = random_tensor(DType::bf16, {T, hidden}, 10), weight = random_tensor(DType::bf16, {width, hidden}, 11);
  Tensor rows = device_tensor(DType::f32, {T, width}), state = device_tensor(DType::f32, {B, kRatio, width});
  Tensor norm = random_tensor(DType::f32, {D}, 12), latent = device_tensor(DType::bf16, {T, D});
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

// A one-layer model at the preset's dimensions whose layer does everything a V4.1 ratio-1 layer
// can: kv source, index source, candidate source.
ModelConfig single_layer_config(ModelConfig c) {
  DSV4_CHECK(c.family == ModelFamily::v4_1, "bench: --op layer needs a V4.1 preset, '", c.name, "' is ",
             family_name(c.family));
  c.num_layers = 1;
  c.num_mtp_layers = 0;
  c.compress_ratios = {1};
  c.kv_source_layers = {0};
  c.index_source_layers = {0};
  c.candidate_source_layer = 0;
  validate_config(c);
  return c;
}

// Returns false when the ranks of a tensor-parallel run computed different outputs.
bool bench_layer(const BenchOptions& o, const ModelConfig& preset, cuda::Stream& stream,
                 const std::shared_ptr<NcclCommunicator>& ranks) {
  const ModelConfig c = single_layer_config(preset);
  const ModelTopology topology = resolve_topology(c);
  const int64_t B = o.batch, L = o.context, hidden = c.hidden_size;
  auto weights = std::make_shared<const ModelWeights>(random_weights(c, topology, 1, true));
  constexpr int64_t kPrefillTokens = 8192;
  EngineOptions options;
  options.backend = Backend::cuda;
  options.precision = Precision::reference;
  options.max_sequences = B;
  options.max_context = L + 1;
  options.max_tokens_per_step = std::max(B, std::min(B * L, kPrefillTokens));
  options.cuda_stream = stream.get();
  // A tensor-parallel rank runs its shard of the layer (docs/parallel.md).
  const RankShard shard = ranks ? make_rank_shard(c, *weights, options, ranks, o.parallel.indexer_sharding())
                                : RankShard{c, weights, options};
  const std::unique_ptr<Engine> engine_owner = Engine::create(shard.config, shard.weights, shard.options);
  Engine& engine = *engine_owner;
  std::vector<SequenceId> ids;
  for (int64_t s = 0; s < B; ++s) ids.push_back(engine.add_sequence());
  Tensor in = random_tensor(DType::f32, {options.max_tokens_per_step, hidden}, 13);
  Tensor out = device_tensor(DType::f32, {options.max_tokens_per_step, hidden});
  const auto run = [&](const std::vector<StepEntry>& step) {
    int64_t T = 0;
    for (const StepEntry& e : step) T += e.num_tokens;
    engine.begin_step(step);
    engine.run_layer(0, in.buffer.view(DType::f32, {T, hidden}), out.buffer.view(DType::f32, {T, hidden}));
  };
  // Prefill every sequence to L tokens, in steps of at most kPrefillTokens tokens.
  const int64_t chunk = std::max<int64_t>(1, options.max_tokens_per_step / B);
  for (int64_t done = 0; done < L;) {
    const int64_t n = std::min(chunk, L - done);
    std::vector<StepEntry> step;
    for (SequenceId id : ids) step.push_back({id, n});
    run(step);
    engine.end_step();
    done += n;
  }
  stream.synchronize("bench: prefill");
  // The decode step, captured once and replayed: a replay writes the same rows again.
  std::vector<StepEntry> decode;
  for (SequenceId id : ids) decode.push_back({id, 1});
  engine.begin_step(decode);
  cudaGraph_t graph = nullptr;
  DSV4_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  engine.run_layer(0, in.buffer.view(DType::f32, {B, hidden}), out.buffer.view(DType::f32, {B, hidden}));
  DSV4_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  DSV4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const std::vector<double> us = time_runs(o, stream.get(), [&] { DSV4_CUDA_CHECK(cudaGraphLaunch(exec, stream.get())); });
  DSV4_CUDA_CHECK(cudaGraphExecDestroy(exec));
  DSV4_CUDA_CHECK(cudaGraphDestroy(graph));
  engine.end_step();
  // The ranks' decode outputs (all-reduced) must be the same bits on every rank.
  bool ranks_agree = true;
  if (ranks) {
    std::vector<uint32_t> bits(static_cast<size_t>(B * hidden));
    out.buffer.download(bits.data(), bits.size() * sizeof(uint32_t));
    uint64_t hash = 0xCBF29CE484222325ull;
    for (uint32_t b : bits) hash = (hash ^ b) * 0x100000001B3ull;
    ranks_agree = ranks->same_on_all_ranks(hash);
    if (ranks->rank() != 0) return ranks_agree;
  }

  const int64_t H = c.num_heads, D = c.head_dim, k = c.index_topk, nI = c.index_n_heads, dI = c.index_head_dim;
  double params = 0;
  for (const ExpectedWeight& e : expected_layer_weights(c, topology[0]))
    if (e.shape.size() == 2) params += static_cast<double>(e.shape[0] * e.shape[1]);
  const int64_t window_rows = std::min(c.sliding_window, L + 1), picked_rows = std::min(k, L + 1);
  const double rows = static_cast<double>(window_rows + picked_rows);
  const auto row_bytes = [&](KvRowFormat f, int64_t dims) { return static_cast<double>(row_layout(f, dims).row_bytes()); };
  const double token_cache_bytes = static_cast<double>(window_rows) * row_bytes(KvRowFormat::v41_fp8, D) +
                                   static_cast<double>(picked_rows) * row_bytes(KvRowFormat::v41_fp4, D) +
                                   static_cast<double>(L + 1) * row_bytes(KvRowFormat::index_mxfp4, dI);
  Workload w;
  w.what = format_string("one decode token per sequence through a ratio-1 kv/index/candidate-source layer, "
                         "%.0f M projection weights (bf16), v4.1-native caches",
                         params * 1e-6);
  w.bytes = 2 * params + static_cast<double>(B) * token_cache_bytes;
  w.bytes_note = "bf16 weights once, attended rows and all index keys per token";
  w.flops = 2 * params * static_cast<double>(B) + 4.0 * static_cast<double>(B * H * D) * rows +
            2.0 * static_cast<double>(B) * static_cast<double>(L + 1) * static_cast<double>(nI * dI);
  print_result(o, c, w, us);
  const double median = percentile(us, 0.5);
  std::printf("  decode    %" PRId64 " tokens per step through the layer -> %.0f tokens/s\n", B,
              static_cast<double>(B) / (median * 1e-6));
  if (ranks)
    std::printf("  parallel  tp %d (GPUs 0..%d, NCCL all-reduce of the output%s in the graph), %d of %d heads per "
                "rank, indexer %s; decode outputs %s on all ranks\n",
                ranks->size(), ranks->size() - 1, o.parallel.indexer == "split" ? " and the index scores" : "",
                shard.config.num_heads, c.num_heads, o.parallel.indexer.c_str(), ranks_agree ? "identical" : "DIFFER (FAIL)");
  return ranks_agree;
}

int run_bench(BenchOptions o) {
  DSV4_CHECK(o.parallel.tp == 1 || o.op == "layer", "bench: --tp applies to --op layer, not to --op ", o.op);
  if (o.parallel.launches()) return launch_ranks(o.parallel, "bench");
  // A tensor-parallel rank joins its group first, which makes its GPU current.
  const std::shared_ptr<NcclCommunicator> ranks = join_rank_group(o.parallel, "bench");
  if (cuda::device_count() == 0) fail("bench: no CUDA device is present; bench times GPU operations");
  const ModelConfig c = preset_config(o.preset);
  const bool decode = o.op == "indexer" || o.op == "topk" || o.op == "attention-decode" || o.op == "layer";
  if (o.batch == 0) o.batch = o.op == "layer" ? 16 : decode ? 64 : 4;
  if (o.context == 0) o.context = o.op == "layer" ? 4096 : decode ? 8192 : 1024;
  DSV4_CHECK(o.batch >= 1 && o.batch <= 4096, "bench: --batch ", o.batch, " is outside [1, 4096]");
  DSV4_CHECK(o.context >= 1 && o.context <= (int64_t{1} << 20), "bench: --context ", o.context,
             " is outside [1, 1048576]");
  DSV4_CHECK(o.iters >= 1 && o.warmup >= 0, "bench: --iters ", o.iters, " and --warmup ", o.warmup,
             " must be >= 1 and >= 0");
  DSV4_CHECK(c.head_dim == 512 && c.index_head_dim == 128, "bench: the kernels need head_dim 512 and index_head_dim 128, '",
             c.name, "' has ", c.head_dim, " and ", c.index_head_dim);
  cuda::Stream stream;
  if (o.op == "indexer") bench_indexer(o, c, stream);
  else if (o.op == "topk") bench_topk(o, c, stream);
  else if (o.op == "attention-decode") bench_attention(o, c, stream, false);
  else if (o.op == "attention-prefill") bench_attention(o, c, stream, true);
  else if (o.op == "compressor") bench_compressor(o, c, stream);
  else return bench_layer(o, c, stream, ranks) ? 0 : 1;
  return 0;
}
#else
int run_bench(const BenchOptions&) {
  fail("bench: this binary was built without the CUDA backend (configure with -DDSV4_CUDA=ON); bench times GPU "
       "operations");
}
#endif

const CommandRegistration registration(
    "bench", "Time single GPU operations (CUDA events) at a preset's dimensions", [](CLI::App& app) {
      auto o = std::make_shared<BenchOptions>();
      app.add_option("--op", o->op, "Operation to time")->required()->check(CLI::IsMember(kOps));
      app.add_option("--preset", o->preset, "Model preset whose dimensions are used")->capture_default_str();
      app.add_option("--batch", o->batch,
                     "Sequences (default: 64 for decode ops, 4 for prefill / compressor, 16 for layer)");
      app.add_option("--context", o->context,
                     "Context tokens per sequence, or the chunk length of prefill / compressor "
                     "(default: 8192 decode, 1024 prefill, 4096 layer)");
      app.add_option("--iters", o->iters, "Timed runs")->capture_default_str();
      app.add_option("--warmup", o->warmup, "Untimed runs before them")->capture_default_str();
      o->parallel.add_to(app);
      return [o] { return run_bench(*o); };
    });

}  // namespace
}  // namespace dsv4::cli
