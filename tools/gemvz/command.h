// The gemvz CLI's subcommand registry. Each subcommand lives in its own file and registers itself
// with GEMVZ_REGISTER_COMMAND; main.cc finds it by name, handles --help, and parses its flags.
#pragma once

#include <string>
#include <vector>

namespace gemvz::cli {

struct Command {
  const char* name;     // "bench"
  const char* summary;  // one line for `gemvz help`
  const char* usage;    // full help text: synopsis, every flag, examples
  // Runs with the positional arguments left after flag parsing (the command name excluded).
  int (*run)(const std::vector<std::string>& args);
  // The absl flags it takes, by name, separated by spaces ("shape m json"). Every flag is
  // defined once for the whole program, so this list is what makes another command's flag
  // (or absl's own, --helpfull, --flagfile) a usage error here instead of silently ignored.
  const char* flags;
};

bool RegisterCommand(const Command& command);
const std::vector<Command>& Commands();

// Whether the command line gave the flag `name` ("sweep_format"), whatever the value, even its
// default: for a command to refuse a flag that its other flags would make it ignore.
bool FlagGiven(const std::string& name);

}  // namespace gemvz::cli

#define GEMVZ_REGISTER_COMMAND(id, ...) \
  static const bool gemvz_command_registered_##id = ::gemvz::cli::RegisterCommand({__VA_ARGS__})
