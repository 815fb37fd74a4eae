// What a DeviceMatrix holds on its GPU, and per-device facts the launch path needs.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gemvz/config.h"
#include "gemvz/gemv.h"
#include "kernel_sources/gemv_params.cuh"

namespace gemvz::internal {

struct DeviceMatrixState {
  int device = 0;
  WeightFormat format = WeightFormat::kZ12;
  WeightOrder order = WeightOrder::kBlockMajor;  // z12: how `weights` lies (config.h)
  int64_t rows = 0, cols = 0;
  int64_t weight_bytes = 0;
  std::string fallback_reason;
  // z12
  CUdeviceptr weights = 0, row_offsets = 0, entries = 0, dense_block_offsets = 0, dense_rows = 0,
              dense_values = 0;
  CUdeviceptr dense_global_rows = 0;  // [n_dense] the matrix row of each dense row
  int64_t n_dense = 0;
  uint32_t tl = 0, th = 0;
  // bf16: [rows16][ldw] zero-padded
  CUdeviceptr plain = 0;
  int64_t rows16 = 0, cols64 = 0, ldw = 0;

  std::vector<CUdeviceptr> allocations;
  ~DeviceMatrixState();

  static DeviceMatrix Wrap(std::shared_ptr<DeviceMatrixState> s) {
    DeviceMatrix m;
    m.state_ = std::move(s);
    return m;
  }
};

struct DeviceInfo {
  DeviceLimits limits;
  std::string arch;  // "sm_90"
  std::string name;
};
// A 12-bit matrix's part of its kernel's arguments: the weights, side tables and dense rows, N, K
// and the window's lookup words. The call's part (x, out, workspace, M, strides, S, flags) is zero.
Z12Params Z12MatrixParams(const DeviceMatrixState& s);

// Queried once per device.
absl::StatusOr<DeviceInfo> GetDeviceInfo(int device);

// A 12-bit matrix of `rows` rows with `n_dense` dense rows launches up to rows/16 + n_dense CTAs
// a K slice (RB 1: every row block's CTA, then one a dense row), which must fit the grid's x
// limit; Validate checks the row blocks alone, since a shape has no dense rows. Upload asks, so
// that every configuration Validate passes can launch the matrix.
absl::Status CheckDenseRowGrid(int64_t rows, int64_t n_dense, const DeviceLimits& limits);

// UploadOptions::order's rule: `requested` if set, else GEMVZ_WEIGHT_ORDER (block or group; auto
// or unset defers to the next rule), else PreferredOrder(arch, rows, cols, device). An error
// names a bad GEMVZ_WEIGHT_ORDER.
absl::StatusOr<WeightOrder> ResolveOrder(const std::optional<WeightOrder>& requested,
                                         const std::string& arch, int64_t rows, int64_t cols,
                                         const std::string& device = "");

}  // namespace gemvz::internal
