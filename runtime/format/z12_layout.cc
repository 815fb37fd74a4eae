#include "runtime/format/z12_layout.h"

#include <cstring>

#include "gemvz/format.h"

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

std::vector<uint8_t> ToGroupMajor(const std::vector<uint8_t>& weights, int64_t rows, int64_t cols) {
  const int64_t blocks = rows / kRowBlock, groups = cols / kColGroup;
  std::vector<uint8_t> out(weights.size());
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      std::memcpy(out.data() + (g * blocks + b) * kGroupBytes,
                  weights.data() + (b * groups + g) * kGroupBytes, kGroupBytes);
    }
  }
  return out;
}

}  // namespace gemvz::internal
