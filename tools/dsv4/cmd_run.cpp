// dsv4 run: the main job. Serves a synthetic workload through the engine the way a serving loop
// would (continuous batching: chunked prefill of new sequences interleaved with decode steps of
// running ones, sequences released as they finish), reports throughput and KV-cache size, and
// checks one sequence against an independent recomputation in a fresh engine.
//
// Layer inputs are synthetic: layer 0 of every token gets uniform random values of unit variance
// that depend only on (seed, sequence, position, attempt); layer l+1 gets RMSNorm(h_l + attn_out_l)
// of the same token (no weight), a residual stream in miniature (synthetic_inputs.h: the same bits
// from the host loops of the cpu backend and the kernels of the cuda backend). With the cuda
// backend the rows stay on the GPU: a step's layers and residual updates are stream-ordered device
// work with no copy across PCIe and no wait in between. The check feeds the recomputation the
// inputs each layer had in the workload, so that every layer is compared on its own.
//
// With --speculative K every decode step is a verify step, DSpark-style: each sequence past its
// prompt carries its bonus token and K drafts, a seeded random number of the drafts is accepted and
// the rest rolled back (Engine::rollback_sequence); a rejected position is decoded again in a later
// attempt with other inputs, so the check (a recomputation over the accepted tokens only) finds any
// trace a rejected draft left behind. A model with DSpark draft layers also drafts: every step
// gives the draft layers the target layers' inputs (run_draft_context), and before each verify step
// every draft stage runs over a block per verifying sequence (run_draft_block), its inputs synthetic.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/backend_util.h"
#include "dsv4/command.h"
#include "dsv4/config.h"
#ifdef DSV4_WITH_CUDA
#include "dsv4/cuda/runtime.h"
#endif
#include "dsv4/engine.h"
#include "dsv4/error.h"
#include "dsv4/parallel.h"
#include "dsv4/progress.h"
#include "dsv4/synthetic_inputs.h"
#include "dsv4/tensor_parallel.h"
#include "dsv4/weights.h"

namespace dsv4::cli {
namespace {

// The defaults of the workload flags, by where the run happens.
struct RunProfile {
  std::string preset;
  int64_t sequences;
  int64_t prompt_len;
  double prompt_spread;
  int64_t gen_len;
  int64_t chunk;
  int64_t max_running;
  int64_t step_tokens;
};

// Small enough for a minute on two cores: six sequences of 100..300 prompt tokens, four at a time.
RunProfile cpu_profile() { return {"tiny-v4.1", 6, 200, 0.5, 32, 64, 4, 256}; }
// A serving-like load: 64 sequences of 4096 prompt tokens, then 128 decode steps.
RunProfile gpu_profile() { return {"v4.1-flash", 64, 4096, 0.0, 128, 2048, 64, 16384}; }

// The backend when --backend is not given: cuda when this binary has it and it runs here.
Backend default_backend() { return built_with_cuda() ? usable_backend(Backend::cuda, "run") : Backend::cpu; }

struct RunOptions {
  std::string preset;
  std::string config_path;
  std::string weights_path;
  std::string backend;
  std::string precision = "reference";
  std::string kv_format;
  int64_t sequences = 0;
  int64_t prompt_len = 0;
  double prompt_spread = 0.0;
  int64_t gen_len = 0;
  int64_t chunk = 0;
  int64_t max_running = 0;
  int64_t step_tokens = 0;
  uint64_t seed = 1;
  int64_t speculative = 0;
  double check_tolerance = 0.0;
  int threads = 0;
  int64_t attention_stage_mib = EngineOptions{}.attention_stage_bytes >> 20;
  std::string trace_path;
  std::optional<int> device_fill;
  TensorParallelFlags parallel;
  // The flags whose defaults depend on the profile; those not given take the profile's.
  std::map<std::string, const CLI::Option*> profile_flags;
  bool was_given(const std::string& flag) const { return profile_flags.at(flag)->count() > 0; }
};

// --- synthetic inputs (synthetic_inputs.h) ---------------------------------------------------

// One step's token rows: which sequence and positions each entry covers.
struct StepRows {
  struct Span {
    int sequence;  // index into the workload
    int64_t first_position;
    int64_t tokens;
    int64_t attempt = 0;  // verify steps of the sequence so far (--speculative)
    bool verify = false;  // a verify step: the bonus token and drafts
  };
  std::vector<Span> spans;
  int64_t rows = 0;
};

// The tokens of the step's rows, in order.
std::vector<TokenKey> step_token_keys(const StepRows& step) {
  std::vector<TokenKey> keys;
  keys.reserve(static_cast<size_t>(step.rows));
  for (const StepRows::Span& span : step.spans)
    for (int64_t t = 0; t < span.tokens; ++t) keys.push_back({span.sequence, span.first_position + t, span.attempt});
  return keys;
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The check: runs layer `layer` of a begun step on `rows` host rows of `hidden` and brings its
// output to `attn_out` on the host.
void run_layer_on_host_rows(Engine& engine, int layer, int64_t rows, const float* hidden, float* attn_out,
                            DeviceRows& device_in, DeviceRows& device_out) {
  device_in.upload(hidden, rows);
  engine.run_layer(layer, device_in.view(rows), device_out.view(rows));
  device_out.download(attn_out, rows);
}

// --- the workload ----------------------------------------------------------------------------

struct Workload {
  std::vector<int64_t> prompt_lengths;  // per sequence, in arrival order
  int64_t gen_len = 0;
  int64_t chunk = 0;
  int64_t max_running = 0;
  int64_t step_tokens = 0;
  int64_t speculative = 0;  // drafts per verify step (0: plain decode)
  int64_t longest() const { return *std::max_element(prompt_lengths.begin(), prompt_lengths.end()) + gen_len; }
  int64_t total_tokens() const {
    int64_t total = 0;
    for (int64_t p : prompt_lengths) total += p + gen_len;
    return total;
  }
};

// Prompt lengths spread evenly over prompt_len * (1 +- spread), in a seeded random order.
std::vector<int64_t> spread_prompt_lengths(int64_t sequences, int64_t prompt_len, double spread, uint64_t seed) {
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < sequences; ++i) {
    const double t = sequences == 1 ? 0.5 : static_cast<double>(i) / static_cast<double>(sequences - 1);
    lengths.push_back(std::max<int64_t>(1, std::llround(prompt_len * (1.0 - spread + 2.0 * spread * t))));
  }
  uint64_t state = seed ^ 0x5EED5EEDull;
  for (size_t i = lengths.size(); i > 1; --i) std::swap(lengths[i - 1], lengths[splitmix64(state) % i]);
  return lengths;
}

struct SequenceState {
  enum class Phase { waiting, running, finished };
  Phase phase = Phase::waiting;
  SequenceId id = -1;
  int64_t length = 0;  // tokens already in the engine
  int64_t attempts = 0;  // verify steps so far
  int64_t cache_bytes_at_end = 0;
};

// The next step, as a serving scheduler would plan it: one decode token (with --speculative, a
// verify step of up to 1 + K tokens) for every running sequence past its prompt, then prefill
// chunks for running sequences still in their prompt, then newly admitted sequences while the
// token budget and the running limit allow.
StepRows plan_step(const Workload& w, std::vector<SequenceState>& states, Engine& engine) {
  StepRows step;
  int64_t budget = w.step_tokens;
  int64_t running = 0;
  auto add = [&](int i, int64_t tokens) {
    step.spans.push_back({i, states[i].length, tokens});
    step.rows += tokens;
    budget -= tokens;
  };
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i].phase != SequenceState::Phase::running) continue;
    running += 1;
    if (states[i].length < w.prompt_lengths[i]) continue;
    const int64_t left = w.prompt_lengths[i] + w.gen_len - states[i].length;
    add(static_cast<int>(i), std::min(1 + w.speculative, left));
    if (w.speculative > 0) {
      step.spans.back().attempt = ++states[i].attempts;
      step.spans.back().verify = true;
    }
  }
  for (size_t i = 0; i < states.size() && budget > 0; ++i) {
    const int64_t remaining = w.prompt_lengths[i] - states[i].length;
    if (states[i].phase == SequenceState::Phase::running && remaining > 0)
      add(static_cast<int>(i), std::min({w.chunk, remaining, budget}));
  }
  for (size_t i = 0; i < states.size() && budget > 0 && running < w.max_running; ++i) {
    if (states[i].phase != SequenceState::Phase::waiting) continue;
    states[i].phase = SequenceState::Phase::running;
    states[i].id = engine.add_sequence();
    running += 1;
    add(static_cast<int>(i), std::min({w.chunk, w.prompt_lengths[i], budget}));
  }
  return step;
}

