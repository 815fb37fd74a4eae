// gemvz: the command-line tool. `gemvz help` lists the subcommands; `gemvz CMD --help` explains one.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tools/gemvz/command.h"
#include "tools/gemvz/signals.h"

namespace gemvz::cli {

bool RegisterCommand(const Command& command) {
  const_cast<std::vector<Command>&>(Commands()).push_back(command);
  return true;
}

const std::vector<Command>& Commands() {
  static std::vector<Command>* commands = new std::vector<Command>();
  return *commands;
}

namespace {
std::set<std::string>& GivenFlags() {  // filled by ParseArgs, before the command runs
  static std::set<std::string>* given = new std::set<std::string>();
  return *given;
}
}  // namespace

bool FlagGiven(const std::string& name) { return GivenFlags().count(name) > 0; }

namespace {

void PrintOverview(FILE* out) {
  std::fprintf(out,
               "gemvz: 12-bit lossless BF16 weights and a fused GEMV for LLM decode on NVIDIA GPUs\n\n"
               "usage: gemvz COMMAND [flags] [args]\n\ncommands:\n");
  for (const Command& c : Commands()) std::fprintf(out, "  %-8s %s\n", c.name, c.summary);
  std::fprintf(out, "\n'gemvz COMMAND --help' describes a command and its flags.\n");
}

const Command* Find(const char* name) {
  for (const Command& c : Commands()) {
    if (std::strcmp(c.name, name) == 0) return &c;
  }
  return nullptr;
}

bool IsHelp(const char* arg) {
  return std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-h") == 0 ||
         std::strcmp(arg, "-help") == 0;
}

// Sets the command's flags from argv[2..] and collects its positional arguments. Flags are
// --name=value, --name value (or one dash), --name and --noname for booleans; a name may use
// dashes for underscores (--all-default). Everything after "--" is positional, as is "-" alone
// (standard input). Only the command's own flags are taken. Returns 0, or 2 after printing what
// is wrong.
int ParseArgs(const Command& command, int argc, char** argv, std::vector<std::string>* positional) {
  const std::vector<std::string> takes = absl::StrSplit(command.flags, ' ', absl::SkipEmpty());
  auto find = [&](const std::string& name) -> absl::CommandLineFlag* {
    if (std::find(takes.begin(), takes.end(), name) == takes.end()) return nullptr;
    return absl::FindCommandLineFlag(name);
  };
  auto usage_error = [&](const std::string& message) {
    std::fprintf(stderr, "gemvz %s: %s\n", command.name, message.c_str());
    return 2;
  };
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      positional->insert(positional->end(), argv + i + 1, argv + argc);
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      positional->push_back(arg);
      continue;
    }
    const size_t dashes = arg[1] == '-' ? 2 : 1;
    const size_t eq = arg.find('=');
    std::string name =
        arg.substr(dashes, eq == std::string::npos ? std::string::npos : eq - dashes);
    std::replace(name.begin(), name.end(), '-', '_');
    std::optional<std::string> value;
    if (eq != std::string::npos) value = arg.substr(eq + 1);
    absl::CommandLineFlag* flag = find(name);
    bool negated = false;
    if (flag == nullptr && !value && absl::StartsWith(name, "no")) {
      flag = find(name.substr(2));
      negated = flag != nullptr && flag->IsOfType<bool>();
      if (!negated) flag = nullptr;
    }
    if (flag == nullptr) {
      std::vector<std::string> listed;
      for (const std::string& t : takes) listed.push_back("--" + t);
      return usage_error("unknown flag '" + arg.substr(0, eq) + "'; it takes " +
                         absl::StrJoin(listed, ", ") + " (see gemvz " + command.name + " --help)");
    }
    const std::string shown = "--" + std::string(flag->Name());
    if (flag->IsOfType<bool>()) {
      if (!value) value = negated ? "false" : "true";
    } else if (!value) {
      if (i + 1 >= argc) return usage_error(shown + " needs a value");
      value = argv[++i];
    }
    // An empty value is what an unset variable gives (--json=$OUT): not the flag's default, which
    // leaving the flag out asks for, and not a report silently not written.
    if (!flag->IsOfType<bool>() && value->empty()) {
      return usage_error(shown +
                         " was given an empty value (an unset variable?); give it one, or "
                         "leave the flag out for its default");
    }
    std::string error;
    if (!flag->ParseFrom(*value, &error)) {
      return usage_error("bad " + shown + "=" + *value + ": " + error);
    }
    GivenFlags().insert(std::string(flag->Name()));
  }
  return 0;
}

// A command that lists a flag no file defines is a bug of this program, found by any test that
// runs the command.
bool CheckFlagList(const Command& command) {
  for (absl::string_view name : absl::StrSplit(command.flags, ' ', absl::SkipEmpty())) {
    if (absl::FindCommandLineFlag(name) == nullptr) {
      std::fprintf(stderr, "gemvz %s: internal error: it lists the flag --%s, which is not defined\n",
                   command.name, std::string(name).c_str());
      return false;
    }
  }
  return true;
}

}  // namespace
}  // namespace gemvz::cli

int main(int argc, char** argv) {
  using gemvz::cli::Command;
  if (argc < 2 || std::strcmp(argv[1], "help") == 0 || gemvz::cli::IsHelp(argv[1])) {
    if (argc >= 3 && std::strcmp(argv[1], "help") == 0 && std::strcmp(argv[2], "help") != 0 &&
        !gemvz::cli::IsHelp(argv[2])) {
      const Command* c = gemvz::cli::Find(argv[2]);
      if (c == nullptr) {
        std::fprintf(stderr, "gemvz help: unknown command '%s'\n\n", argv[2]);
        gemvz::cli::PrintOverview(stderr);
        return 2;
      }
      std::printf("%s", c->usage);
      return 0;
    }
    gemvz::cli::PrintOverview(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const Command* command = gemvz::cli::Find(argv[1]);
  if (command == nullptr) {
    std::fprintf(stderr, "gemvz: unknown command '%s'\n\n", argv[1]);
    gemvz::cli::PrintOverview(stderr);
    return 2;
  }
  if (!gemvz::cli::CheckFlagList(*command)) return 70;
  // Ctrl-C or a kill during pack, warmup or a --json write leaves no temporary file behind.
  gemvz::cli::InstallTempFileCleanupOnSignals();
  // --help anywhere before "--" prints the command's own text, whatever else is given.
  for (int i = 2; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
    if (gemvz::cli::IsHelp(argv[i])) {
      std::printf("%s", command->usage);
      return 0;
    }
  }
  std::vector<std::string> args;
  if (int rc = gemvz::cli::ParseArgs(*command, argc, argv, &args); rc != 0) return rc;
  // Host memory running out (a --shape too large for this machine, say) ends the command with
  // a message, not an abort: the thread pools bring a worker's std::bad_alloc back to their
  // caller (internal::RunWorkers), and the writers unwound on the way remove their temporary
  // files (SafetensorsWriter, AtomicWriteFileStreamed).
  try {
    return command->run(args);
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);  // what was printed before comes first
    std::fprintf(stderr, "gemvz %s: out of host memory: an allocation failed, so it stopped here\n",
                 command->name);
    return 1;
  }
}
