// The C API (include/dsv4/dsv4.h) over the C++ library: handles in a registry, exceptions turned
// into statuses and a per-thread message, DLTensors checked and turned into views.
#include "dsv4/dsv4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "capi/device_ops.h"
#include "capi/dlpack_view.h"
#include "dsv4/config.h"
#include "dsv4/engine.h"
#include "dsv4/error.h"
#include "dsv4/kv_cache.h"
#include "dsv4/kv_format.h"
#include "dsv4/numeric.h"
#include "dsv4/weights.h"
#include "model/layer_recipe.h"
#include "reference/ops.h"

struct dsv4_config {
  dsv4::ModelConfig config;
  dsv4::ModelTopology topology;
};
struct dsv4_weights {
  std::shared_ptr<const dsv4::ModelWeights> weights;
  int total_layers;
};
struct dsv4_engine {
  std::unique_ptr<dsv4::Engine> engine;
  int64_t step_tokens = -1;  // -1: no step open
};

namespace dsv4::capi {
namespace {

thread_local std::string last_error;

// The live handles and their kinds, so that a stale or foreign pointer is reported, never read.
enum class HandleKind { config, weights, engine };
std::mutex registry_mutex;
std::unordered_map<const void*, HandleKind>& registry() {
  static std::unordered_map<const void*, HandleKind> handles;
  return handles;
}
void register_handle(const void* h, HandleKind kind) {
  std::lock_guard lock(registry_mutex);
  registry()[h] = kind;
}
bool unregister_handle(const void* h, HandleKind kind) {
  std::lock_guard lock(registry_mutex);
  auto it = registry().find(h);
  if (it == registry().end() || it->second != kind) return false;
  registry().erase(it);
  return true;
}
const char* kind_name(HandleKind k) {
  return k == HandleKind::config ? "config" : k == HandleKind::weights ? "weights" : "engine";
}
void check_handle(const char* op, const char* arg, const void* h, HandleKind kind) {
  if (!h) throw ApiError(DSV4_ERROR_BAD_HANDLE, std::string("dsv4: ") + op + ": " + arg + " is NULL");
  std::lock_guard lock(registry_mutex);
  auto it = registry().find(h);
  if (it == registry().end())
    throw ApiError(DSV4_ERROR_BAD_HANDLE, std::string("dsv4: ") + op + ": " + arg +
                                              " is not a live dsv4_" + kind_name(kind) + " (destroyed or never created)");
  if (it->second != kind)
    throw ApiError(DSV4_ERROR_BAD_HANDLE, std::string("dsv4: ") + op + ": " + arg + " is a dsv4_" +
                                              kind_name(it->second) + ", expected a dsv4_" + kind_name(kind));
}

void check_out(const char* op, const char* arg, const void* p) {
  if (!p) throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, std::string("dsv4: ") + op + ": " + arg + " is NULL");
}
std::string str_arg(const char* op, const char* arg, const char* s) {
  check_out(op, arg, s);
  return s;
}

// Runs `body`, turning every exception into a status and the thread's message. `library_status`
// is the status of a dsv4::Error that is not a pool exhaustion (its message names the problem).
template <class Body>
dsv4_status guarded(dsv4_status library_status, Body&& body) {
  try {
    body();
    return DSV4_OK;
  } catch (const ApiError& e) {
    last_error = e.what();
    return e.status;
  } catch (const Error& e) {
    last_error = e.what();
    // The two resources a caller frees by releasing sequences: cache pages and sequence slots.
    if (std::strstr(e.what(), " is exhausted: ") || std::strstr(e.what(), " sequences are live, the maximum is "))
      return DSV4_ERROR_POOL_EXHAUSTED;
    return library_status;
  } catch (const std::bad_alloc&) {
    last_error = "dsv4: out of host memory";
    return DSV4_ERROR_INTERNAL;
  } catch (const std::exception& e) {
    last_error = std::string("dsv4: ") + e.what();
    return DSV4_ERROR_INTERNAL;
  } catch (...) {
    last_error = "dsv4: unknown exception";
    return DSV4_ERROR_INTERNAL;
  }
}

dsv4_status copy_string(const std::string& s, char* buf, size_t capacity, size_t* needed) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    if (needed) *needed = s.size() + 1;
    if (!buf || capacity < s.size() + 1)
      throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, "dsv4: string: buffer of " + std::to_string(capacity) +
                                                      " bytes, " + std::to_string(s.size() + 1) + " needed");
    std::memcpy(buf, s.c_str(), s.size() + 1);
  });
}

dsv4_config* make_config(ModelConfig config) {
  auto topology = resolve_topology(config);
  auto* h = new dsv4_config{std::move(config), std::move(topology)};
  register_handle(h, HandleKind::config);
  return h;
}

PagePlacement parse_placement(const char* op, const char* placement) {
  if (!placement || std::strcmp(placement, "segregated") == 0) return PagePlacement::segregated;
  if (std::strcmp(placement, "interleaved") == 0) return PagePlacement::interleaved;
  throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, std::string("dsv4: ") + op + ": placement '" + placement +
                                                  "': expected 'segregated' or 'interleaved'");
}

PageGeometry geometry_of(const char* op, const char* format, int64_t dims, int64_t rows_per_page,
                         const char* placement) {
  const KvRowFormat f = parse_kv_row_format(str_arg(op, "format", format));
  return page_geometry(f, dims, rows_per_page > 0 ? rows_per_page : default_rows_per_page(f),
                       parse_placement(op, placement));
}

}  // namespace
}  // namespace dsv4::capi

