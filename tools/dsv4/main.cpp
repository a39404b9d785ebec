// dsv4: the command-line tool. Sub-commands register themselves (command.h).
#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>

#include "dsv4/error.h"
#include "dsv4/command.h"

namespace dsv4::cli {
std::vector<CommandInfo>& command_registry() {
  static std::vector<CommandInfo> registry;
  return registry;
}
}  // namespace dsv4::cli

int main(int argc, char** argv) {
  using namespace dsv4::cli;
  CLI::App app{"dsv4: the DeepSeek V4 / V4.1 attention layer (CPU reference and CUDA backend)"};
  app.require_subcommand(1);
  auto& registry = command_registry();
  std::sort(registry.begin(), registry.end(), [](auto& a, auto& b) { return a.name < b.name; });
  std::map<CLI::App*, std::function<int()>> runners;
  for (auto& cmd : registry) {
    CLI::App* sub = app.add_subcommand(cmd.name, cmd.description);
    runners[sub] = cmd.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
  } catch (const dsv4::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsv4: error: %s\n", e.what());
    return 1;
  }
  return 1;
}