// The sequence checked against a recomputation, and the outputs recorded at sampled positions.
// During the workload the rows are recorded in the engine's memory (copies queued on its stream
// between the layers); download() brings them to the host once the workload is done.
struct Probe {
  static constexpr int64_t kMaxPositions = 32;
  int sequence = 0;
  int64_t length = 0;
  int layers = 0;
  int64_t hidden = 0;
  std::vector<int64_t> positions;          // sampled, ascending
  std::vector<int64_t> slot_of_position;   // [length], -1 when not sampled
  std::vector<float> outputs;              // [layers, positions, hidden] at the sampled positions
  std::vector<float> inputs;               // [layers, length, hidden] every layer's input, all positions
  int64_t topk = 0;
  std::vector<int32_t> picks;              // [layers, positions, topk] index sources' picks at the sampled positions
  DeviceRows input_rows;                   // inputs, in the engine's memory
  DeviceRows output_rows;                  // outputs, in the engine's memory
#ifdef DSV4_WITH_CUDA
  // Graphed steps (cuda backend): the span's placement is data on the device, {first row in the
  // step, first position, tokens}, so that the copies a step graph captured replay with each
  // step's span; at most kGraphedRows tokens of this sequence per graphed step.
  static constexpr int64_t kGraphedRows = 16;
  cuda::DeviceBuffer span;                 // [3] i64
  cuda::DeviceBuffer device_slot_of_position;  // [length] i64
#endif

  Probe(const Engine& engine, const Workload& w, uint64_t seed, int layer_count)
      : sequence(sampled_sequence(w, seed)),
        length(w.prompt_lengths[sequence] + w.gen_len),
        layers(layer_count),
        hidden(engine.config().hidden_size),
        topk(engine.config().index_topk),
        input_rows(engine, layer_count * length, hidden),
        output_rows(engine, layer_count * std::min(kMaxPositions, length), hidden) {
    uint64_t state = seed ^ 0x9B0BEull;
    splitmix64(state);  // the draw that chose the sequence
    const int64_t prompt = w.prompt_lengths[sequence];
    // The last prompt token and the last token (a decode step when there is one), then random ones.
    std::vector<bool> sampled(static_cast<size_t>(length), false);
    sampled[prompt - 1] = sampled[length - 1] = true;
    int64_t count = prompt - 1 == length - 1 ? 1 : 2;
    while (count < std::min(kMaxPositions, length)) {
      const int64_t p = static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(length));
      if (!sampled[p]) {
        sampled[p] = true;
        count += 1;
      }
    }
    slot_of_position.assign(static_cast<size_t>(length), -1);
    for (int64_t p = 0; p < length; ++p)
      if (sampled[p]) {
        slot_of_position[p] = static_cast<int64_t>(positions.size());
        positions.push_back(p);
      }
    picks.assign(static_cast<size_t>(layers) * positions.size() * topk, -1);
#ifdef DSV4_WITH_CUDA
    if (engine.cuda_stream()) {
      span = cuda::DeviceBuffer(3 * sizeof(int64_t));
      device_slot_of_position = cuda::DeviceBuffer(slot_of_position.size() * sizeof(int64_t));
      device_slot_of_position.upload(slot_of_position.data(), device_slot_of_position.bytes(), engine.cuda_stream());
    }
#endif
  }

  // The sequence the probe follows (the first draw of its seeded generator).
  static int sampled_sequence(const Workload& w, uint64_t seed) {
    uint64_t state = seed ^ 0x9B0BEull;
    return static_cast<int>(splitmix64(state) % w.prompt_lengths.size());
  }

  const float* layer_inputs(int layer) const { return inputs.data() + layer * length * hidden; }

  // Queues the copies of layer `layer`'s inputs and sampled outputs of a span of this sequence at
  // `first_row` of the step's rows.
  void record_rows(int layer, int64_t first_position, int64_t tokens, const DeviceRows& hidden_in,
                   const DeviceRows& attn_out, int64_t first_row) {
    input_rows.copy_rows_from(hidden_in, first_row, layer * length + first_position, tokens);
    const int64_t slots = static_cast<int64_t>(positions.size());
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = slot_of_position[first_position + t];
      if (slot >= 0) output_rows.copy_rows_from(attn_out, first_row + t, layer * slots + slot, 1);
    }
  }

