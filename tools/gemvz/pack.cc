// `gemvz pack`: safetensors checkpoints in, 12-bit packed safetensors out (PackCheckpoint), with a
// progress bar on stderr and a per-tensor report on stdout.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gemvz/checkpoint.h"
#include "nlohmann/json.hpp"
#include "runtime/checkpoint/shard_index.h"
#include "runtime/common/file_util.h"
#include "runtime/common/log.h"
#include "tools/gemvz/bench_support.h"
#include "tools/gemvz/command.h"
#include "tools/gemvz/common_flags.h"

ABSL_FLAG(std::string, o, "", "pack: output directory (created if missing)");
ABSL_FLAG(bool, verify, false, "pack: re-read every written file and compare every tensor's bits");
ABSL_FLAG(bool, keep_nonfinite, false,
          "pack: keep 2-D BF16 tensors holding Inf/NaN unpacked instead of failing");

namespace gemvz::cli {
namespace {

constexpr char kPackUsage[] =
    "usage: gemvz pack IN.safetensors [IN2.safetensors ...] -o OUT_DIR [--verify] [--j=N]\n"
    "                  [--keep_nonfinite] [--json=FILE]\n"
    "\n"
    "Packs every 2-D BF16 tensor whose shape the compressed kernel takes (rows % 16 == 0,\n"
    "cols % 64 == 0) into the lossless 12-bit format and copies every other tensor (1-D, norms,\n"
    "other dtypes, odd shapes) as it is. Each input becomes OUT_DIR/<its file name>, a\n"
    "safetensors file any reader opens: a packed tensor NAME is stored as NAME.z12.weights,\n"
    "NAME.z12.row_offsets, NAME.z12.entries, NAME.z12.dense_block_offsets, NAME.z12.dense_rows "
    "and\n"
    "NAME.z12.dense_values, described by the metadata entry gemvz.z12.NAME (format, version,\n"
    "shape, window, CRC32C per part, statistics). Two or more inputs also get Hugging Face's\n"
    "index, OUT_DIR/<prefix>.safetensors.index.json (the prefix of inputs named\n"
    "<prefix>-NNNNN-of-NNNNN.safetensors, else model), published with them. See\n"
    "docs/CHECKPOINTS.md.\n"
    "\n"
    "Inputs are memory-mapped and processed one tensor at a time. Outputs are written under\n"
    "temporary names, fsynced, and renamed into place only once all of them are complete (and\n"
    "verified with --verify), all or none: a failure leaves the output directory as it was (files\n"
    "it would have replaced included; directories it created are removed) and no temporary\n"
    "file. So does Ctrl-C, SIGTERM or SIGHUP before the publish, except that directories it\n"
    "created stay, empty; one during the publish waits for the new files to be in place. Either\n"
    "way the run ends with the signal's exit status and writes no report. An input truncated by\n"
    "another process while mapped (or whose storage fails) raises SIGBUS: the run removes its\n"
    "temporary files (during the publish, which a fault cannot wait for, it leaves the files as\n"
    "they are), says so and ends by that signal. An output name taken by a directory, or by a\n"
    "device, FIFO or socket or a link to one (the publish would replace it), fails the run\n"
    "before any work. Two inputs of one file name (both would be packed to one output) or\n"
    "an -o that puts an output in an input's place (it would replace the input) is a usage\n"
    "error that names the paths, before anything is written.\n"
    "\n"
    "flags:\n"
    "  -o, --o=DIR         output directory (required)\n"
    "  --verify            reopen every written file, unpack every packed tensor and compare\n"
    "                      its bits, and every kept tensor's bytes, with the input; read the\n"
    "                      index back and check that it gives each tensor's file\n"
    "  --j=N               packing threads (default 0: all cores)\n"
    "  --keep_nonfinite    keep 2-D BF16 tensors with Inf/NaN unpacked (default: refuse them)\n"
    "  --json=FILE         also write the report as JSON (schema gemvz.pack/1)\n"
    "\n"
    "Output: a progress bar on stderr; on stdout one line per tensor (packed: bits per weight,\n"
    "exception rate, window coverage, dense rows; kept: why) and a total. Exit status 0 on\n"
    "success, 1 when a file is bad or anything fails (the message names the file and tensor), 2\n"
    "for a usage error.\n"
    "\n"
    "examples:\n"
    "  gemvz pack model.safetensors -o packed/\n"
    "  gemvz pack model-0000{1,2,3}-of-00003.safetensors -o packed/ --verify --j=8\n";

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Bytes(int64_t b) {
  if (b >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / double(int64_t{1} << 30));
  if (b >= (int64_t{1} << 20)) return absl::StrFormat("%.1f MiB", b / double(int64_t{1} << 20));
  if (b >= 1024) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrCat(b, " B");
}

std::string Shape(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

// Draws the bar in place on a terminal (at most ~10 times a second); elsewhere (logs, CI) prints
// a line at every tenth of the work.
class ProgressBar {
 public:
  ProgressBar() : tty_(::isatty(2) != 0), start_(Now()) {}
  void Update(const PackProgress& p) {
    const double now = Now();
    const double frac = p.bytes_total > 0 ? double(p.bytes_done) / double(p.bytes_total) : 1.0;
    if (tty_) {
      if (now - last_ < 0.1 && p.bytes_done < p.bytes_total) return;
      last_ = now;
      constexpr int kWidth = 30;
      const int fill = static_cast<int>(frac * kWidth);
      const double rate = p.bytes_done / std::max(1e-9, now - start_) / 1e6;
      std::string name = internal::Escaped(p.current, std::string::npos);
      if (name.size() > 40) name = "..." + name.substr(name.size() - 37);
      std::fprintf(stderr, "\r[%s%s] %3d%%  %s / %s  %.0f MB/s  %lld/%lld  %-6s %-40s",
                   std::string(fill, '#').c_str(), std::string(kWidth - fill, '.').c_str(),
                   static_cast<int>(frac * 100), Bytes(p.bytes_done).c_str(),
                   Bytes(p.bytes_total).c_str(), rate, static_cast<long long>(p.tensors_done),
                   static_cast<long long>(p.tensors_total), p.stage.c_str(), name.c_str());
      drawn_ = true;
    } else {
      // The last tenth waits for the last tensor to be counted as done.
      if (p.bytes_done >= p.bytes_total && p.tensors_done < p.tensors_total) return;
      const int tenth = static_cast<int>(frac * 10);
      if (tenth <= last_tenth_) return;
      last_tenth_ = tenth;
      std::fprintf(stderr, "gemvz pack: %d%% (%s of %s, %lld of %lld tensors)\n", tenth * 10,
                   Bytes(p.bytes_done).c_str(), Bytes(p.bytes_total).c_str(),
                   static_cast<long long>(p.tensors_done), static_cast<long long>(p.tensors_total));
    }
  }
  void Done() {
    if (tty_ && drawn_) std::fprintf(stderr, "\n");
  }

 private:
  bool tty_;
  double start_;
  double last_ = 0;
  int last_tenth_ = 0;
  bool drawn_ = false;
};

void PrintReport(const CheckpointPackReport& r) {
  std::printf("%-48s %-16s %-5s %-7s %8s %10s %10s %6s %s\n", "tensor", "shape", "dtype", "action",
              "bits/w", "exc.rate", "coverage", "dense", "bytes in -> out");
  for (const TensorPackReport& t : r.tensors) {
    const std::string name = internal::Escaped(t.name, std::string::npos);
    if (t.packed) {
      std::printf("%-48s %-16s %-5s %-7s %8.4f %9.5f%% %9.5f%% %6lld %s -> %s%s\n", name.c_str(),
                  Shape(t.shape).c_str(), t.dtype.c_str(), "packed", t.stats.bits_per_weight,
                  100 * t.stats.exception_rate, 100 * t.stats.window_coverage,
                  static_cast<long long>(t.stats.dense_rows), Bytes(t.input_bytes).c_str(),
                  Bytes(t.output_bytes).c_str(), t.verified ? "  verified" : "");
    } else {
      std::printf("%-48s %-16s %-5s %-7s %s%s\n", name.c_str(), Shape(t.shape).c_str(),
                  t.dtype.c_str(), "kept", t.skip_reason.c_str(), t.verified ? "  (verified)" : "");
    }
  }
  const int64_t kept = static_cast<int64_t>(r.tensors.size()) - r.packed_tensors;
  const double bits = r.packed_weights > 0 ? 8.0 * r.packed_output_bytes / r.packed_weights : 0;
  int64_t outside = 0;
  for (const TensorPackReport& t : r.tensors) outside += t.packed ? t.stats.outside_window : 0;
  std::printf(
      "\ntotal: packed %lld of %zu tensors (%lld weights, %s -> %s, %.4f bits per weight, "
      "exception rate %.5f%%); kept %lld as they were\n",
      static_cast<long long>(r.packed_tensors), r.tensors.size(),
      static_cast<long long>(r.packed_weights), Bytes(r.packed_input_bytes).c_str(),
      Bytes(r.packed_output_bytes).c_str(), bits,
      r.packed_weights > 0 ? 100.0 * outside / r.packed_weights : 0.0,
      static_cast<long long>(kept));
  std::printf(
      "       %s of tensors in, %s written to %zu file(s) in %.2f s (%.1f MB/s of input)%s\n",
      Bytes(r.input_bytes).c_str(), Bytes(r.output_bytes).c_str(), r.outputs.size(), r.seconds,
      r.input_bytes / std::max(1e-9, r.seconds) / 1e6,
      r.verified ? "; verified: every bit matches" : "");
}

nlohmann::json ReportJson(const CheckpointPackReport& r) {
  nlohmann::json j;
  j["schema"] = "gemvz.pack/1";
  j["outputs"] = r.outputs;
  j["input_bytes"] = r.input_bytes;
  j["output_bytes"] = r.output_bytes;
  j["packed_tensors"] = r.packed_tensors;
  j["packed_weights"] = r.packed_weights;
  j["packed_input_bytes"] = r.packed_input_bytes;
  j["packed_output_bytes"] = r.packed_output_bytes;
  j["verified"] = r.verified;
  j["seconds"] = r.seconds;
  nlohmann::json ts = nlohmann::json::array();
  for (const TensorPackReport& t : r.tensors) {
    nlohmann::json x;
    x["name"] = t.name;
    x["file"] = t.file;
    x["dtype"] = t.dtype;
    x["shape"] = t.shape;
    x["packed"] = t.packed;
    x["input_bytes"] = t.input_bytes;
    x["output_bytes"] = t.output_bytes;
    x["seconds"] = t.seconds;
    x["verified"] = t.verified;
    if (t.packed) {
      x["bits_per_weight"] = t.stats.bits_per_weight;
      x["exception_rate"] = t.stats.exception_rate;
      x["window_coverage"] = t.stats.window_coverage;
      x["outside_window"] = t.stats.outside_window;
      x["sparse_entries"] = t.stats.sparse_entries;
      x["residual_entries"] = t.stats.residual_entries;
      x["dense_rows"] = t.stats.dense_rows;
      x["padded_table_bytes"] = t.stats.padded_table_bytes;
    } else {
      x["skip_reason"] = t.skip_reason;
    }
    ts.push_back(std::move(x));
  }
  j["tensors"] = std::move(ts);
  return j;
}

int RunPack(const std::vector<std::string>& args) {
  const std::string out = absl::GetFlag(FLAGS_o);
  if (args.empty() || out.empty()) {
    std::fprintf(stderr, "gemvz pack: %s (see gemvz pack --help)\n",
                 args.empty() ? "no input .safetensors file" : "no output directory: give -o DIR");
    return 2;
  }
  const absl::StatusOr<int> threads = ThreadsFromFlag();
  if (!threads.ok()) {
    std::fprintf(stderr, "gemvz pack: %s\n", std::string(threads.status().message()).c_str());
    return 2;
  }
  // An input named twice, or an -o that is a file: the command line's mistakes, said before any
  // work (the library would refuse both too, as failures).
  for (size_t i = 0; i < args.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (internal::SameFile(args[i], args[j])) {
        std::fprintf(stderr, "gemvz pack: the input '%s' is given twice ('%s')\n", args[j].c_str(),
                     args[i].c_str());
        return 2;
      }
    }
  }
  if (struct stat st; ::stat(out.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
    std::fprintf(stderr, "gemvz pack: -o %s is not a directory\n", out.c_str());
    return 2;
  }
  // Each input is packed to OUT_DIR/<its file name>: two inputs of one name would both be written
  // to one file, and an output in an input's place would replace it. Usage errors too, said
  // before anything is opened or written (the library refuses both only as failures, later).
  // Two outputs collide when their names do, as the library has it: not when files already there
  // under two names are one (linked), since each is replaced by a rename, not written through.
  // An input that is no file (missing, a directory, "x/") is packed to nothing and replaced by
  // nothing: the library names it as it opens it (exit 1), so it is left out of these checks.
  std::vector<std::string> outputs;
  std::vector<bool> is_file;
  for (const std::string& in : args) {
    outputs.push_back(absl::StrCat(out, "/", internal::BaseName(in)));
    struct stat st;
    is_file.push_back(::stat(in.c_str(), &st) == 0 && S_ISREG(st.st_mode));
  }
  for (size_t i = 0; i < args.size(); ++i) {
    if (!is_file[i]) continue;
    for (size_t j = 0; j < i; ++j) {
      if (!is_file[j]) continue;
      if (outputs[i] == outputs[j]) {
        std::fprintf(stderr,
                     "gemvz pack: the inputs '%s' and '%s' would both be packed to '%s': give "
                     "inputs of different file names\n",
                     args[j].c_str(), args[i].c_str(), outputs[i].c_str());
        return 2;
      }
    }
    for (size_t k = 0; k < args.size(); ++k) {
      const std::string& in = args[k];
      if (!is_file[k]) continue;
      if (internal::SameFile(outputs[i], in)) {
        std::fprintf(stderr,
                     "gemvz pack: '%s', where '%s' is packed to, is the input '%s': it would be "
                     "replaced; choose another -o\n",
                     outputs[i].c_str(), args[i].c_str(), in.c_str());
        return 2;
      }
    }
  }
  // The report may go into -o itself, which the pack creates: there it is checked once it exists.
  const std::string json_path = absl::GetFlag(FLAGS_json);
  struct stat out_info;
  const bool into_new_out = !json_path.empty() && ::stat(out.c_str(), &out_info) != 0 &&
                            internal::SameFile(internal::DirName(json_path), out);
  // Nor may it replace an input or one of the packed files (SameFile compares the paths where
  // the files are still to be written).
  std::vector<NamedFile> others;
  for (const std::string& in : args) {
    others.push_back({absl::StrCat("the input '", in, "'"), in});
    others.push_back({absl::StrCat("where '", in, "' is packed to"),
                      absl::StrCat(out, "/", internal::BaseName(in))});
  }
  std::vector<std::string> out_names;
  for (const std::string& in : args) out_names.push_back(internal::BaseName(in));
  if (const std::string index = internal::ShardIndexNameFor(out_names); !index.empty()) {
    others.push_back({"the index of the packed files", absl::StrCat(out, "/", index)});
  }
  for (const absl::Status& st : {CheckOutputFile("json", into_new_out ? "" : json_path),
                                 CheckOutputIsNoneOf("json", json_path, others)}) {
    if (!st.ok()) {
      std::fprintf(stderr, "gemvz pack: %s\n", std::string(st.message()).c_str());
      return 2;
    }
  }
  CheckpointPackOptions options;
  options.threads = *threads;
  options.verify = absl::GetFlag(FLAGS_verify);
  options.keep_nonfinite = absl::GetFlag(FLAGS_keep_nonfinite);
  ProgressBar bar;
  options.progress = [&bar](const PackProgress& p) { bar.Update(p); };
  absl::StatusOr<CheckpointPackReport> report = PackCheckpoint(args, out, options);
  bar.Done();
  if (!report.ok()) {
    std::fprintf(stderr, "gemvz pack: %s\n", std::string(report.status().message()).c_str());
    return 1;
  }
  PrintReport(*report);
  if (!json_path.empty()) {
    // Atomically, and saying "wrote PATH", as bench and tune write theirs: an interrupted run
    // leaves no half report.
    if (!WriteJsonReport("pack", json_path, ReportJson(*report))) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace gemvz::cli

GEMVZ_REGISTER_COMMAND(pack, "pack", "pack safetensors checkpoints into 12-bit safetensors files",
                       gemvz::cli::kPackUsage, gemvz::cli::RunPack,
                       "o verify j keep_nonfinite json");
