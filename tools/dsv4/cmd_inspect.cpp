// dsv4 inspect: checks a checkpoint's attention tensors against a config, layer by layer.
#include <algorithm>
#include <cstdio>
#include <map>
#include <string>

#include "dsv4/command.h"
#include "dsv4/config.h"
#include "dsv4/weights.h"

namespace dsv4::cli {
namespace {

struct InspectOptions {
  std::string config_file;
  std::string preset;
  std::string weights;
  bool list_all_ignored = false;
};

// Non-attention tensors of a full checkpoint number in the thousands; by default a few are shown.
constexpr size_t kIgnoredShown = 20;

void print_row(const InspectedTensor& t) {
  std::printf("  %-60s -> %-40s %-8s %-14s %s\n", t.checkpoint_name.c_str(), t.role.c_str(), t.dtype.c_str(),
              shape_string(t.shape).c_str(), t.problem.empty() ? "OK" : t.problem.c_str());
}

int run_inspect(const InspectOptions& o) {
  const ModelConfig config = config_from_preset_or_file(o.preset, o.config_file);
  const ModelTopology topology = resolve_topology(config);
  const InspectReport report = inspect_weights(o.weights, config);

  std::printf("checkpoint %s\nconfig %s (%s, %d layers + %d MTP, fp8 weights: %s)\n", o.weights.c_str(),
              config.name.c_str(), family_name(config.family), config.num_layers, config.num_mtp_layers,
              config.weight_quantization ? (std::to_string(config.weight_quantization->block_out) + "x" +
                                            std::to_string(config.weight_quantization->block_in) + " blocks")
                                               .c_str()
                                         : "none");
  std::multimap<int, const InspectedTensor*> by_layer;
  for (const InspectedTensor& t : report.tensors) by_layer.emplace(t.layer, &t);
  for (int l = 0; l < topology.size(); ++l) {
    std::printf("layer %d (%s):\n", l, describe_plan(topology[l]).c_str());
    if (std::find(report.absent_mtp_layers.begin(), report.absent_mtp_layers.end(), l) !=
        report.absent_mtp_layers.end())
      std::printf("  no tensors in the checkpoint (optional MTP layer, not loaded)\n");
    const auto [first, last] = by_layer.equal_range(l);
    for (auto it = first; it != last; ++it) print_row(*it->second);
  }
  bool beyond_header = false;
  for (const InspectedTensor& t : report.tensors) {
    if (t.layer < topology.size()) continue;
    if (!beyond_header) std::printf("tensors of layers the config does not have:\n");
    beyond_header = true;
    print_row(t);
  }
  if (!report.missing.empty()) {
    std::printf("missing (%zu):\n", report.missing.size());
    for (const std::string& name : report.missing) std::printf("  %s\n", name.c_str());
  }
  if (!report.unexpected.empty()) {
    std::printf("not attention, ignored (%zu):\n", report.unexpected.size());
    const size_t shown = o.list_all_ignored ? report.unexpected.size() : std::min(report.unexpected.size(), kIgnoredShown);
    for (size_t i = 0; i < shown; ++i) std::printf("  %s\n", report.unexpected[i].c_str());
    if (shown < report.unexpected.size())
      std::printf("  ... and %zu more (--all lists them)\n", report.unexpected.size() - shown);
  }
  size_t problems = 0;
  for (const InspectedTensor& t : report.tensors) problems += t.problem.empty() ? 0 : 1;
  std::printf("%s: %zu attention tensors, %zu with problems, %zu missing, %zu not attention\n",
              report.ok() ? "OK" : "FAILED", report.tensors.size(), problems, report.missing.size(),
              report.unexpected.size());
  return report.ok() ? 0 : 1;
}

const CommandRegistration kInspect{
    "inspect", "Check a checkpoint's attention tensors (names, shapes, dtypes, fp8 scales) against a config",
    [](CLI::App& app) -> std::function<int()> {
      auto o = std::make_shared<InspectOptions>();
      auto* config = app.add_option("--config", o->config_file, "config.json (transformers or DeepSeek ModelArgs)")
                         ->check(CLI::ExistingFile);
      auto* preset = app.add_option("--preset", o->preset, "embedded config preset (v4.1-flash, v4-flash, ...)");
      config->excludes(preset);
      preset->excludes(config);
      app.add_option("weights", o->weights, ".safetensors file, sharded index JSON or checkpoint directory")
          ->required();
      app.add_flag("--all", o->list_all_ignored, "list every tensor that is not an attention tensor");
      return [o] { return run_inspect(*o); };
    }};

}  // namespace
}  // namespace dsv4::cli