#ifdef DSV4_WITH_CUDA
  // The span of this sequence in the next step (tokens 0: none), for record_graphed_rows; waits for
  // the engine's stream.
  void set_span(int64_t first_row, int64_t first_position, int64_t tokens, CUstream_st* stream) {
    const int64_t values[3] = {first_row, first_position, tokens};
    span.upload(values, sizeof values, stream);
  }
  // record_rows with the span set_span gave, as data: what a step graph replays.
  void record_graphed_rows(int layer, const DeviceRows& hidden_in, const DeviceRows& attn_out) {
    const int64_t slots = static_cast<int64_t>(positions.size());
    const auto* s = static_cast<const int64_t*>(span.data());
    launch_copy_span_rows(hidden_in.view(1).ptr<float>(),
                          input_rows.view(layers * length).ptr<float>() + layer * length * hidden, hidden, s, nullptr,
                          kGraphedRows, input_rows.stream());
    launch_copy_span_rows(attn_out.view(1).ptr<float>(),
                          output_rows.view(layers * slots).ptr<float>() + layer * slots * hidden, hidden, s,
                          static_cast<const int64_t*>(device_slot_of_position.data()), kGraphedRows,
                          output_rows.stream());
  }
#endif

  // Keeps the sampled rows of `rows` ([step rows, width]: picks) for a span of this sequence at
  // `first_row`.
  template <class T>
  void record_sampled(std::vector<T>& into, int layer, int64_t first_position, int64_t tokens, const T* rows,
                      int64_t first_row, int64_t width) const {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = slot_of_position[first_position + t];
      if (slot < 0) continue;
      std::copy_n(rows + (first_row + t) * width, width,
                  into.data() + (static_cast<int64_t>(layer) * positions.size() + slot) * width);
    }
  }

  // Brings the recorded rows to the host (waits for the engine's stream).
  void download() {
    inputs.resize(static_cast<size_t>(layers * length * hidden));
    outputs.resize(static_cast<size_t>(layers) * positions.size() * static_cast<size_t>(hidden));
    input_rows.download(inputs.data(), layers * length);
    output_rows.download(outputs.data(), layers * static_cast<int64_t>(positions.size()));
  }
};

constexpr uint64_t kHashBasis = 0xCBF29CE484222325ull;  // FNV-1a offset basis

struct WorkloadStats {
  int64_t steps = 0, prefill_steps = 0, decode_steps = 0;
  int64_t prefill_tokens = 0;            // prompt tokens (all in steps with prefill)
  int64_t decode_tokens_mixed = 0;       // decode tokens in steps with prefill
  int64_t decode_tokens_alone = 0;       // decode tokens in decode-only steps
  double prefill_step_seconds = 0.0;     // engine time of steps with prefill
  double decode_step_seconds = 0.0;      // engine time of decode-only steps
  double wall_seconds = 0.0;
  int64_t peak_cache_bytes = 0;          // all running sequences together, after a step
  int64_t peak_device_bytes = 0;         // GPU memory in use after a step (cuda backend)
  int64_t verifies = 0;                  // --speculative: verify steps of a sequence
  int64_t drafts = 0, accepted = 0;      // ... drafts they carried, drafts accepted
  int64_t committed_alone = 0;           // tokens kept by decode-only steps (decode_tokens_alone less rejected drafts)
  int64_t draft_blocks = 0;              // DSpark: blocks run (sequences x stages)
  int64_t graph_captures = 0, graph_replays = 0;  // cuda: steps run as step graphs (cuda::StepGraphs)
  double draft_seconds = 0.0;            // ... engine time of run_draft_block (in the decode / prefill times too)
  std::vector<int64_t> cache_bytes;      // per sequence, at its end
  // A hash of the last layer's outputs of every step, which depend on every earlier layer's (the
  // ranks of a tensor-parallel run compare theirs).
  uint64_t output_checksum = kHashBasis;
  double engine_seconds() const { return prefill_step_seconds + decode_step_seconds; }
};

// Folds the bit patterns of `n` floats into `hash`: FNV-1a over 32-bit words, with the high half
// folded back after each word (a multiply only carries upwards, and bf16-exact floats have zero
// low halves).
uint64_t hash_floats(uint64_t hash, const float* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, sizeof bits);
    hash = (hash ^ bits) * 0x100000001B3ull;
    hash ^= hash >> 32;
  }
  return hash;
}

// --trace: one line per step and layer with hashes of the layer's inputs, outputs and (index
// sources) picks, so that two runs that should agree bit for bit can be diffed line by line and
// the first step and layer where they part found.
class Trace {
 public:
  explicit Trace(const std::string& path) : file_(std::fopen(path.c_str(), "w")) {
    DSV4_CHECK(file_ != nullptr, "run: --trace: cannot write '", path, "': ", std::strerror(errno));
  }
  ~Trace() { std::fclose(file_); }
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;

  // Downloads the layer's rows, which waits for the engine's stream: tracing synchronizes after
  // every layer (a debugging mode; the workload's timings are then not representative).
  void record(const Engine& engine, int64_t step, int layer, int64_t rows, int64_t hidden, const DeviceRows& hidden_in,
              const DeviceRows& attn_out) {
    inputs_.resize(static_cast<size_t>(rows * hidden));
    outputs_.resize(static_cast<size_t>(rows * hidden));
    hidden_in.download(inputs_.data(), rows);
    attn_out.download(outputs_.data(), rows);
    const float* inputs = inputs_.data();
    const float* outputs = outputs_.data();
    const bool index_source = engine.topology()[layer].owns_indexer;
    const HostTensor picks = index_source ? engine.layer_picks(layer) : HostTensor();
    std::fprintf(file_, "step %lld layer %d rows %lld in %016llx out %016llx picks %016llx\n",
                 static_cast<long long>(step), layer, static_cast<long long>(rows),
                 static_cast<unsigned long long>(hash_floats(kHashBasis, inputs, rows * hidden)),
                 static_cast<unsigned long long>(hash_floats(kHashBasis, outputs, rows * hidden)),
                 static_cast<unsigned long long>(
                     index_source ? hash_floats(kHashBasis, static_cast<const float*>(picks.data()), picks.numel()) : 0));
  }

 private:
  FILE* file_;
  std::vector<float> inputs_, outputs_;  // the layer's rows on the host
};

// The caches in the byte formats a serving engine of the model's family keeps (vLLM's defaults on
// Hopper), unless --kv-format names another set or "float" (fp32 rows, no format).
std::string run_kv_format(const std::string& requested, const ModelConfig& config) {
  if (!requested.empty()) return requested;
  return config.family == ModelFamily::v4_1 ? "v4.1-native" : "fp8_ds_mla";
}

