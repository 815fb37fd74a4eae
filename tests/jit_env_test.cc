// Environment helpers: byte sizes with units, booleans, integers; malformed values warn and fall
// back to the default.
#include <dlfcn.h>
#include <pwd.h>
#include <sys/types.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "gtest/gtest.h"
#include "runtime/common/env.h"
#include "tests/support/jit_test_util.h"

// Fault injection: while g_pw_min_buffer is above 0, getpwuid_r answers as a password database
// whose entry for any uid needs that many bytes of buffer: ERANGE below, home /home/long-entry at
// or above. The library, linked statically into this binary, calls this one.
std::atomic<size_t> g_pw_min_buffer{0};
extern "C" int getpwuid_r(uid_t uid, struct passwd* pw, char* buf, size_t buflen,
                          struct passwd** result) {
  static const auto real =
      reinterpret_cast<int (*)(uid_t, struct passwd*, char*, size_t, struct passwd**)>(
          dlsym(RTLD_NEXT, "getpwuid_r"));
  const size_t need = g_pw_min_buffer.load();
  if (need == 0) return real(uid, pw, buf, buflen, result);
  *result = nullptr;
  if (buflen < need) return ERANGE;
  std::memset(pw, 0, sizeof(*pw));
  std::strcpy(buf, "/home/long-entry");
  pw->pw_dir = buf;
  *result = pw;
  return 0;
}

