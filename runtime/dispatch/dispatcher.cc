// The dispatcher's lookup: tuning file, then the built-in table, then the heuristic. The tuning
// file is read once per process; the answers are memoised per (arch, format, shape, SM count).
#include "runtime/dispatch/dispatcher.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gemvz/dispatch.h"
#include "runtime/common/log.h"
#include "runtime/common/per_thread_cache.h"

namespace gemvz::internal {
namespace {

// (arch, format, n, k) -> the table's entries for it, ordered by m.
using ShapeKey = std::tuple<std::string, int, int64_t, int64_t>;
using BuiltinIndex = absl::flat_hash_map<ShapeKey, std::vector<const TunedChoice*>>;

const BuiltinIndex& GetBuiltinIndex() {
  static const BuiltinIndex* const index = [] {
    auto* idx = new BuiltinIndex();
    for (const TunedChoice& c : BuiltinTunedTable()) {
      (*idx)[ShapeKey{c.arch, static_cast<int>(c.format), c.n, c.k}].push_back(&c);
    }
    for (auto& [key, entries] : *idx) {
      std::stable_sort(entries.begin(), entries.end(),
                       [](const TunedChoice* a, const TunedChoice* b) { return a->m < b->m; });
    }
    return idx;
  }();
  return *index;
}

// (arch, device, format, m, n, k); device "" for entries that serve any GPU of the arch
using ChoiceKey = std::tuple<std::string, std::string, int, int64_t, int64_t, int64_t>;
// (arch, device, format, m, n, k, sm_count, order)
using PlanKey = std::tuple<std::string, std::string, int, int64_t, int64_t, int64_t, int, int>;

constexpr size_t kMaxPlans = 1 << 14;

const std::string kAnyDevice;  // the device of entries that serve any GPU of their arch

// The tuning file as read (once) and the plans answered so far, under one mutex.
class Dispatcher {
 public:
  absl::StatusOr<GemvPlan> Choose(const GemvShape& launch, WeightFormat format,
                                  const std::string& arch, const std::string& device,
                                  int sm_count, WeightOrder order) ABSL_LOCKS_EXCLUDED(mu_) {
    if (format != WeightFormat::kZ12) order = WeightOrder::kBlockMajor;
    const PlanKey plan_key{arch,     device,   static_cast<int>(format), launch.m, launch.n,
                           launch.k, sm_count, static_cast<int>(order)};
    // Every Gemv asks: a plan answered before is the thread's own copy, found with no lock.
    return front_.FindOrAsk(
        plan_key, [&] { return Plan(plan_key, launch, format, arch, device, sm_count, order); });
  }

  // The order of the tuning file's (arch, device, z12, *, n, k) entries, else of its (arch, no
  // device, z12, *, n, k) ones: nullopt when it has neither.
  std::optional<WeightOrder> FileOrder(const std::string& arch, const std::string& device,
                                       int64_t n, int64_t k) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!loaded_) LoadLocked();
    if (!device.empty()) {
      if (std::optional<WeightOrder> own = FileOrderLocked(arch, device, n, k)) return own;
    }
    return FileOrderLocked(arch, kAnyDevice, n, k);
  }

  absl::Status Reload() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    plans_.clear();
    LoadLocked();
    front_.Invalidate();  // after the change (per_thread_cache.h)
    return status_;
  }

  absl::Status status() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return status_;
  }

  void Invalidate() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    loaded_ = false;
    plans_.clear();
    front_.Invalidate();  // the next Choose reads the file again, on every thread
  }

 private:
  // plans_' answer for `plan_key`, made on a miss: the tuning file's entry, else the built-in
  // table's, else the heuristic's.
  GemvPlan Plan(const PlanKey& plan_key, const GemvShape& launch, WeightFormat format,
                const std::string& arch, const std::string& device, int sm_count, WeightOrder order)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (const auto it = plans_.find(plan_key); it != plans_.end()) return it->second;
    if (!loaded_) LoadLocked();

    GemvPlan plan;
    // This GPU's own entry, else one that serves any GPU of the arch; each only in the matrix's
    // weight order (a save keeps one order per shape and device, not across devices).
    auto find = [&](const std::string& d) -> const KernelConfig* {
      const auto it =
          entries_.find(ChoiceKey{arch, d, static_cast<int>(format), launch.m, launch.n, launch.k});
      return it != entries_.end() && it->second.order == order ? &it->second : nullptr;
    };
    const KernelConfig* tuned = find(device);
    if (tuned == nullptr && !device.empty()) tuned = find(kAnyDevice);
    if (tuned != nullptr) {
      plan.config = *tuned;
      plan.source = "tuning-file";
    } else if (std::optional<KernelConfig> t = LookupBuiltinTable(launch, format, arch, order)) {
      plan.config = *t;
      plan.source = "tuned";
    } else {
      plan.config = InOrder(HeuristicConfig(launch, format, sm_count), order);
      plan.source = "heuristic";
    }
    plan.chunk_m = std::min<int64_t>(launch.m, plan.config.tokens_per_launch());
    // Bounded for callers that sweep many shapes; a cleared memo only costs a recomputation.
    if (plans_.size() >= kMaxPlans) plans_.clear();
    plans_[plan_key] = plan;
    return plan;
  }

  // The order of the (arch, device, z12, *, n, k) entries exactly: nullopt when there are none.
  std::optional<WeightOrder> FileOrderLocked(const std::string& arch, const std::string& device,
                                             int64_t n, int64_t k)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool any = false, all_group = true;  // group-major only if every entry is
    for (const auto& [key, config] : entries_) {
      if (std::get<0>(key) != arch || std::get<1>(key) != device ||
          std::get<2>(key) != static_cast<int>(WeightFormat::kZ12) || std::get<4>(key) != n ||
          std::get<5>(key) != k) {
        continue;
      }
      any = true;
      all_group = all_group && config.order == WeightOrder::kGroupMajor;
    }
    if (!any) return std::nullopt;
    return all_group ? WeightOrder::kGroupMajor : WeightOrder::kBlockMajor;
  }

  void LoadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    loaded_ = true;
    entries_.clear();
    absl::StatusOr<std::vector<TunedChoice>> choices = LoadTunedChoices();
    status_ = choices.status();
    if (!choices.ok()) {
      // Once per load: a bad file must not make every call noisy, nor stop any of them.
      GEMVZ_LOG_WARNING("%s; running without the tuning file", choices.status().message());
      return;
    }
    for (const TunedChoice& c : *choices) {
      entries_[ChoiceKey{c.arch, c.device, static_cast<int>(c.format), c.m, c.n, c.k}] = c.config;
    }
    GEMVZ_LOG_DEBUG("tuning file '%s': %d entries", TuningFilePath(),
                    static_cast<int>(entries_.size()));
  }

  absl::Mutex mu_;
  bool loaded_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ChoiceKey, KernelConfig> entries_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<PlanKey, GemvPlan> plans_ ABSL_GUARDED_BY(mu_);
  PerThreadCache<PlanKey, GemvPlan> front_;  // each thread's copies of plans_' answers
};