using namespace dsv4;
using namespace dsv4::capi;

extern "C" {

const char* dsv4_status_name(dsv4_status status) {
  switch (status) {
    case DSV4_OK: return "DSV4_OK";
    case DSV4_ERROR_INVALID_ARGUMENT: return "DSV4_ERROR_INVALID_ARGUMENT";
    case DSV4_ERROR_BAD_HANDLE: return "DSV4_ERROR_BAD_HANDLE";
    case DSV4_ERROR_BAD_SHAPE: return "DSV4_ERROR_BAD_SHAPE";
    case DSV4_ERROR_BAD_DTYPE: return "DSV4_ERROR_BAD_DTYPE";
    case DSV4_ERROR_BAD_DEVICE: return "DSV4_ERROR_BAD_DEVICE";
    case DSV4_ERROR_BAD_LAYOUT: return "DSV4_ERROR_BAD_LAYOUT";
    case DSV4_ERROR_POOL_EXHAUSTED: return "DSV4_ERROR_POOL_EXHAUSTED";
    case DSV4_ERROR_IO: return "DSV4_ERROR_IO";
    case DSV4_ERROR_UNSUPPORTED: return "DSV4_ERROR_UNSUPPORTED";
    case DSV4_ERROR_INTERNAL: return "DSV4_ERROR_INTERNAL";
  }
  return "DSV4_ERROR_UNKNOWN";
}

const char* dsv4_last_error(void) { return last_error.c_str(); }
const char* dsv4_version(void) { return DSV4_VERSION_STRING; }
int dsv4_has_cuda(void) {
#ifdef DSV4_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

// ---------------------------------------------------------------------------------------------
// Config

dsv4_status dsv4_config_from_preset(const char* name, dsv4_config** out) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_out("config_from_preset", "out", out);
    *out = make_config(preset_config(str_arg("config_from_preset", "name", name)));
  });
}

dsv4_status dsv4_config_from_file(const char* path, dsv4_config** out) {
  return guarded(DSV4_ERROR_IO, [&] {
    check_out("config_from_file", "out", out);
    const std::string p = str_arg("config_from_file", "path", path);
    if (!std::filesystem::is_regular_file(p))
      throw ApiError(DSV4_ERROR_IO, "dsv4: config_from_file: '" + p + "' is not a readable file");
    *out = make_config(load_config_file(p));
  });
}

dsv4_status dsv4_config_from_json(const char* json_text, dsv4_config** out) {
  return guarded(DSV4_ERROR_IO, [&] {
    check_out("config_from_json", "out", out);
    *out = make_config(parse_config_json(str_arg("config_from_json", "json_text", json_text), "json"));
  });
}

dsv4_status dsv4_config_destroy(dsv4_config* config) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("config_destroy", "config", config, HandleKind::config);
    unregister_handle(config, HandleKind::config);
    delete config;
  });
}

dsv4_status dsv4_preset_names(char* buf, size_t capacity, size_t* needed) {
  std::string s;
  for (const std::string& n : preset_names()) s += (s.empty() ? "" : "\n") + n;
  return copy_string(s, buf, capacity, needed);
}

dsv4_status dsv4_config_name(const dsv4_config* config, char* buf, size_t capacity, size_t* needed) {
  dsv4_status st = guarded(DSV4_ERROR_INVALID_ARGUMENT,
                           [&] { check_handle("config_name", "config", config, HandleKind::config); });
  return st != DSV4_OK ? st : copy_string(config->config.name, buf, capacity, needed);
}

dsv4_status dsv4_config_get_int(const dsv4_config* config, const char* field, int64_t* value) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("config_get_int", "config", config, HandleKind::config);
    check_out("config_get_int", "value", value);
    const ModelConfig& c = config->config;
    const std::string f = str_arg("config_get_int", "field", field);
    const std::pair<const char*, int64_t> fields[] = {
        {"hidden_size", c.hidden_size},
        {"num_layers", c.num_layers},
        {"num_mtp_layers", c.num_mtp_layers},
        {"total_layers", c.total_layers()},
        {"num_heads", c.num_heads},
        {"head_dim", c.head_dim},
        {"rope_head_dim", c.rope_head_dim},
        {"q_lora_rank", c.q_lora_rank},
        {"o_groups", c.o_groups},
        {"o_lora_rank", c.o_lora_rank},
        {"sliding_window", c.sliding_window},
        {"index_n_heads", c.index_n_heads},
        {"index_head_dim", c.index_head_dim},
        {"index_topk", c.index_topk},
        {"candidate_source_layer", c.candidate_source_layer},
        {"candidate_topk_blocks", c.candidate_topk_blocks},
        {"candidate_block_size", c.candidate_block_size},
        {"family", c.family == ModelFamily::v4_1 ? 1 : 0},
        {"tensor_parallel_size", c.tensor_parallel_size},
        {"vision_max_n_token", c.vision_max_n_token},
        {"dspark_block_size", c.dspark_block_size},
        {"num_dspark_targets", static_cast<int64_t>(c.dspark_target_layer_ids.size())},
        {"indexer_qat", c.indexer_qat ? 1 : 0},
    };
    for (const auto& [name, v] : fields)
      if (f == name) {
        *value = v;
        return;
      }
    throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, "dsv4: config_get_int: unknown field '" + f + "'");
  });
}

