#include "runtime/jit/cubin_info.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace gemvz::internal {
namespace {

// The attribute codes of NVIDIA's .nv.info sections that matter here.
constexpr uint8_t kEiattrFrameSize = 0x11;
constexpr uint8_t kEiattrRegcount = 0x2f;
// Record formats: 1 no value (2 bytes), 2 byte value and 3 half value (4 bytes), 4 sized.
constexpr uint8_t kFmtNone = 1, kFmtByte = 2, kFmtHalf = 3, kFmtSized = 4;

template <typename T>
bool Read(std::string_view b, size_t at, T* out) {
  if (at > b.size() || b.size() - at < sizeof(T)) return false;
  std::memcpy(out, b.data() + at, sizeof(T));
  return true;
}

struct Section {
  uint32_t name, type;
  uint64_t offset, size;
  uint32_t link;
};

}  // namespace

absl::StatusOr<CubinKernelInfo> ReadCubinKernelInfo(std::string_view elf, std::string_view kernel) {
  auto bad = [&](const char* what) {
    return absl::InvalidArgumentError(absl::StrCat("cubin of ", std::string(kernel), ": ", what));
  };
  if (elf.size() < 64 || elf.substr(0, 4) != std::string_view("\x7f" "ELF", 4) || elf[4] != 2) {
    return bad("not a 64-bit ELF file");
  }
  uint64_t shoff = 0;
  uint16_t shentsize = 0, shnum = 0, shstrndx = 0;
  if (!Read(elf, 0x28, &shoff) || !Read(elf, 0x3A, &shentsize) || !Read(elf, 0x3C, &shnum) ||
      !Read(elf, 0x3E, &shstrndx) || shentsize < 64 || shstrndx >= shnum) {
    return bad("bad ELF header");
  }
  std::vector<Section> secs(shnum);
  for (uint16_t i = 0; i < shnum; ++i) {
    const size_t at = shoff + static_cast<size_t>(i) * shentsize;
    Section& s = secs[i];
    if (!Read(elf, at, &s.name) || !Read(elf, at + 4, &s.type) || !Read(elf, at + 24, &s.offset) ||
        !Read(elf, at + 32, &s.size) || !Read(elf, at + 40, &s.link)) {
      return bad("section header out of bounds");
    }
    // SHT_NOBITS sections (.nv.shared.*) have a size but no bytes in the file.
    if (s.type != 8 && (s.offset > elf.size() || elf.size() - s.offset < s.size)) {
      return bad("section header out of bounds");
    }
  }
  // A SHT_NOBITS section's offset and size were not checked against the file: it has no bytes.
  auto str = [&](const Section& table, uint32_t off) -> std::string_view {
    if (table.type == 8 || off >= table.size) return {};
    const std::string_view t = elf.substr(table.offset + off, table.size - off);
    return t.substr(0, t.find('\0'));
  };
  // The kernel's symbol index, and the sections that name it.
  int64_t symbol = -1;
  CubinKernelInfo info;
  const Section* global_info = nullptr;
  for (const Section& s : secs) {
    const std::string_view name = str(secs[shstrndx], s.name);
    if (name == ".nv.info" && s.type != 8) global_info = &s;
    if (name == absl::StrCat(".nv.shared.", std::string(kernel))) {
      info.shared_bytes = static_cast<int>(s.size);
    }
    if (s.type == 2 /* SHT_SYMTAB */ && s.link < shnum) {
      for (uint64_t i = 0; i * 24 + 24 <= s.size; ++i) {
        uint32_t sym_name = 0;
        if (Read(elf, s.offset + i * 24, &sym_name) && str(secs[s.link], sym_name) == kernel) {
          symbol = static_cast<int64_t>(i);
        }
      }
    }
  }
  if (symbol < 0) return bad("kernel symbol not found");
  if (global_info == nullptr) return bad("no .nv.info section");
  // The section also holds the 1 KiB that sm_80+ reserve per CTA, which ptxas does not count
  // (checked against ptxas on sm_90 by compiler_test); no section: none used.
  constexpr int kReservedShared = 1024;
  info.shared_bytes = info.shared_bytes < 0 ? 0 : std::max(0, info.shared_bytes - kReservedShared);
  for (uint64_t p = global_info->offset, end = p + global_info->size; p + 2 <= end;) {
    const uint8_t fmt = static_cast<uint8_t>(elf[p]), attr = static_cast<uint8_t>(elf[p + 1]);
    if (fmt == kFmtNone) {
      p += 2;
    } else if (fmt == kFmtByte || fmt == kFmtHalf) {
      p += 4;
    } else if (fmt == kFmtSized) {
      uint16_t size = 0;
      if (!Read(elf, p + 2, &size) || p + 4 + size > end) return bad("truncated .nv.info record");
      uint32_t sym = 0, value = 0;
      if (size == 8 && Read(elf, p + 4, &sym) && Read(elf, p + 8, &value) && sym == symbol) {
        if (attr == kEiattrRegcount) info.registers = static_cast<int>(value);
        if (attr == kEiattrFrameSize) info.frame_bytes = static_cast<int>(value);
      }
      p += 4 + size;
    } else {
      return bad("unknown .nv.info record format");
    }
  }
  if (info.registers < 0) return bad("no register count for the kernel");
  if (info.frame_bytes < 0) info.frame_bytes = 0;
  return info;
}

}  // namespace gemvz::internal
