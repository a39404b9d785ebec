// dsv4._dsv4: the C API (include/dsv4/dsv4.h) for Python. Tensors arrive as DLPack capsules
// (dsv4/_tensors.py makes them from numpy arrays and torch tensors); a failed call raises the
// exception class dsv4/errors.py maps its status to, with the C API's message.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/dsv4.h"

namespace py = pybind11;

namespace {

[[noreturn]] void raise(dsv4_status status) {
  const std::string message = dsv4_last_error();
  py::object errors = py::module_::import("dsv4.errors");
  py::object cls = errors.attr("error_class")(static_cast<int>(status));
  PyErr_SetString(cls.ptr(), message.c_str());
  throw py::error_already_set();
}

void check(dsv4_status status) {
  if (status != DSV4_OK) raise(status);
}

// Runs a C API call without the GIL (the error message stays on this thread: dsv4_last_error).
template <class Call>
dsv4_status released(Call&& call) {
  py::gil_scoped_release release;
  return call();
}

// A borrowed DLTensor of a "dltensor" capsule (None: NULL). The capsule keeps its producer's
// memory alive for the call; its destructor returns it afterwards (the capsule is not consumed).
const DLTensor* dl(const py::object& capsule) {
  if (capsule.is_none()) return nullptr;
  if (!PyCapsule_CheckExact(capsule.ptr()) || !PyCapsule_IsValid(capsule.ptr(), "dltensor"))
    throw py::type_error("dsv4: expected a DLPack capsule named 'dltensor' (use dsv4's functions, not _dsv4's)");
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  return &managed->dl_tensor;
}

const char* opt(const std::optional<std::string>& s) { return s ? s->c_str() : nullptr; }

std::string get_string(dsv4_status (*getter)(const dsv4_config*, char*, size_t, size_t*), const dsv4_config* c) {
  size_t needed = 0;
  getter(c, nullptr, 0, &needed);
  std::string s(needed, '\0');
  check(getter(c, s.data(), s.size(), nullptr));
  s.resize(needed - 1);
  return s;
}

// Owning handles: destroyed with their Python objects.
struct Config {
  dsv4_config* h = nullptr;
  explicit Config(dsv4_config* handle) : h(handle) {}
  Config(const Config&) = delete;
  ~Config() { dsv4_config_destroy(h); }
};
struct Weights {
  dsv4_weights* h = nullptr;
  explicit Weights(dsv4_weights* handle) : h(handle) {}
  Weights(const Weights&) = delete;
  ~Weights() { dsv4_weights_destroy(h); }
};
struct Engine {
  dsv4_engine* h = nullptr;
  explicit Engine(dsv4_engine* handle) : h(handle) {}
  Engine(const Engine&) = delete;
  ~Engine() { dsv4_engine_destroy(h); }
};

}  // namespace

