// KernelConfig text form and the validation rules every launch passes first.
#include "gemvz/config.h"

#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "runtime/common/log.h"
#include "runtime/dispatch/dispatcher.h"

namespace gemvz {
namespace {

// Digits only, without a leading zero: SimpleAtoi alone would also take "+8", " 8", "8 " or
// "08", and the text form must stay canonical so that a configuration has exactly one spelling.
enum class FieldValue { kOk, kNotDecimal, kLeadingZero, kTooLong };

FieldValue ParseFieldValue(absl::string_view digits, int* value) {
  if (digits.empty()) return FieldValue::kNotDecimal;
  for (char ch : digits) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(ch))) return FieldValue::kNotDecimal;
  }
  if (digits.size() > 1 && digits[0] == '0') return FieldValue::kLeadingZero;
  if (digits.size() > 9 || !absl::SimpleAtoi(digits, value)) return FieldValue::kTooLong;
  return FieldValue::kOk;
}

// What to lower when a configuration's static shared memory is too large.
const char* SharedMemoryHint(const KernelConfig& c) {
  return c.rb > 1 ? " (lower NW, NB or RB)" : " (lower NW or NB)";
}

}  // namespace

std::string_view FormatName(WeightFormat format) {
  return format == WeightFormat::kZ12 ? "z12" : "bf16";
}

std::string_view OrderName(WeightOrder order) {
  return order == WeightOrder::kGroupMajor ? "group" : "block";
}

std::string KernelConfig::KernelName() const {
  std::string name =
      absl::StrFormat("%s.nw%d.ug%d.nb%d.pipe%d", FormatName(format), nw, ug, nb, pipe);
  if (rb != 1) absl::StrAppend(&name, ".rb", rb);  // one row block per CTA is written by omission
  if (order == WeightOrder::kGroupMajor) absl::StrAppend(&name, ".gm");  // block-major likewise
  return name;
}

std::string KernelConfig::ToString() const { return absl::StrCat(KernelName(), ".s", splits); }

namespace internal {

std::vector<KernelConfig> DistinctKernels(const std::vector<KernelConfig>& configs) {
  std::vector<KernelConfig> out;
  absl::flat_hash_set<std::string> seen;
  for (KernelConfig c : configs) {
    c.splits = 1;
    if (seen.insert(c.KernelName()).second) out.push_back(c);
  }
  return out;
}

}  // namespace internal

std::string GemvShape::ToString() const { return absl::StrFormat("m%d.n%d.k%d", m, n, k); }

int64_t KernelConfig::shared_bytes() const {
  // The kernels' static arrays: red[NW][RB*NB*32] float4 and s_last; z12 adds
  // ecorr[RB*16][NB*8+1] float and s_dense (64 bits at RB 4). config_test compares this with
  // what ptxas reports.
  int64_t bytes = static_cast<int64_t>(nw) * rb * nb * 32 * 16;
  if (format == WeightFormat::kZ12) bytes += rb * 16 * (nb * 8 + 1) * 4 + (rb == 4 ? 8 : 4);
  return bytes + 4;  // s_last
}

namespace {

// `s` as an error message quotes it: an excerpt, control bytes and quotes escaped.
std::string Shown(absl::string_view s, size_t max) {
  return internal::Escaped(std::string_view(s.data(), s.size()), max);
}

}  // namespace