// How many of a verify step's `drafts` drafts are accepted: each in turn with probability 0.7 (a
// typical DSpark acceptance rate), the first rejection ending the run; seeded per sequence and attempt.
int64_t accepted_drafts(uint64_t seed, int sequence, int64_t attempt, int64_t drafts) {
  constexpr double kAcceptance = 0.7;
  uint64_t state = seed ^ 0xACCE97ull;
  state = splitmix64(state) ^ static_cast<uint64_t>(sequence);
  state = splitmix64(state) ^ static_cast<uint64_t>(attempt);
  int64_t k = 0;
  while (k < drafts && static_cast<double>(splitmix64(state) >> 11) * 0x1p-53 < kAcceptance) ++k;
  return k;
}

// DSpark drafting of a model with draft layers (docs/speculative.md): the target layers' inputs of
// every step go to the draft layers' windows, and every stage runs a block per verifying sequence.
// Rows stay in the engine's memory; copies and residual updates are queued on its stream.
class Drafter {
 public:
  Drafter(Engine& engine, const Workload& w)
      : engine_(engine),
        config_(engine.config()),
        block_(config_.dspark_block_size),
        main_(engine, w.step_tokens, config_.dspark_main_width()),
        block_in_(engine, w.max_running * block_, config_.hidden_size),
        block_out_(engine, w.max_running * block_, config_.hidden_size),
        block_inputs_(engine, w.max_running * block_) {}

  // Queues the copy of layer `layer`'s inputs (the first `rows` rows) when it is a target layer.
  void keep_inputs(int layer, const DeviceRows& inputs, int64_t rows) {
    keep_draft_inputs(config_, layer, inputs, rows, main_);
  }
  // Inside the step, after the backbone: the draft layers store the step's rows (queued).
  void run_context(int64_t rows) { engine_.run_draft_context(main_.view(rows)); }
  // Before a step: every stage over one block per verify span. Returns seconds.
  double run_blocks(uint64_t seed, const StepRows& step, const std::vector<SequenceState>& states,
                    WorkloadStats& stats) {
    std::vector<SequenceId> sequences;
    std::vector<TokenKey> keys;
    for (const StepRows::Span& span : step.spans) {
      if (!span.verify) continue;
      sequences.push_back(states[span.sequence].id);
      for (int64_t j = 0; j < block_; ++j) keys.push_back({span.sequence, span.first_position + j, span.attempt});
    }
    if (sequences.empty()) return 0.0;
    const int64_t rows = static_cast<int64_t>(keys.size());
    block_inputs_.fill(seed ^ 0xD5BA4Cull, keys, block_in_);
    const auto start = Clock::now();
    for (int stage = 0; stage < config_.num_mtp_layers; ++stage) {
      engine_.run_draft_block(config_.num_layers + stage, sequences, block_in_.view(rows), block_out_.view(rows));
      if (stage + 1 < config_.num_mtp_layers) chain_residual(block_in_, block_out_, rows);
      stats.draft_blocks += static_cast<int64_t>(sequences.size());
    }
    wait_for_engine(engine_);
    return seconds_since(start);
  }

 private:
  Engine& engine_;
  const ModelConfig& config_;
  int64_t block_;
  DeviceRows main_, block_in_, block_out_;
  TokenInputs block_inputs_;
};

// The span of the probe's sequence in a step and its first row, if the step has one.
std::optional<std::pair<StepRows::Span, int64_t>> probed_span(const StepRows& step, int probe_sequence) {
  int64_t row = 0;
  for (const StepRows::Span& span : step.spans) {
    if (span.sequence == probe_sequence) return std::pair{span, row};
    row += span.tokens;
  }
  return std::nullopt;
}