PYBIND11_MODULE(_dsv4, m) {
  m.doc() = "dsv4's C API for Python (use the package dsv4, not this module)";
  m.attr("C_API_VERSION") = DSV4_C_API_VERSION;
  m.def("version", [] { return std::string(dsv4_version()); });
  m.def("has_cuda", [] { return dsv4_has_cuda() != 0; });
  m.def("preset_names", [] {
    size_t needed = 0;
    dsv4_preset_names(nullptr, 0, &needed);
    std::string s(needed, '\0');
    check(dsv4_preset_names(s.data(), s.size(), nullptr));
    s.resize(needed - 1);
    return s;
  });

  py::class_<Config>(m, "Config")
      .def_static("from_preset", [](const std::string& name) {
        dsv4_config* h = nullptr;
        check(dsv4_config_from_preset(name.c_str(), &h));
        return std::make_unique<Config>(h);
      })
      .def_static("from_file", [](const std::string& path) {
        dsv4_config* h = nullptr;
        check(dsv4_config_from_file(path.c_str(), &h));
        return std::make_unique<Config>(h);
      })
      .def_static("from_json", [](const std::string& text) {
        dsv4_config* h = nullptr;
        check(dsv4_config_from_json(text.c_str(), &h));
        return std::make_unique<Config>(h);
      })
      .def("name", [](const Config& c) { return get_string(dsv4_config_name, c.h); })
      .def("get_int", [](const Config& c, const std::string& field) {
        int64_t v = 0;
        check(dsv4_config_get_int(c.h, field.c_str(), &v));
        return v;
      })
      .def("layer_plan", [](const Config& c, int32_t layer) {
        dsv4_layer_plan p;
        check(dsv4_config_layer_plan(c.h, layer, &p));
        py::dict d;
        d["layer"] = p.layer;
        static const char* kinds[] = {"sliding", "compressed", "csa", "hca"};
        d["kind"] = kinds[p.kind];
        d["compress_ratio"] = p.compress_ratio;
        d["is_mtp"] = bool(p.is_mtp);
        d["uses_compress_rope"] = bool(p.uses_compress_rope);
        d["kv_source"] = p.kv_source;
        d["index_source"] = p.index_source;
        d["owns_compressor"] = bool(p.owns_compressor);
        d["owns_index_keys"] = bool(p.owns_index_keys);
        d["owns_indexer"] = bool(p.owns_indexer);
        d["is_candidate_source"] = bool(p.is_candidate_source);
        d["uses_candidates"] = bool(p.uses_candidates);
        return d;
      })
      .def("kv_bytes", [](const Config& c, std::optional<std::string> kv_format, const std::string& precision,
                          int64_t context) {
        int64_t bytes = 0;
        check(dsv4_config_kv_bytes(c.h, opt(kv_format), precision.c_str(), context, &bytes));
        return bytes;
      });

  py::class_<Weights>(m, "Weights")
      .def_static("load", [](const Config& c, const std::string& path) {
        dsv4_weights* h = nullptr;
        dsv4_status st;
        {
          py::gil_scoped_release release;
          st = dsv4_weights_load(c.h, path.c_str(), &h);
        }
        check(st);
        return std::make_unique<Weights>(h);
      })
      .def_static("random", [](const Config& c, uint64_t seed, bool fp8) {
        dsv4_weights* h = nullptr;
        check(dsv4_weights_random(c.h, seed, fp8 ? 1 : 0, &h));
        return std::make_unique<Weights>(h);
      })
      .def("save", [](const Weights& w, const std::string& path) { check(dsv4_weights_save(w.h, path.c_str())); });

  py::class_<Engine>(m, "Engine")
      .def(py::init([](const Config& c, const Weights& w, const std::string& backend, const std::string& precision,
                       const std::string& cache_storage, const std::string& kv_format, int64_t max_sequences,
                       int64_t max_tokens_per_step, int64_t max_context, int32_t num_threads, uintptr_t cuda_stream,
                       int64_t max_rollback, int64_t attention_stage_bytes) {
        dsv4_engine_options o;
        dsv4_engine_options_init(&o);
        o.backend = backend.c_str();
        o.precision = precision.c_str();
        o.cache_storage = cache_storage.c_str();
        o.kv_format = kv_format.c_str();
        o.max_sequences = max_sequences;
        o.max_tokens_per_step = max_tokens_per_step;
        o.max_context = max_context;
        o.num_threads = num_threads;
        o.cuda_stream = reinterpret_cast<void*>(cuda_stream);
        o.max_rollback = max_rollback;
        o.attention_stage_bytes = attention_stage_bytes;
        dsv4_engine* h = nullptr;
        check(dsv4_engine_create(c.h, w.h, &o, &h));
        return std::make_unique<Engine>(h);
      }))
      .def("add_sequence", [](Engine& e) {
        int64_t id = 0;
        check(dsv4_engine_add_sequence(e.h, &id));
        return id;
      })
      .def("fork_sequence", [](Engine& e, int64_t parent) {
        int64_t id = 0;
        check(dsv4_engine_fork_sequence(e.h, parent, &id));
        return id;
      })
      .def("release_sequence", [](Engine& e, int64_t s) { check(dsv4_engine_release_sequence(e.h, s)); })
      .def("rollback_sequence",
           [](Engine& e, int64_t s, int64_t n) { check(dsv4_engine_rollback_sequence(e.h, s, n)); })
      .def("sequence_length", [](const Engine& e, int64_t s) {
        int64_t v = 0;
        check(dsv4_engine_sequence_length(e.h, s, &v));
        return v;
      })
      .def("sequence_cache_bytes", [](const Engine& e, int64_t s) {
        int64_t v = 0;
        check(dsv4_engine_sequence_cache_bytes(e.h, s, &v));
        return v;
      })
      .def("begin_step", [](Engine& e, const std::vector<int64_t>& sequences, const std::vector<int64_t>& tokens,
                            const std::vector<int64_t>& span_counts, const std::vector<int64_t>& spans) {
        if (sequences.size() != tokens.size() || sequences.size() != span_counts.size())
          throw py::value_error("dsv4: begin_step: sequences, num_tokens and image span counts differ in length");
        check(dsv4_engine_begin_step_with_image_spans(e.h, sequences.data(), tokens.data(),
                                                      static_cast<int64_t>(sequences.size()), span_counts.data(),
                                                      spans.data()));
      })
      .def("run_layer", [](Engine& e, int32_t layer, const py::object& in, const py::object& out) {
        const DLTensor* i = dl(in);
        const DLTensor* o = dl(out);
        dsv4_status st;
        {
          py::gil_scoped_release release;
          st = dsv4_engine_run_layer(e.h, layer, i, o);
        }
        check(st);
      })
      .def("layer_picks_shape", [](const Engine& e, int32_t layer) {
        int64_t rows = 0, cols = 0;
        check(dsv4_engine_layer_picks_shape(e.h, layer, &rows, &cols));
        return std::make_pair(rows, cols);
      })
      .def("layer_picks", [](const Engine& e, int32_t layer, const py::object& out) {
        check(dsv4_engine_layer_picks(e.h, layer, dl(out)));
      })
      .def("end_step", [](Engine& e) { check(dsv4_engine_end_step(e.h)); })
      .def("memory", [](const Engine& e) {
        dsv4_engine_memory mem;
        check(dsv4_engine_memory_usage(e.h, &mem));
        py::dict d;
        d["weights"] = mem.weights;
        d["caches"] = mem.caches;
        d["workspace"] = mem.workspace;
        return d;
      })
      .def("cuda_stream", [](const Engine& e) {
        void* s = nullptr;
        check(dsv4_engine_cuda_stream(e.h, &s));
        return reinterpret_cast<uintptr_t>(s);
      })
      .def("config", [](const Engine& e) {
        dsv4_config* h = nullptr;
        check(dsv4_engine_config(e.h, &h));
        return std::make_unique<Config>(h);
      });

  m.def("kv_page_geometry", [](const std::string& format, int64_t dims, int64_t rows_per_page,
                               const std::string& placement) {
    dsv4_page_geometry g;
    check(dsv4_kv_page_geometry(format.c_str(), dims, rows_per_page, placement.c_str(), &g));
    py::dict d;
    d["dims"] = g.dims;
    d["rows_per_page"] = g.rows_per_page;
    d["page_stride"] = g.page_stride;
    d["row_bytes"] = g.row_bytes;
    d["data_bytes"] = g.data_bytes;
    d["scale_bytes"] = g.scale_bytes;
    return d;
  });
  // The operations take the stream their CUDA work is queued on (a cudaStream_t as an integer,
  // torch.cuda.current_stream().cuda_stream; ignored on the CPU) and release the GIL while they run.
  m.def("kv_encode", [](const std::string& format, int64_t rows_per_page, const std::string& placement,
                        const py::object& x, const py::object& slots, const py::object& pages, float tensor_scale,
                        const std::string& fp8_scale_floor, uintptr_t stream) {
    const DLTensor *a = dl(x), *b = dl(slots), *c = dl(pages);
    check(released([&] {
      return dsv4_kv_encode(format.c_str(), rows_per_page, placement.c_str(), a, b, c, tensor_scale,
                            fp8_scale_floor.c_str(), reinterpret_cast<void*>(stream));
    }));
  });
  m.def("kv_decode", [](const std::string& format, int64_t rows_per_page, const std::string& placement,
                        const py::object& pages, const py::object& slots, const py::object& out, float tensor_scale,
                        uintptr_t stream) {
    const DLTensor *a = dl(pages), *b = dl(slots), *c = dl(out);
    check(released([&] {
      return dsv4_kv_decode(format.c_str(), rows_per_page, placement.c_str(), a, b, c, tensor_scale,
                            reinterpret_cast<void*>(stream));
    }));
  });
  m.def("sparse_attention", [](const py::object& q, const py::object& kv, const py::object& indices,
                               const py::object& topk_length, const py::object& sink, float scale, bool bf16,
                               const py::object& out, const py::object& lse, uintptr_t stream) {
    const DLTensor *a = dl(q), *b = dl(kv), *c = dl(indices), *d = dl(topk_length), *e = dl(sink), *f = dl(out),
                   *g = dl(lse);
    check(released([&] {
      return dsv4_sparse_attention(a, b, c, d, e, scale, bf16 ? 1 : 0, f, g, reinterpret_cast<void*>(stream));
    }));
  });
  m.def("paged_sparse_attention", [](const py::object& q, const std::string& format, int64_t rows_per_page,
                                     const std::string& placement, const py::object& pages, float tensor_scale,
                                     const py::object& indices, const py::object& topk_length, const py::object& sink,
                                     float scale, bool bf16, const py::object& out, const py::object& lse,
                                     uintptr_t stream) {
    const DLTensor *a = dl(q), *b = dl(pages), *c = dl(indices), *d = dl(topk_length), *e = dl(sink), *f = dl(out),
                   *g = dl(lse);
    check(released([&] {
      return dsv4_paged_sparse_attention(a, format.c_str(), rows_per_page, placement.c_str(), b, tensor_scale, c, d, e,
                                         scale, bf16 ? 1 : 0, f, g, reinterpret_cast<void*>(stream));
    }));
  });
  m.def("index_scores", [](const py::object& q, const py::object& weights, const py::object& keys,
                           const py::object& token_position, int32_t compress_ratio, bool bf16,
                           const py::object& scores, uintptr_t stream) {
    const DLTensor *a = dl(q), *b = dl(weights), *c = dl(keys), *d = dl(token_position), *e = dl(scores);
    check(released([&] {
      return dsv4_index_scores(a, b, c, d, compress_ratio, bf16 ? 1 : 0, e, reinterpret_cast<void*>(stream));
    }));
  });
  m.def("topk", [](const py::object& scores, const py::object& token_position, int32_t compress_ratio,
                   const py::object& picks, uintptr_t stream) {
    const DLTensor *a = dl(scores), *b = dl(token_position), *c = dl(picks);
    check(released([&] { return dsv4_topk(a, b, compress_ratio, c, reinterpret_cast<void*>(stream)); }));
  });
  m.def("compressor_pool", [](const py::object& kv, const py::object& score, const py::object& bias,
                              const py::object& pooled) {
    check(dsv4_compressor_pool(dl(kv), dl(score), dl(bias), dl(pooled)));
  });
}
