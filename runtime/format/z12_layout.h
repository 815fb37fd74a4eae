// Where each weight of a 16 x 64 group lives in the 12-bit layout (seed chapter 7.2-7.3), and the
// bit-exact host emulation of the device decoder (prmt.b32, lop3.b32, decz).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

#include "gemvz/format.h"

namespace gemvz::internal {

// Position of one weight inside a group: fragment f (0..3), lane (0..31), value i (0..7).
// Fragment f covers k block kb = f / 2 (32 wide) and mma step j = f % 2; lane = 4 * g + t;
// value i = 4 * X + 2 * h + e is W[h*8 + g][kb*32 + t*8 + j*4 + X*2 + e] (the mma A fragment with
// the K relabelling that lets x be loaded as 16-byte vectors).
struct GroupSlot {
  uint8_t row;  // 0..15 within the row block
  uint8_t col;  // 0..63 within the group
};
// kSlots[f][lane][i]
using GroupSlotTable = std::array<std::array<std::array<GroupSlot, 8>, 32>, 4>;
const GroupSlotTable& GroupSlots();

// Byte offset within a group of the low byte of value i of (fragment f, lane).
inline int LowByteOffset(int f, int lane, int i) { return (f / 2) * 512 + lane * 16 + (f % 2) * 8 + i; }
// Byte offset within a group of the code/sign word of (fragment f, lane).
inline int CodeWordOffset(int f, int lane) { return 2 * 512 + lane * 16 + f * 4; }
// Bit that holds the sign of value i inside a code word (the code sits at bits 4i..4i+2).
inline constexpr int kSignBit[8] = {7, 15, 23, 31, 3, 11, 19, 27};

// The BF16 bits the decoder produces for value i of (fragment f, lane), given that lane's code
// word `q` (at CodeWordOffset) and the group's bytes: sign, window base + code, low byte.
inline uint16_t DecodedBits(const uint8_t* group, uint32_t q, int base, int f, int lane, int i) {
  const uint32_t code = (q >> (4 * i)) & 7, sign = (q >> kSignBit[i]) & 1;
  return static_cast<uint16_t>((sign << 15) | ((static_cast<uint32_t>(base) + code) << 8) |
                               group[LowByteOffset(f, lane, i)]);
}

// Calls fn(slot, bits) for each of a group's 1024 weights: where it sits in the 16 x 64 group and
// the BF16 bits the decoder produces for it (DecodedBits), fragment by fragment, lane by lane.
template <class Fn>
void ForEachDecodedWeight(const uint8_t* group, int base, Fn&& fn) {
  const GroupSlotTable& slots = GroupSlots();
  for (int f = 0; f < 4; ++f) {
    for (int lane = 0; lane < 32; ++lane) {
      uint32_t q;
      std::memcpy(&q, group + CodeWordOffset(f, lane), 4);
      for (int i = 0; i < 8; ++i) fn(slots[f][lane][i], DecodedBits(group, q, base, f, lane, i));
    }
  }
}

// prmt.b32 d, a, b, sel (default mode), from the PTX ISA definition.
uint32_t EmulatePrmt(uint32_t a, uint32_t b, uint32_t sel);
// lop3.b32 d, a, b, c, lut, from the PTX ISA definition.
uint32_t EmulateLop3(uint32_t a, uint32_t b, uint32_t c, uint8_t lut);
// decz: S0/S1 low bytes of values 0-3 / 4-7, Q the code/sign word -> the four A-fragment registers
// (each two BF16 values, the lower-indexed in the low half).
std::array<uint32_t, 4> EmulateDecz(uint32_t s0, uint32_t s1, uint32_t q, uint32_t tl, uint32_t th);

// The packed weights ([rows/16][cols/64] units of kGroupBytes, block-major) in group-major order
// ([cols/64][rows/16] units) into `out`, which holds as many bytes: what a DeviceMatrix uploaded
// with WeightOrder::kGroupMajor holds. Uses up to 16 threads. rows and cols are multiples of 16
// and 64 (ValidatePacked); none is nothing to do.
void ToGroupMajor(const uint8_t* weights, int64_t rows, int64_t cols, uint8_t* out);

// Whether the window starting at `base` holds the weight's exponent byte (its 7 high bits after
// the sign), so that the decoder restores it with no correction.
inline bool InWindow(uint16_t bits, int base) {
  const int e7 = (bits >> 8) & 0x7F;
  return e7 >= base && e7 < base + 8;
}

// Calls fn(col, values, n) for each corrected weight of `row`, in column order: the run of its
// entries with one column, n = 1 or 2 values (a third in the run starts another call;
// ValidatePacked refuses three). `p`'s row offsets and entries must be in range (ValidatePacked
// checks them first).
template <class Fn>
void ForEachCorrectedWeight(const PackedMatrix& p, int64_t row, Fn&& fn) {
  for (uint32_t e = p.row_offsets[row], e1 = p.row_offsets[row + 1]; e < e1;) {
    const int32_t col = p.entries[e].col;
    uint32_t values[2];
    int n = 0;
    while (e < e1 && p.entries[e].col == col && n < 2) values[n++] = p.entries[e++].value_bits;
    fn(col, values, n);
  }
}

// The weight Unpack restores from its decoded bits and its n (1 or 2) correction values.
uint16_t RestoredWeight(uint16_t decoded, const uint32_t* values, int n);

// The correction entries that Pack makes for `n` BF16 weights with window start `base`: none
// inside the window, one or two outside (PackStats counts a dense row's, which are not stored,
// for its padded table).
int64_t CorrectionEntries(const uint16_t* weights, int64_t n, int base);

// Every byte of `p` a kernel may read (PackStats::total_bytes), counted from the arrays
// themselves: the packed weights, row offsets, correction entries, dense-row block offsets, dense
// rows' indices and values.
int64_t KernelBytes(const PackedMatrix& p);

}  // namespace gemvz::internal