// Runs the workload. The step's rows live in the engine's memory (the GPU's with the cuda backend):
// the layer-0 inputs are generated there (one upload of the step's token keys before the step),
// the residual update between layers is a kernel, and the probe's rows are copied there; inside a
// step nothing crosses PCIe and nothing waits for the device (unless --trace), so everything
// between begin_step and the last layer is stream-ordered device work.
WorkloadStats serve(Engine& engine, Backend backend, const Workload& w, uint64_t seed, Probe& probe,
                    bool show_progress, Trace* trace) {
  const int64_t hidden = engine.config().hidden_size;
  const int layers = backbone_layer_count(engine.config());
  const ModelTopology& topology = engine.topology();
  std::optional<Drafter> drafter;
  if (w.speculative > 0 && engine.config().has_dspark()) drafter.emplace(engine, w);
  std::vector<SequenceState> states(w.prompt_lengths.size());
  DeviceRows hidden_rows(engine, w.step_tokens, hidden), out_rows(engine, w.step_tokens, hidden);
  TokenInputs token_inputs(engine, w.step_tokens);
  // Step graphs (Engine::run_step_graph) for the cuda backend, but not with --trace (it reads
  // every layer on the host) nor with a drafter (its context runs between the layers).
  const bool step_graphs = backend == Backend::cuda && !trace && !drafter;
  std::vector<float> last_outputs;  // the last layer's outputs of a step, on the host for the checksum
  WorkloadStats stats;
  Progress progress("run", w.total_tokens());
  int64_t tokens_done = 0, finished = 0;
  const auto start = Clock::now();

  while (finished < static_cast<int64_t>(states.size())) {
    const StepRows step = plan_step(w, states, engine);
    DSV4_CHECK(step.rows > 0, "run: internal: the scheduler planned an empty step");
    std::vector<StepEntry> entries;
    int64_t prefill_tokens = 0;
    for (const StepRows::Span& span : step.spans) {
      entries.push_back({states[span.sequence].id, span.tokens});
      if (span.first_position < w.prompt_lengths[span.sequence]) prefill_tokens += span.tokens;
    }

    double engine_seconds = 0.0;
    if (drafter) {
      const double seconds = drafter->run_blocks(seed, step, states, stats);
      stats.draft_seconds += seconds;
      engine_seconds += seconds;
    }
    token_inputs.fill(seed, step_token_keys(step), hidden_rows);
    const auto probed = probed_span(step, probe.sequence);
#ifdef DSV4_WITH_CUDA
    // Decode steps whose probe span fits run as step graphs: captured once per step key, then
    // replayed (steps with prefill chunks rarely repeat a key).
    const bool graphed =
        step_graphs && prefill_tokens == 0 && (!probed || probed->first.tokens <= Probe::kGraphedRows);
    if (graphed)
      probe.set_span(probed ? probed->second : 0, probed ? probed->first.first_position : 0,
                     probed ? probed->first.tokens : 0, engine.cuda_stream());
#endif
    auto step_start = Clock::now();
    engine.begin_step(entries);
#ifdef DSV4_WITH_CUDA
    if (graphed) {
      const bool replayed = engine.run_step_graph([&] {
        for (int l = 0; l < layers; ++l) {
          engine.run_layer(l, hidden_rows.view(step.rows), out_rows.view(step.rows));
          probe.record_graphed_rows(l, hidden_rows, out_rows);
          if (l + 1 < layers) chain_residual(hidden_rows, out_rows, step.rows);
        }
      });
      (replayed ? stats.graph_replays : stats.graph_captures) += 1;
    }
#else
    constexpr bool graphed = false;
#endif
    for (int l = 0; l < layers && !graphed; ++l) {
      if (drafter) drafter->keep_inputs(l, hidden_rows, step.rows);
      engine.run_layer(l, hidden_rows.view(step.rows), out_rows.view(step.rows));
      if (probed) probe.record_rows(l, probed->first.first_position, probed->first.tokens, hidden_rows, out_rows,
                                    probed->second);
      if (trace) trace->record(engine, stats.steps, l, step.rows, hidden, hidden_rows, out_rows);
      if (l + 1 < layers) chain_residual(hidden_rows, out_rows, step.rows);
    }
    if (drafter) drafter->run_context(step.rows);
    wait_for_engine(engine);
    engine_seconds += seconds_since(step_start);
    if (probed)
      for (int l = 0; l < layers; ++l)
        if (topology[l].owns_indexer)
          probe.record_sampled(probe.picks, l, probed->first.first_position, probed->first.tokens,
                               static_cast<const int32_t*>(engine.layer_picks(l).data()), probed->second, probe.topk);
    last_outputs.resize(static_cast<size_t>(step.rows * hidden));
    out_rows.download(last_outputs.data(), step.rows);
    stats.output_checksum = hash_floats(stats.output_checksum, last_outputs.data(), step.rows * hidden);
    step_start = Clock::now();
    engine.end_step();
    engine_seconds += seconds_since(step_start);
    // Verify steps keep the bonus token and the accepted drafts, and roll the rest back.
    int64_t committed = 0;
    for (const StepRows::Span& span : step.spans) {
      int64_t kept = span.tokens;
      if (span.verify) {
        kept = 1 + accepted_drafts(seed, span.sequence, span.attempt, span.tokens - 1);
        stats.verifies += 1;
        stats.drafts += span.tokens - 1;
        stats.accepted += kept - 1;
        if (kept < span.tokens) {
          step_start = Clock::now();
          engine.rollback_sequence(states[span.sequence].id, span.first_position + kept);
          engine_seconds += seconds_since(step_start);
        }
      }
      states[span.sequence].length += kept;
      committed += kept;
    }

    stats.steps += 1;
    if (prefill_tokens > 0) {
      stats.prefill_steps += 1;
      stats.prefill_tokens += prefill_tokens;
      stats.decode_tokens_mixed += step.rows - prefill_tokens;
      stats.prefill_step_seconds += engine_seconds;
    } else {
      stats.decode_steps += 1;
      stats.decode_tokens_alone += step.rows;
      stats.committed_alone += committed;
      stats.decode_step_seconds += engine_seconds;
    }
    int64_t cache_bytes = 0;
    for (const SequenceState& s : states)
      if (s.phase == SequenceState::Phase::running) cache_bytes += engine.sequence_cache_bytes(s.id);
    stats.peak_cache_bytes = std::max(stats.peak_cache_bytes, cache_bytes);
    stats.peak_device_bytes = std::max(stats.peak_device_bytes, device_memory_in_use(backend));
    for (size_t i = 0; i < states.size(); ++i) {
      SequenceState& s = states[i];
      if (s.phase != SequenceState::Phase::running || s.length < w.prompt_lengths[i] + w.gen_len) continue;
      s.cache_bytes_at_end = engine.sequence_cache_bytes(s.id);
      engine.release_sequence(s.id);
      s.phase = SequenceState::Phase::finished;
      finished += 1;
    }
    tokens_done += committed;
    if (show_progress)
      progress.update(tokens_done, "step " + std::to_string(stats.steps) + " (" + std::to_string(step.rows) +
                                     " tokens of " + std::to_string(step.spans.size()) + " sequences), " +
                                     std::to_string(finished) + "/" + std::to_string(states.size()) + " finished");
  }
  if (show_progress) progress.finish();
  stats.wall_seconds = seconds_since(start);
  for (const SequenceState& s : states) stats.cache_bytes.push_back(s.cache_bytes_at_end);
  return stats;
}

// --- the check -------------------------------------------------------------------------------

struct CheckResult {
  double rel_l2 = 0.0;        // the compared outputs together
  int worst_layer = 0;
  double worst_layer_rel_l2 = 0.0;
  bool outputs_nonzero = false;  // all-zero outputs would agree trivially
  int64_t compared = 0;          // (layer, position) outputs compared
  int64_t left_out = 0;          // ... left out because their index source picked other entries
  int64_t pick_rows = 0, picks_equal = 0;  // index sources' rows at the sampled positions
};

// At least this share of the index sources' rows must pick the same entries in the workload and
// the recomputation (as engine_cuda_test asks of the GPU against the CPU engine).
constexpr double kMinPickAgreement = 0.5;

