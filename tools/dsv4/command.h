// Sub-command registry of the dsv4 tool: each cmd_*.cpp registers itself with a static
// CommandRegistration, so commands live in their own files and main.cpp stays generic.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace dsv4::cli {

// `setup` adds the command's options to `app` and returns the function that runs it (exit code).
using CommandSetup = std::function<std::function<int()>(CLI::App& app)>;

struct CommandInfo {
  std::string name;
  std::string description;
  CommandSetup setup;
};

std::vector<CommandInfo>& command_registry();

struct CommandRegistration {
  CommandRegistration(std::string name, std::string description, CommandSetup setup) {
    command_registry().push_back({std::move(name), std::move(description), std::move(setup)});
  }
};

}  // namespace dsv4::cli
