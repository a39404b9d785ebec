// dsv4 bench: times single GPU operations at a preset's dimensions (default: the released
// V4.1-Flash: 64 heads x 512, window 128, top-k 512, indexer 32 heads x 128) with CUDA events. The
// ops and the timing live in bench/ (bench/ops.cpp lists them); this file is the command line and
// the op that runs the engine:
//   layer              one decode step of a whole ratio-1 layer (kv source, index source, candidate
//                      source) through the CUDA engine, after prefilling `context` tokens per
//                      sequence; run_layer is captured in a CUDA graph and the graph is replayed.
//                      With --tp N, N rank processes (one GPU each) run their shards of the layer
//                      with the NCCL all-reduces inside the graph (docs/parallel.md).
//   step               one decode step of the whole model (every layer with the synthetic residual
//                      update between them, and the DSpark draft context) after a prefill, replayed
//                      as a graph of one child graph per layer, beside its roofline floor and the
//                      time of each kind of layer.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_options.h"
#include "dsv4/command.h"
#include "dsv4/config.h"
#include "dsv4/error.h"
#include "dsv4/kv_format.h"
#include "dsv4/tensor_parallel.h"

#ifdef DSV4_WITH_CUDA
#include "bench/bench.h"
#include "bench/device_inputs.h"
#include "dsv4/backend_util.h"
#include "dsv4/cuda/runtime.h"
#include "dsv4/engine.h"
#include "dsv4/synthetic_inputs.h"
#include "dsv4/weights.h"
#endif

