// Random BF16 matrices of the kinds the format must survive (DESIGN.md: N(0, 1/K), Student-t(3),
// exact zeros, all-zero rows, tiny values), shared by the format, kernel and tool tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace gemvz::testing {

enum class Distribution {
  kNormal,        // N(0, 1/K)
  kStudentT3,     // Student-t with 3 degrees of freedom, / sqrt(K)
  kFullRange,     // random finite BF16 bit patterns: every exponent, subnormals, +-0
  kSparseZeros,   // N(0, 1/K) with 5 % exact zeros (half of them -0.0)
  kTiny,          // N(0, 1/K) with 1 % values far below the window (down to subnormals)
};

// A fresh [rows, cols] BF16 matrix (row-major raw bits). The seed comes from the caller so that a
// failure can be reproduced; tests take it from std::random_device and print it.
std::vector<uint16_t> RandomMatrix(int64_t rows, int64_t cols, Distribution dist, uint64_t seed);

// Random BF16 activations in [-1, 1) (N(0,1) clipped), [m, k].
std::vector<uint16_t> RandomActivations(int64_t m, int64_t k, uint64_t seed);

// A seed from std::random_device, for fresh inputs on every run.
uint64_t FreshSeed();

}  // namespace gemvz::testing
