// dsv4 replay: runs a golden schedule of calls through an Engine, feeding every layer its recorded
// input, and writes the outputs in the same format (golden_schedule.h) for `dsv4 compare`.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/backend_util.h"
#include "dsv4/command.h"
#include "dsv4/config.h"
#include "dsv4/engine.h"
#include "dsv4/error.h"
#include "dsv4/golden_schedule.h"
#include "dsv4/safetensors.h"
#include "dsv4/weights.h"

namespace dsv4::cli {
namespace {

struct ReplayOptions {
  std::string config_path;
  std::string weights_path;
  std::string calls_path;
  std::string out_path;
  std::string backend = "cpu";
  std::string precision = "reference";
  std::string kv_format;
  bool split_steps = false;
  int threads = 0;
  std::vector<std::string> image_spans;  // --image-span b:first:last
};

// Image spans of each call and batch sequence: rows (b, first, last) of calls.{c}.image_spans,
// then every --image-span b:first:last, given to the call whose positions hold `first` (the engine
// rejects a span that does not lie inside that call).
std::vector<std::vector<std::vector<ImageSpan>>> read_image_spans(const ReplayOptions& o, const SafetensorsFile& calls,
                                                                 const ReplaySchedule& schedule) {
  std::vector<std::vector<std::vector<ImageSpan>>> spans(
      schedule.calls.size(), std::vector<std::vector<ImageSpan>>(static_cast<size_t>(schedule.batch)));
  const auto add = [&](const std::string& origin, int64_t b, int64_t first, int64_t last, int call) {
    DSV4_CHECK(b >= 0 && b < schedule.batch, "replay: ", origin, ": sequence ", b, " is not in the batch of ",
               schedule.batch, " (0..", schedule.batch - 1, ")");
    spans[static_cast<size_t>(call)][static_cast<size_t>(b)].push_back({first, last});
  };
  for (const ScheduledCall& call : schedule.calls) {
    const SafetensorsEntry* entry = calls.find(call_tensor_name(call.index, kImageSpans));
    if (entry == nullptr) continue;
    const std::string name = call_tensor_name(call.index, kImageSpans);
    DSV4_CHECK((entry->dtype == DType::i64 || entry->dtype == DType::i32) && entry->shape.size() == 2 &&
                   entry->shape[1] == 3,
               "replay: ", name, " in ", calls.path(), " is ", dtype_name(entry->dtype), " ",
               shape_string(entry->shape), ", expected I64 or I32 [n, 3] (sequence, first, last)");
    const std::vector<int64_t> v = read_integers(calls, *entry);
    for (size_t i = 0; i < v.size(); i += 3) add(name, v[i], v[i + 1], v[i + 2], call.index);
  }
  for (const std::string& text : o.image_spans) {
    const std::string origin = "--image-span " + text;
    int64_t b = 0, first = 0, last = 0;
    char end = 0;
    DSV4_CHECK(std::sscanf(text.c_str(), "%" SCNd64 ":%" SCNd64 ":%" SCNd64 "%c", &b, &first, &last, &end) == 3, "replay: ", origin,
               ": expected sequence:first:last (batch sequence, first and last position)");
    const auto call = std::find_if(schedule.calls.begin(), schedule.calls.end(), [&](const ScheduledCall& c) {
      return first >= c.first_position && first < c.first_position + c.num_tokens;
    });
    DSV4_CHECK(call != schedule.calls.end(), "replay: ", origin, ": position ", first,
               " is not in the schedule's positions 0..", schedule.total_positions() - 1);
    add(origin, b, first, last, call->index);
  }
  return spans;
}

// The calls file decides which layers run. A file that covers the backbone but not the MTP layers
// (independent window-only layers after it) replays the backbone alone.
void fit_layers_to_schedule(ModelConfig& config, int file_layers, const std::string& calls_path) {
  if (file_layers == config.total_layers()) return;
  DSV4_CHECK(file_layers == config.num_layers, "replay: ", calls_path, " has hidden_in for layers 0..",
             file_layers - 1, " (", file_layers, " layers), expected the config's ", config.total_layers(), " layers",
             config.num_mtp_layers > 0 ? " or its " + std::to_string(config.num_layers) + " backbone layers" : "");
  std::fprintf(stderr, "dsv4: replay: %s has no MTP layers; replaying the %d backbone layers only\n",
               calls_path.c_str(), config.num_layers);
  config.num_mtp_layers = 0;
  config.dspark_target_layer_ids.clear();
}

// Copies the picks of one step ([rows, k'] i32, k' <= k) into rows first_row.. of [B, S, k].
// The output file's writer, its metadata saying how the outputs were made.
SafetensorsWriter output_writer(const ModelConfig& config, const EngineOptions& options) {
  SafetensorsWriter writer;
  writer.set_metadata("dsv4.command", "replay");
  writer.set_metadata("dsv4.config", config.name);
  writer.set_metadata("dsv4.backend", backend_name(options.backend));
  writer.set_metadata("dsv4.precision", precision_name(options.precision));
  writer.set_metadata("dsv4.kv_format", cache_storage_label(options));
  return writer;
}

void store_picks(const HostTensor& step_picks, int layer, int64_t rows, HostTensor& picks, int64_t first_row) {
  const int64_t k = picks.size(2);
  DSV4_CHECK(step_picks.dtype() == DType::i32 && step_picks.rank() == 2 && step_picks.size(0) == rows &&
                 step_picks.size(1) <= k,
             "replay: the engine's picks of index layer ", layer, " are ", dtype_name(step_picks.dtype()), " ",
             shape_string(step_picks.shape()), ", expected I32 [", rows, ", <= ", k, "]");
  const int64_t step_k = step_picks.size(1);
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(step_picks.as<int32_t>() + r * step_k, step_k, picks.as<int32_t>() + (first_row + r) * k);
}

// A DSpark set through a drafter engine (EngineOptions::layers = draft): each call's main rows
// in one step (run_draft_context), then each draft call's block through every stage
// (run_draft_block); calls.{c}.layers.{l}.attn_out with l the stage.
int replay_dspark(const ReplayOptions& o, EngineOptions options, const ModelConfig& config,
                  const std::shared_ptr<SafetensorsFile>& calls, const std::chrono::steady_clock::time_point started) {
  DSV4_CHECK(config.has_dspark(), "replay: ", o.calls_path, " is a DSpark set (calls.0.main_hidden), but config ",
             config.name, " has no DSpark draft layers (dspark_target_layer_ids)");
  const int64_t hidden = config.hidden_size, B = config.dspark_block_size, width = config.dspark_main_width();
  const DsparkSchedule schedule = read_dspark_schedule(*calls, hidden, width, B, config.num_mtp_layers);
  const ModelTopology topology = resolve_topology(config);
  auto weights = std::make_shared<const ModelWeights>(load_weights(o.weights_path, config, topology, LayerSet::draft));
  const int64_t batch = schedule.batch;
  int64_t longest_call = batch * B;
  for (const DsparkCall& call : schedule.calls) longest_call = std::max(longest_call, batch * call.main_rows);
  options.layers = LayerSet::draft;
  options.max_sequences = batch;
  options.max_tokens_per_step = longest_call;
  options.max_context = schedule.longest_sequence;
  const std::unique_ptr<Engine> engine = Engine::create(config, weights, options);

  DeviceRows main_rows(*engine, longest_call, width);
  DeviceRows hidden_rows(*engine, batch * B, hidden), out_rows(*engine, batch * B, hidden);
  SafetensorsWriter writer = output_writer(config, options);
  writer.set_metadata("dsv4.layers", "draft");
  int64_t tensors_written = 0, blocks = 0;
  std::vector<SequenceId> sequences;
  for (const DsparkCall& call : schedule.calls) {
    if (call.first_main_position == 0) {
      for (SequenceId s : sequences) engine->release_sequence(s);
      sequences.clear();
      for (int64_t b = 0; b < batch; ++b) sequences.push_back(engine->add_sequence());
    }
    const HostTensor main_hidden = calls->read_as(call_tensor_name(call.index, kMainHidden), DType::f32);
    std::vector<StepEntry> entries;
    for (SequenceId s : sequences) entries.push_back({s, call.main_rows});
    engine->begin_step(entries);
    main_rows.upload(main_hidden.as<float>(), batch * call.main_rows);
    engine->run_draft_context(main_rows.view(batch * call.main_rows));
    engine->end_step();
    if (!call.draft) continue;
    const std::string positions_name = call_tensor_name(call.index, kPositionIds);
    writer.add(positions_name, calls->read(positions_name));
    tensors_written += 1;
    for (int stage = 0; stage < config.num_mtp_layers; ++stage) {
      const HostTensor hidden_in = calls->read_as(layer_tensor_name(call.index, stage, kHiddenIn), DType::f32);
      HostTensor attn_out(DType::f32, {batch, B, hidden});
      hidden_rows.upload(hidden_in.as<float>(), batch * B);
      engine->run_draft_block(config.num_layers + stage, sequences, hidden_rows.view(batch * B), out_rows.view(batch * B));
      out_rows.download(attn_out.as<float>(), batch * B);
      writer.add(layer_tensor_name(call.index, stage, kAttnOut), attn_out);
      tensors_written += 1;
    }
    blocks += 1;
  }
  writer.write(o.out_path);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("replay: DSpark set, %zu calls (%lld with a draft block) x %d draft stages x %lld sequences of %s, "
              "backend %s, precision %s, kv format %s: wrote %lld tensors to %s in %.2f s\n",
              schedule.calls.size(), static_cast<long long>(blocks), config.num_mtp_layers,
              static_cast<long long>(batch), config.name.c_str(), backend_name(options.backend),
              precision_name(options.precision), cache_storage_label(options).c_str(),
              static_cast<long long>(tensors_written), o.out_path.c_str(), seconds);
  return 0;
}

int replay(const ReplayOptions& o) {
  const auto started = std::chrono::steady_clock::now();
  EngineOptions options;
  options.precision = parse_precision(o.precision);
  options.backend = usable_backend(parse_backend(o.backend), "replay");
  // Float rows by default on the cpu (exact in every precision); the cuda backend pages.
  apply_kv_format_flag(options, o.kv_format.empty() && options.backend == Backend::cpu ? "float" : o.kv_format);
  options.num_threads = o.threads;
  ModelConfig config = load_config_file(o.config_path);
  const std::shared_ptr<SafetensorsFile> calls = SafetensorsFile::open(o.calls_path);
  if (is_dspark_schedule(*calls)) {
    DSV4_CHECK(!o.split_steps, "replay: --split-steps is not available for a DSpark set");
    return replay_dspark(o, options, config, calls, started);
  }
  const ReplaySchedule schedule = read_replay_schedule(*calls, config.hidden_size);
  const std::vector<std::vector<std::vector<ImageSpan>>> image_spans = read_image_spans(o, *calls, schedule);
  fit_layers_to_schedule(config, schedule.num_layers, o.calls_path);
  const ModelTopology topology = resolve_topology(config);
  auto weights = std::make_shared<const ModelWeights>(load_weights(o.weights_path, config, topology));

  const int64_t batch = schedule.batch;
  const int64_t hidden = config.hidden_size;
  const int64_t sequences_per_step = o.split_steps ? 1 : batch;
  int64_t longest_call = 0;
  for (const ScheduledCall& call : schedule.calls) longest_call = std::max(longest_call, call.num_tokens);

  options.max_sequences = batch;
  options.max_tokens_per_step = sequences_per_step * longest_call;
  options.max_context = schedule.total_positions();
  const std::unique_ptr<Engine> engine = Engine::create(config, weights, options);
  std::vector<SequenceId> sequences;
  for (int64_t b = 0; b < batch; ++b) sequences.push_back(engine->add_sequence());

  DeviceRows hidden_rows(*engine, options.max_tokens_per_step, hidden);
  DeviceRows out_rows(*engine, options.max_tokens_per_step, hidden);
  SafetensorsWriter writer = output_writer(config, options);
  writer.set_metadata("dsv4.split_steps", o.split_steps ? "true" : "false");
  int64_t tensors_written = 0;

  for (const ScheduledCall& call : schedule.calls) {
    const auto call_started = std::chrono::steady_clock::now();
    const int64_t s = call.num_tokens;
    std::vector<HostTensor> attn_out(static_cast<size_t>(config.total_layers()));
    std::vector<HostTensor> picks(attn_out.size());
    for (int l = 0; l < config.total_layers(); ++l) {
      attn_out[l] = HostTensor(DType::f32, {batch, s, hidden});
      if (topology[l].owns_indexer) {
        picks[l] = HostTensor(DType::i32, {batch, s, config.index_topk});
        std::fill_n(picks[l].as<int32_t>(), picks[l].numel(), -1);
      }
    }
    // Widened to f32 once per call (bf16 sets convert exactly).
    std::vector<HostTensor> hidden_in(attn_out.size());
    for (int l = 0; l < config.total_layers(); ++l)
      hidden_in[l] = calls->read_as(layer_tensor_name(call.index, l, kHiddenIn), DType::f32);
    // [B, S, hidden] keeps each sequence's rows together, so a step over sequences first..last
    // reads and writes one contiguous block of rows.
    for (int64_t first = 0; first < batch; first += sequences_per_step) {
      std::vector<StepEntry> entries;
      for (int64_t b = first; b < first + sequences_per_step; ++b)
        entries.push_back({sequences[b], s, image_spans[static_cast<size_t>(call.index)][static_cast<size_t>(b)]});
      const int64_t rows = sequences_per_step * s;
      const int64_t first_row = first * s;
      engine->begin_step(entries);
      for (int l = 0; l < config.total_layers(); ++l) {
        hidden_rows.upload(hidden_in[l].as<float>() + first_row * hidden, rows);
        engine->run_layer(l, hidden_rows.view(rows), out_rows.view(rows));
        out_rows.download(attn_out[l].as<float>() + first_row * hidden, rows);
        if (topology[l].owns_indexer) store_picks(engine->layer_picks(l), l, rows, picks[l], first_row);
      }
      engine->end_step();
    }

    const std::string positions_name = call_tensor_name(call.index, kPositionIds);
    writer.add(positions_name, calls->read(positions_name));
    tensors_written += 1;
    for (int l = 0; l < config.total_layers(); ++l) {
      writer.add(layer_tensor_name(call.index, l, kAttnOut), attn_out[l]);
      tensors_written += 1;
      if (!picks[l].empty()) {
        writer.add(layer_tensor_name(call.index, l, kTopk), picks[l]);
        tensors_written += 1;
      }
    }
    const double call_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - call_started).count();
    std::fprintf(stderr, "replay: call %d/%zu: %lld token(s) x %lld sequences at positions %lld..%lld, %.1f ms\n",
                 call.index + 1, schedule.calls.size(), static_cast<long long>(s), static_cast<long long>(batch),
                 static_cast<long long>(call.first_position),
                 static_cast<long long>(call.first_position + s - 1), call_ms);
  }
  writer.write(o.out_path);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf(
      "replay: %zu calls (%lld positions) x %d layers x %lld sequences of %s, backend %s, precision %s, kv format "
      "%s, %s: wrote %lld tensors to %s in %.2f s\n",
      schedule.calls.size(), static_cast<long long>(schedule.total_positions()), config.total_layers(),
      static_cast<long long>(batch), config.name.c_str(), backend_name(options.backend),
      precision_name(options.precision), cache_storage_label(options).c_str(),
      o.split_steps ? "one step per sequence and call" : "one step per call", static_cast<long long>(tensors_written),
      o.out_path.c_str(), seconds);
  return 0;
}

const CommandRegistration registration{
    "replay", "Run a golden schedule of calls through the engine and write its outputs", [](CLI::App& app) {
      auto o = std::make_shared<ReplayOptions>();
      app.add_option("--config", o->config_path, "Model config (any config.json form)")->required();
      app.add_option("--weights", o->weights_path, "Weights: a .safetensors file or a sharded index JSON")->required();
      app.add_option("--calls", o->calls_path,
                     "The schedule: calls.{c}.position_ids and layers.{l}.hidden_in (a DSpark set: also main_hidden)")
          ->required();
      app.add_option("--out", o->out_path, "Output .safetensors: calls.{c}.layers.{l}.attn_out (and topk)")
          ->required();
      app.add_option("--backend", o->backend, "cpu or cuda")->capture_default_str();
      app.add_option("--precision", o->precision, "fp32 or reference (DeepSeek's roundings and fake quantization)")
          ->capture_default_str();
      app.add_option("--kv-format", o->kv_format, "KV cache format set, or float for float rows (default: float on cpu, the exact formats on cuda)");
      app.add_flag("--split-steps", o->split_steps, "One step per sequence and call instead of one per call");
      app.add_option("--threads", o->threads, "CPU backend threads (0: all cores)")->capture_default_str();
      app.add_option("--image-span", o->image_spans,
                     "An image span b:first:last of batch sequence b (positions, inclusive; SPEC §14), "
                     "besides calls.{c}.image_spans; repeatable");
      return [o] { return replay(*o); };
    }};

}  // namespace
}  // namespace dsv4::cli
