// How the `geotrain` CLI is assembled: each area (head/worker/job verbs, model verbs, plan, cluster)
// adds its subcommands from its own cli/<area>_commands.cc through a registration at namespace scope:
//
//   namespace { bool registered = geotrain::cli::RegisterCommands("plan", &AddPlanCommands); }
//
// A subcommand's callback sets context.exit_code; main() returns it. Callbacks print one clear line on
// errors a user can cause (naming the problem and the fix) and set a non-zero exit code.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"

namespace geotrain::cli {

struct Context {
  int exit_code = 0;
};

using AddCommandsFn = void (*)(CLI::App& app, Context& context);

// Records an adder; returns true so that it can initialise a namespace-scope bool.
bool RegisterCommands(const char* area, AddCommandsFn fn);
// Every adder registered so far, in the order of their area names.
std::vector<std::pair<std::string, AddCommandsFn>> RegisteredCommands();

}  // namespace geotrain::cli