// Recomputes the probe's sequence from scratch in a fresh engine, all its tokens prefilled in one
// step, each layer fed the inputs it had in the workload (so that layers are compared one by one,
// not through a chain that compounds their differences), and compares the sampled outputs with
// those of the workload, relative to the recomputation. An output whose layer attends picks that
// differ from the workload's is left out, as `dsv4 compare --skip-differing-picks` does: a last-bit
// difference upstream (other GEMM shapes in a decode step than in a prefill) can move a near-tie
// at the top-k cut, and attending another entry changes an output by percents; how often that
// happens is reported instead.
CheckResult check_probe(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights,
                        EngineOptions options, const Probe& probe) {
  options.max_sequences = 1;
  options.max_tokens_per_step = probe.length;
  options.max_context = probe.length;
  const std::unique_ptr<Engine> engine = Engine::create(config, std::move(weights), options);
  const ModelTopology& topology = engine->topology();
  const int64_t hidden = config.hidden_size, positions = static_cast<int64_t>(probe.positions.size());
  std::vector<float> outputs(static_cast<size_t>(probe.length * hidden)), recomputed(probe.outputs.size());
  std::vector<int32_t> recomputed_picks(probe.picks.size(), -1);
  DeviceRows device_in(*engine, probe.length, hidden), device_out(*engine, probe.length, hidden);
  engine->begin_step({{engine->add_sequence(), probe.length}});
  for (int l = 0; l < backbone_layer_count(config); ++l) {
    run_layer_on_host_rows(*engine, l, probe.length, probe.layer_inputs(l), outputs.data(), device_in, device_out);
    probe.record_sampled(recomputed, l, 0, probe.length, outputs.data(), 0, hidden);
    if (topology[l].owns_indexer)
      probe.record_sampled(recomputed_picks, l, 0, probe.length,
                           static_cast<const int32_t*>(engine->layer_picks(l).data()), 0, probe.topk);
  }
  engine->end_step();

  CheckResult result;
  const auto same_picks = [&](int source, int64_t slot) {
    const size_t first = (static_cast<size_t>(source) * positions + slot) * probe.topk;
    return std::equal(probe.picks.begin() + first, probe.picks.begin() + first + probe.topk,
                      recomputed_picks.begin() + first);
  };
  for (int l = 0; l < backbone_layer_count(config); ++l)
    if (topology[l].owns_indexer)
      for (int64_t i = 0; i < positions; ++i) {
        result.pick_rows += 1;
        result.picks_equal += same_picks(l, i);
      }
  double error_sq = 0.0, norm_sq = 0.0;
  result.worst_layer_rel_l2 = -1.0;
  for (int l = 0; l < backbone_layer_count(config); ++l) {
    double layer_error_sq = 0.0, layer_norm_sq = 0.0;
    for (int64_t i = 0; i < positions; ++i) {
      const int source = topology[l].index_source;
      if (source >= 0 && !same_picks(source, i)) {
        result.left_out += 1;
        continue;
      }
      result.compared += 1;
      const size_t first = (static_cast<size_t>(l) * positions + i) * hidden;
      for (size_t j = first; j < first + hidden; ++j) {
        const double diff = static_cast<double>(probe.outputs[j]) - recomputed[j];
        layer_error_sq += diff * diff;
        layer_norm_sq += static_cast<double>(recomputed[j]) * recomputed[j];
      }
    }
    const double layer_rel = std::sqrt(layer_error_sq / std::max(layer_norm_sq, 1e-300));
    if (!(layer_rel <= result.worst_layer_rel_l2)) {
      result.worst_layer = l;
      result.worst_layer_rel_l2 = layer_rel;
    }
    error_sq += layer_error_sq;
    norm_sq += layer_norm_sq;
  }
  result.rel_l2 = std::sqrt(error_sq / std::max(norm_sq, 1e-300));
  result.outputs_nonzero = norm_sq > 0.0;
  return result;
}

// --- command ---------------------------------------------------------------------------------

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  for (; bytes >= 1024.0 && u < 4; ++u) bytes /= 1024.0;
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buffer;
}

std::string format_rate(int64_t tokens, double seconds) {
  if (tokens == 0 || seconds <= 0.0) return "n/a";
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.1f tok/s", static_cast<double>(tokens) / seconds);
  return buffer;
}

