// PackCheckpoint: safetensors in, packed safetensors out, one tensor at a time so that memory
// stays near the size of the largest tensor, never the size of a file.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <new>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gemvz/checkpoint.h"
#include "runtime/checkpoint/packed_tensor.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/shard_index.h"
#include "runtime/common/file_util.h"
#include "runtime/common/log.h"
#include "runtime/common/status_macros.h"

namespace gemvz {
namespace {

using internal::BaseName;
using internal::SafetensorsEntry;
using internal::SafetensorsFile;
using internal::SafetensorsWriter;
using internal::StagedFile;

// Kept tensors are copied, and packed ones verified, in pieces of this many bytes, each released
// from the resident set once done.
constexpr uint64_t kChunkBytes = uint64_t{32} << 20;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Where a message about tensor `e` of `in` points: '<file>', tensor '<name>' [shape].
std::string TensorWhere(const SafetensorsFile& in, const SafetensorsEntry& e) {
  return absl::StrCat("'", in.path(), "', tensor '", internal::Escaped(e.name), "' ",
                      ShapeString(e.shape));
}

struct TensorPlan {
  const SafetensorsEntry* entry = nullptr;
  bool pack = false;
  std::string reason;  // why it is kept as is
};

// Which tensors of a file get packed, in file order (so the input is read front to back).
std::vector<TensorPlan> PlanFile(const SafetensorsFile& f) {
  std::vector<TensorPlan> plans;
  for (const SafetensorsEntry& e : f.tensors()) {
    TensorPlan p;
    p.entry = &e;
    if (e.dtype != "BF16") {
      p.reason = absl::StrCat("dtype ", e.dtype, " (only BF16 is packed)");
    } else if (e.shape.size() != 2) {
      p.reason = absl::StrCat(e.shape.size(), "-D tensor (only 2-D matrices are packed)");
    } else if (absl::Status st = CheckPackableShape(e.shape[0], e.shape[1]); !st.ok()) {
      p.reason = std::string(st.message());
    } else {
      p.pack = true;
    }
    plans.push_back(std::move(p));
  }
  std::stable_sort(plans.begin(), plans.end(), [](const TensorPlan& a, const TensorPlan& b) {
    return a.entry->begin < b.entry->begin;
  });
  return plans;
}

// The first non-finite BF16 value, or -1.
int64_t FindNonFinite(const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t v;
    std::memcpy(&v, p + 2 * i, 2);
    if ((v & 0x7F80) == 0x7F80) return i;
  }
  return -1;
}

class Driver {
 public:
  Driver(const CheckpointPackOptions& options, CheckpointPackReport& report)
      : options_(options), report_(report) {}

  absl::Status PackFile(const SafetensorsFile& in, const std::string& out_path,
                        std::unique_ptr<SafetensorsWriter>* writer_out);

  void Progress(const std::string& current, const std::string& stage) {
    if (!options_.progress) return;
    PackProgress p;
    p.bytes_done = bytes_done_;
    p.bytes_total = bytes_total_;
    p.tensors_done = tensors_done_;
    p.tensors_total = tensors_total_;
    p.current = current;
    p.stage = stage;
    options_.progress(p);
  }

  int64_t bytes_total_ = 0, tensors_total_ = 0;

  // Claims the names of `in`'s output tensors; an error when one is already taken. Called for
  // every input before any work.
  absl::Status ClaimOutputNames(const SafetensorsFile& in);

 private:
  absl::Status PackTensor(const SafetensorsFile& in, const TensorPlan& plan,
                          SafetensorsWriter& writer, TensorPackReport& r);
  absl::Status CopyTensor(const SafetensorsFile& in, const SafetensorsEntry& e,
                          SafetensorsWriter& writer, const std::string& stage_name);
  // A kept tensor: copied now, or left for WriteLast when its size would unalign what follows.
  absl::Status KeepTensor(const SafetensorsFile& in, const SafetensorsEntry& e,
                          SafetensorsWriter& writer);
  // Writes what was left for the end of the file (internal::WritesLast), largest elements first.
  absl::Status WriteLast(const SafetensorsFile& in, SafetensorsWriter& writer);
  // `*verifying` is the tensor being compared, for a caller that reports running out of memory.
  absl::Status Verify(const SafetensorsFile& in, const std::vector<TensorPlan>& plans,
                      const std::string& temp_path, size_t first_report,
                      const SafetensorsEntry** verifying);

