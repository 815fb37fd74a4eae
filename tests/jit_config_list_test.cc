// Warm-up configuration lists: comments and blank lines are skipped, every error names its line,
// and kernels differing only in the split count are compiled once.
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "runtime/jit/config_list.h"
#include "tests/support/jit_test_util.h"

namespace gemvz::internal {
namespace {

TEST(ConfigListTest, ParsesLinesCommentsAndBlanks) {
  std::vector<KernelConfig> want;
  std::string text = "# serving configurations\n\n";
  for (int i = 0; i < 6; ++i) {
    const KernelConfig c = jit_test::RandomValidConfig(jit_test::Rng());
    want.push_back(c);
    absl::StrAppend(&text, i % 2 ? "  " : "", c.ToString(), i % 3 == 0 ? "   # why\n" : "\n");
  }
  text += "   \n# the end";  // no final newline
  absl::StatusOr<std::vector<KernelConfig>> got = ParseConfigList(text, "f.txt");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, want);
}

// warm-up's --configs and tune's --space read lines alike: '#' starts a comment anywhere.
TEST(ConfigListTest, OneLineRuleForEveryList) {
  EXPECT_EQ(ConfigLineText("  z12.nw8.ug2.nb1.pipe3.s1   # the 8b qkv kernel"),
            "z12.nw8.ug2.nb1.pipe3.s1");
  EXPECT_EQ(ConfigLineText("z12.nw8.ug2.nb1.pipe3\r"), "z12.nw8.ug2.nb1.pipe3");
  EXPECT_EQ(ConfigLineText("   # all comment"), "");
  EXPECT_EQ(ConfigLineText(" \t "), "");
}

// A file some editors saved with a UTF-8 byte order mark: skipped at the start (the first line
// failed to parse), and only there.
TEST(ConfigListTest, SkipsAByteOrderMarkAtTheStart) {
  const std::string bom = "\xEF\xBB\xBF";
  absl::StatusOr<std::vector<KernelConfig>> got =
      ParseConfigList(bom + "z12.nw8.ug2.nb1.pipe3.s1\nbf16.nw4.ug2.nb1.pipe3\n", "bom.txt");
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 2u);
  EXPECT_EQ((*got)[0].ToString(), "z12.nw8.ug2.nb1.pipe3.s1");
  got = ParseConfigList(bom + "# a comment first\n" + bom + "z12.nw8.ug2.nb1.pipe3\n", "bom.txt");
  ASSERT_FALSE(got.ok());
  EXPECT_NE(std::string(got.status().message()).find("bom.txt:2:"), std::string::npos)
      << got.status();
  EXPECT_EQ(WithoutUtf8Bom(bom + "x"), "x");
  EXPECT_EQ(WithoutUtf8Bom("x" + bom), "x" + bom);
  EXPECT_EQ(WithoutUtf8Bom("\xEF\xBB"), "\xEF\xBB");
}

TEST(ConfigListTest, ErrorsNameFileAndLine) {
  const int bad_line = 3 + static_cast<int>(jit_test::Rng()() % 5);
  std::string text;
  for (int line = 1; line < bad_line; ++line)
    text += line % 2 ? "# c\n" : "z12.nw8.ug2.nb2.pipe3\n";
  text += "z12.nw2.ug2.nb4.pipe3\nbf16.nw8.ug2.nb2.pipe3\n";
  absl::StatusOr<std::vector<KernelConfig>> got = ParseConfigList(text, "serving.txt");
  ASSERT_FALSE(got.ok());
  const std::string msg(got.status().message());
  EXPECT_NE(msg.find(absl::StrCat("serving.txt:", bad_line, ":")), std::string::npos) << msg;
  EXPECT_NE(msg.find("NW >= NB"), std::string::npos) << msg;

  absl::StatusOr<std::vector<KernelConfig>> typo = ParseConfigList("\nz13.nw8\n", "t.txt");
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(std::string(typo.status().message()).find("t.txt:2:"), std::string::npos);
}

}  // namespace
}  // namespace gemvz::internal
