// Known answers of the two digests. Every file gemvz writes and reads back agrees with itself
// whatever the polynomial or the rounds, so only published values show that the checksums are the
// CRC-32C the formats document and that the cache keys are SHA-256.
#include "runtime/common/hash.h"

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace gemvz::internal {
namespace {

uint32_t Crc(const std::string& s) { return Crc32c(s.data(), s.size()); }

TEST(HashTest, Crc32cKnownAnswers) {
  // The CRC catalogue's check value of CRC-32C (Castagnoli); CRC-32 (IEEE) gives 0xCBF43926.
  EXPECT_EQ(Crc("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc(""), 0u);
  // RFC 3720 (iSCSI), appendix B.4: 32 bytes of zeros, of ones, ascending and descending.
  std::string up, down;
  for (int i = 0; i < 32; ++i) {
    up.push_back(static_cast<char>(i));
    down.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(Crc(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc(std::string(32, '\xff')), 0x62A8AB43u);
  EXPECT_EQ(Crc(up), 0x46DD794Eu);
  EXPECT_EQ(Crc(down), 0x113FDB5Cu);
}

// The 8-byte loop and the byte loop agree, at any alignment, and a checksum continued from a
// prefix's is the whole's.
TEST(HashTest, Crc32cInPiecesAndAtAnyAlignment) {
  std::string data;
  for (int i = 0; i < 100; ++i) data.push_back(static_cast<char>(i * 37 + 11));
  const uint32_t whole = Crc(data);
  for (size_t k = 0; k <= data.size(); ++k) {
    EXPECT_EQ(Crc32c(data.data() + k, data.size() - k, Crc32c(data.data(), k)), whole) << k;
  }
  const std::string check = "123456789";
  for (size_t shift = 0; shift < 8; ++shift) {
    std::vector<char> buf(shift + check.size());
    check.copy(buf.data() + shift, check.size());
    EXPECT_EQ(Crc32c(buf.data() + shift, check.size()), 0xE3069283u) << shift;
  }
}

TEST(HashTest, Sha256KnownAnswers) {
  // FIPS 180-2 examples, and the padding edges: 55 bytes fit one block with the length, 56 do not,
  // 64 are a whole block.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
      {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
      {std::string(55, 'a'), "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
      {std::string(56, 'a'), "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
      {std::string(64, 'a'), "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
  };
  for (const auto& [message, digest] : cases) {
    EXPECT_EQ(Sha256().Update(message).HexFinish(), digest) << message.size() << " bytes";
    // The same fed a byte at a time.
    Sha256 h;
    for (char c : message) h.Update(&c, 1);
    EXPECT_EQ(h.HexFinish(), digest) << message.size() << " bytes, one at a time";
  }
  // A million 'a's, in pieces of 999 and 1001 bytes that straddle the 64-byte blocks.
  Sha256 h;
  const std::string piece(1001, 'a');
  for (int i = 0; i < 1000; ++i) h.Update(piece.data(), i % 2 == 0 ? 999 : 1001);
  EXPECT_EQ(h.HexFinish(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Finish gives the same bytes.
  const std::array<uint8_t, 32> bytes = Sha256().Update("abc").Finish();
  EXPECT_EQ(bytes[0], 0xBA);
  EXPECT_EQ(bytes[31], 0xAD);
}

// A field is its length as 8 little-endian bytes, then its bytes: the cache keys depend on it.
TEST(HashTest, Sha256FieldIsLengthPrefixed) {
  EXPECT_EQ(Sha256().UpdateField("abc").HexFinish(),
            Sha256().Update(std::string("\x03\0\0\0\0\0\0\0abc", 11)).HexFinish());
  EXPECT_EQ(Sha256().UpdateField("abc").HexFinish(),
            "ce91dc5eec0139adf091900d225971d6ad246a845bad791b5693a9d0d55dd391");
  EXPECT_NE(Sha256().UpdateField("ab").UpdateField("c").HexFinish(),
            Sha256().UpdateField("a").UpdateField("bc").HexFinish());
}

}  // namespace
}  // namespace gemvz::internal