  const CheckpointPackOptions& options_;
  CheckpointPackReport& report_;
  int64_t bytes_done_ = 0, tensors_done_ = 0;
  std::map<std::string, std::string> output_names_;  // every output tensor name -> its input
  // The current file's tensors that WritesLast: packed parts (their bytes) and kept tensors.
  std::vector<internal::DeferredPart> later_parts_;
  std::vector<const SafetensorsEntry*> later_kept_;
};

absl::Status Driver::KeepTensor(const SafetensorsFile& in, const SafetensorsEntry& e,
                                SafetensorsWriter& writer) {
  if (internal::WritesLast(e.end - e.begin)) {
    later_kept_.push_back(&e);
    return absl::OkStatus();
  }
  return CopyTensor(in, e, writer, "copy");
}

absl::Status Driver::WriteLast(const SafetensorsFile& in, SafetensorsWriter& writer) {
  struct Later {
    int element_size;
    const internal::DeferredPart* part;  // a packed part, or
    const SafetensorsEntry* kept;        // a kept tensor of the input
  };
  std::vector<Later> all;
  for (const internal::DeferredPart& p : later_parts_) {
    ASSIGN_OR_RETURN(const int element_size, internal::SafetensorsDtypeSize(p.dtype));
    all.push_back({element_size, &p, nullptr});
  }
  for (const SafetensorsEntry* e : later_kept_) {
    ASSIGN_OR_RETURN(const int element_size, internal::SafetensorsDtypeSize(e->dtype));
    all.push_back({element_size, nullptr, e});
  }
  std::stable_sort(all.begin(), all.end(),
                   [](const Later& a, const Later& b) { return a.element_size > b.element_size; });
  for (const Later& l : all) {
    if (l.part != nullptr) {
      RETURN_IF_ERROR(writer.AddTensor(l.part->name, l.part->dtype, l.part->shape,
                                       l.part->bytes.data(), l.part->bytes.size()));
    } else {
      RETURN_IF_ERROR(CopyTensor(in, *l.kept, writer, "copy"));
    }
  }
  later_parts_.clear();
  later_kept_.clear();
  return absl::OkStatus();
}

absl::Status Driver::CopyTensor(const SafetensorsFile& in, const SafetensorsEntry& e,
                                SafetensorsWriter& writer, const std::string& stage) {
  RETURN_IF_ERROR(writer.BeginTensor(e.name, e.dtype, e.shape));
  for (uint64_t off = 0; off < e.end - e.begin; off += kChunkBytes) {
    const uint64_t n = std::min(kChunkBytes, e.end - e.begin - off);
    in.WillNeed(e.begin + off, n);
    RETURN_IF_ERROR(writer.Write(in.data(e) + off, n));
    in.Release(e.begin + off, n);
    bytes_done_ += static_cast<int64_t>(n);
    Progress(e.name, stage);
  }
  return writer.EndTensor();
}

absl::Status Driver::PackTensor(const SafetensorsFile& in, const TensorPlan& plan,
                                SafetensorsWriter& writer, TensorPackReport& r) {
  const SafetensorsEntry& e = *plan.entry;
  const int64_t rows = e.shape[0], cols = e.shape[1];
  const uint8_t* src = in.data(e);
  in.WillNeed(e.begin, e.end - e.begin);
  // Files from the reference writer keep tensors aligned; an odd offset gets an aligned copy.
  std::vector<uint16_t> aligned;
  const uint16_t* bf16 = reinterpret_cast<const uint16_t*>(src);
  if (reinterpret_cast<uintptr_t>(src) % alignof(uint16_t) != 0) {
    aligned.resize(static_cast<size_t>(rows * cols));
    std::memcpy(aligned.data(), src, aligned.size() * 2);
    bf16 = aligned.data();
  }
  PackOptions po;
  po.threads = options_.threads;
  absl::StatusOr<PackedMatrix> packed = Pack(bf16, rows, cols, po);
  if (!packed.ok()) {
    const int64_t bad = FindNonFinite(src, rows * cols);
    if (bad < 0) {
      return absl::Status(packed.status().code(),
                          absl::StrCat(TensorWhere(in, e), ": ", packed.status().message()));
    }
    uint16_t v;
    std::memcpy(&v, src + 2 * bad, 2);
    const std::string what = absl::StrFormat("weight at (row %d, col %d) is %s (BF16 bits 0x%04x)",
                                             bad / cols, bad % cols,
                                             (v & 0x7F)     ? "NaN"
                                             : (v & 0x8000) ? "-Inf"
                                                            : "+Inf",
                                             v);
    if (!options_.keep_nonfinite) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorWhere(in, e), ": ", what,
                       "; only finite weights can be packed (keep such tensors unpacked with "
                       "keep_nonfinite / --keep_nonfinite)"));
    }
    GEMVZ_LOG_WARNING("'%s', tensor '%s': %s; kept unpacked", in.path(), internal::Escaped(e.name),
                      what);
    r.packed = false;
    r.skip_reason = absl::StrCat("non-finite: ", what);
    in.Release(e.begin, e.end - e.begin);
    return KeepTensor(in, e, writer);
  }
  in.Release(e.begin, e.end - e.begin);
  const uint64_t before = writer.bytes_written();
  const size_t first_later = later_parts_.size();
  ASSIGN_OR_RETURN(const internal::PackedTensorMeta meta,
                   internal::WritePackedTensor(writer, e.name, *packed, later_parts_));
  uint64_t later_bytes = 0;
  for (size_t i = first_later; i < later_parts_.size(); ++i) {
    later_bytes += later_parts_[i].bytes.size();
  }
  writer.SetMetadata(absl::StrCat(internal::kMetaTensorPrefix, e.name),
                     internal::EncodePackedTensorMeta(meta));
  r.packed = true;
  r.stats = packed->stats;
  r.output_bytes = static_cast<int64_t>(writer.bytes_written() - before + later_bytes);
  bytes_done_ += static_cast<int64_t>(e.end - e.begin);
  return absl::OkStatus();
}

