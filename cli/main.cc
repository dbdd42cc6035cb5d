// geotrain: the command-line entry point. Verbs come from the cli/*_commands.cc files (see registry.h).
#include <algorithm>
#include <cstdio>
#include <mutex>

#include "cli/registry.h"

namespace geotrain::cli {
namespace {
std::vector<std::pair<std::string, AddCommandsFn>>& Registry() {
  static auto* registry = new std::vector<std::pair<std::string, AddCommandsFn>>();
  return *registry;
}
}  // namespace

bool RegisterCommands(const char* area, AddCommandsFn fn) {
  Registry().emplace_back(area, fn);
  return true;
}

std::vector<std::pair<std::string, AddCommandsFn>> RegisteredCommands() {
  auto out = Registry();
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

}  // namespace geotrain::cli

int main(int argc, char** argv) {
  CLI::App app{
      "geotrain: geo-distributed training of GPT-style models across heterogeneous GPUs at several "
      "sites.\nStart a head, join workers, submit jobs; see README.md."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "geotrain 0.1");
  geotrain::cli::Context context;
  for (const auto& [area, add] : geotrain::cli::RegisteredCommands()) add(app, context);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return context.exit_code;
}