absl::StatusOr<KernelConfig> KernelConfig::Parse(std::string_view text_in) {
  // Debian's Abseil has its own string_view; the public API speaks std::string_view.
  const absl::string_view raw(text_in.data(), text_in.size());
  // What messages quote (made only for a message): control bytes escaped (a NUL would end the
  // message where it is printed), a long line or field cut (a 4 MB --configs line is not echoed).
  const auto text = [raw] { return Shown(raw, 120); };
  const std::vector<absl::string_view> parts = absl::StrSplit(raw, '.');
  KernelConfig c;
  if (parts.empty() || (parts[0] != "z12" && parts[0] != "bf16")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad configuration '", text(), "': it must start with the format, z12 or bf16 (e.g. ",
        "z12.nw8.ug2.nb2.pipe3.s1)"));
  }
  c.format = parts[0] == "z12" ? WeightFormat::kZ12 : WeightFormat::kBf16;
  bool seen[6] = {false, false, false, false, false, false};
  static constexpr absl::string_view kNames[6] = {"nw", "ug", "nb", "pipe", "s", "rb"};
  int* fields[6] = {&c.nw, &c.ug, &c.nb, &c.pipe, &c.splits, &c.rb};
  bool seen_gm = false;
  for (size_t i = 1; i < parts.size(); ++i) {
    absl::string_view p = parts[i];
    if (p == "gm") {  // the group-major order: a flag, not a number
      if (seen_gm) {
        return absl::InvalidArgumentError(
            absl::StrCat("bad configuration '", text(), "': field gm given twice"));
      }
      seen_gm = true;
      c.order = WeightOrder::kGroupMajor;
      continue;
    }
    int which = -1;
    // "pipe" before "nb"/"nw" has no prefix clash; check the longest names first.
    for (int f : {3, 0, 1, 2, 5, 4}) {
      if (absl::StartsWith(p, kNames[f])) {
        which = f;
        break;
      }
    }
    int value = 0;
    const FieldValue parsed = which < 0 ? FieldValue::kNotDecimal
                                        : ParseFieldValue(p.substr(kNames[which].size()), &value);
    if (parsed == FieldValue::kLeadingZero) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad configuration '", text(), "': field '", Shown(p, 40), "' has a leading zero (",
          kNames[which], " is written without one: a configuration has one spelling)"));
    }
    if (parsed == FieldValue::kTooLong) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad configuration '", text(), "': field '", Shown(p, 40), "' is out of range (",
          kNames[which], " takes a number of at most 9 digits)"));
    }
    if (parsed != FieldValue::kOk) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad configuration '", text(), "': field '", Shown(p, 40),
          "' is not one of nw<N>, ug<N>, nb<N>, pipe<N>, rb<N>, gm, s<N>",
          which < 0 ? "" : absl::StrCat(" (", kNames[which], " takes a decimal number)")));
    }
    if (seen[which]) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad configuration '", text(), "': field ", kNames[which], " given twice"));
    }
    seen[which] = true;
    *fields[which] = value;
  }
  for (int f = 0; f < 4; ++f) {
    if (!seen[f]) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad configuration '", text(), "': missing field ", kNames[f], "<N>"));
    }
  }
  if (!seen[4]) c.splits = 1;  // s defaults to 1 (and rb to 1, KernelConfig's default)
  if (absl::Status st = ValidateConfig(c); !st.ok()) return st;
  return c;
}

DeviceLimits DefaultDeviceLimits() { return DeviceLimits{}; }

absl::Status ValidateConfig(const KernelConfig& c) {
  auto fail = [&](const std::string& rule) {
    return absl::InvalidArgumentError(
        absl::StrCat("configuration ", c.ToString(), " is invalid: ", rule));
  };
  if (c.nw < 1 || c.nw > 32) return fail(absl::StrCat("NW must be in 1..32 (got ", c.nw, ")"));
  if (c.ug < 1 || c.ug > 8) return fail(absl::StrCat("UG must be in 1..8 (got ", c.ug, ")"));
  if (c.nb < 1 || c.nb > 4) return fail(absl::StrCat("NB must be in 1..4 (got ", c.nb, ")"));
  if (c.pipe < 0 || c.pipe > MaxPipe(WeightFormat::kZ12)) {
    return fail(
        absl::StrCat("PIPE must be in 0..", MaxPipe(WeightFormat::kZ12), " (got ", c.pipe, ")"));
  }
  if (c.pipe > MaxPipe(c.format)) {
    return fail(absl::StrCat("PIPE 4..", MaxPipe(WeightFormat::kZ12),
                             " (register-capped plain and rolling loops) exist for z12 only; ",
                             std::string(FormatName(c.format)), " takes 0..", MaxPipe(c.format),
                             " (got ", c.pipe, ")"));
  }
  if (c.splits < 1) return fail(absl::StrCat("S must be at least 1 (got ", c.splits, ")"));
  if (c.rb != 1 && c.rb != 2 && c.rb != 4) {
    return fail(absl::StrCat("RB must be 1, 2 or 4 (got ", c.rb, ")"));
  }
  if (c.rb != 1 && c.format != WeightFormat::kZ12) {
    return fail(absl::StrCat("RB ", c.rb, " (", c.rb, " row blocks per CTA) exists for z12 only; ",
                             std::string(FormatName(c.format)), " takes RB 1"));
  }
  if (c.order == WeightOrder::kGroupMajor && c.format != WeightFormat::kZ12) {
    return fail(absl::StrCat("the group-major order (gm) is a layout of 12-bit weights; ",
                             std::string(FormatName(c.format)), " reads row-major BF16"));
  }
  if (c.rb == 4 && c.splits != 1) {
    return fail(absl::StrCat("RB 4 takes S = 1 only: its combine takes the fragments in turns, ",
                             "without the split-K step (got S = ", c.splits, ")"));
  }
  if (c.nw < c.nb) {
    return fail(absl::StrCat("NW >= NB is required: the first NB warps do the final reduction (NW=",
                             c.nw, ", NB=", c.nb, ")"));
  }
  // (RB 4's combine takes the fragments in turns, so any thread count serves.)
  if (c.rb != 4 && c.threads() < c.rb * c.nb * 32) {
    return fail(absl::StrCat("NW + 1 >= RB * NB is required: the first RB*NB*32 threads do the ",
                             "final reduction (NW=", c.nw, ", RB=", c.rb, ", NB=", c.nb, ")"));
  }
  // No GPU launches more than 1024 threads a block, so such a kernel would be compiled and cached
  // for nothing.
  if (c.threads() > kMaxThreadsPerBlock) {
    return fail(absl::StrCat(c.threads(), " threads per block (NW = ", c.nw,
                             c.format == WeightFormat::kZ12 ? " and the exception warp" : "",
                             ") exceed ", kMaxThreadsPerBlock,
                             ", the most any GPU launches in one block"));
  }
  // No GPU lets a kernel declare more than 48 KiB of static shared memory (ptxas refuses it), so
  // such a configuration cannot be compiled at all, whatever the shape or device.
  if (c.shared_bytes() > kMaxStaticSharedBytes) {
    return fail(absl::StrCat("static shared memory ", c.shared_bytes(), " bytes exceeds ",
                             kMaxStaticSharedBytes, ", the most any kernel may declare",
                             SharedMemoryHint(c)));
  }
  return absl::OkStatus();
}