absl::Status Driver::Verify(const SafetensorsFile& in, const std::vector<TensorPlan>& plans,
                            const std::string& temp_path, size_t first_report,
                            const SafetensorsEntry** verifying) {
  // Reopened the way any reader would: a header the writer got wrong fails here.
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> out, SafetensorsFile::Open(temp_path));
  const std::string where =
      absl::StrCat("verify of '", BaseName(in.path()), "' (written to '", temp_path, "')");
  size_t parts = 0;
  for (size_t i = 0; i < plans.size(); ++i) {
    const SafetensorsEntry& e = *plans[i].entry;
    TensorPackReport& r = report_.tensors[first_report + i];
    *verifying = &e;
    Progress(e.name, "verify");
    if (r.packed) {
      auto m = out->metadata().find(absl::StrCat(internal::kMetaTensorPrefix, e.name));
      if (m == out->metadata().end()) {
        return absl::DataLossError(
            absl::StrCat(where, ": no metadata for '", internal::Escaped(e.name), "'"));
      }
      ASSIGN_OR_RETURN(const internal::PackedTensorMeta meta,
                       internal::DecodePackedTensorMeta(m->second));
      ASSIGN_OR_RETURN(const PackedMatrix p, internal::ReadPackedTensor(*out, e.name, meta));
      parts += internal::kPackedParts;
      // Row slices keep the unpacked buffer small whatever the matrix size.
      const int64_t cols = p.cols;
      const int64_t slice_rows = std::max<int64_t>(
          kRowBlock, static_cast<int64_t>(kChunkBytes / 2 / cols) / kRowBlock * kRowBlock);
      std::vector<uint16_t> buf;
      for (int64_t r0 = 0; r0 < p.rows; r0 += slice_rows) {
        const int64_t r1 = std::min(p.rows, r0 + slice_rows);
        const PackedMatrix slice = internal::SlicePackedRows(p, r0, r1);
        buf.resize(static_cast<size_t>((r1 - r0) * cols));
        RETURN_IF_ERROR(Unpack(slice, buf.data()));
        const uint8_t* orig = in.data(e) + static_cast<uint64_t>(r0 * cols) * 2;
        if (std::memcmp(buf.data(), orig, buf.size() * 2) != 0) {
          for (size_t k = 0; k < buf.size(); ++k) {
            uint16_t o;
            std::memcpy(&o, orig + 2 * k, 2);
            if (o != buf[k]) {
              return absl::DataLossError(absl::StrFormat(
                  "%s: tensor '%s' (row %d, col %d) unpacks to BF16 0x%04x, the input holds "
                  "0x%04x",
                  where, internal::Escaped(e.name), r0 + static_cast<int64_t>(k) / cols,
                  static_cast<int64_t>(k) % cols, buf[k], o));
            }
          }
        }
        in.Release(e.begin + static_cast<uint64_t>(r0 * cols) * 2,
                   static_cast<uint64_t>((r1 - r0) * cols) * 2);
      }
    } else {
      const SafetensorsEntry* o = out->Find(e.name);
      parts += 1;
      if (o == nullptr || o->dtype != e.dtype || o->shape != e.shape) {
        return absl::DataLossError(absl::StrCat(where, ": tensor '", internal::Escaped(e.name),
                                                "' is missing or has another dtype/shape"));
      }
      for (uint64_t off = 0; off < e.end - e.begin; off += kChunkBytes) {
        const uint64_t n = std::min(kChunkBytes, e.end - e.begin - off);
        if (std::memcmp(out->data(*o) + off, in.data(e) + off, n) != 0) {
          return absl::DataLossError(absl::StrCat(where, ": tensor '", internal::Escaped(e.name),
                                                  "' differs from the input near byte ", off));
        }
        in.Release(e.begin + off, n);
        out->Release(o->begin + off, n);
      }
    }
    r.verified = true;
    bytes_done_ += static_cast<int64_t>(e.end - e.begin);
  }
  *verifying = nullptr;  // past the last tensor
  Progress("", "verify");
  if (out->tensors().size() != parts) {
    return absl::DataLossError(absl::StrCat(where, ": ", out->tensors().size(),
                                            " tensors in the output, expected ", parts));
  }
  return absl::OkStatus();
}