namespace gemvz::internal {
namespace {

using ::gemvz::jit_test::CountOccurrences;
using ::gemvz::jit_test::ScopedEnv;

TEST(EnvTest, ByteSizes) {
  const int64_t n = static_cast<int64_t>(jit_test::Rng()() % 1000000);
  EXPECT_EQ(ParseByteSize(std::to_string(n)).value(), n);
  EXPECT_EQ(ParseByteSize("512K").value(), 512 << 10);
  EXPECT_EQ(ParseByteSize("64M").value(), int64_t{64} << 20);
  EXPECT_EQ(ParseByteSize("64MiB").value(), int64_t{64} << 20);
  EXPECT_EQ(ParseByteSize("64mb").value(), int64_t{64} << 20);
  EXPECT_EQ(ParseByteSize(" 2G ").value(), int64_t{2} << 30);
  EXPECT_EQ(ParseByteSize("3T").value(), int64_t{3} << 40);
  EXPECT_EQ(ParseByteSize("10B").value(), 10);
  // The largest sizes an int64_t holds, bytes and gigabytes; one more is refused below.
  EXPECT_EQ(ParseByteSize("9223372036854775807").value(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(ParseByteSize("8589934591G").value(), (int64_t{8589934591} << 30));
  // Sizes from 2^63 to 2^64 bytes fit a uint64_t but come back negative, so they are refused
  // like larger ones; and a bare "iB" names no unit (12iB is a typo of 12KiB or 12MiB, not 12).
  for (const char* bad :
       {"", "-1", "G", "12Q", "1.5G", "iB", "12iB", "99999999999999999999", "9000000000T",
        "9223372036854775808", "8589934592G", "9000000000G", "18446744073709551615"}) {
    absl::StatusOr<int64_t> r = ParseByteSize(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_NE(std::string(r.status().message()).find(std::string("'") + bad + "'"),
                std::string::npos)
          << r.status();
    }
  }
}

TEST(EnvTest, BooleansIntegersAndUnset) {
  constexpr char kName[] = "GEMVZ_JIT_ENV_TEST_VALUE";
  {
    ScopedEnv v(kName, std::nullopt);
    EXPECT_FALSE(GetEnv(kName).has_value());
    EXPECT_TRUE(GetEnvBool(kName, true));
    EXPECT_EQ(GetEnvInt64(kName, 7), 7);
    EXPECT_EQ(GetEnvBytes(kName, 9), 9);
  }
  {
    ScopedEnv v(kName, "");  // empty counts as unset
    EXPECT_FALSE(GetEnv(kName).has_value());
    EXPECT_FALSE(GetEnvBool(kName, false));
  }
  for (const char* yes : {"1", "true", "YES", "On"}) {
    ScopedEnv v(kName, yes);
    EXPECT_TRUE(GetEnvBool(kName, false)) << yes;
  }
  for (const char* no : {"0", "false", "No", "OFF"}) {
    ScopedEnv v(kName, no);
    EXPECT_FALSE(GetEnvBool(kName, true)) << no;
  }
  {
    ScopedEnv v(kName, "maybe");
    testing::internal::CaptureStderr();
    EXPECT_TRUE(GetEnvBool(kName, true));
    EXPECT_NE(testing::internal::GetCapturedStderr().find(kName), std::string::npos);
  }
  {
    ScopedEnv v(kName, "-42");
    EXPECT_EQ(GetEnvInt64(kName, 0), -42);
  }
  {
    ScopedEnv v(kName, "4x");
    testing::internal::CaptureStderr();
    EXPECT_EQ(GetEnvInt64(kName, 5), 5);
    EXPECT_NE(testing::internal::GetCapturedStderr().find("4x"), std::string::npos);
  }
  {
    ScopedEnv v(kName, "1G");
    EXPECT_EQ(GetEnvBytes(kName, 0), int64_t{1} << 30);
  }
  // A malformed value is read on every compile or call (GEMVZ_CACHE_MAX_BYTES after each
  // compile): it warns once per process, and again only for another value.
  for (const char* value : {"lots", "heaps"}) {
    ScopedEnv v(kName, value);
    testing::internal::CaptureStderr();
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(GetEnvBytes(kName, 9), 9);
      EXPECT_EQ(GetEnvInt64(kName, 7), 7);
      EXPECT_TRUE(GetEnvBool(kName, true));
    }
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(CountOccurrences(err, kName), 1) << value << ": " << err;
  }
}

// Values are read without the whitespace around them (a shell's quoting, a line of an env
// file), as they are meant, and without a warning.
TEST(EnvTest, WhitespaceAroundAValueIsIgnored) {
  constexpr char kName[] = "GEMVZ_JIT_ENV_TEST_SPACES";
  for (const char* yes : {" yes ", "\ton", "1\n", " \tTRUE \r\n"}) {
    ScopedEnv v(kName, yes);
    testing::internal::CaptureStderr();
    EXPECT_TRUE(GetEnvBool(kName, false)) << "'" << yes << "'";
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "") << "'" << yes << "'";
  }
  for (const char* no : {"\tOFF\n", " no", "0 ", "\n false\t"}) {
    ScopedEnv v(kName, no);
    testing::internal::CaptureStderr();
    EXPECT_FALSE(GetEnvBool(kName, true)) << "'" << no << "'";
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "") << "'" << no << "'";
  }
  {
    ScopedEnv v(kName, " -42\n");
    testing::internal::CaptureStderr();
    EXPECT_EQ(GetEnvInt64(kName, 0), -42);
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  }
  {
    ScopedEnv v(kName, "\t64M ");
    testing::internal::CaptureStderr();
    EXPECT_EQ(GetEnvBytes(kName, 0), int64_t{64} << 20);
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  }
}

TEST(EnvTest, HomeDirectory) {
  {
    ScopedEnv home("HOME", "/home/x");
    EXPECT_EQ(HomeDirectory(), "/home/x");
  }
  {
    ScopedEnv home("HOME", std::nullopt);
    // The password database's answer: an absolute path, or nothing.
    const std::string h = HomeDirectory();
    EXPECT_TRUE(h.empty() || h[0] == '/') << h;
  }
}

// An entry larger than sysconf's hint (1024 bytes on glibc: a long GECOS field, a directory
// service's entry) answers ERANGE; the buffer grows until it fits, up to 1 MiB, rather than the
// disk cache going off for want of a home directory.
TEST(EnvTest, HomeDirectoryOfAnEntryPastTheBufferHint) {
  ScopedEnv home("HOME", std::nullopt);
  for (const size_t need : {size_t{1} << 12, size_t{1} << 16, size_t{1} << 20}) {
    g_pw_min_buffer = need;
    const std::string h = HomeDirectory();
    g_pw_min_buffer = 0;
    EXPECT_EQ(h, "/home/long-entry") << "an entry of " << need << " bytes";
  }
  g_pw_min_buffer = (size_t{1} << 20) + 1;  // past the cap: no home, no endless growth
  const std::string h = HomeDirectory();
  g_pw_min_buffer = 0;
  EXPECT_EQ(h, "");
}

}  // namespace
}  // namespace gemvz::internal
