// gemvz: the command-line tool. `gemvz help` lists the subcommands; `gemvz CMD --help` explains one.
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "tools/gemvz/command.h"

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

}  // namespace
}  // namespace gemvz::cli

int main(int argc, char** argv) {
  using gemvz::cli::Command;
  absl::SetProgramUsageMessage("gemvz COMMAND [flags]; see 'gemvz help'");
  if (argc < 2 || std::strcmp(argv[1], "help") == 0 || std::strcmp(argv[1], "--help") == 0 ||
      std::strcmp(argv[1], "-h") == 0) {
    if (argc >= 3 && std::strcmp(argv[1], "help") == 0) {
      if (const Command* c = gemvz::cli::Find(argv[2])) {
        std::printf("%s", c->usage);
        return 0;
      }
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
  // argv without the command name; --help prints the command's own text, not every absl flag.
  // Flag names may be written with dashes (--all-default): absl names use underscores.
  std::vector<std::string> normalized;
  normalized.reserve(argc);
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (i >= 2 && a.size() > 2 && a[0] == '-' && a != "--") {
      const size_t start = a.find_first_not_of('-');
      const size_t end = std::min(a.find('='), a.size());
      for (size_t c = start; c < end; ++c) {
        if (a[c] == '-') a[c] = '_';
      }
    }
    normalized.push_back(std::move(a));
  }
  for (int i = 0; i < argc; ++i) argv[i] = normalized[i].data();
  std::vector<char*> rest = {argv[0]};
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0 ||
        std::strcmp(argv[i], "-help") == 0) {
      std::printf("%s", command->usage);
      return 0;
    }
    rest.push_back(argv[i]);
  }
  std::vector<char*> positional = absl::ParseCommandLine(static_cast<int>(rest.size()), rest.data());
  std::vector<std::string> args(positional.begin() + 1, positional.end());
  return command->run(args);
}