dsv4_status dsv4_config_layer_plan(const dsv4_config* config, int32_t layer, dsv4_layer_plan* plan) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("config_layer_plan", "config", config, HandleKind::config);
    check_out("config_layer_plan", "plan", plan);
    const ModelTopology& t = config->topology;
    if (layer < 0 || layer >= t.size())
      throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, "dsv4: config_layer_plan: layer " + std::to_string(layer) +
                                                      ", expected 0 ... " + std::to_string(t.size() - 1));
    const LayerPlan& p = t[layer];
    *plan = dsv4_layer_plan{p.layer,           static_cast<int32_t>(p.kind), p.compress_ratio,
                            p.is_mtp,          p.uses_compress_rope,         p.kv_source,
                            p.index_source,    p.owns_compressor,            p.owns_index_keys,
                            p.owns_indexer,    p.is_candidate_source,        p.uses_candidates};
  });
}

dsv4_status dsv4_config_kv_bytes(const dsv4_config* config, const char* kv_format, const char* precision,
                                 int64_t context, int64_t* bytes) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "config_kv_bytes";
    check_handle(op, "config", config, HandleKind::config);
    check_out(op, "bytes", bytes);
    if (context < 1)
      throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, "dsv4: config_kv_bytes: context " + std::to_string(context) +
                                                      ", expected >= 1");
    const ModelConfig& c = config->config;
    const ModelTopology& t = config->topology;
    KvCacheOptions options;
    options.formats = kv_format && *kv_format
                          ? kv_format_set(kv_format)
                          : default_kv_formats(c, parse_precision(precision ? precision : "reference"));
    const KvCacheCapacity cap = plan_kv_cache_capacity(c, t, options, 1, context, context);
    auto stride = [&](KvRowFormat f, int64_t dims) {
      return page_geometry(f, dims, default_rows_per_page(f)).page_stride;
    };
    int64_t total = 0;
    for (const LayerPlan& p : t.layers) {
      total += cap.window_pages * stride(options.formats->window, c.head_dim);
      if (p.owns_compressor) total += cap.compressed_pages * stride(options.formats->compressed, c.head_dim);
      if (p.owns_index_keys)
        total += cap.index_key_pages * stride(options.formats->index_keys, c.index_head_dim);
    }
    *bytes = total;
  });
}

// ---------------------------------------------------------------------------------------------
// Weights

dsv4_status dsv4_weights_load(const dsv4_config* config, const char* path, dsv4_weights** out) {
  return guarded(DSV4_ERROR_IO, [&] {
    check_handle("weights_load", "config", config, HandleKind::config);
    check_out("weights_load", "out", out);
    const std::string p = str_arg("weights_load", "path", path);
    if (!std::filesystem::exists(p))
      throw ApiError(DSV4_ERROR_IO, "dsv4: weights_load: '" + p + "' does not exist");
    auto w = std::make_shared<const ModelWeights>(load_weights(p, config->config, config->topology));
    *out = new dsv4_weights{std::move(w), config->config.total_layers()};
    register_handle(*out, HandleKind::weights);
  });
}

dsv4_status dsv4_weights_random(const dsv4_config* config, uint64_t seed, int fp8, dsv4_weights** out) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("weights_random", "config", config, HandleKind::config);
    check_out("weights_random", "out", out);
    auto w = std::make_shared<const ModelWeights>(random_weights(config->config, config->topology, seed, fp8 != 0));
    *out = new dsv4_weights{std::move(w), config->config.total_layers()};
    register_handle(*out, HandleKind::weights);
  });
}

dsv4_status dsv4_weights_save(const dsv4_weights* weights, const char* path) {
  return guarded(DSV4_ERROR_IO, [&] {
    check_handle("weights_save", "weights", weights, HandleKind::weights);
    save_weights(*weights->weights, str_arg("weights_save", "path", path));
  });
}

dsv4_status dsv4_weights_destroy(dsv4_weights* weights) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("weights_destroy", "weights", weights, HandleKind::weights);
    unregister_handle(weights, HandleKind::weights);
    delete weights;
  });
}

// ---------------------------------------------------------------------------------------------
// Engine

void dsv4_engine_options_init(dsv4_engine_options* options) {
  if (!options) return;
  static const EngineOptions d;
  *options = dsv4_engine_options{"cpu", "reference", "paged", "", d.max_sequences, d.max_tokens_per_step,
                                 d.max_context, d.num_threads, nullptr, d.max_rollback, d.attention_stage_bytes};
}

dsv4_status dsv4_engine_create(const dsv4_config* config, const dsv4_weights* weights,
                               const dsv4_engine_options* options, dsv4_engine** out) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "engine_create";
    check_handle(op, "config", config, HandleKind::config);
    check_handle(op, "weights", weights, HandleKind::weights);
    check_out(op, "out", out);
    dsv4_engine_options o;
    dsv4_engine_options_init(&o);
    if (options) o = *options;
    EngineOptions e;
    e.backend = parse_backend(str_arg(op, "options.backend", o.backend));
#ifndef DSV4_WITH_CUDA
    if (e.backend == Backend::cuda)
      throw ApiError(DSV4_ERROR_UNSUPPORTED, "dsv4: engine_create: backend 'cuda': this dsv4 was built without CUDA");