Dispatcher& GetDispatcher() {
  static Dispatcher* const dispatcher = new Dispatcher();
  return *dispatcher;
}

absl::Status CheckShape(const GemvShape& shape) {
  auto fail = [&](const std::string& rule) {
    return absl::InvalidArgumentError(
        absl::StrCat("no gemvz kernel takes shape ", shape.ToString(), ": ", rule));
  };
  if (shape.m < 1) return fail("m must be at least 1");
  if (shape.n < 16 || shape.n % 16 != 0) return fail("N must be a positive multiple of 16");
  if (shape.k < 64 || shape.k % 64 != 0) return fail("K must be a positive multiple of 64");
  // The kernels take N and K as 32-bit ints; the heuristic's last resort is not validated.
  if (shape.n > INT32_MAX || shape.k > INT32_MAX) return fail("N and K must be below 2^31");
  return absl::OkStatus();
}

// The architecture whose built-in rows serve `arch`: an arch-specific target ("sm_90a", "sm_100f")
// compiles the same kernels for the same GPU as its base ("sm_90"), where the rows were measured.
std::string TableArch(const std::string& arch) {
  if (arch.size() > 3 && arch.compare(0, 3, "sm_") == 0 &&
      (arch.back() == 'a' || arch.back() == 'f')) {
    return arch.substr(0, arch.size() - 1);
  }
  return arch;
}

}  // namespace

KernelConfig InOrder(KernelConfig c, WeightOrder order) {
  if (c.format == WeightFormat::kZ12) c.order = order;
  return c;
}

std::optional<KernelConfig> LookupBuiltinTable(const GemvShape& shape, WeightFormat format,
                                               const std::string& arch, WeightOrder order) {
  const BuiltinIndex& index = GetBuiltinIndex();
  const auto it =
      index.find(ShapeKey{TableArch(arch), static_cast<int>(format), shape.n, shape.k});
  if (it == index.end()) return std::nullopt;
  // The exact m, else the next m up: a kernel tuned for 16 rows also serves 9..15 when its NB
  // covers them, which beats a guess.
  for (const TunedChoice* c : it->second) {
    if (c->m < shape.m) continue;
    if (format == WeightFormat::kZ12 && c->config.order != order) continue;  // the other order's
    if (c->config.tokens_per_launch() < shape.m) return std::nullopt;
    if (!Validate(c->config, shape).ok()) return std::nullopt;
    return c->config;
  }
  return std::nullopt;
}

absl::StatusOr<GemvPlan> ChooseConfig(const GemvShape& shape, WeightFormat format,
                                      const std::string& arch, int sm_count, WeightOrder order,
                                      const std::string& device) {
  if (absl::Status st = CheckShape(shape); !st.ok()) return st;
  const GemvShape launch{LaunchRowsFor(shape.m), shape.n, shape.k};
  return GetDispatcher().Choose(launch, format, arch, device, sm_count, order);
}

absl::Status ReloadTuningFile() { return GetDispatcher().Reload(); }

}  // namespace gemvz::internal

namespace gemvz {

WeightOrder PreferredOrder(const std::string& arch, int64_t n, int64_t k,
                           const std::string& device) {
  if (std::optional<WeightOrder> o = internal::GetDispatcher().FileOrder(arch, device, n, k)) {
    return *o;
  }
  const auto& index = internal::GetBuiltinIndex();
  const auto it = index.find(
      internal::ShapeKey{internal::TableArch(arch), static_cast<int>(WeightFormat::kZ12), n, k});
  if (it == index.end()) return WeightOrder::kBlockMajor;
  for (const TunedChoice* c : it->second) {
    if (c->config.order == WeightOrder::kGroupMajor) return WeightOrder::kGroupMajor;
  }
  return WeightOrder::kBlockMajor;
}

}  // namespace gemvz

namespace gemvz::internal {

absl::Status TuningFileStatus() { return GetDispatcher().status(); }

void InvalidateTuningFileCache() { GetDispatcher().Invalidate(); }

}  // namespace gemvz::internal
