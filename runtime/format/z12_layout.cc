#include "runtime/format/z12_layout.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "gemvz/format.h"
#include "runtime/common/parallel.h"

namespace gemvz::internal {

const GroupSlotTable& GroupSlots() {
  static const GroupSlotTable table = [] {
    GroupSlotTable t{};
    for (int f = 0; f < 4; ++f) {
      const int kb = f / 2, j = f % 2;
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, tt = lane % 4;
        for (int i = 0; i < 8; ++i) {
          const int x = i / 4, h = (i / 2) % 2, e = i % 2;
          t[f][lane][i] = GroupSlot{static_cast<uint8_t>(h * 8 + g),
                                    static_cast<uint8_t>(kb * 32 + tt * 8 + j * 4 + x * 2 + e)};
        }
      }
    }
    return t;
  }();
  return table;
}

uint32_t EmulatePrmt(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;  // {b, a}: a holds bytes 0-3
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = (sel >> (4 * i)) & 0xF;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (s & 7))) & 0xFF;
    if (s & 8) byte = (byte & 0x80) ? 0xFF : 0x00;  // replicate the sign bit
    d |= byte << (8 * i);
  }
  return d;
}

uint32_t EmulateLop3(uint32_t a, uint32_t b, uint32_t c, uint8_t lut) {
  uint32_t d = 0;
  for (int bit = 0; bit < 32; ++bit) {
    const int idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1);
    d |= static_cast<uint32_t>((lut >> idx) & 1) << bit;
  }
  return d;
}

std::array<uint32_t, 4> EmulateDecz(uint32_t s0, uint32_t s1, uint32_t q, uint32_t tl, uint32_t th) {
  const uint32_t h0 = EmulateLop3(EmulatePrmt(tl, th, q & 0x7777u), q, 0x80808080u, 0xF8);
  const uint32_t h1 = EmulateLop3(EmulatePrmt(tl, th, (q >> 16) & 0x7777u), q << 4, 0x80808080u, 0xF8);
  return {EmulatePrmt(s0, h0, 0x5140u), EmulatePrmt(s0, h0, 0x7362u), EmulatePrmt(s1, h1, 0x5140u),
          EmulatePrmt(s1, h1, 0x7362u)};
}

void ToGroupMajor(const uint8_t* weights, int64_t rows, int64_t cols, uint8_t* out) {
  const int64_t blocks = rows / kRowBlock, groups = cols / kColGroup;
  const int64_t bytes = blocks * groups * kGroupBytes;
  if (bytes == 0) return;
  // Groups in parallel, each thread writing its own contiguous range of `out` (a memory-bound
  // copy; `out` is best left unwritten before, so that its pages are first touched here).
  auto copy_groups = [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t b = 0; b < blocks; ++b) {
        std::memcpy(out + (g * blocks + b) * kGroupBytes, weights + (b * groups + g) * kGroupBytes,
                    kGroupBytes);
      }
    }
  };
  const int64_t threads = std::min<int64_t>(
      {groups, static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency())), 16,
       std::max<int64_t>(1, bytes >> 24)});  // 16 MiB a thread
  RunWorkers(static_cast<int>(threads),
             [&](int t) { copy_groups(groups * t / threads, groups * (t + 1) / threads); });
}

int64_t KernelBytes(const PackedMatrix& p) {
  static_assert(sizeof(ExceptionEntry) == 8, "an entry is two 32-bit words");
  return static_cast<int64_t>(
      p.weights.size() + 4 * p.row_offsets.size() + sizeof(ExceptionEntry) * p.entries.size() +
      4 * p.dense_block_offsets.size() + p.dense_rows.size() + 2 * p.dense_values.size());
}

}  // namespace gemvz::internal
