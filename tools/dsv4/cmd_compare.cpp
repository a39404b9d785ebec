// dsv4 compare: compares the outputs of two files in the golden calls format (golden_schedule.h),
// a reference and an output such as `dsv4 replay` writes. Exit status: 0 all within tolerance,
// 1 an error above tolerance or a tensor missing in OUT, 2 malformed input.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsv4/command.h"
#include "dsv4/error.h"
#include "dsv4/golden_schedule.h"
#include "dsv4/safetensors.h"

namespace dsv4::cli {
namespace {

struct CompareOptions {
  std::string reference_path;
  std::string out_path;
  double tolerance = 2e-2;
  bool ignore_ambiguous = true;
  bool skip_differing_picks = false;
  bool json = false;
};

// One call and layer of the reference.
struct LayerComparison {
  int call = 0;
  int layer = 0;
  bool attn_out_missing = false;
  int64_t rows = 0;          // B * S
  int64_t rows_ambiguous = 0;     // flagged ambiguous by the reference: left out of both comparisons
  int64_t rows_picks_differ = 0;  // left out of the attn_out error because the picked sets differ
  double rel_l2 = 0.0;       // ||reference - out|| / ||reference|| over the rows compared
  double max_abs_error = 0.0;
  std::vector<int64_t> worst_index;  // [b, s, h] of the largest |reference - out|
  float reference_value = 0.0f;
  float out_value = 0.0f;
  std::string topk_field;  // the reference's picks ("topk" or "topk_pos"), empty when it has none
  bool topk_missing = false;
  int64_t topk_rows = 0;        // rows compared
  int64_t topk_rows_equal = 0;  // rows whose picked sets are equal

