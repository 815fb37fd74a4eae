// Real checkpoints: packing safetensors files into 12-bit safetensors files (PackCheckpoint, the
// library side of `gemvz pack`), and reading tensors back from them (PackedCheckpoint).
// The packed format is described in docs/CHECKPOINTS.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gemvz/format.h"
#include "gemvz/gemv.h"

namespace gemvz {

namespace internal {
struct CheckpointState;
}

// Version of the packed-checkpoint layout (metadata key "gemvz.version"); files of a newer
// version are refused.
inline constexpr int kCheckpointFormatVersion = 1;

// One logical tensor of a checkpoint: a packed matrix (stored as several "<name>.z12.*" parts) or
// a tensor kept as it was.
struct TensorInfo {
  std::string name;
  std::string file;            // the safetensors file that holds it
  std::string dtype;           // of the original tensor: "BF16", "F32", ...
  std::vector<int64_t> shape;  // of the original tensor
  bool packed = false;
  int64_t stored_bytes = 0;  // bytes in the file (all parts of a packed tensor)
};

// A tensor kept as is, straight from the mapped file: valid while its PackedCheckpoint (or a copy
// of it) lives.
struct TensorView {
  std::string dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t size = 0;  // bytes
};

// A packed checkpoint, opened read-only and memory-mapped. Cheap to copy (shared state);
// thread-safe.
class PackedCheckpoint {
 public:
  // `path`: a directory (every *.safetensors in it) or one .safetensors file. Plain safetensors
  // files open too: all their tensors are then unpacked ones. Links are followed; a *.safetensors
  // entry that is not a file (a directory, a FIFO, a link whose target is gone) is an error
  // (FailedPrecondition) that names it, never skipped: the checkpoint would lack its tensors.
  // A directory's *.safetensors.index.json files (Hugging Face's sharded layout; each one) are
  // read first: a file a weight_map names that the directory lacks is FailedPrecondition naming
  // it and the index, with nothing opened; a malformed index (not JSON, no weight_map object, a
  // value that is no plain *.safetensors file name) is InvalidArgument, one above 100 MiB or not
  // a regular file FailedPrecondition. Then each tensor an index names must be in the file it
  // gives (a packed one under its logical name), else FailedPrecondition; tensors no index names
  // are accepted. A single file reads no index; a directory without one opens as it is.
  static absl::StatusOr<PackedCheckpoint> Open(const std::string& path);

  PackedCheckpoint() = default;
  // Every logical tensor, sorted by name.
  const std::vector<TensorInfo>& tensors() const;
  absl::StatusOr<TensorInfo> Info(const std::string& name) const;

  // A packed tensor as a PackedMatrix: every part checked against its CRC32C, then ValidatePacked.
  absl::StatusOr<PackedMatrix> GetPacked(const std::string& name) const;
  // A packed tensor uploaded to a GPU (DeviceMatrix::Upload of GetPacked, with `options`).
  absl::StatusOr<DeviceMatrix> GetDevice(const std::string& name, int device = 0,
                                         const UploadOptions& options = {}) const;
  // A tensor that was kept as is (not packed).
  absl::StatusOr<TensorView> GetRaw(const std::string& name) const;
  // The original BF16 bits of a BF16 tensor, row-major, packed (unpacked here) or not.
  absl::StatusOr<std::vector<uint16_t>> GetBf16(const std::string& name) const;

 private:
  std::shared_ptr<const internal::CheckpointState> state_;
};

struct PackProgress {
  int64_t bytes_done = 0;   // input tensor bytes finished (twice over with verify: packed, then
  int64_t bytes_total = 0;  // verified)
  int64_t tensors_done = 0;
  int64_t tensors_total = 0;
  std::string current;  // tensor now being processed ("" at the end)
  std::string stage;    // "pack", "copy", "verify"
};

struct CheckpointPackOptions {
  int threads = 0;      // 0: all hardware threads; each matrix uses as PackOptions::threads does
  bool verify = false;  // re-read every written file, unpack every tensor and compare its bits
  // A tensor that would be packed (2-D BF16 of a shape CheckPackableShape accepts) holding Inf or
  // NaN is an error by default; with this it is kept unpacked instead. Every other tensor is
  // copied as it is, non-finite values included.
  bool keep_nonfinite = false;
  // Called from the packing thread between steps (often; keep it cheap).
  std::function<void(const PackProgress&)> progress;
};

struct TensorPackReport {
  std::string name;
  std::string file;  // input file
  std::string dtype;
  std::vector<int64_t> shape;
  bool packed = false;
  std::string skip_reason;  // why it was kept as is (when !packed)
  int64_t input_bytes = 0;
  int64_t output_bytes = 0;  // all parts
  PackStats stats;           // when packed
  bool verified = false;     // when options.verify: its bits matched
  double seconds = 0;
};

struct CheckpointPackReport {
  std::vector<TensorPackReport> tensors;  // in input order
  std::vector<std::string> outputs;       // the files written, the index (if any) last
  int64_t input_bytes = 0;                // tensor bytes read
  int64_t output_bytes = 0;               // file bytes written (the index's included)
  int64_t packed_tensors = 0;
  int64_t packed_weights = 0;
  int64_t packed_input_bytes = 0;   // BF16 bytes of the packed tensors
  int64_t packed_output_bytes = 0;  // their 12-bit parts
  bool verified = false;
  double seconds = 0;
};

// Packs safetensors `inputs` into `out_dir` (created if missing): one output file per input, with
// the same file name. Every 2-D BF16 tensor whose shape CheckPackableShape accepts is packed; the
// rest is copied as is. Two or more outputs also get Hugging Face's index,
// "<prefix>.safetensors.index.json" (the prefix of inputs all named
// "<prefix>-NNNNN-of-NNNNN.safetensors", else "model"): every logical tensor (a packed one under
// its own name) mapped to its output's file name, metadata.total_size the outputs' tensor bytes;
// verified (read back, each tensor's file checked) when asked; listed last in `outputs`. One
// output gets none, nor do outputs an index cannot name (not *.safetensors, not UTF-8: a warning
// says so). Other *.safetensors.index.json files in `out_dir` are left alone (Open reads them
// all: a stale one naming other files makes it refuse the directory). Files (the index included)
// appear under their final names only once every one of them has been written (and verified
// when asked), all or none: a failure leaves `out_dir` as it was (a file that an output would
// have replaced is restored, directories made for it are removed) and no temporary files. Host
// memory running out while a tensor is packed or verified is ResourceExhausted, naming the file
// (and the tensor).
absl::StatusOr<CheckpointPackReport> PackCheckpoint(const std::vector<std::string>& inputs,
                                                    const std::string& out_dir,
                                                    const CheckpointPackOptions& options = {});

}  // namespace gemvz