int run(const RunOptions& o) {
  DSV4_CHECK(o.parallel.tp == 1 || !o.was_given("--backend") || parse_backend(o.backend) == Backend::cuda, "run: --tp ",
             o.parallel.tp, " runs on the cuda backend (one GPU per rank), not on ", o.backend);
  if (o.parallel.launches()) return launch_ranks(o.parallel, "run");
  if (o.device_fill) fill_device_allocations(static_cast<uint8_t>(*o.device_fill));
  // A tensor-parallel rank joins its group first, which makes its GPU current; rank 0 reports.
  const std::shared_ptr<NcclCommunicator> ranks = join_rank_group(o.parallel, "run");
  const bool reports = !ranks || ranks->rank() == 0;
  // Every rank traces its own run (a file per rank: PATH.rank1 ...).
  std::optional<Trace> trace;
  if (!o.trace_path.empty())
    trace.emplace(ranks && ranks->rank() > 0 ? o.trace_path + ".rank" + std::to_string(ranks->rank()) : o.trace_path);
  const Backend backend = ranks                      ? Backend::cuda
                          : o.was_given("--backend") ? usable_backend(parse_backend(o.backend), "run")
                                                     : default_backend();
  const RunProfile profile = backend == Backend::cuda ? gpu_profile() : cpu_profile();
  auto pick = [&](const char* flag, auto given, auto fallback) { return o.was_given(flag) ? given : fallback; };

  const int64_t sequences = pick("--batch", o.sequences, profile.sequences);
  const int64_t prompt_len = pick("--prompt-len", o.prompt_len, profile.prompt_len);
  const double prompt_spread = pick("--prompt-spread", o.prompt_spread, profile.prompt_spread);
  Workload w;
  w.gen_len = pick("--gen-len", o.gen_len, profile.gen_len);
  w.chunk = pick("--chunk", o.chunk, profile.chunk);
  w.max_running = pick("--max-running", o.max_running, profile.max_running);
  w.step_tokens = pick("--step-tokens", o.step_tokens, profile.step_tokens);
  DSV4_CHECK(sequences >= 1, "run: --batch is ", sequences, ", expected >= 1");
  DSV4_CHECK(prompt_len >= 1, "run: --prompt-len is ", prompt_len, ", expected >= 1");
  DSV4_CHECK(prompt_spread >= 0.0 && prompt_spread < 1.0, "run: --prompt-spread is ", prompt_spread,
             ", expected in [0, 1)");
  DSV4_CHECK(w.gen_len >= 0, "run: --gen-len is ", w.gen_len, ", expected >= 0");
  DSV4_CHECK(w.chunk >= 1, "run: --chunk is ", w.chunk, ", expected >= 1");
  DSV4_CHECK(w.max_running >= 1, "run: --max-running is ", w.max_running, ", expected >= 1");
  w.speculative = o.speculative;
  DSV4_CHECK(w.speculative >= 0 && w.speculative <= 64, "run: --speculative is ", w.speculative,
             ", expected 0 ... 64 drafts per verify step");
  DSV4_CHECK(w.step_tokens >= w.max_running * (1 + w.speculative), "run: --step-tokens is ", w.step_tokens,
             ", expected >= --max-running x (1 + --speculative) (", w.max_running * (1 + w.speculative),
             "): every running sequence decodes (or verifies) in every step");
  w.prompt_lengths = spread_prompt_lengths(sequences, prompt_len, prompt_spread, o.seed);
  const Precision precision = parse_precision(o.precision);
  const double tolerance = pick("--check-tol", o.check_tolerance, precision == Precision::fp32 ? 1e-4 : 2e-2);
  DSV4_CHECK(tolerance >= 0.0, "run: --check-tol is ", tolerance, ", expected >= 0");

  const bool from_file = !o.config_path.empty();
  const std::string preset = o.preset.empty() ? profile.preset : o.preset;
  const ModelConfig config = from_file ? load_config_file(o.config_path) : preset_config(preset);
  const ModelTopology topology = resolve_topology(config);
  const bool fp8_weights = config.weight_quantization.has_value();
  auto setup_start = Clock::now();
  auto weights = std::make_shared<const ModelWeights>(
      o.weights_path.empty() ? random_weights(config, topology, o.seed, fp8_weights)
                             : load_weights(o.weights_path, config, topology));
  if (reports)
    std::fprintf(stderr, "dsv4: run: %s weights of %s in %.1f s\n",
                 o.weights_path.empty() ? "generated random" : "loaded", config.name.c_str(), seconds_since(setup_start));

  EngineOptions options;
  options.backend = backend;
  options.precision = precision;
  apply_kv_format_flag(options, run_kv_format(o.kv_format, config));
  options.max_sequences = w.max_running;
  options.max_tokens_per_step = w.step_tokens;
  // A DSpark draft block reaches dspark_block_size positions past the sequence.
  options.max_context = w.longest() + (w.speculative > 0 && config.has_dspark() ? config.dspark_block_size : 0);
  options.max_rollback = w.speculative;
  options.num_threads = o.threads;
  options.attention_stage_bytes = o.attention_stage_mib << 20;
  setup_start = Clock::now();
  // A tensor-parallel rank's engine runs the rank's shard of every layer (docs/parallel.md).
  const RankShard shard = ranks ? make_rank_shard(config, *weights, options, ranks, o.parallel.indexer_sharding())
                                : RankShard{config, weights, options};
  const std::unique_ptr<Engine> engine = Engine::create(shard.config, shard.weights, shard.options);
  if (reports)
    std::fprintf(stderr, "dsv4: run: created the %s engine in %.1f s\n", backend_name(backend),
                 seconds_since(setup_start));


  Probe probe(*engine, w, o.seed, backbone_layer_count(config));
  const WorkloadStats stats = serve(*engine, backend, w, o.seed, probe, reports, trace ? &*trace : nullptr);
  // Every rank holds the all-reduced outputs: they must be the same bits everywhere.
  const bool ranks_agree = !ranks || ranks->same_on_all_ranks(stats.output_checksum);
  if (!reports) return ranks_agree ? 0 : 1;
  probe.download();
  // The recomputation runs unsharded (the whole model on one device, no communicator): under --tp
  // it compares the tensor-parallel outputs with single-GPU ones.
  const CheckResult check = check_probe(config, weights, options, probe);
  const double pick_agreement =
      check.pick_rows > 0 ? static_cast<double>(check.picks_equal) / static_cast<double>(check.pick_rows) : 1.0;
  const bool pass = check.outputs_nonzero && check.rel_l2 <= tolerance &&  // false for NaN
                    pick_agreement >= kMinPickAgreement;

  const auto [shortest, longest] = std::minmax_element(w.prompt_lengths.begin(), w.prompt_lengths.end());
  int64_t prompt_total = 0;
  for (int64_t p : w.prompt_lengths) prompt_total += p;
  std::printf("model: %s (%d layers, hidden %lld, %d heads), %s\n", config.name.c_str(), config.total_layers(),
              static_cast<long long>(config.hidden_size), config.num_heads,
              o.weights_path.empty()
                  ? ("random weights (seed " + std::to_string(o.seed) + (fp8_weights ? ", fp8)" : ", bf16)")).c_str()
                  : ("weights " + o.weights_path).c_str());
  std::printf("engine: backend %s, precision %s, kv format %s\n", backend_name(backend),
              precision_name(options.precision), cache_storage_label(options).c_str());
  if (ranks)
    std::printf("tensor parallel: %d ranks on GPUs 0..%d (NCCL), %d heads and %d output groups per rank, indexer %s; "
                "last-layer outputs of every step %s on all ranks (checksum %016llx)\n",
                ranks->size(), ranks->size() - 1, shard.config.num_heads, shard.config.o_groups,
                o.parallel.indexer.c_str(), ranks_agree ? "identical" : "DIFFER (FAIL)",
                static_cast<unsigned long long>(stats.output_checksum));
  std::printf(
      "workload: %lld sequences, prompts of %lld..%lld tokens (%lld in all), %lld decode steps each, prefill chunks "
      "of %lld, at most %lld running, at most %lld tokens per step\n",
      static_cast<long long>(sequences), static_cast<long long>(*shortest), static_cast<long long>(*longest),
      static_cast<long long>(prompt_total), static_cast<long long>(w.gen_len), static_cast<long long>(w.chunk),
      static_cast<long long>(w.max_running), static_cast<long long>(w.step_tokens));
  // The checksum tells whether two runs computed the same bits (same binary, machine and flags).
  std::printf("steps: %lld (%lld with prefill, %lld decode only) in %.2f s, of which %.2f s in the engine; "
              "last-layer outputs checksum %016llx\n",
              static_cast<long long>(stats.steps), static_cast<long long>(stats.prefill_steps),
              static_cast<long long>(stats.decode_steps), stats.wall_seconds, stats.engine_seconds(),
              static_cast<unsigned long long>(stats.output_checksum));
  if (stats.graph_captures > 0)
    std::printf("step graphs: %lld steps replayed a graph, %lld captured one (one per step key)\n",
                static_cast<long long>(stats.graph_replays), static_cast<long long>(stats.graph_captures));
  std::printf("prefill: %lld tokens in %.2f s of steps with prefill: %s (these steps also decoded %lld tokens)\n",
              static_cast<long long>(stats.prefill_tokens), stats.prefill_step_seconds,
              format_rate(stats.prefill_tokens, stats.prefill_step_seconds).c_str(),
              static_cast<long long>(stats.decode_tokens_mixed));
  std::printf("decode: %lld tokens in %.2f s of decode-only steps: %s, %.3f ms per decode step\n",
              static_cast<long long>(stats.decode_tokens_alone), stats.decode_step_seconds,
              format_rate(stats.decode_tokens_alone, stats.decode_step_seconds).c_str(),
              stats.decode_steps > 0 ? 1e3 * stats.decode_step_seconds / static_cast<double>(stats.decode_steps) : 0.0);
  if (w.speculative > 0)
    std::printf("speculative: %lld verify steps of the bonus token and up to %lld drafts, %.2f of %.2f drafts accepted "
                "on average (acceptance 0.7 per draft); decode-only steps kept %lld of %lld tokens: %s accepted, "
                "%.2f tokens per sequence and step\n",
                static_cast<long long>(stats.verifies), static_cast<long long>(w.speculative),
                stats.verifies ? static_cast<double>(stats.accepted) / static_cast<double>(stats.verifies) : 0.0,
                stats.verifies ? static_cast<double>(stats.drafts) / static_cast<double>(stats.verifies) : 0.0,
                static_cast<long long>(stats.committed_alone), static_cast<long long>(stats.decode_tokens_alone),
                format_rate(stats.committed_alone, stats.decode_step_seconds).c_str(),
                stats.verifies ? 1.0 + static_cast<double>(stats.accepted) / static_cast<double>(stats.verifies) : 0.0);
  if (stats.draft_blocks > 0)
    std::printf("drafting: %lld DSpark draft blocks of %lld rows (%d stages per verify step) in %.3f s of engine time, "
                "%.1f us per block; the target layers' inputs stored in the draft layers' windows every step\n",
                static_cast<long long>(stats.draft_blocks), static_cast<long long>(config.dspark_block_size),
                config.num_mtp_layers, stats.draft_seconds, 1e6 * stats.draft_seconds / static_cast<double>(stats.draft_blocks));
  const EngineMemory held = engine->memory();
  std::printf("engine memory (%s): weights %s, caches %s, workspace %s\n", backend == Backend::cuda ? "gpu" : "host",
              format_bytes(static_cast<double>(held.weights)).c_str(),
              format_bytes(static_cast<double>(held.caches)).c_str(),
              format_bytes(static_cast<double>(held.workspace)).c_str());
  if (backend == Backend::cuda)
    std::printf("gpu memory: %s in use at the peak (weights, cache pools, workspace and the CUDA context)\n",
                format_bytes(static_cast<double>(stats.peak_device_bytes)).c_str());
  const auto [fewest, most] = std::minmax_element(stats.cache_bytes.begin(), stats.cache_bytes.end());
  double total_bytes = 0.0;
  for (int64_t b : stats.cache_bytes) total_bytes += static_cast<double>(b);
  std::printf("kv cache: %s per sequence at its end (%s..%s, %s per token), peak %s for all running sequences\n",
              format_bytes(total_bytes / static_cast<double>(sequences)).c_str(),
              format_bytes(static_cast<double>(*fewest)).c_str(), format_bytes(static_cast<double>(*most)).c_str(),
              format_bytes(total_bytes / static_cast<double>(w.total_tokens())).c_str(),
              format_bytes(static_cast<double>(stats.peak_cache_bytes)).c_str());
  std::printf(
      "check: sequence %d (%lld tokens) recomputed as one %lld-token prefill in a fresh %sengine from the same layer "
      "inputs, %zu sampled positions x %d layers; index sources picked the same entries on %lld of %lld rows (at "
      "least %.0f%% required), %lld of %lld outputs left out for attending other picks: rel L2 %.2e (worst layer "
      "%d: %.2e), tolerance %.0e: %s\n",
      probe.sequence, static_cast<long long>(probe.length), static_cast<long long>(probe.length),
      ranks ? "single-GPU (unsharded) " : "", probe.positions.size(), backbone_layer_count(config),
      static_cast<long long>(check.picks_equal), static_cast<long long>(check.pick_rows), 100.0 * kMinPickAgreement,
      static_cast<long long>(check.left_out), static_cast<long long>(check.left_out + check.compared), check.rel_l2,
      check.worst_layer, check.worst_layer_rel_l2, tolerance,
      pass ? "PASS" : !check.outputs_nonzero ? "FAIL (the outputs are all zero)" : "FAIL");
  return pass && ranks_agree ? 0 : 1;
}