#endif
    e.precision = parse_precision(str_arg(op, "options.precision", o.precision));
    const std::string storage = str_arg(op, "options.cache_storage", o.cache_storage);
    if (storage == "paged") e.cache_storage = CacheStorage::paged;
    else if (storage == "float_rows") e.cache_storage = CacheStorage::float_rows;
    else
      throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, "dsv4: engine_create: options.cache_storage '" + storage +
                                                      "': expected 'paged' or 'float_rows'");
    e.kv_format = o.kv_format ? o.kv_format : "";
    e.max_sequences = o.max_sequences;
    e.max_tokens_per_step = o.max_tokens_per_step;
    e.max_context = o.max_context;
    e.max_rollback = o.max_rollback;
    e.attention_stage_bytes = o.attention_stage_bytes;
    e.num_threads = o.num_threads;
    e.cuda_stream = static_cast<CUstream_st*>(o.cuda_stream);
    if (weights->total_layers != config->config.total_layers())
      throw ApiError(DSV4_ERROR_INVALID_ARGUMENT,
                     "dsv4: engine_create: weights hold " + std::to_string(weights->total_layers) +
                         " layers, the config has " + std::to_string(config->config.total_layers()));
    auto engine = Engine::create(config->config, weights->weights, e);
    *out = new dsv4_engine{std::move(engine)};
    register_handle(*out, HandleKind::engine);
  });
}

dsv4_status dsv4_engine_destroy(dsv4_engine* engine) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_destroy", "engine", engine, HandleKind::engine);
    unregister_handle(engine, HandleKind::engine);
    delete engine;
  });
}

dsv4_status dsv4_engine_add_sequence(dsv4_engine* engine, int64_t* sequence) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_add_sequence", "engine", engine, HandleKind::engine);
    check_out("engine_add_sequence", "sequence", sequence);
    *sequence = engine->engine->add_sequence();
  });
}

dsv4_status dsv4_engine_fork_sequence(dsv4_engine* engine, int64_t parent, int64_t* child) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_fork_sequence", "engine", engine, HandleKind::engine);
    check_out("engine_fork_sequence", "child", child);
    *child = engine->engine->fork_sequence(parent);
  });
}

dsv4_status dsv4_engine_release_sequence(dsv4_engine* engine, int64_t sequence) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_release_sequence", "engine", engine, HandleKind::engine);
    engine->engine->release_sequence(sequence);
  });
}

dsv4_status dsv4_engine_rollback_sequence(dsv4_engine* engine, int64_t sequence, int64_t new_length) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_rollback_sequence", "engine", engine, HandleKind::engine);
    if (engine->step_tokens >= 0)
      throw ApiError(DSV4_ERROR_INVALID_ARGUMENT,
                     "dsv4: engine_rollback_sequence: a step is open; roll back after dsv4_engine_end_step");
    engine->engine->rollback_sequence(sequence, new_length);
  });
}

dsv4_status dsv4_engine_sequence_length(const dsv4_engine* engine, int64_t sequence, int64_t* length) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_sequence_length", "engine", engine, HandleKind::engine);
    check_out("engine_sequence_length", "length", length);
    *length = engine->engine->sequence_length(sequence);
  });
}

dsv4_status dsv4_engine_sequence_cache_bytes(const dsv4_engine* engine, int64_t sequence, int64_t* bytes) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_sequence_cache_bytes", "engine", engine, HandleKind::engine);
    check_out("engine_sequence_cache_bytes", "bytes", bytes);
    *bytes = engine->engine->sequence_cache_bytes(sequence);
  });
}

dsv4_status dsv4_engine_begin_step(dsv4_engine* engine, const int64_t* sequences, const int64_t* num_tokens,
                                   int64_t count) {
  return dsv4_engine_begin_step_with_image_spans(engine, sequences, num_tokens, count, nullptr, nullptr);
}

dsv4_status dsv4_engine_begin_step_with_image_spans(dsv4_engine* engine, const int64_t* sequences,
                                                   const int64_t* num_tokens, int64_t count,
                                                   const int64_t* image_span_counts, const int64_t* image_spans) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "engine_begin_step";
    check_handle(op, "engine", engine, HandleKind::engine);
    if (count < 0)
      throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, "dsv4: engine_begin_step: count " + std::to_string(count) +
                                                      ", expected >= 0");
    if (count > 0) {
      check_out(op, "sequences", sequences);
      check_out(op, "num_tokens", num_tokens);
    }
    std::vector<StepEntry> entries;
    int64_t tokens = 0, spans = 0;
    for (int64_t i = 0; i < count; ++i) {
      entries.push_back({sequences[i], num_tokens[i]});
      tokens += num_tokens[i];
      const int64_t n = image_span_counts ? image_span_counts[i] : 0;
      if (n < 0)
        throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, "dsv4: engine_begin_step: image_span_counts[" + std::to_string(i) +
                                                        "] is " + std::to_string(n) + ", expected >= 0");
      if (n > 0) check_out(op, "image_spans", image_spans);
      for (int64_t j = spans; j < spans + n; ++j) entries.back().image_spans.push_back({image_spans[2 * j], image_spans[2 * j + 1]});
      spans += n;
    }
    engine->engine->begin_step(entries);
    engine->step_tokens = tokens;
  });
}

