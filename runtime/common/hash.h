// Digests: SHA-256 for cache keys (collisions must not happen), CRC32C for file section checksums.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace gemvz::internal {

class Sha256 {
 public:
  Sha256();
  Sha256& Update(const void* data, size_t size);
  Sha256& Update(std::string_view s) { return Update(s.data(), s.size()); }
  // Adds a length-prefixed field, so that ("ab","c") and ("a","bc") differ.
  Sha256& UpdateField(std::string_view s);
  std::array<uint8_t, 32> Finish();
  std::string HexFinish();  // 64 lowercase hex digits

 private:
  void Block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

// CRC-32C (Castagnoli), continuing from `crc` (0 to start).
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace gemvz::internal