namespace dsv4::cli {
namespace {

struct BenchCommandOptions : bench::BenchOptions {
  std::string preset = "v4.1-flash";
  TensorParallelFlags parallel;  // --op layer only
  int64_t prefill_tokens = int64_t{1} << 18;  // --op step: tokens prefilled; further sequences are forks
};

std::vector<std::string> op_names() {
  std::vector<std::string> names;
#ifdef DSV4_WITH_CUDA
  for (const bench::BenchOp& op : bench::bench_ops()) names.push_back(op.name);
#endif
  names.push_back("layer");
  names.push_back("step");
  return names;
}

#ifdef DSV4_WITH_CUDA
using bench::format_string;
using bench::kCopyBytesPerSecond;
using bench::percentile;
using bench::print_result;
using bench::time_graph;
using bench::Workload;
using cuda::inputs::DeviceTensor;
using cuda::inputs::poisoned_tensor;
using cuda::inputs::random_device_tensor;

// A one-layer model at the preset's dimensions whose layer does everything a V4.1 ratio-1 layer
// can: kv source, index source, candidate source.
ModelConfig single_layer_config(ModelConfig c) {
  DSV4_CHECK(c.family == ModelFamily::v4_1, "bench: --op layer needs a V4.1 preset, '", c.name, "' is ",
             family_name(c.family));
  c.num_layers = 1;
  c.num_mtp_layers = 0;
  c.dspark_target_layer_ids.clear();
  c.compress_ratios = {1};
  c.kv_source_layers = {0};
  c.index_source_layers = {0};
  c.candidate_source_layer = 0;
  validate_config(c);
  return c;
}

// Prefill steps of a decode bench carry at most this many tokens.
constexpr int64_t kPrefillTokens = 8192;

// The engine of a decode bench: `sequences` sequences, of which `prefilled` get `context` tokens
// in prefill steps of at most kPrefillTokens tokens, then `decode_steps` decode steps, on `stream`.
EngineOptions decode_bench_options(int64_t sequences, int64_t prefilled, int64_t context, int64_t decode_steps,
                                   cuda::Stream& stream) {
  EngineOptions options;
  options.backend = Backend::cuda;
  options.precision = Precision::reference;
  options.max_sequences = sequences;
  options.max_context = context + decode_steps;
  options.max_tokens_per_step = std::max(sequences, std::min(prefilled * context, kPrefillTokens));
  options.cuda_stream = stream.get();
  return options;
}

// Prefills each of `sequences` to `context` tokens, all of them in every step, at most
// `max_tokens` tokens per step; `queue_layers(first_position, tokens_per_sequence)` queues the
// step's layers between begin_step and end_step.
void prefill(Engine& engine, const std::vector<SequenceId>& sequences, int64_t context, int64_t max_tokens,
             const std::function<void(int64_t, int64_t)>& queue_layers) {
  const int64_t chunk = std::max<int64_t>(1, max_tokens / static_cast<int64_t>(sequences.size()));
  for (int64_t done = 0; done < context;) {
    const int64_t n = std::min(chunk, context - done);
    std::vector<StepEntry> step;
    for (SequenceId id : sequences) step.push_back({id, n});
    engine.begin_step(step);
    queue_layers(done, n);
    engine.end_step();
    done += n;
  }
}

// One token for each of `sequences`.
std::vector<StepEntry> decode_entries(const std::vector<SequenceId>& sequences) {
  std::vector<StepEntry> step;
  for (SequenceId id : sequences) step.push_back({id, 1});
  return step;
}

// An instantiated CUDA graph: the work a function queues on a stream, captured; or graphs run one
// after the other (child graphs).
class CapturedGraph {
 public:
  CapturedGraph(cudaStream_t stream, const std::function<void()>& queue) {
    DSV4_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      queue();
    } catch (...) {
      cudaStreamEndCapture(stream, &graph_);  // leaves the stream usable
      if (graph_) cudaGraphDestroy(graph_);
      throw;
    }
    DSV4_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    DSV4_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  explicit CapturedGraph(const std::vector<std::unique_ptr<CapturedGraph>>& parts) {
    DSV4_CUDA_CHECK(cudaGraphCreate(&graph_, 0));
    cudaGraphNode_t previous = nullptr;
    for (const auto& part : parts) {
      cudaGraphNode_t node = nullptr;
      DSV4_CUDA_CHECK(cudaGraphAddChildGraphNode(&node, graph_, previous ? &previous : nullptr, previous ? 1 : 0,
                                                 part->graph_));
      previous = node;
    }
    DSV4_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  cudaGraphExec_t exec() const { return exec_; }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Returns false when the ranks of a tensor-parallel run computed different outputs.
bool bench_layer(const BenchCommandOptions& o, const ModelConfig& preset, cuda::Stream& stream,
                 const std::shared_ptr<NcclCommunicator>& ranks) {
  const ModelConfig c = single_layer_config(preset);
  const ModelTopology topology = resolve_topology(c);
  const int64_t B = o.batch, L = o.context, hidden = c.hidden_size;
  auto weights = std::make_shared<const ModelWeights>(random_weights(c, topology, 1, true));
  const EngineOptions options = decode_bench_options(B, B, L, 1, stream);
  // A tensor-parallel rank runs its shard of the layer (docs/parallel.md).
  const RankShard shard = ranks ? make_rank_shard(c, *weights, options, ranks, o.parallel.indexer_sharding())
                                : RankShard{c, weights, options};
  const std::unique_ptr<Engine> engine_owner = Engine::create(shard.config, shard.weights, shard.options);
  Engine& engine = *engine_owner;
  std::vector<SequenceId> ids;
  for (int64_t s = 0; s < B; ++s) ids.push_back(engine.add_sequence());
  DeviceTensor in = random_device_tensor(DType::f32, {options.max_tokens_per_step, hidden}, 13);
  DeviceTensor out = poisoned_tensor(DType::f32, {options.max_tokens_per_step, hidden});
  const auto run_layer = [&](int64_t T) {
    engine.run_layer(0, in.buffer.view(DType::f32, {T, hidden}), out.buffer.view(DType::f32, {T, hidden}));
  };
  prefill(engine, ids, L, options.max_tokens_per_step, [&](int64_t, int64_t n) { run_layer(B * n); });
  stream.synchronize("bench: prefill");
  // The decode step, captured once and replayed: a replay writes the same rows again.
  engine.begin_step(decode_entries(ids));
  const CapturedGraph decode(stream.get(), [&] { run_layer(B); });
  const std::vector<double> us = time_graph(o, stream.get(), decode.exec());
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

// --- --op step ---------------------------------------------------------------------------------

// What a backbone layer does in a decode step, without layer numbers: the rows of the per-kind
// breakdown.
std::string layer_kind(const LayerPlan& p) {
  std::string kind = attention_kind_name(p.kind);
  if (p.compress_ratio > 0) kind += " ratio " + std::to_string(p.compress_ratio);
  if (p.owns_compressor) kind += p.owns_index_keys ? ", kv source with index keys" : ", kv source";
  else if (p.kv_source >= 0) kind += ", reads a kv source";
  if (p.owns_indexer) kind += p.uses_candidates ? ", index source (candidate-filtered)" : ", index source";
  else if (p.index_source >= 0) kind += ", reuses picks";
  else if (p.compress_ratio > 0) kind += ", attends every entry";
  if (p.is_candidate_source) kind += ", candidate source";
  return kind;
}

// The bytes a decode token at position `context` reads from the caches of a backbone layer at
// least: its window rows, the compressed rows it attends (the picks, or every entry without an
// index source) and, for an index source, the index keys it scores (those of the candidate blocks
// when it is candidate-filtered).
double decode_cache_bytes(const ModelConfig& c, const LayerPlan& p, const KvFormatSet& formats, int64_t context) {
  const auto row_bytes = [](KvRowFormat f, int64_t dims) { return static_cast<double>(row_layout(f, dims).row_bytes()); };
  double bytes = static_cast<double>(std::min(c.sliding_window, context + 1)) * row_bytes(formats.window, c.head_dim);
  if (p.compress_ratio > 0) {
    const int64_t entries = (context + 1) / p.compress_ratio;
    const bool picks = p.owns_indexer || p.index_source >= 0;
    bytes += static_cast<double>(picks ? std::min(c.index_topk, entries) : entries) *
             row_bytes(formats.compressed, c.head_dim);
    const int64_t scored = p.uses_candidates ? std::min(entries, c.candidate_topk_blocks * c.candidate_block_size) : entries;
    if (p.owns_indexer) bytes += static_cast<double>(scored) * row_bytes(formats.index_keys, c.index_head_dim);
  }
  return bytes;
}

// Bytes of a weight as the engine keeps it: projections of an fp8 checkpoint as e4m3 codes plus
// their block scales, other projections bf16, the rest (norms, biases, sinks) f32.
double device_weight_bytes(const ModelConfig& c, const ExpectedWeight& e) {
  double n = 1;
  for (int64_t d : e.shape) n *= static_cast<double>(d);
  if (e.shape.size() != 2) return n * 4.0;
  if (!e.fp8_allowed || !c.weight_quantization) return n * 2.0;
  const WeightQuantization& q = *c.weight_quantization;
  const double blocks = std::ceil(static_cast<double>(e.shape[0]) / q.block_out) *
                        std::ceil(static_cast<double>(e.shape[1]) / q.block_in);
  return n + blocks * (q.ue8m0_scales ? 1.0 : 4.0);
}

// One decode step of the whole model (every backbone layer, the synthetic residual update between
// them, and with DSpark draft layers the draft context), captured as a graph of one child graph
// per layer and replayed; each kind of layer is also timed alone (its first layer's graph).
void bench_step(const BenchCommandOptions& o, const ModelConfig& c, cuda::Stream& stream) {
  const ModelTopology topology = resolve_topology(c);
  const int64_t B = o.batch, L = o.context, hidden = c.hidden_size;
  const int layers = backbone_layer_count(c);
  const bool drafts = c.has_dspark();
  DSV4_CHECK(o.prefill_tokens >= 1, "bench: --prefill-tokens is ", o.prefill_tokens, ", expected >= 1");
  // Sequences beyond the prefill budget are forked from the prefilled ones (their pages shared).
  const int64_t prefilled = std::clamp<int64_t>(o.prefill_tokens / L, 1, B);
  auto weights = std::make_shared<const ModelWeights>(random_weights(c, topology, 1, c.weight_quantization.has_value()));
  // A warm-up decode step, then the timed one.
  EngineOptions options = decode_bench_options(B, prefilled, L, 2, stream);
  options.kv_format = !o.kv_format.empty()             ? o.kv_format
                      : c.family == ModelFamily::v4_1 ? "v4.1-native"
                                                      : "fp8_ds_mla";  // as dsv4 run
  const std::unique_ptr<Engine> engine_owner = Engine::create(c, weights, options);
  Engine& engine = *engine_owner;
  const int64_t T = options.max_tokens_per_step;
  DeviceRows hidden_rows(engine, T, hidden), out_rows(engine, T, hidden), step_inputs(engine, B, hidden);
  std::optional<DeviceRows> main_hidden;
  if (drafts) main_hidden.emplace(engine, T, c.dspark_main_width());
  TokenInputs token_inputs(engine, T);
  constexpr uint64_t kSeed = 1;
  // Layer-0 inputs of tokens [first, first + n) of each of the first `sequences` sequences.
  const auto keys = [](int64_t sequences, int64_t first, int64_t n) {
    std::vector<TokenKey> k;
    for (int64_t s = 0; s < sequences; ++s)
      for (int64_t t = 0; t < n; ++t) k.push_back({s, first + t, 0});
    return k;
  };
  // Layer l of a step of `rows` rows, as dsv4 run chains them.
  const auto queue_layer = [&](int l, int64_t rows) {
    if (main_hidden) keep_draft_inputs(c, l, hidden_rows, rows, *main_hidden);
    engine.run_layer(l, hidden_rows.view(rows), out_rows.view(rows));
    if (l + 1 < layers) chain_residual(hidden_rows, out_rows, rows);
  };
  const auto queue_draft_context = [&](int64_t rows) { engine.run_draft_context(main_hidden->view(rows)); };
  const auto queue_step = [&](int64_t rows) {
    for (int l = 0; l < layers; ++l) queue_layer(l, rows);
    if (drafts) queue_draft_context(rows);
  };

  std::vector<SequenceId> ids;
  for (int64_t s = 0; s < prefilled; ++s) ids.push_back(engine.add_sequence());
  prefill(engine, ids, L, T, [&](int64_t first, int64_t n) {
    token_inputs.fill(kSeed, keys(prefilled, first, n), hidden_rows);
    queue_step(prefilled * n);
  });
  for (int64_t s = prefilled; s < B; ++s) ids.push_back(engine.fork_sequence(ids[static_cast<size_t>(s % prefilled)]));
  // Eagerly first, so that what the decode shapes load on first use (kernels, cuBLASLt
  // algorithms) is loaded outside the capture.
  engine.begin_step(decode_entries(ids));
  token_inputs.fill(kSeed, keys(B, L, 1), hidden_rows);
  queue_step(B);
  engine.end_step();
  stream.synchronize("bench: prefill and warm-up decode step");

  // The timed step: every replay starts from the same layer-0 inputs and rewrites the same rows.
  engine.begin_step(decode_entries(ids));
  token_inputs.fill(kSeed, keys(B, L + 1, 1), step_inputs);
  std::vector<std::unique_ptr<CapturedGraph>> parts;
  for (int l = 0; l < layers; ++l)
    parts.push_back(std::make_unique<CapturedGraph>(stream.get(), [&] {
      if (l == 0) hidden_rows.copy_rows_from(step_inputs, 0, 0, B);
      queue_layer(l, B);
    }));
  if (drafts) parts.push_back(std::make_unique<CapturedGraph>(stream.get(), [&] { queue_draft_context(B); }));
  const CapturedGraph step(parts);
  const std::vector<double> us = time_graph(o, stream.get(), step.exec());
  struct Kind {
    std::string name;
    int first = 0;  // index into parts
    int count = 0;
    double us = 0;  // median of the first one's replays
  };
  std::vector<Kind> kinds;
  for (int l = 0; l < layers; ++l) {
    const std::string name = layer_kind(topology[l]);
    const auto kind = std::find_if(kinds.begin(), kinds.end(), [&](const Kind& k) { return k.name == name; });
    if (kind == kinds.end()) kinds.push_back({name, l, 1});
    else kind->count += 1;
  }
  if (drafts)
    kinds.push_back({format_string("DSpark draft context (%d draft layers' window rows)", c.num_mtp_layers), layers, 1});
  for (Kind& k : kinds) k.us = percentile(time_graph(o, stream.get(), parts[static_cast<size_t>(k.first)]->exec()), 0.5);
  engine.end_step();

  // The floor: every weight the step reads once, and per token the cache rows it reads.
  const KvFormatSet formats = kv_format_set(options.kv_format);
  double weight_bytes = 0, token_cache_bytes = 0, params = 0;
  for (int l = 0; l < layers; ++l) {
    for (const ExpectedWeight& e : expected_layer_weights(c, topology[l])) {
      weight_bytes += device_weight_bytes(c, e);
      if (e.shape.size() == 2) params += static_cast<double>(e.shape[0] * e.shape[1]);
    }
    token_cache_bytes += decode_cache_bytes(c, topology[l], formats, L);
  }
  // The draft context reads stage 0's main_proj / main_norm and every draft layer's kv path.
  for (int l = layers; drafts && l < topology.size(); ++l)
    for (const ExpectedWeight& e : expected_layer_weights(c, topology[l]))
      if (e.role == WeightRole::main_proj || e.role == WeightRole::main_norm || e.role == WeightRole::wkv ||
          e.role == WeightRole::kv_norm) {
        weight_bytes += device_weight_bytes(c, e);
        if (e.shape.size() == 2) params += static_cast<double>(e.shape[0] * e.shape[1]);
      }
  const double cache_bytes = static_cast<double>(B) * token_cache_bytes;
  Workload w;
  w.what = format_string("one decode token per sequence through %d layers%s (the synthetic residual update "
                         "between them), %s caches; %" PRId64 " of the %" PRId64
                         " sequences prefilled with %" PRId64 " synthetic tokens%s",
                         layers, drafts ? format_string(" and the DSpark draft context (%d draft layers)", c.num_mtp_layers).c_str() : "",
                         formats.name.c_str(), prefilled, B, L,
                         prefilled < B ? ", the others forked from them (shared pages, which the L2 may serve)" : "");
  w.bytes = weight_bytes + cache_bytes;
  w.bytes_note = "weights once, per token its window rows, attended compressed rows and scored index keys";
  w.flops = 2 * params * static_cast<double>(B);
  print_result(o, c, w, us);
  const double median = percentile(us, 0.5), floor_us = w.bytes / kCopyBytesPerSecond * 1e6;
  std::printf("  floor     %.1f us: weights %.1f MB + cache rows %.1f MB at %.1f TB/s; the step takes %.2fx the floor\n",
              floor_us, weight_bytes * 1e-6, cache_bytes * 1e-6, kCopyBytesPerSecond * 1e-12, median / floor_us);
  std::printf("  decode    %" PRId64 " tokens per step -> %.0f tokens/s (positions do not advance between replays: "
              "each recomputes the same step)\n",
              B, static_cast<double>(B) / (median * 1e-6));
  std::printf("  by kind   each kind's first layer replayed alone (median), times its layers:\n");
  double sum = 0;
  for (const Kind& k : kinds) {
    sum += k.us * k.count;
    std::printf("            %-68s %2d x %9.2f us = %9.2f us  %5.1f%%\n", k.name.c_str(), k.count, k.us, k.us * k.count,
                100.0 * k.us * k.count / median);
  }
  std::printf("            %-68s                %9.2f us  %5.1f%% of the whole step's %.2f us\n", "sum", sum,
              100.0 * sum / median, median);
}

int run_bench(BenchCommandOptions o) {
  DSV4_CHECK(o.parallel.tp == 1 || o.op == "layer", "bench: --tp applies to --op layer, not to --op ", o.op);
  DSV4_CHECK(o.kv_format.empty() || o.op == "step" || o.op.starts_with("attention-") || o.op.starts_with("index"),
             "bench: --kv-format applies to the attention, indexer and step ops, not to --op ", o.op);
  if (o.parallel.launches()) return launch_ranks(o.parallel, "bench");
  // A tensor-parallel rank joins its group first, which makes its GPU current.
  const std::shared_ptr<NcclCommunicator> ranks = join_rank_group(o.parallel, "bench");
  if (cuda::device_count() == 0) fail("bench: no CUDA device is present; bench times GPU operations");
  const ModelConfig c = preset_config(o.preset);
  const auto& ops = bench::bench_ops();
  const auto op = std::find_if(ops.begin(), ops.end(), [&](const bench::BenchOp& b) { return o.op == b.name; });
  const bool decode = o.op == "layer" || o.op == "step" || (op != ops.end() && op->decode);
  if (o.batch == 0) o.batch = o.op == "layer" ? 16 : decode ? 64 : 4;
  if (o.context == 0) o.context = o.op == "layer" || o.op == "step" ? 4096 : decode ? 8192 : 1024;
  DSV4_CHECK(o.batch >= 1 && o.batch <= 4096, "bench: --batch ", o.batch, " is outside [1, 4096]");
  DSV4_CHECK(o.context >= 1 && o.context <= (int64_t{1} << 20), "bench: --context ", o.context,
             " is outside [1, 1048576]");
  DSV4_CHECK(o.iters >= 1 && o.warmup >= 0, "bench: --iters ", o.iters, " and --warmup ", o.warmup,
             " must be >= 1 and >= 0");
  DSV4_CHECK(c.head_dim == 512, "bench: the kernels need head_dim 512, '", c.name, "' has ", c.head_dim);
  cuda::Stream stream;
  if (o.op == "step") {
    bench_step(o, c, stream);
    return 0;
  }
  if (op == ops.end()) return bench_layer(o, c, stream, ranks) ? 0 : 1;
  op->run(o, c, stream);
  return 0;
}
#else
int run_bench(const BenchCommandOptions&) {
  fail("bench: this binary was built without the CUDA backend (configure with -DDSV4_CUDA=ON); bench times GPU "
       "operations");
}
#endif

const CommandRegistration registration(
    "bench", "Time single GPU operations (CUDA events) at a preset's dimensions", [](CLI::App& app) {
      auto o = std::make_shared<BenchCommandOptions>();
      app.add_option("--op", o->op, "Operation to time")->required()->check(CLI::IsMember(op_names()));
      app.add_option("--preset", o->preset, "Model preset whose dimensions are used")->capture_default_str();
      app.add_option("--batch", o->batch,
                     "Sequences (default: 64 for decode ops and step, 4 for chunk ops (prefill, compressor, linear, "
                     "rope-heads, cache-insert), 16 for layer)");
      app.add_option("--context", o->context,
                     "Context tokens per sequence, or the chunk length of chunk ops "
                     "(default: 8192 decode, 1024 chunk ops, 4096 layer and step)");
      app.add_option("--kv-format", o->kv_format,
                     "KV format set of the caches the attention and indexer ops and step read (default: v4.1-native; "
                     "step: as dsv4 run)")
          ->check(CLI::IsMember(kv_format_set_names()));
      app.add_option("--prefill-tokens", o->prefill_tokens,
                     "--op step: at most this many tokens are prefilled (whole sequences of --context tokens); the "
                     "other sequences are forked from them, sharing their pages")
          ->capture_default_str();
      app.add_option("--iters", o->iters, "Timed runs")->capture_default_str();
      app.add_option("--warmup", o->warmup, "Untimed runs before them")->capture_default_str();
      o->parallel.add_to(app);
      return [o] { return run_bench(*o); };
    });

}  // namespace
}  // namespace dsv4::cli