dsv4_status dsv4_engine_run_layer(dsv4_engine* engine, int32_t layer, const DLTensor* hidden_in,
                                  const DLTensor* attn_out) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "engine_run_layer";
    check_handle(op, "engine", engine, HandleKind::engine);
    if (engine->step_tokens < 0)
      throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, "dsv4: engine_run_layer: no step is open (call begin_step first)");
    const int64_t hidden = engine->engine->config().hidden_size;
    const bool cuda = engine->engine->cuda_stream() != nullptr;
    const DLDeviceType device = cuda ? kDLCUDA : kDLCPU;
    const TensorView in = checked_view(op, "hidden_in", hidden_in, DType::f32, {engine->step_tokens, hidden}, device);
    const TensorView out = checked_view(op, "attn_out", attn_out, DType::f32, {engine->step_tokens, hidden}, device);
    engine->engine->run_layer(layer, in, out);
  });
}

dsv4_status dsv4_engine_layer_picks_shape(const dsv4_engine* engine, int32_t layer, int64_t* rows, int64_t* cols) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_layer_picks_shape", "engine", engine, HandleKind::engine);
    check_out("engine_layer_picks_shape", "rows", rows);
    check_out("engine_layer_picks_shape", "cols", cols);
    const HostTensor picks = engine->engine->layer_picks(layer);
    *rows = picks.empty() ? 0 : picks.size(0);
    *cols = picks.empty() ? 0 : picks.size(1);
  });
}

dsv4_status dsv4_engine_layer_picks(const dsv4_engine* engine, int32_t layer, const DLTensor* picks) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "engine_layer_picks";
    check_handle(op, "engine", engine, HandleKind::engine);
    const HostTensor p = engine->engine->layer_picks(layer);
    const int64_t rows = p.empty() ? 0 : p.size(0), cols = p.empty() ? 0 : p.size(1);
    const TensorView out = checked_view(op, "picks", picks, DType::i32, {rows, cols}, kDLCPU);
    if (p.nbytes() > 0) std::memcpy(out.data, p.data(), p.nbytes());
  });
}

dsv4_status dsv4_engine_end_step(dsv4_engine* engine) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_end_step", "engine", engine, HandleKind::engine);
    engine->engine->end_step();
    engine->step_tokens = -1;
  });
}

dsv4_status dsv4_engine_memory_usage(const dsv4_engine* engine, dsv4_engine_memory* memory) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_memory_usage", "engine", engine, HandleKind::engine);
    check_out("engine_memory_usage", "memory", memory);
    const EngineMemory m = engine->engine->memory();
    *memory = dsv4_engine_memory{m.weights, m.caches, m.workspace};
  });
}

dsv4_status dsv4_engine_cuda_stream(const dsv4_engine* engine, void** stream) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_cuda_stream", "engine", engine, HandleKind::engine);
    check_out("engine_cuda_stream", "stream", stream);
    *stream = engine->engine->cuda_stream();
  });
}

dsv4_status dsv4_engine_config(const dsv4_engine* engine, dsv4_config** out) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_handle("engine_config", "engine", engine, HandleKind::engine);
    check_out("engine_config", "out", out);
    *out = make_config(engine->engine->config());
  });
}

// ---------------------------------------------------------------------------------------------
// Operations

dsv4_status dsv4_kv_page_geometry(const char* format, int64_t dims, int64_t rows_per_page, const char* placement,
                                  dsv4_page_geometry* geometry) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    check_out("kv_page_geometry", "geometry", geometry);
    const PageGeometry g = geometry_of("kv_page_geometry", format, dims, rows_per_page, placement);
    *geometry = dsv4_page_geometry{g.row.dims,        g.rows_per_page,  g.page_stride,
                                   g.row.row_bytes(), g.row.data_bytes, g.row.scale_bytes};
  });
}

}  // extern "C"

namespace {
// The pages of a codec or attention call, [num_pages, page_stride] u8 (either device).
void check_pages_shape(const char* op, const PageGeometry& g, const DLTensor* pages) {
  check_dltensor(op, "pages", pages);
  if (pages->ndim != 2 || pages->shape[1] != g.page_stride)
    throw_shape(op, "pages", pages, "[num_pages, " + std::to_string(g.page_stride) + "]");
}

// Host pages and slots [n] i64 of a codec call, the slots checked against the pages.
struct CodecArgs {
  int64_t n = 0;
  const int64_t* slots = nullptr;
  std::span<std::byte> pages;
};
CodecArgs host_codec_args(const char* op, const PageGeometry& g, int64_t n, const DLTensor* slots,
                          const DLTensor* pages) {
  CodecArgs a;
  a.n = n;
  a.slots = checked_view(op, "slots", slots, DType::i64, {n}, kDLCPU).ptr<const int64_t>();
  const TensorView p = checked_view(op, "pages", pages, DType::u8, {pages->shape[0], g.page_stride}, kDLCPU);
  a.pages = std::span<std::byte>(p.ptr<std::byte>(), static_cast<size_t>(pages->shape[0] * g.page_stride));
  const int64_t capacity = pages->shape[0] * g.rows_per_page;
  for (int64_t i = 0; i < n; ++i)
    if (a.slots[i] >= capacity)
      throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, std::string("dsv4: ") + op + ": slots[" + std::to_string(i) +
                                                      "] = " + std::to_string(a.slots[i]) + ", expected < " +
                                                      std::to_string(capacity) + " (pages x rows_per_page)");
  return a;
}

void check_tensor_scale(const char* op, float tensor_scale) {
  if (!(tensor_scale > 0.0f) || !std::isfinite(tensor_scale))
    throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, std::string("dsv4: ") + op + ": tensor_scale must be finite and > 0");
}