absl::Status Validate(const KernelConfig& c, const GemvShape& s, const DeviceLimits& limits) {
  if (absl::Status st = ValidateConfig(c); !st.ok()) return st;
  // The message is built only on failure: the sweep and the heuristic validate many candidates.
  auto fail = [&](const std::string& rule) {
    return absl::InvalidArgumentError(
        absl::StrCat("configuration ", c.ToString(), " for ", s.ToString(), " is invalid: ", rule));
  };
  if (c.threads() > limits.max_threads_per_block) {
    return fail(absl::StrCat("threads per block ", c.threads(), " exceed the device limit ",
                             limits.max_threads_per_block));
  }
  if (c.shared_bytes() > limits.max_shared_per_block) {
    return fail(absl::StrCat("static shared memory ", c.shared_bytes(), " bytes exceeds ",
                             limits.max_shared_per_block, SharedMemoryHint(c)));
  }
  if (s.m < 1 || s.m > c.tokens_per_launch()) {
    return fail(absl::StrCat("m must be in 1..8*NB = ", c.tokens_per_launch(), " per launch"));
  }
  if (s.n < 16 || s.n % 16 != 0) return fail("N must be a positive multiple of 16");
  if (s.n % (16 * c.rb) != 0) {
    return fail(absl::StrCat("N must be a multiple of 16*RB = ", 16 * c.rb,
                             " (each CTA takes RB whole row blocks)"));
  }
  if (s.k < 64 || s.k % 64 != 0) return fail("K must be a positive multiple of 64");
  // The kernels take M, N and K as 32-bit ints.
  if (s.n > INT32_MAX || s.k > INT32_MAX) return fail("N and K must be below 2^31");
  if (c.format == WeightFormat::kBf16) {
    // The plain kernel's warps take equal shares of K. (Dealt as the 12-bit kernel's are, through
    // k_range, its loop bound would depend on the warp, and ptxas then gave the heuristic's
    // plain families 2-8 more registers or a spill on sm_90 (NW 8, UG 2, NB 3, PIPE 3: 130 instead
    // of 128, one CTA per SM instead of two), even on K that NW divides; session 11, not kept.)
    const int64_t quantum = int64_t{64} * c.splits * c.nw * c.ug;
    if (s.k % quantum != 0) {
      return fail(absl::StrCat("K must be divisible by 64*S*NW*UG = ", quantum,
                               " (the plain kernel's warps take equal shares)"));
    }
  } else {
    // The 12-bit kernel's warps take K in whole trips of UG groups, each K slice the same
    // number, and share a slice's trips as evenly as whole trips go (counts one trip apart).
    const int64_t slice = int64_t{64} * c.splits * c.ug;
    if (s.k % slice != 0) {
      return fail(absl::StrCat("K must be divisible by 64*S*UG = ", slice,
                               " (K slices of whole trips of UG groups)"));
    }
    if (s.k / slice < c.nw) {
      return fail(absl::StrCat("K/(64*S*UG) = ", s.k / slice, " trips per K slice must be at ",
                               "least NW = ", c.nw, ", one for every warp"));
    }
  }
  if (s.n / (16 * c.rb) > limits.max_grid_x) {
    return fail("N/(16*RB) CTAs per K slice exceed the grid's x limit");
  }
  if (c.splits > limits.max_grid_y) return fail("S exceeds the grid's y limit");
  return absl::OkStatus();
}

}  // namespace gemvz