absl::Status Driver::ClaimOutputNames(const SafetensorsFile& in) {
  // Output names must not collide (an input tensor called "x.z12.weights" beside a packed "x"),
  // in this file or in another output of the same run.
  for (const TensorPlan& p : PlanFile(in)) {
    std::vector<std::string> out_names;
    if (p.pack) {
      for (int i = 0; i < internal::kPackedParts; ++i) {
        out_names.push_back(internal::PackedPartName(p.entry->name, i));
      }
    }
    // With keep_nonfinite a packable tensor holding a NaN or an infinity is kept under its own
    // name, which is known only once it is read: claimed now, so that a clash is found before
    // any work, not by the writer halfway through.
    if (!p.pack || options_.keep_nonfinite) out_names.push_back(p.entry->name);
    for (const std::string& n : out_names) {
      if (auto [it, ok] = output_names_.emplace(n, in.path()); !ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            "'", in.path(), "': output tensor name '", internal::Escaped(n),
            "' would be used twice",
            it->second == in.path() ? ""
                                    : absl::StrCat(" (also in the output of '", it->second, "')"),
            " (a packed tensor's part collides with another tensor",
            options_.keep_nonfinite ? ", or with a tensor that keep_nonfinite may keep unpacked"
                                    : "",
            ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Driver::PackFile(const SafetensorsFile& in, const std::string& out_path,
                              std::unique_ptr<SafetensorsWriter>* writer_out) {
  const std::vector<TensorPlan> plans = PlanFile(in);

  // Room for the header, which is written last: every unknown number at its longest.
  std::vector<SafetensorsEntry> bound_entries;
  std::map<std::string, std::string> bound_meta = in.metadata();
  bound_meta[internal::kMetaFormatKey] = internal::kMetaFormatValue;
  bound_meta[internal::kMetaVersionKey] = std::to_string(kCheckpointFormatVersion);
  for (const TensorPlan& p : plans) {
    const SafetensorsEntry& e = *p.entry;
    // A packable tensor may end up kept (keep_nonfinite): reserve for both.
    SafetensorsEntry kept = e;
    kept.begin = kept.end = internal::kMaxHeaderNumber;
    bound_entries.push_back(kept);
    if (p.pack) {
      for (auto& part : internal::PlaceholderPackedEntries(e.name, e.shape[0], e.shape[1])) {
        bound_entries.push_back(std::move(part));
      }
      bound_meta[absl::StrCat(internal::kMetaTensorPrefix, e.name)] =
          internal::PlaceholderPackedMeta(e.shape[0], e.shape[1]);
    }
  }
  const uint64_t reserve = internal::SafetensorsHeaderJson(bound_entries, bound_meta).size();
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                   SafetensorsWriter::Create(out_path, reserve));

  const size_t first_report = report_.tensors.size();
  for (const TensorPlan& p : plans) {
    const SafetensorsEntry& e = *p.entry;
    const double t0 = Now();
    TensorPackReport r;
    r.name = e.name;
    r.file = in.path();
    r.dtype = e.dtype;
    r.shape = e.shape;
    r.input_bytes = static_cast<int64_t>(e.end - e.begin);
    if (p.pack) {
      Progress(e.name, "pack");
      // Host memory running out is said here, where the file and tensor are known, as a status
      // (nothing throws across the API); the caller removes what was written.
      absl::Status packed;
      try {
        packed = PackTensor(in, p, *writer, r);
      } catch (const std::bad_alloc&) {
        packed = absl::ResourceExhaustedError(
            absl::StrCat(TensorWhere(in, e), ": out of host memory while packing it (",
                         e.end - e.begin, " bytes of BF16 in; packing holds about as much again)"));
      }
      RETURN_IF_ERROR(packed);
    } else {
      r.skip_reason = p.reason;
      RETURN_IF_ERROR(KeepTensor(in, e, *writer));
    }
    if (!r.packed && r.output_bytes == 0) r.output_bytes = r.input_bytes;
    r.seconds = Now() - t0;
    ++tensors_done_;
    report_.tensors.push_back(std::move(r));
    Progress("", "");
  }
  RETURN_IF_ERROR(WriteLast(in, *writer));
  for (const auto& [k, v] : in.metadata()) writer->SetMetadata(k, v);
  writer->SetMetadata(internal::kMetaFormatKey, internal::kMetaFormatValue);
  writer->SetMetadata(internal::kMetaVersionKey, std::to_string(kCheckpointFormatVersion));
  RETURN_IF_ERROR(writer->Finish());
  if (options_.verify) {
    absl::Status verified;
    const SafetensorsEntry* verifying = nullptr;
    try {
      verified = Verify(in, plans, writer->temp_path(), first_report, &verifying);
    } catch (const std::bad_alloc&) {
      verified = absl::ResourceExhaustedError(absl::StrCat(
          verifying == nullptr ? absl::StrCat("'", in.path(), "'") : TensorWhere(in, *verifying),
          ": out of host memory while verifying its packed copy"));
    }
    RETURN_IF_ERROR(verified);
  }
  report_.output_bytes += static_cast<int64_t>(writer->bytes_written());
  *writer_out = std::move(writer);
  return absl::OkStatus();
}

// The index of the outputs (shard_index.h), staged at `path` for the publish: every logical
// tensor that was written (a packed one under its own name) mapped to its output's file name;
// total_size the outputs' tensor bytes (data sections, packed parts included, headers not), as
// Hugging Face counts it; the outputs' gemvz.format and gemvz.version beside it.
absl::StatusOr<std::unique_ptr<StagedFile>> StageIndex(
    const std::string& path, const CheckpointPackReport& report,
    const std::vector<std::unique_ptr<SafetensorsWriter>>& writers) {
  std::map<std::string, std::string> weight_map;
  for (const TensorPackReport& t : report.tensors) weight_map[t.name] = BaseName(t.file);
  uint64_t total_size = 0;
  for (const auto& w : writers) total_size += w->data_bytes();
  const std::string text = internal::ShardIndexJson(
      weight_map, total_size,
      {{internal::kMetaFormatKey, internal::kMetaFormatValue},
       {internal::kMetaVersionKey, std::to_string(kCheckpointFormatVersion)}});
  return StagedFile::Write(path, [&](const auto& sink) { return sink(text.data(), text.size()); });
}

// --verify of the index: its temporary file read back and parsed as PackedCheckpoint::Open
// parses an index, its weight_map must be every tensor of the inputs (each found in its output
// under its own name by Driver::Verify) mapped to the output of its input, nothing else.
absl::Status VerifyIndex(const StagedFile& index,
                         const std::vector<std::unique_ptr<SafetensorsFile>>& inputs) {
  const std::string name = BaseName(index.path());
  const std::string where =
      absl::StrCat("verify of the index '", name, "' (written to '", index.temp_path(), "')");
  absl::StatusOr<std::string> text =
      internal::ReadRegularFile(index.temp_path(), internal::kMaxSafetensorsHeaderBytes);
  if (!text.ok()) return absl::DataLossError(absl::StrCat(where, ": ", text.status().message()));
  absl::StatusOr<internal::ShardIndex> read = internal::ParseShardIndex(*text, name);
  if (!read.ok()) {
    return absl::DataLossError(absl::StrCat(where, ": it ", read.status().message()));
  }
  std::map<std::string, std::string> expected;
  for (const auto& f : inputs) {
    for (const SafetensorsEntry& e : f->tensors()) expected[e.name] = BaseName(f->path());
  }
  for (const auto& [tensor, file] : expected) {
    auto it = read->weight_map.find(tensor);
    if (it == read->weight_map.end() || it->second != file) {
      return absl::DataLossError(absl::StrCat(
          where, ": tensor '", internal::Escaped(tensor), "' is in '", internal::Escaped(file),
          "', the index gives ",
          it == read->weight_map.end() ? "no file"
                                       : absl::StrCat("'", internal::Escaped(it->second), "'")));
    }
  }
  for (const auto& [tensor, file] : read->weight_map) {
    if (expected.count(tensor) == 0) {
      return absl::DataLossError(absl::StrCat(
          where, ": it names tensor '", internal::Escaped(tensor), "', which no output holds"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointPackReport> PackCheckpoint(const std::vector<std::string>& inputs,
                                                    const std::string& out_dir,
                                                    const CheckpointPackOptions& options) {
  const double t0 = Now();
  if (inputs.empty()) return absl::InvalidArgumentError("no input safetensors files");
  if (out_dir.empty()) return absl::InvalidArgumentError("no output directory");

  // Every input is opened and checked before anything is written.
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::string> base_names, tensor_files;
  CheckpointPackReport report;
  Driver driver(options, report);
  for (const std::string& path : inputs) {
    ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open(path));
    if (f->metadata().count(internal::kMetaFormatKey)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "' is already a gemvz packed checkpoint"));
    }
    for (const auto& [key, value] : f->metadata()) {
      if (key.compare(0, 6, "gemvz.") == 0) {
        return absl::InvalidArgumentError(absl::StrCat("'", path, "': metadata key '",
                                                       internal::Escaped(key),
                                                       "' is reserved for packed checkpoints"));
      }
    }
    const std::string base = BaseName(path);
    if (auto [it, ok] = base_names.emplace(base, path); !ok) {
      return absl::InvalidArgumentError(absl::StrCat("inputs '", it->second, "' and '", path,
                                                     "' would both be written to '", base, "'"));
    }
    for (const SafetensorsEntry& e : f->tensors()) {
      if (auto [it, ok] = tensor_files.emplace(e.name, path); !ok) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", internal::Escaped(e.name),
                                                       "' is in both '", it->second, "' and '",
                                                       path, "'"));
      }
      driver.bytes_total_ += static_cast<int64_t>(e.end - e.begin);
      ++driver.tensors_total_;
    }
    files.push_back(std::move(f));
  }
  for (const auto& f : files) RETURN_IF_ERROR(driver.ClaimOutputNames(*f));
  if (options.verify) driver.bytes_total_ *= 2;  // every byte is read again to verify it
  // A failure takes back the directories made here, so that it leaves out_dir as it was.
  std::vector<std::string> created_dirs;
  absl::Cleanup remove_created_dirs = [&] { internal::RemoveCreatedDirectories(created_dirs); };
  RETURN_IF_ERROR(internal::CreateDirectories(out_dir, &created_dirs));
  // Each input's output, under its file name in out_dir; then the index, which two or more
  // outputs get (shard_index.h), published with them.
  std::vector<std::string> out_names, out_paths;
  for (const auto& f : files) {
    out_names.push_back(BaseName(f->path()));
    out_paths.push_back(absl::StrCat(out_dir, "/", out_names.back()));
  }
  std::string no_index;
  const std::string index_name = internal::ShardIndexNameFor(out_names, &no_index);
  if (!no_index.empty()) GEMVZ_LOG_WARNING("no index written beside the outputs: %s", no_index);
  // Packing into the input's own directory would replace the input with its packed version. A
  // directory where an output (or the index) goes would make the publish fail: better now than
  // after the work (the publish checks again).
  for (size_t i = 0; i < files.size(); ++i) {
    struct stat in_st, out_st;
    if (::stat(files[i]->path().c_str(), &in_st) == 0 &&
        ::stat(out_paths[i].c_str(), &out_st) == 0 && in_st.st_dev == out_st.st_dev &&
        in_st.st_ino == out_st.st_ino) {
      return absl::InvalidArgumentError(
          absl::StrCat("output '", out_paths[i], "' is the input itself; choose another -o"));
    }
  }
  const std::string index_path = index_name.empty() ? "" : absl::StrCat(out_dir, "/", index_name);
  if (!index_path.empty()) out_paths.push_back(index_path);
  for (const std::string& out_path : out_paths) {
    struct stat out_st;
    if (::lstat(out_path.c_str(), &out_st) == 0 && S_ISDIR(out_st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("output '", out_path, "' is a directory; nothing was written"));
    }
    // Nor a device, FIFO or socket, or a link to one, which the publish would replace.
    if (internal::IsSpecialFile(out_path)) {
      return absl::FailedPreconditionError(
          absl::StrCat("output '", out_path,
                       "' is not a regular file (a device, FIFO or socket, or a link to one), "
                       "which the publish would replace; nothing was written"));
    }
  }

  // Written and verified under temporary names; published together at the end, all or none (a
  // file that fails to go into place takes back those before it and restores any it replaced).
  // Writers that are never published remove their temporary files when destroyed. Every file the
  // pack writes into out_dir must be one of these writers, or join the same PublishTogether.
  std::vector<std::unique_ptr<SafetensorsWriter>> writers;
  for (size_t i = 0; i < files.size(); ++i) {
    std::unique_ptr<SafetensorsWriter> w;
    RETURN_IF_ERROR(driver.PackFile(*files[i], out_paths[i], &w));
    writers.push_back(std::move(w));
  }
  // The index is one more file of the same publish (renamed first, see PublishTogether).
  std::unique_ptr<StagedFile> index;
  std::vector<StagedFile*> publish_also;
  if (!index_path.empty()) {
    ASSIGN_OR_RETURN(index, StageIndex(index_path, report, writers));
    if (options.verify) {
      driver.Progress("", "verify");
      RETURN_IF_ERROR(VerifyIndex(*index, files));
    }
    publish_also.push_back(index.get());
  }
  std::vector<SafetensorsWriter*> publish;
  for (auto& w : writers) publish.push_back(w.get());
  RETURN_IF_ERROR(SafetensorsWriter::PublishTogether(publish, publish_also));
  std::move(remove_created_dirs).Cancel();
  for (auto& w : writers) report.outputs.push_back(w->path());
  if (index != nullptr) {
    report.outputs.push_back(index->path());
    report.output_bytes += static_cast<int64_t>(index->size());
  }

  for (const TensorPackReport& r : report.tensors) {
    report.input_bytes += r.input_bytes;
    if (r.packed) {
      ++report.packed_tensors;
      report.packed_weights += r.stats.weights;
      report.packed_input_bytes += r.input_bytes;
      report.packed_output_bytes += r.output_bytes;
    }
  }
  report.verified = options.verify;
  report.seconds = Now() - t0;
  return report;
}

}  // namespace gemvz