// A float copy of a host tensor of `shape` given as f32 or bf16 (the CPU reference takes floats).
std::vector<float> host_floats(const char* op, const char* arg, const DLTensor* t,
                               std::initializer_list<int64_t> shape) {
  check_dltensor(op, arg, t);
  const bool bf16 = t->dtype.code == kDLBfloat && t->dtype.bits == 16;
  const TensorView v = checked_view(op, arg, t, bf16 ? DType::bf16 : DType::f32, shape, kDLCPU);
  const int64_t n = v.numel();
  std::vector<float> out(static_cast<size_t>(n));
  if (bf16)
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(v.ptr<const uint16_t>()[i]);
  else
    std::copy_n(v.ptr<const float>(), n, out.data());
  return out;
}

// The CPU attention of one call: token t attends row(t, i, indices[t, i]) for its valid list
// positions i; a token's rows are used before row() is asked for the next token's.
template <class RowOf>
void host_sparse_attention(const char* op, const DLTensor* q, int64_t D, const DLTensor* indices,
                           const DLTensor* topk_length, const DLTensor* sink, float scale, bool bf16,
                           const DLTensor* out, const DLTensor* lse, RowOf&& row) {
  const int64_t T = q->shape[0], H = q->shape[1], K = indices->shape[1];
  const std::vector<float> qf = host_floats(op, "q", q, {T, H, D});
  const int32_t* idx = checked_view(op, "indices", indices, DType::i32, {T, K}, kDLCPU).ptr<const int32_t>();
  const TensorView ov = checked_view(op, "out", out, DType::f32, {T, H, D}, kDLCPU);
  const int32_t* lengths =
      topk_length ? checked_view(op, "topk_length", topk_length, DType::i32, {T}, kDLCPU).ptr<const int32_t>()
                  : nullptr;
  const float* sinks = sink ? checked_view(op, "sink", sink, DType::f32, {H}, kDLCPU).ptr<const float>() : nullptr;
  float* lse_out = lse ? checked_view(op, "lse", lse, DType::f32, {T, H}, kDLCPU).ptr<float>() : nullptr;
  // A sink of −inf adds nothing to the denominator: the same as no sink.
  const std::vector<float> no_sink(static_cast<size_t>(H), -std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t len = lengths ? std::clamp<int64_t>(lengths[t], 0, K) : K;
    std::vector<const float*> rows;
    for (int64_t i = 0; i < len; ++i)
      if (idx[t * K + i] >= 0) rows.push_back(row(t, i, idx[t * K + i]));
    const float* qt = qf.data() + t * H * D;
    reference::sparse_attention(qt, H, D, rows.data(), static_cast<int64_t>(rows.size()),
                                sinks ? sinks : no_sink.data(), scale, bf16, ov.ptr<float>() + t * H * D);
    if (!lse_out) continue;
    // FlashMLA's lse: log Σ_i exp(scale q·kv_i), the sink left out; −inf for no rows. The logits
    // are the attention's (the dot rounded once to fp32, times the scale in fp32).
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> logits(rows.size());
      double m = -std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < rows.size(); ++i) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += double(qt[h * D + d]) * double(rows[i][d]);
        logits[i] = static_cast<float>(dot) * scale;
        m = std::max(m, logits[i]);
      }
      double sum = 0;
      for (double l : logits) sum += std::exp(l - m);
      lse_out[t * H + h] = rows.empty() ? -std::numeric_limits<float>::infinity() : float(m + std::log(sum));
    }
  }
}

// q [T, H, D] and indices [T, K]: the ranks both devices check first.
void check_attention_ranks(const char* op, const DLTensor* q, const DLTensor* indices) {
  check_dltensor(op, "q", q);
  if (q->ndim != 3) throw_shape(op, "q", q, "[tokens, heads, dim]");
  check_dltensor(op, "indices", indices);
  if (indices->ndim != 2) throw_shape(op, "indices", indices, "[" + std::to_string(q->shape[0]) + ", topk]");
}

// n_visible(t) of dsv4_index_scores / dsv4_topk, at most n.
int64_t host_visible(const int32_t* position, int32_t ratio, int64_t t, int64_t n) {
  if (!position) return n;
  return std::min<int64_t>(position[t] >= 0 ? (int64_t{position[t]} + 1) / ratio : 0, n);
}

void check_compress_ratio(const char* op, int32_t ratio) {
  if (ratio < 1)
    throw ApiError(DSV4_ERROR_INVALID_ARGUMENT,
                   std::string("dsv4: ") + op + ": compress_ratio is " + std::to_string(ratio) + ", expected >= 1");
}
}  // namespace