  bool within(double tolerance) const { return !attn_out_missing && rel_l2 <= tolerance; }  // false for NaN
};

// An f32 or bf16 tensor of rank 3 ([B, S, hidden]) from `file`, as f32.
HostTensor read_outputs(const SafetensorsFile& file, const std::string& name) {
  const SafetensorsEntry& entry = file.at(name);
  DSV4_CHECK(is_activation_dtype(entry.dtype), "compare: ", name, " in ", file.path(), " has dtype ",
             dtype_name(entry.dtype), ", expected F32 or BF16");
  DSV4_CHECK(entry.shape.size() == 3, "compare: ", name, " in ", file.path(), " has shape ",
             shape_string(entry.shape), ", expected [B, S, hidden]");
  return file.read_as(name, DType::f32);
}

// Picks [B, S, k] (any k) as int64.
std::vector<int64_t> read_picks(const SafetensorsFile& file, const std::string& name, int64_t batch, int64_t tokens,
                                int64_t* k) {
  const SafetensorsEntry& entry = file.at(name);
  DSV4_CHECK(entry.shape.size() == 3 && entry.shape[0] == batch && entry.shape[1] == tokens, "compare: ", name,
             " in ", file.path(), " has shape ", shape_string(entry.shape), ", expected [", batch, ", ", tokens,
             ", k] as the reference's attn_out");
  *k = entry.shape[2];
  return read_integers(file, entry);
}

// The picked set of a row: valid (>= 0) entries, sorted.
std::vector<int64_t> picked_set(const int64_t* row, int64_t k) {
  std::vector<int64_t> set;
  for (int64_t i = 0; i < k; ++i)
    if (row[i] >= 0) set.push_back(row[i]);
  std::sort(set.begin(), set.end());
  return set;
}

LayerComparison compare_layer(const SafetensorsFile& reference, const CallIndex& reference_index,
                              const SafetensorsFile& out, const CallIndex& out_index, int call, int layer,
                              const CompareOptions& o) {
  LayerComparison result;
  result.call = call;
  result.layer = layer;
  const std::string name = layer_tensor_name(call, layer, kAttnOut);
  const HostTensor expected = read_outputs(reference, name);
  const int64_t batch = expected.size(0), tokens = expected.size(1), hidden = expected.size(2);
  result.rows = batch * tokens;

  std::vector<uint8_t> ambiguous(static_cast<size_t>(result.rows), 0);
  if (o.ignore_ambiguous && reference_index.has(call, layer, kAmbiguous)) {
    const std::string flag_name = layer_tensor_name(call, layer, kAmbiguous);
    const SafetensorsEntry& flags = expect_tensor(reference, flag_name, DType::u8, {batch, tokens}, "compare",
                                                  "B and S of " + name);
    const auto* flag = reinterpret_cast<const uint8_t*>(reference.data(flags));
    for (int64_t r = 0; r < result.rows; ++r) ambiguous[r] = flag[r] != 0;
    result.rows_ambiguous = std::count(ambiguous.begin(), ambiguous.end(), 1);
  }

  // Picks: the reference's and OUT's, each under either name (replay writes topk).
  auto picks_field = [&](const CallIndex& index) -> std::string {
    for (const char* field : {kTopk, kTopkPos})
      if (index.has(call, layer, field)) return field;
    return "";
  };
  std::vector<uint8_t> picks_differ(static_cast<size_t>(result.rows), 0);
  result.topk_field = picks_field(reference_index);
  const std::string out_field = picks_field(out_index);
  result.topk_missing = !result.topk_field.empty() && out_field.empty();
  if (!result.topk_field.empty() && !out_field.empty()) {
    int64_t k_reference = 0, k_out = 0;
    const std::vector<int64_t> expected_picks =
        read_picks(reference, layer_tensor_name(call, layer, result.topk_field), batch, tokens, &k_reference);
    const std::vector<int64_t> actual_picks =
        read_picks(out, layer_tensor_name(call, layer, out_field), batch, tokens, &k_out);
    for (int64_t r = 0; r < result.rows; ++r) {
      if (ambiguous[r]) continue;
      picks_differ[r] = picked_set(expected_picks.data() + r * k_reference, k_reference) !=
                        picked_set(actual_picks.data() + r * k_out, k_out);
      result.topk_rows += 1;
      result.topk_rows_equal += !picks_differ[r];
    }
    if (o.skip_differing_picks) result.rows_picks_differ = result.topk_rows - result.topk_rows_equal;
  }

  if (out.find(name) == nullptr) {
    result.attn_out_missing = true;
    return result;
  }
  const HostTensor actual = read_outputs(out, name);
  DSV4_CHECK(actual.shape() == expected.shape(), "compare: ", name, " has shape ", shape_string(actual.shape()),
             " in ", out.path(), ", expected ", shape_string(expected.shape()), " as in ", reference.path());
  double error_sq = 0.0, reference_sq = 0.0;
  result.max_abs_error = -1.0;
  for (int64_t r = 0; r < result.rows; ++r) {
    if (ambiguous[r] || (o.skip_differing_picks && picks_differ[r])) continue;
    for (int64_t h = 0; h < hidden; ++h) {
      const int64_t i = r * hidden + h;
      const double a = expected.as<float>()[i], b = actual.as<float>()[i];
      const double diff = a - b;
      // NaN counts as the largest error, so that it is reported and fails.
      const double abs_error = std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::fabs(diff);
      error_sq += diff * diff;
      reference_sq += a * a;
      if (abs_error > result.max_abs_error) {
        result.max_abs_error = abs_error;
        result.worst_index = {r / tokens, r % tokens, h};
        result.reference_value = static_cast<float>(a);
        result.out_value = static_cast<float>(b);
      }
    }
  }
  result.max_abs_error = std::max(result.max_abs_error, 0.0);
  result.rel_l2 = reference_sq > 0.0 ? std::sqrt(error_sq / reference_sq)
                                     : (error_sq == 0.0 ? 0.0 : std::numeric_limits<double>::infinity());
  return result;
}

std::string format_double(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, format, value);
  return buffer;
}

void print_table(const std::vector<LayerComparison>& results) {
  std::printf("%5s %5s %6s %7s %10s %10s %17s %12s %12s %11s\n", "call", "layer", "rows", "skipped", "rel_l2",
              "max_abs", "worst [b, s, h]", "reference", "out", "topk_equal");
  for (const LayerComparison& r : results) {
    std::printf("%5d %5d %6lld %7lld ", r.call, r.layer, static_cast<long long>(r.rows),
                static_cast<long long>(r.rows_ambiguous + r.rows_picks_differ));
    if (r.attn_out_missing) {
      std::printf("%10s %10s %17s %12s %12s ", "MISSING", "-", "-", "-", "-");
    } else if (r.worst_index.empty()) {  // every row was skipped
      std::printf("%10.3e %10s %17s %12s %12s ", r.rel_l2, "-", "-", "-", "-");
    } else {
      const std::string where = "[" + std::to_string(r.worst_index[0]) + ", " + std::to_string(r.worst_index[1]) +
                                ", " + std::to_string(r.worst_index[2]) + "]";
      std::printf("%10.3e %10.3e %17s %12.5e %12.5e ", r.rel_l2, r.max_abs_error, where.c_str(), r.reference_value,
                  r.out_value);
    }
    if (r.topk_field.empty()) {
      std::printf("%11s\n", "-");
    } else if (r.topk_missing) {
      std::printf("%11s\n", "MISSING");
    } else {
      const std::string equal = std::to_string(r.topk_rows_equal) + "/" + std::to_string(r.topk_rows);
      std::printf("%11s\n", equal.c_str());
    }
  }
}

nlohmann::json to_json(const LayerComparison& r) {
  nlohmann::json j{{"call", r.call}, {"layer", r.layer}, {"rows", r.rows}, {"rows_ambiguous", r.rows_ambiguous},
                   {"rows_picks_differ", r.rows_picks_differ},
                   {"attn_out_missing", r.attn_out_missing}};
  if (!r.attn_out_missing) {
    // JSON has no infinity: a non-finite error is written as null.
    j["rel_l2"] = std::isfinite(r.rel_l2) ? nlohmann::json(r.rel_l2) : nlohmann::json();
    j["max_abs_error"] = std::isfinite(r.max_abs_error) ? nlohmann::json(r.max_abs_error) : nlohmann::json();
    j["worst_index"] = r.worst_index;
    j["reference_value"] = r.reference_value;
    j["out_value"] = r.out_value;
  }
  if (!r.topk_field.empty()) {
    j["topk_reference"] = r.topk_field;
    j["topk_missing"] = r.topk_missing;
    j["topk_rows"] = r.topk_rows;
    j["topk_rows_equal"] = r.topk_rows_equal;
  }
  return j;
}

int compare(const CompareOptions& o) {
  std::vector<LayerComparison> results;
  try {
    DSV4_CHECK(o.tolerance >= 0.0, "compare: --tol is ", o.tolerance, ", expected >= 0");
    const std::shared_ptr<SafetensorsFile> reference = SafetensorsFile::open(o.reference_path);
    const std::shared_ptr<SafetensorsFile> out = SafetensorsFile::open(o.out_path);
    const CallIndex reference_index(*reference), out_index(*out);
    for (int call : reference_index.calls())
      for (int layer : reference_index.layers(call))
        if (reference_index.has(call, layer, kAttnOut))
          results.push_back(compare_layer(*reference, reference_index, *out, out_index, call, layer, o));
    DSV4_CHECK(!results.empty(), "compare: ", o.reference_path, " has no 'calls.{c}.layers.{l}.attn_out' tensors");
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }

  const LayerComparison* worst = nullptr;
  int64_t above = 0, missing = 0, topk_rows = 0, topk_rows_equal = 0, rows_ambiguous = 0, rows_picks_differ = 0;
  for (const LayerComparison& r : results) {
    missing += r.attn_out_missing + r.topk_missing;
    rows_ambiguous += r.rows_ambiguous;
    rows_picks_differ += r.rows_picks_differ;
    above += !r.attn_out_missing && !r.within(o.tolerance);
    topk_rows += r.topk_rows;
    topk_rows_equal += r.topk_rows_equal;
    if (!r.attn_out_missing && (worst == nullptr || !(r.rel_l2 <= worst->rel_l2))) worst = &r;
  }
  const bool pass = above == 0 && missing == 0;

  if (o.json) {
    nlohmann::json report{{"reference", o.reference_path}, {"out", o.out_path},
                          {"tolerance", o.tolerance},      {"ignore_ambiguous", o.ignore_ambiguous},
                          {"skip_differing_picks", o.skip_differing_picks},
                          {"layers", nlohmann::json::array()}, {"above_tolerance", above},
                          {"missing", missing},            {"topk_rows", topk_rows},
                          {"topk_rows_equal", topk_rows_equal}, {"rows_ambiguous", rows_ambiguous},
                          {"rows_picks_differ", rows_picks_differ}, {"pass", pass}};
    for (const LayerComparison& r : results) report["layers"].push_back(to_json(r));
    if (worst != nullptr) report["worst"] = to_json(*worst);
    std::printf("%s\n", report.dump(1).c_str());
  } else {
    print_table(results);
    if (worst != nullptr)
      std::printf("worst: call %d layer %d: rel L2 %s (tolerance %s)\n", worst->call, worst->layer,
                  format_double("%.3e", worst->rel_l2).c_str(), format_double("%.1e", o.tolerance).c_str());
    if (topk_rows > 0)
      std::printf("top-k sets equal: %lld/%lld rows (%.2f%%)\n", static_cast<long long>(topk_rows_equal),
                  static_cast<long long>(topk_rows), 100.0 * static_cast<double>(topk_rows_equal) / topk_rows);
    if (rows_ambiguous + rows_picks_differ > 0)
      std::printf("left out: %lld rows flagged ambiguous, %lld rows whose picks differ\n",
                  static_cast<long long>(rows_ambiguous), static_cast<long long>(rows_picks_differ));
    if (pass)
      std::printf("PASS: %zu outputs within tolerance\n", results.size());
    else
      std::printf("FAIL: %lld of %zu outputs above tolerance, %lld tensors missing in %s\n",
                  static_cast<long long>(above), results.size(), static_cast<long long>(missing), o.out_path.c_str());
  }
  return pass ? 0 : 1;
}

const CommandRegistration registration{
    "compare", "Compare outputs in the golden calls format against a reference", [](CLI::App& app) {
      auto o = std::make_shared<CompareOptions>();
      app.add_option("reference", o->reference_path, "Reference file (e.g. a golden NAME.calls.safetensors)")
          ->required();
      app.add_option("out", o->out_path, "File to check (e.g. what dsv4 replay wrote)")->required();
      app.add_option("--tol", o->tolerance, "Largest relative L2 error of an attn_out allowed")
          ->capture_default_str();
      app.add_flag("--ignore-ambiguous,!--no-ignore-ambiguous", o->ignore_ambiguous,
                   "Leave out rows the reference flags ambiguous (default on)");
      app.add_flag("--skip-differing-picks", o->skip_differing_picks,
                   "Leave rows whose picked set differs from the reference's out of the attn_out error (references "
                   "without ambiguity flags whose ties break differently)");
      app.add_flag("--json", o->json, "Print the report as JSON");
      return [o] { return compare(*o); };
    }};

}  // namespace
}  // namespace dsv4::cli
