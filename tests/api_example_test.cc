// The README's API example, compiled and run here so the README never shows code that does not
// build; a second test checks the README quotes this example verbatim.
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "runtime/cuda/driver.h"
#include "tests/support/gpu_util.h"

// BEGIN README EXAMPLE
#include <cstdio>
#include <vector>

#include "gemvz/format.h"
#include "gemvz/gemv.h"

// out[m, N] = x[m, K] * W^T with W packed losslessly to 12 bits per weight.
absl::Status Example(const std::vector<uint16_t>& w_bf16, int64_t n, int64_t k,
                     const uint16_t* x_dev, int64_t m, uint16_t* out_dev, CUstream_st* stream) {
  // Pack once on the host (lossless: gemvz::Unpack gives back the same bits) ...
  absl::StatusOr<gemvz::PackedMatrix> packed = gemvz::Pack(w_bf16.data(), n, k);
  if (!packed.ok()) return packed.status();
  std::printf("%.3f bits/weight, %.4f%% exceptions\n", packed->stats.bits_per_weight,
              100 * packed->stats.exception_rate);
  // ... upload once ...
  absl::StatusOr<gemvz::DeviceMatrix> w = gemvz::DeviceMatrix::Upload(*packed, /*device=*/0);
  if (!w.ok()) return w.status();
  // ... and multiply every decode step. The first call compiles its kernel (or loads it from
  // the disk cache); later calls only launch.
  return gemvz::Gemv(*w, x_dev, m, out_dev, stream);
}
// END README EXAMPLE

namespace gemvz {
namespace {

std::string ExampleText() {
  std::ifstream f(std::string(GEMVZ_SOURCE_DIR) + "/tests/api_example_test.cc");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  const std::string begin = "// BEGIN README EXAMPLE\n", end = "// END README EXAMPLE";
  const size_t b = s.find(begin), e = s.find(end);
  return s.substr(b + begin.size(), e - b - begin.size());
}

TEST(ApiExample, ReadmeQuotesItVerbatim) {
  std::ifstream f(std::string(GEMVZ_SOURCE_DIR) + "/README.md");
  ASSERT_TRUE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string example = ExampleText();
  ASSERT_GT(example.size(), 200u);
  EXPECT_NE(ss.str().find(example), std::string::npos)
      << "README.md must contain the example of tests/api_example_test.cc verbatim";
}

TEST(ApiExample, RunsOnTheGpu) {
  GEMVZ_REQUIRE_GPU();
  const int64_t n = 256, k = 1024, m = 4;
  std::vector<uint16_t> w(n * k), x(m * k);
  // Small multiples of 1/1600 and 1/4. (Computed in size_t, the "- 50" and "- 3" wrapped around
  // to about 1e16 and 5e18, and every row of W was a dense row; found by the mutants of
  // tools/mutants.tsv, docs/TESTING.md.)
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = FloatToBf16(static_cast<float>(static_cast<int>((i * 37) % 101) - 50) / 1600.f);
  }
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = FloatToBf16(static_cast<float>(static_cast<int>((i * 13) % 7) - 3) / 4.f);
  }
  testing::DeviceBuffer dx(x.size() * 2), dout(m * n * 2);
  dx.Upload(x.data(), x.size() * 2);
  dout.Fill16(0x7FC1);
  ASSERT_TRUE(Example(w, n, k, dx.as<uint16_t>(), m, dout.as<uint16_t>(), nullptr).ok());
  std::vector<uint16_t> got(m * n);
  dout.Download(got.data(), got.size() * 2);
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(w, x, m, n, k, &ref, &abs_sum);
  EXPECT_EQ(testing::CompareToReference(got, ref, abs_sum, m, n), "");
}

}  // namespace
}  // namespace gemvz