extern "C" {

dsv4_status dsv4_kv_encode(const char* format, int64_t rows_per_page, const char* placement, const DLTensor* x,
                           const DLTensor* slots, const DLTensor* pages, float tensor_scale,
                           const char* fp8_scale_floor, void* cuda_stream) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "kv_encode";
    check_dltensor(op, "x", x);
    if (x->ndim != 2) throw_shape(op, "x", x, "[n, dims]");
    const PageGeometry g = geometry_of(op, format, x->shape[1], rows_per_page, placement);
    check_pages_shape(op, g, pages);
    EncodeOptions options;
    const std::string floor = fp8_scale_floor ? fp8_scale_floor : "amax";
    if (floor == "ratio") options.fp8_scale_floor = Fp8ScaleFloor::ratio;
    else if (floor != "amax")
      throw ApiError(DSV4_ERROR_INVALID_ARGUMENT,
                     "dsv4: kv_encode: fp8_scale_floor '" + floor + "': expected 'amax' or 'ratio'");
    check_tensor_scale(op, tensor_scale);
    if (on_cuda(x)) return cuda_kv_encode(g, x, slots, pages, tensor_scale, options.fp8_scale_floor, cuda_stream);
    const int64_t n = x->shape[0];
    const TensorView xv = checked_view(op, "x", x, DType::f32, {n, g.row.dims}, kDLCPU);
    const CodecArgs a = host_codec_args(op, g, n, slots, pages);
    encode_rows(g, xv.ptr<const float>(), n, a.slots, a.pages, tensor_scale, options);
  });
}

dsv4_status dsv4_kv_decode(const char* format, int64_t rows_per_page, const char* placement, const DLTensor* pages,
                           const DLTensor* slots, const DLTensor* out, float tensor_scale, void* cuda_stream) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "kv_decode";
    check_dltensor(op, "out", out);
    if (out->ndim != 2) throw_shape(op, "out", out, "[n, dims]");
    const PageGeometry g = geometry_of(op, format, out->shape[1], rows_per_page, placement);
    check_pages_shape(op, g, pages);
    check_tensor_scale(op, tensor_scale);
    if (on_cuda(out)) return cuda_kv_decode(g, pages, slots, out, tensor_scale, cuda_stream);
    const int64_t n = out->shape[0];
    const TensorView ov = checked_view(op, "out", out, DType::f32, {n, g.row.dims}, kDLCPU);
    const CodecArgs a = host_codec_args(op, g, n, slots, pages);
    decode_rows(g, std::span<const std::byte>(a.pages), a.slots, n, ov.ptr<float>(), tensor_scale);
  });
}

dsv4_status dsv4_sparse_attention(const DLTensor* q, const DLTensor* kv, const DLTensor* indices,
                                  const DLTensor* topk_length, const DLTensor* sink, float scale, int bf16,
                                  const DLTensor* out, const DLTensor* lse, void* cuda_stream) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "sparse_attention";
    check_attention_ranks(op, q, indices);
    const int64_t D = q->shape[2];
    check_dltensor(op, "kv", kv);
    if (kv->ndim != 2) throw_shape(op, "kv", kv, "[n, " + std::to_string(D) + "]");
    const int64_t N = kv->shape[0];
    if (on_cuda(q)) {
      const AttentionRows rows{.geometry = page_geometry(KvRowFormat::bf16, D, 1), .pages = kv, .rows_as_pages = true};
      return cuda_sparse_attention(op, q, rows, indices, topk_length, sink, scale, bf16 != 0, out, lse, cuda_stream);
    }
    const std::vector<float> kv_rows = host_floats(op, "kv", kv, {N, D});
    const int64_t K = indices->shape[1];
    const int32_t* idx = checked_view(op, "indices", indices, DType::i32, {q->shape[0], K}, kDLCPU).ptr<const int32_t>();
    for (int64_t i = 0; i < q->shape[0] * K; ++i)
      if (idx[i] >= N)
        throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, "dsv4: sparse_attention: indices[" + std::to_string(i / K) + ", " +
                                                        std::to_string(i % K) + "] = " + std::to_string(idx[i]) +
                                                        ", expected < " + std::to_string(N) + " (kv rows) or -1");
    host_sparse_attention(op, q, D, indices, topk_length, sink, scale, bf16 != 0, out, lse,
                          [&](int64_t, int64_t, int32_t index) { return kv_rows.data() + index * D; });
  });
}

dsv4_status dsv4_paged_sparse_attention(const DLTensor* q, const char* format, int64_t rows_per_page,
                                        const char* placement, const DLTensor* pages, float tensor_scale,
                                        const DLTensor* indices, const DLTensor* topk_length, const DLTensor* sink,
                                        float scale, int bf16, const DLTensor* out, const DLTensor* lse,
                                        void* cuda_stream) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "paged_sparse_attention";
    check_attention_ranks(op, q, indices);
    const int64_t T = q->shape[0], D = q->shape[2], K = indices->shape[1];
    const PageGeometry g = geometry_of(op, format, D, rows_per_page, placement);
    check_pages_shape(op, g, pages);
    check_tensor_scale(op, tensor_scale);
    if (on_cuda(q)) {
      const AttentionRows rows{.geometry = g, .pages = pages, .tensor_scale = tensor_scale};
      return cuda_sparse_attention(op, q, rows, indices, topk_length, sink, scale, bf16 != 0, out, lse, cuda_stream);
    }
    const TensorView iv = checked_view(op, "indices", indices, DType::i32, {T, K}, kDLCPU);
    const TensorView pv = checked_view(op, "pages", pages, DType::u8, {pages->shape[0], g.page_stride}, kDLCPU);
    const int64_t capacity = pages->shape[0] * g.rows_per_page;
    for (int64_t i = 0; i < T * K; ++i)
      if (iv.ptr<const int32_t>()[i] >= capacity)
        throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, "dsv4: paged_sparse_attention: indices[" + std::to_string(i / K) +
                                                        ", " + std::to_string(i % K) + "] = " +
                                                        std::to_string(iv.ptr<const int32_t>()[i]) + ", expected < " +
                                                        std::to_string(capacity) + " (pages x rows_per_page) or -1");
    // A token's rows are decoded when it is attended (host_sparse_attention takes one token at a
    // time), into one buffer of K rows: memory stays K x D whatever the number of tokens.
    const std::span<const std::byte> bytes(pv.ptr<const std::byte>(), static_cast<size_t>(pv.numel()));
    std::vector<float> rows(static_cast<size_t>(K * D));
    host_sparse_attention(op, q, D, indices, topk_length, sink, scale, bf16 != 0, out, lse,
                          [&](int64_t, int64_t i, int32_t index) {
                            const int64_t slot = index;
                            decode_rows(g, bytes, &slot, 1, rows.data() + i * D, tensor_scale);
                            return rows.data() + i * D;
                          });
  });
}

