// dsv4 bench: times single GPU operations at a preset's dimensions (default: the released
// V4.1-Flash: 64 heads x 512, window 128, top-k 512, indexer 32 heads x 128) with CUDA events. The
// ops and the timing live in bench/ (bench/ops.cpp lists them); this file is the command line and
// the op that runs the engine:
//   layer              one decode step of a whole ratio-1 layer (kv source, index source, candidate
//                      source) through the CUDA engine, after prefilling `context` tokens per
//                      sequence; run_layer is captured in a CUDA graph and the graph is replayed.
//                      With --tp N, N rank processes (one GPU each) run their shards of the layer
//                      with the NCCL all-reduces inside the graph (docs/parallel.md).
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_options.h"
#include "dsv4/command.h"
#include "dsv4/config.h"
#include "dsv4/error.h"
#include "dsv4/tensor_parallel.h"

#ifdef DSV4_WITH_CUDA
#include "bench/bench.h"
#include "bench/device_inputs.h"
#include "dsv4/cuda/runtime.h"
#include "dsv4/engine.h"
#include "dsv4/kv_format.h"
#include "dsv4/weights.h"
#endif

namespace dsv4::cli {
namespace {

struct BenchCommandOptions : bench::BenchOptions {
  std::string preset = "v4.1-flash";
  TensorParallelFlags parallel;  // --op layer only
};

std::vector<std::string> op_names() {
  std::vector<std::string> names;
#ifdef DSV4_WITH_CUDA
  for (const bench::BenchOp& op : bench::bench_ops()) names.push_back(op.name);
#endif
  names.push_back("layer");
  return names;
}

#ifdef DSV4_WITH_CUDA
using bench::format_string;
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

// Returns false when the ranks of a tensor-parallel run computed different outputs.
bool bench_layer(const BenchCommandOptions& o, const ModelConfig& preset, cuda::Stream& stream,
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
  DeviceTensor in = random_device_tensor(DType::f32, {options.max_tokens_per_step, hidden}, 13);
  DeviceTensor out = poisoned_tensor(DType::f32, {options.max_tokens_per_step, hidden});
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
  const std::vector<double> us = time_graph(o, stream.get(), exec);
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

int run_bench(BenchCommandOptions o) {
  DSV4_CHECK(o.parallel.tp == 1 || o.op == "layer", "bench: --tp applies to --op layer, not to --op ", o.op);
  if (o.parallel.launches()) return launch_ranks(o.parallel, "bench");
  // A tensor-parallel rank joins its group first, which makes its GPU current.
  const std::shared_ptr<NcclCommunicator> ranks = join_rank_group(o.parallel, "bench");
  if (cuda::device_count() == 0) fail("bench: no CUDA device is present; bench times GPU operations");
  const ModelConfig c = preset_config(o.preset);
  const auto& ops = bench::bench_ops();
  const auto op = std::find_if(ops.begin(), ops.end(), [&](const bench::BenchOp& b) { return o.op == b.name; });
  const bool decode = o.op == "layer" || (op != ops.end() && op->decode);
  if (o.batch == 0) o.batch = o.op == "layer" ? 16 : decode ? 64 : 4;
  if (o.context == 0) o.context = o.op == "layer" ? 4096 : decode ? 8192 : 1024;
  DSV4_CHECK(o.batch >= 1 && o.batch <= 4096, "bench: --batch ", o.batch, " is outside [1, 4096]");
  DSV4_CHECK(o.context >= 1 && o.context <= (int64_t{1} << 20), "bench: --context ", o.context,
             " is outside [1, 1048576]");
  DSV4_CHECK(o.iters >= 1 && o.warmup >= 0, "bench: --iters ", o.iters, " and --warmup ", o.warmup,
             " must be >= 1 and >= 0");
  DSV4_CHECK(c.head_dim == 512, "bench: the kernels need head_dim 512, '", c.name, "' has ", c.head_dim);
  cuda::Stream stream;
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
                     "Sequences (default: 64 for decode ops, 4 for chunk ops (prefill, compressor, linear, "
                     "rope-heads, cache-insert), 16 for layer)");
      app.add_option("--context", o->context,
                     "Context tokens per sequence, or the chunk length of chunk ops "
                     "(default: 8192 decode, 1024 chunk ops, 4096 layer)");
      app.add_option("--iters", o->iters, "Timed runs")->capture_default_str();
      app.add_option("--warmup", o->warmup, "Untimed runs before them")->capture_default_str();
      o->parallel.add_to(app);
      return [o] { return run_bench(*o); };
    });

}  // namespace
}  // namespace dsv4::cli
