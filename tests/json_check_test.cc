// CheckJsonText: the pass over JSON text that the file readers make before a DOM parse.
#include "runtime/common/json_check.h"

#include <string>

#include "gtest/gtest.h"

namespace gemvz::internal {
namespace {

std::string Nested(int depth, char open, char close) {
  return std::string(depth, open) + std::string(depth, close);
}

TEST(CheckJsonTextTest, AcceptsJsonWithinTheDepth) {
  EXPECT_TRUE(CheckJsonText(R"({"a": [1, {"b": "x"}], "c": null})", 3, true).ok());
  EXPECT_TRUE(CheckJsonText(Nested(64, '[', ']'), 64, true).ok());
  EXPECT_TRUE(CheckJsonText("  7 ", 0, true).ok());
  // Keys repeat freely across objects; only a repeat within one object is refused.
  EXPECT_TRUE(CheckJsonText(R"({"a": {"k": 1}, "b": {"k": 2}})", 4, true).ok());
}

TEST(CheckJsonTextTest, RefusesDeepNestingRepeatedKeysAndBadSyntax) {
  absl::Status st = CheckJsonText(Nested(65, '[', ']'), 64, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "objects and arrays nest more than 64 deep");
  // Deep enough to crash a recursive walk of a DOM; the check itself does not recurse.
  std::string deep;
  for (int i = 0; i < 200000; ++i) deep += "{\"a\":";
  deep += "1" + std::string(200000, '}');
  EXPECT_EQ(CheckJsonText(deep, 64, true).message(), "objects and arrays nest more than 64 deep");

  st = CheckJsonText(R"({"a": 1, "b": {"k": 1, "k": 2}})", 8, true);
  EXPECT_EQ(st.message(), "an object repeats the key 'k'");
  EXPECT_TRUE(CheckJsonText(R"({"k": 1, "k": 2})", 8, false).ok()) << "not asked to";
  st = CheckJsonText("{\"" + std::string(1000, 'k') + "\": 1, \"" + std::string(1000, 'k') +
                         "\": 2}",
                     8, true);
  EXPECT_LT(st.message().size(), 260u) << "a long key is quoted in part";

  for (const char* bad : {"", "{", "[1,]", "{\"a\" 1}", "1 2", "nul"}) {
    st = CheckJsonText(bad, 8, true);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("parse error"), std::string::npos) << bad << ": " << st;
  }
}

// A JSON string holds UTF-8 only: names from outside (file names are bytes) are checked before
// they are written, since the strict dump would throw.
TEST(JsonCanCarryTest, ValidUtf8OnlyWithoutThrowing) {
  for (const std::string ok : {std::string(""), std::string("model-00001-of-00002.safetensors"),
                               std::string("gr\xc3\xbc\xc3\x9f.safetensors"),
                               std::string("a\0b", 3), std::string("\xe2\x82\xac")}) {
    EXPECT_TRUE(JsonCanCarry(ok)) << ok;
  }
  for (const std::string bad : {std::string("\xff.safetensors"), std::string("a\xc3"),
                                std::string("\xe2\x82"), std::string("\xc0\xaf")}) {
    EXPECT_FALSE(JsonCanCarry(bad)) << bad;
  }
}

}  // namespace
}  // namespace gemvz::internal