dsv4_status dsv4_index_scores(const DLTensor* q, const DLTensor* weights, const DLTensor* keys,
                              const DLTensor* token_position, int32_t compress_ratio, int bf16,
                              const DLTensor* scores, void* cuda_stream) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "index_scores";
    check_dltensor(op, "q", q);
    if (q->ndim != 3) throw_shape(op, "q", q, "[tokens, heads, dim]");
    const int64_t T = q->shape[0], H = q->shape[1], D = q->shape[2];
    check_dltensor(op, "keys", keys);
    if (keys->ndim != 2) throw_shape(op, "keys", keys, "[n, " + std::to_string(D) + "]");
    const int64_t N = keys->shape[0];
    check_compress_ratio(op, compress_ratio);
    if (on_cuda(q))
      return cuda_index_scores(q, weights, keys, token_position, compress_ratio, bf16 != 0, scores, cuda_stream);
    const std::vector<float> qf = host_floats(op, "q", q, {T, H, D});
    const TensorView wv = checked_view(op, "weights", weights, DType::f32, {T, H}, kDLCPU);
    const std::vector<float> kf = host_floats(op, "keys", keys, {N, D});
    const int32_t* pv = checked_view(op, "token_position", token_position, DType::i32, {T}, kDLCPU).ptr<const int32_t>();
    const TensorView sv = checked_view(op, "scores", scores, DType::f32, {T, N}, kDLCPU);
    for (int64_t t = 0; t < T; ++t)
      reference::index_scores(qf.data() + t * H * D, wv.ptr<const float>() + t * H, H, D, kf.data(), N,
                              host_visible(pv, compress_ratio, t, N), bf16 != 0, sv.ptr<float>() + t * N);
  });
}

dsv4_status dsv4_topk(const DLTensor* scores, const DLTensor* token_position, int32_t compress_ratio,
                      const DLTensor* picks, void* cuda_stream) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "topk";
    check_dltensor(op, "scores", scores);
    if (scores->ndim != 2) throw_shape(op, "scores", scores, "[tokens, n]");
    const int64_t T = scores->shape[0], N = scores->shape[1];
    check_dltensor(op, "picks", picks);
    if (picks->ndim != 2) throw_shape(op, "picks", picks, "[" + std::to_string(T) + ", k]");
    const int64_t K = picks->shape[1];
    if (token_position) check_compress_ratio(op, compress_ratio);
    if (on_cuda(scores)) return cuda_topk(scores, token_position, compress_ratio, picks, cuda_stream);
    const TensorView sv = checked_view(op, "scores", scores, DType::f32, {T, N}, kDLCPU);
    const int32_t* pv =
        token_position
            ? checked_view(op, "token_position", token_position, DType::i32, {T}, kDLCPU).ptr<const int32_t>()
            : nullptr;
    const TensorView kv = checked_view(op, "picks", picks, DType::i32, {T, K}, kDLCPU);
    for (int64_t t = 0; t < T; ++t)
      reference::select_topk(sv.ptr<const float>() + t * N, N, host_visible(pv, compress_ratio, t, N), K,
                             kv.ptr<int32_t>() + t * K);
  });
}

dsv4_status dsv4_compressor_pool(const DLTensor* kv, const DLTensor* score, const DLTensor* bias,
                                 const DLTensor* pooled) {
  return guarded(DSV4_ERROR_INVALID_ARGUMENT, [&] {
    const char* op = "compressor_pool";
    check_dltensor(op, "kv", kv);
    if (kv->ndim != 3) throw_shape(op, "kv", kv, "[entries, slots, dim]");
    const int64_t E = kv->shape[0], S = kv->shape[1], D = kv->shape[2];
    const TensorView kvv = checked_view(op, "kv", kv, DType::f32, {E, S, D}, kDLCPU);
    const TensorView sv = checked_view(op, "score", score, DType::f32, {E, S, D}, kDLCPU);
    const float* b = bias ? checked_view(op, "bias", bias, DType::f32, {S, D}, kDLCPU).ptr<const float>() : nullptr;
    const TensorView pv = checked_view(op, "pooled", pooled, DType::f32, {E, D}, kDLCPU);
    std::vector<const float*> k(static_cast<size_t>(S)), s(k.size()), bs(k.size());
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t i = 0; i < S; ++i) {
        k[i] = kvv.ptr<const float>() + (e * S + i) * D;
        s[i] = sv.ptr<const float>() + (e * S + i) * D;
        bs[i] = b ? b + i * D : nullptr;
      }
      reference::softmax_pool(k.data(), s.data(), b ? bs.data() : nullptr, S, D, pv.ptr<float>() + e * D);
    }
  });
}

}  // extern "C"