const CommandRegistration registration{
    "run", "Serve a synthetic workload (continuous batching), report throughput and KV size, check a sequence",
    [](CLI::App& app) {
      auto o = std::make_shared<RunOptions>();
      auto* preset = app.add_option("--preset", o->preset, "Model preset (default tiny-v4.1; v4.1-flash on a GPU)");
      auto* config = app.add_option("--config", o->config_path, "Model config file instead of a preset");
      preset->excludes(config);
      app.add_option("--weights", o->weights_path, "Weights (.safetensors or index JSON); default: random weights");
      auto flag = [&](const std::string& name, auto& value, const std::string& description) {
        o->profile_flags[name] = app.add_option(name, value, description);
      };
      flag("--backend", o->backend, "cpu or cuda (default: cuda when built with it and a GPU is present)");
      flag("--batch", o->sequences, "Number of sequences (default 6; GPU 64)");
      flag("--prompt-len", o->prompt_len, "Mean prompt length (default 200; GPU 4096)");
      flag("--prompt-spread", o->prompt_spread, "Prompt lengths spread over len * (1 +- spread) (default 0.5; GPU 0)");
      flag("--gen-len", o->gen_len, "Decode steps per sequence (default 32; GPU 128)");
      flag("--chunk", o->chunk, "Prefill chunk size (default 64; GPU 2048)");
      flag("--max-running", o->max_running, "Sequences in flight at once (default 4; GPU 64)");
      flag("--step-tokens", o->step_tokens, "Token budget of one step (default 256; GPU 16384)");
      flag("--check-tol", o->check_tolerance, "Largest relative L2 error of the check (default 1e-4 fp32, 2e-2 reference)");
      app.add_option("--speculative", o->speculative,
                     "Verify steps of the bonus token and this many drafts, a seeded random number of them accepted "
                     "and the rest rolled back (0: plain decode)")
          ->capture_default_str();
      app.add_option("--precision", o->precision, "fp32 or reference")->capture_default_str();
      app.add_option("--kv-format", o->kv_format,
                     "KV cache format set, or float (default: v4.1-native for V4.1 models, fp8_ds_mla for V4.0)");
      app.add_option("--seed", o->seed, "Seed of the random weights, prompt lengths and inputs")->capture_default_str();
      app.add_option("--threads", o->threads, "CPU backend threads (0: all cores)")->capture_default_str();
      app.add_option("--attention-stage-mib", o->attention_stage_mib,
                     "cuda backend on Hopper: MiB of device memory for a prefill step's attended pages decoded to "
                     "bf16 once per layer (the same outputs; 0: attend the quantized pages directly)")
          ->capture_default_str()
          ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
      app.add_option("--trace", o->trace_path,
                     "Write a line per step and layer with hashes of its inputs, outputs and picks to this file "
                     "(diff two runs to find where they part)");
      app.add_option("--fill-device-memory", o->device_fill,
                     "Fill every device buffer with this byte when it is allocated (two runs with different bytes "
                     "differ only if something reads memory nothing wrote)")
          ->check(CLI::Range(0, 255));
      o->parallel.add_to(app);
      return [o] { return run(*o); };
    }};

}  // namespace
}  // namespace dsv4::cli
