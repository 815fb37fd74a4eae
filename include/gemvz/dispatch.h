// How configurations are chosen: the tuned table shipped with the library, the tuning file that
// `gemvz tune --save` and autotuning write, a heuristic for unseen shapes, and the sweep space.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gemvz/config.h"

namespace gemvz {

// One tuned decision: for (arch, format, m, n, k) use `config`, on the GPU named `device`.
struct TunedChoice {
  std::string arch;  // "sm_90"
  WeightFormat format = WeightFormat::kZ12;
  int64_t m = 0, n = 0, k = 0;
  KernelConfig config;
  double time_us = 0;  // measured time of the winner, for reports
  std::string device;  // the GPU it was measured on ("NVIDIA H200"); "" for any (the built-in
                       // table, files older than version 6, entries written by hand)
};

// The tuning file: GEMVZ_TUNING_FILE, else <CacheDirectory()>/tuning.json. JSON
// {"version": V, "entries": [{arch, [device,] format, m, n, k, config, time_us}, ...]}, written
// with the oldest V that holds every entry, so that older gemvz read it while they can: 1, 2 once
// a config uses RB 2 or PIPE 4..8, 3 once a 12-bit entry's warps take uneven shares of K, 4 once a
// config uses RB 4, 5 once a config reads group-major weights (".gm"), 6 once an entry names its
// device or a config uses PIPE 9..13. All six are read; a newer version is neither read nor
// overwritten. An entry measured on one GPU serves only a GPU of that name (an H100 and an H200
// are both sm_90, but their winners differ); one without a device serves every GPU of its arch.
std::string TuningFilePath();
// Merges `choices` into the tuning file (replacing entries of the same key), atomically. A 12-bit
// choice whose weight order (KernelConfig::order) differs from the file's entries for the same
// (arch, device, n, k) replaces those entries too (a warning says so): a shape's entries share one
// order. A choice's m is one launch's rows (1..32), what the dispatcher looks up; a larger m
// (which runs in chunks) is refused.
absl::Status SaveTunedChoices(const std::vector<TunedChoice>& choices);
// The entries of the tuning file (empty when there is none).
absl::StatusOr<std::vector<TunedChoice>> LoadTunedChoices();
// The table compiled into the library (DESIGN.md's suite on sm_90; the dispatcher and
// PreferredOrder use its sm_90 rows for the arch-specific target sm_90a too).
const std::vector<TunedChoice>& BuiltinTunedTable();

// Every configuration worth timing for a shape (m rounded up to the launch's token blocks): the
// valid combinations of NW, UG, NB, PIPE, S and, for z12, RB (2 and 4 only where they can pay).
// All are block-major; `gemvz tune` runs them in the order the shape's weights are uploaded in.
std::vector<KernelConfig> SweepSpace(const GemvShape& shape, WeightFormat format);

// The device order a 12-bit [n, k] matrix gets on an `arch` GPU named `device` when its upload
// does not say (UploadOptions, GEMVZ_WEIGHT_ORDER): if the tuning file has entries for (arch,
// device, z12, n, k), else for (arch, no device, z12, n, k), their order (SaveTunedChoices keeps a
// shape's entries in one; block-major if a hand-edited file mixes them); else group-major if the
// built-in table has group-major rows for the shape (it may hold block-major rows for it too, for
// matrices uploaded so); else block-major, which the heuristic was measured on.
WeightOrder PreferredOrder(const std::string& arch, int64_t n, int64_t k,
                           const std::string& device = "");

// The dispatcher's choice without a tuned entry.
KernelConfig HeuristicConfig(const GemvShape& shape, WeightFormat format, int sm_count = 132);

// The distinct kernels (splits ignored) of the built-in table (each row in its own weight order),
// of the heuristic for the suite, and every kernel the heuristic's shaped rule can pick for other
// shapes, the 12-bit ones in both weight orders: what `gemvz warmup --all_default` compiles after
// the tuning file's (TunedWarmupConfigs).
std::vector<KernelConfig> DefaultWarmupConfigs();

// The distinct kernels (splits ignored) of the tuning file's entries for `arch` exactly (every
// GPU's entries; the dispatcher reads no other arch's, sm_90's for sm_90a included), in the
// file's order: what `gemvz warmup --tuned` compiles and `--all_default` adds to the defaults, so
// that a tuning file copied to a serving machine starts warm there too. Empty when there is no
// file; the file's error when it cannot be read.
absl::StatusOr<std::vector<KernelConfig>> TunedWarmupConfigs(const std::string& arch);

}  // namespace gemvz
