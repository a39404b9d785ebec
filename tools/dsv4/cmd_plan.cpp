// dsv4 plan: a config's per-layer roles (SPEC §1.3, §12) and what its KV caches cost in each cache
// format set (SPEC §7), per token and, with --context, per sequence and per memory budget.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "dsv4/command.h"
#include "dsv4/config.h"
#include "dsv4/error.h"
#include "dsv4/kv_format.h"

namespace dsv4::cli {
namespace {

struct PlanOptions {
  std::string preset;
  std::string config_file;
  std::string kv_format;  // empty: every format set
  std::string memory;     // empty: no capacity estimate
  int64_t context = 0;    // 0: no per-sequence estimate
};

constexpr int64_t kMaxContext = int64_t{1} << 40;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// "0-1, 40-42": ascending layer ids with consecutive runs collapsed.
std::string layer_ranges(const std::vector<int>& layers) {
  std::string out;
  for (size_t i = 0; i < layers.size();) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(layers[i]);
    if (j > i) out += "-" + std::to_string(layers[j]);
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 5) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", bytes, units[u]);
  return buf;
}

// "120GiB", "1.5 TiB", "4096" (bytes).
int64_t parse_byte_size(const std::string& text) {
  static const std::regex pattern(R"(^\s*([0-9]+(?:\.[0-9]+)?)\s*(B|KiB|MiB|GiB|TiB)?\s*$)");
  std::smatch m;
  if (!std::regex_match(text, m, pattern))
    fail("plan: --memory '", text, "': expected a byte count, optionally with KiB, MiB, GiB or TiB (e.g. 120GiB)");
  const std::string unit = m[2].matched ? m[2].str() : "B";
  const int shift = unit == "B" ? 0 : unit == "KiB" ? 10 : unit == "MiB" ? 20 : unit == "GiB" ? 30 : 40;
  const long double bytes = std::stold(m[1].str()) * std::ldexp(1.0L, shift);
  if (bytes < 1.0L || bytes > std::ldexp(1.0L, 62))
    fail("plan: --memory '", text, "': expected 1 B to 4 EiB");
  return static_cast<int64_t>(bytes);
}

// ---------------------------------------------------------------------------------------------
// Topology

void print_config_summary(const ModelConfig& c) {
  std::printf("model %s (%s): %d backbone layers + %d MTP layer%s\n", c.name.c_str(), family_name(c.family),
              c.num_layers, c.num_mtp_layers, c.num_mtp_layers == 1 ? "" : "s");
  std::printf("  hidden %" PRId64 ", %d query heads x %" PRId64 " (%" PRId64 " NoPE + %" PRId64
              " RoPE), one shared K=V head, q_lora %" PRId64 ", output %d groups x %" PRId64 "\n",
              c.hidden_size, c.num_heads, c.head_dim, c.head_dim - c.rope_head_dim, c.rope_head_dim, c.q_lora_rank,
              c.o_groups, c.o_lora_rank);
  std::printf("  window %" PRId64 "; indexer %d heads x %" PRId64 ", top-k %" PRId64, c.sliding_window,
              c.index_n_heads, c.index_head_dim, c.index_topk);
  if (c.indexer_qat) std::printf(" with the official QAT (Hadamard + FP4 q and k in reference precision)");
  if (c.has_dspark()) std::printf("; DSpark blocks of %" PRId64, c.dspark_block_size);
  if (c.candidate_source_layer >= 0)
    std::printf("; candidates from layer %d: %" PRId64 " blocks x %" PRId64 " entries", c.candidate_source_layer,
                c.candidate_topk_blocks, c.candidate_block_size);
  std::printf("\n  rope: main theta %g%s; compressed theta %g", c.main_rope.theta, c.main_rope.yarn ? " + YaRN" : "",
              c.compress_rope.theta);
  if (c.compress_rope.yarn)
    std::printf(", YaRN factor %g, original %" PRId64 ", beta %g/%g", c.compress_rope.factor,
                c.compress_rope.original_max_position, c.compress_rope.beta_fast, c.compress_rope.beta_slow);
  std::printf("\n  rms_norm_eps %g; weights ", c.rms_norm_eps);
  if (c.weight_quantization)
    std::printf("fp8 e4m3, %dx%d blocks, %s scales\n", c.weight_quantization->block_out,
                c.weight_quantization->block_in, c.weight_quantization->ue8m0_scales ? "ue8m0" : "fp32");
  else
    std::printf("bf16 (no fp8 block quantization)\n");
}

// Whether `p` reuses the picks of an index source that masks them to the candidates.
bool reuses_masked_picks(const ModelTopology& t, const LayerPlan& p) {
  return !p.owns_indexer && p.index_source >= 0 && t[p.index_source].uses_candidates;
}

void print_layer_table(const ModelTopology& t) {
  std::printf("\n%5s %-10s %5s %-8s %6s %7s %-10s %-7s %-10s %-12s %s\n", "layer", "kind", "ratio", "rope", "kv_src",
              "idx_src", "compressor", "indexer", "index_keys", "candidates", "mtp");
  auto id = [](int layer) { return layer >= 0 ? std::to_string(layer) : std::string("-"); };
  for (const LayerPlan& p : t.layers) {
    const bool attends_all = p.kind == AttentionKind::hca;  // V4.0 HCA: no indexer, every entry
    const char* candidates = p.is_candidate_source  ? "source"
                             : p.uses_candidates    ? "mask"
                             : reuses_masked_picks(t, p) ? "masked-picks"
                                                         : "-";
    std::printf("%5d %-10s %5d %-8s %6s %7s %-10s %-7s %-10s %-12s %s\n", p.layer, attention_kind_name(p.kind),
                p.compress_ratio, p.uses_compress_rope ? "compress" : "main", id(p.kv_source).c_str(),
                attends_all ? "all" : id(p.index_source).c_str(), p.owns_compressor ? "own" : "-",
                p.owns_indexer ? "own" : p.index_source >= 0 ? "reuse" : "-", p.owns_index_keys ? "own" : "-",
                candidates, p.is_mtp ? "yes" : "-");
  }
}

// DSpark draft layers and the ring sizes speculative decoding with K = dspark_block_size drafts
// per step needs (SPEC §13.3, §13.4): a verify step writes K + 1 positions while its first token
// still reads W − 1 older ones, so a window ring keeps W + K slots; a ratio-2 compressor keeps the
// rows of its open group position-addressed, K + 2 rows (the previous row, the bonus token, K drafts).
void print_dspark(const ModelConfig& c, const std::vector<int>& draft_layers) {
  std::string targets;
  for (int t : c.dspark_target_layer_ids) targets += (targets.empty() ? "" : ", ") + std::to_string(t);
  const int64_t K = c.dspark_block_size, W = c.sliding_window;
  std::printf("\nDSpark draft layers: %s (stages 0..%d), blocks of %" PRId64 " rows, non-causal inside the block\n",
              layer_ranges(draft_layers).c_str(), c.num_mtp_layers - 1, K);
  std::printf("  context rows of committed tokens from the target model: the hidden states entering layers [%s], "
              "main_proj %" PRId64 " -> %" PRId64 ", main_norm (run_draft_context)\n",
              targets.c_str(), c.dspark_main_width(), c.hidden_size);
  std::printf("  a draft block attends min(p0 + 1, %" PRId64 ") window rows + %" PRId64
              " block rows (at most %" PRId64 "); its own rows are never stored\n", W, K, W + K);
  std::printf("rings for speculative decoding with K = %" PRId64 " drafts (verify steps of %" PRId64 " tokens):\n",
              K, K + 1);
  std::printf("  window rings (every layer, draft layers included): W + K = %" PRId64 " slots (%" PRId64
              " without speculation)\n", W + K, W);
  const bool ratio_two = std::find(c.compress_ratios.begin(), c.compress_ratios.end(), 2) != c.compress_ratios.end();
  if (ratio_two)
    std::printf("  ratio-2 compressor state: K + 2 = %" PRId64 " position-addressed rows of [kv | score] per kv source "
                "(2 without speculation)\n", K + 2);
}

void print_roles(const ModelConfig& c, const ModelTopology& t) {
  auto layers_where = [&](auto predicate) {
    std::vector<int> out;
    for (const LayerPlan& p : t.layers)
      if (predicate(p)) out.push_back(p.layer);
    return out;
  };
  std::printf("\nown compressor + compressed cache: %s\n",
              layer_ranges(layers_where([](const LayerPlan& p) { return p.owns_compressor; })).c_str());
  std::printf("own index-key cache: %s\n",
              layer_ranges(layers_where([](const LayerPlan& p) { return p.owns_index_keys; })).c_str());
  std::printf("own indexer (index sources): %s\n",
              layer_ranges(layers_where([](const LayerPlan& p) { return p.owns_indexer; })).c_str());
  std::printf("reuse an index source's picks: %s\n",
              layer_ranges(layers_where([](const LayerPlan& p) { return p.index_source >= 0 && !p.owns_indexer; })).c_str());
  if (c.family == ModelFamily::v4_0)
    std::printf("attend every visible compressed entry (HCA): %s\n",
                layer_ranges(layers_where([](const LayerPlan& p) { return p.kind == AttentionKind::hca; })).c_str());
  if (c.candidate_source_layer >= 0) {
    const auto masking = layers_where([](const LayerPlan& p) { return p.uses_candidates; });
    const auto reusing = layers_where([&](const LayerPlan& p) { return reuses_masked_picks(t, p); });
    auto consumers = masking;
    consumers.insert(consumers.end(), reusing.begin(), reusing.end());
    std::sort(consumers.begin(), consumers.end());
    std::printf("candidate source: %d\n", c.candidate_source_layer);
    std::printf("candidate consumers: %s (index sources %s apply the candidate mask; %s reuse their masked picks)\n",
                layer_ranges(consumers).c_str(), layer_ranges(masking).c_str(), layer_ranges(reusing).c_str());
  }
  std::printf("window-only: %s\n",
              layer_ranges(layers_where([](const LayerPlan& p) { return p.compress_ratio == 0; })).c_str());
  if (c.has_dspark()) print_dspark(c, layers_where([](const LayerPlan& p) { return p.kind == AttentionKind::dspark; }));
}

// ---------------------------------------------------------------------------------------------
// KV bytes

struct CacheGeometry {
  const char* cache;  // "window", "compressed", "index keys"
  PageGeometry page;
  // Bytes a row costs in whole pages: page stride (incl. alignment padding) / rows per page.
  double paged_row_bytes() const { return static_cast<double>(page.page_stride) / static_cast<double>(page.rows_per_page); }
};

CacheGeometry cache_geometry(const char* cache, KvRowFormat format, int64_t dims) {
  return {cache, page_geometry(format, dims, default_rows_per_page(format))};
}

// fp32 partial-group state a kv source keeps per sequence (SPEC §3.3, §12): the kv and gate/score
// rows of the group being formed. The overlapping V4.0 CSA compressor buffers both halves of its
// 2·width projections for the current window plus the first half of the previous one, and its
// indexer's own compressor does the same at index_head_dim. Ratio-1 compressors keep nothing.
int64_t compressor_state_bytes(const ModelConfig& c, const LayerPlan& p) {
  const int64_t r = p.compress_ratio;
  if (!p.owns_compressor || r < 2) return 0;
  if (p.kind == AttentionKind::csa) return 4 * r * 6 * (c.head_dim + c.index_head_dim);
  return 4 * r * 2 * c.head_dim;
}

struct SequenceBytes {
  int64_t window = 0;
  int64_t compressed = 0;
  int64_t index_keys = 0;
  int64_t compressor_state = 0;
  int64_t total() const { return window + compressed + index_keys + compressor_state; }
};

// Whole pages one sequence of `context` tokens holds: every layer's window keeps
// min(context, window) rows, plus one page once the ring wraps (the live window straddles a page
// boundary); kv sources keep ceil(context / ratio) compressed and index-key entries.
SequenceBytes sequence_bytes(const ModelConfig& c, const ModelTopology& t, const CacheGeometry& window,
                             const CacheGeometry& compressed, const CacheGeometry& index_keys, int64_t context) {
  auto pages_bytes = [](const PageGeometry& g, int64_t rows) { return ceil_div(rows, g.rows_per_page) * g.page_stride; };
  SequenceBytes s;
  const int64_t window_rows = std::min(context, c.sliding_window);
  const int64_t ring_page = context > c.sliding_window ? window.page.page_stride : 0;
  for (const LayerPlan& p : t.layers) {
    s.window += pages_bytes(window.page, window_rows) + ring_page;
    if (!p.owns_compressor) continue;
    const int64_t entries = ceil_div(context, p.compress_ratio);
    s.compressed += pages_bytes(compressed.page, entries);
    if (p.owns_index_keys) s.index_keys += pages_bytes(index_keys.page, entries);
    s.compressor_state += compressor_state_bytes(c, p);
  }
  return s;
}

// "ratio 2: 144.00, ratio 1: 288.00" and the per-token sum over the owning layers.
std::pair<std::string, double> per_token_bytes(const ModelTopology& t, const CacheGeometry& g, bool index_keys) {
  std::string by_ratio;
  std::vector<int> ratios_seen;
  double sum = 0.0;
  for (const LayerPlan& p : t.layers) {
    if (!(index_keys ? p.owns_index_keys : p.owns_compressor)) continue;
    const double per_token = g.paged_row_bytes() / p.compress_ratio;
    sum += per_token;
    if (std::find(ratios_seen.begin(), ratios_seen.end(), p.compress_ratio) != ratios_seen.end()) continue;
    ratios_seen.push_back(p.compress_ratio);
    char buf[64];
    std::snprintf(buf, sizeof buf, "%sratio %d: %.2f", by_ratio.empty() ? "" : ", ", p.compress_ratio, per_token);
    by_ratio += buf;
  }
  return {by_ratio, sum};
}

void print_geometry_row(const CacheGeometry& g, const std::string& note) {
  std::printf("  %-11s %-15s %5" PRId64 " %6" PRId64 " %9" PRId64 " %8" PRId64 " %12.2f  %s\n", g.cache,
              kv_row_format_name(g.page.format), g.page.row.dims, g.page.row.row_bytes(), g.page.rows_per_page,
              g.page.page_stride, g.paged_row_bytes(), note.c_str());
}

void print_format_set(const ModelConfig& c, const ModelTopology& t, const KvFormatSet& set, const PlanOptions& o,
                      int64_t memory) {
  const CacheGeometry window = cache_geometry("window", set.window, c.head_dim);
  const CacheGeometry compressed = cache_geometry("compressed", set.compressed, c.head_dim);
  const CacheGeometry index_keys = cache_geometry("index keys", set.index_keys, c.index_head_dim);
  int kv_sources = 0, key_owners = 0;
  for (const LayerPlan& p : t.layers) {
    kv_sources += p.owns_compressor ? 1 : 0;
    key_owners += p.owns_index_keys ? 1 : 0;
  }

  std::printf("  %-11s %-15s %5s %6s %9s %8s %12s  %s\n", "cache", "format", "dims", "row B", "rows/page", "page B",
              "B/row paged", "cost");
  print_geometry_row(window, "B/row in each of " + std::to_string(t.size()) + " layers, for the last " +
                                 std::to_string(c.sliding_window) + " tokens only");
  const auto [compressed_by_ratio, compressed_sum] = per_token_bytes(t, compressed, false);
  const auto [keys_by_ratio, keys_sum] = per_token_bytes(t, index_keys, true);
  if (kv_sources > 0)
    print_geometry_row(compressed, "B/entry; B/token " + compressed_by_ratio + " (" + std::to_string(kv_sources) + " kv sources)");
  if (key_owners > 0)
    print_geometry_row(index_keys, "B/entry; B/token " + keys_by_ratio + " (" + std::to_string(key_owners) + " key owners)");
  std::printf("  growth per token of context, all layers: compressed %.2f B + index keys %.2f B = %.2f B\n",
              compressed_sum, keys_sum, compressed_sum + keys_sum);

  if (o.context == 0) return;
  const SequenceBytes s = sequence_bytes(c, t, window, compressed, index_keys, o.context);
  std::printf("  per sequence at %" PRId64 " tokens: %" PRId64 " B (%s) = window %" PRId64 " + compressed %" PRId64
              " + index keys %" PRId64 " + compressor state %" PRId64 "\n",
              o.context, s.total(), human_bytes(static_cast<double>(s.total())).c_str(), s.window, s.compressed,
              s.index_keys, s.compressor_state);
  if (memory > 0)
    std::printf("  sequences that fit in %" PRId64 " B (%s): %" PRId64 "\n", memory,
                human_bytes(static_cast<double>(memory)).c_str(), memory / s.total());
}

int run_plan(const PlanOptions& o) {
  const ModelConfig config = config_from_preset_or_file(o.preset, o.config_file);
  const ModelTopology topology = resolve_topology(config);
  DSV4_CHECK(o.context >= 0 && o.context <= kMaxContext, "plan: --context is ", o.context, ", expected 1 ... ", kMaxContext);
  const int64_t memory = o.memory.empty() ? 0 : parse_byte_size(o.memory);
  const std::vector<std::string> sets = o.kv_format.empty() ? kv_format_set_names() : std::vector<std::string>{o.kv_format};
  if (!o.kv_format.empty()) kv_format_set(o.kv_format);  // an unknown name fails before any output

  print_config_summary(config);
  print_layer_table(topology);
  print_roles(config, topology);
  int failed = 0;
  for (const std::string& name : sets) {
    const KvFormatSet set = kv_format_set(name);
    std::printf("\nKV format set %s (window %s, compressed %s, index keys %s)\n", set.name.c_str(),
                kv_row_format_name(set.window), kv_row_format_name(set.compressed), kv_row_format_name(set.index_keys));
    try {
      print_format_set(config, topology, set, o, memory);
    } catch (const Error& e) {
      // A format set whose rows do not fit this model's head widths (e.g. 512-wide formats).
      std::printf("  not applicable: %s\n", e.what());
      ++failed;
    }
  }
  // Asking for one specific set that does not apply is an error; listing all of them is not.
  return !o.kv_format.empty() && failed > 0 ? 1 : 0;
}

const CommandRegistration kPlan{
    "plan", "Per-layer topology of a config and the KV bytes per token / per sequence of each cache format",
    [](CLI::App& app) -> std::function<int()> {
      auto o = std::make_shared<PlanOptions>();
      auto* preset = app.add_option("--preset", o->preset, "embedded config preset (v4.1-flash, v4-flash, v4-pro, tiny-v4.1, tiny-v4)");
      auto* config = app.add_option("--config", o->config_file, "config.json (transformers, V4.1 release or DeepSeek ModelArgs)")
                         ->check(CLI::ExistingFile);
      config->excludes(preset);
      preset->excludes(config);
      app.add_option("--kv-format", o->kv_format, "only this KV format set (v4.1-native, fp8_ds_mla, bf16, fp8, f32)");
      auto* context = app.add_option("--context", o->context, "tokens per sequence for the per-sequence bytes")
                          ->check(CLI::Range(int64_t{1}, kMaxContext));
      app.add_option("--memory", o->memory, "KV memory budget (bytes, or with KiB/MiB/GiB/TiB) for the sequence count")
          ->needs(context);
      return [o] { return run_plan(*o); };
    }};

}  // namespace
}  // namespace dsv4::cli
