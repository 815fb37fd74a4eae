#include "tests/support/random_weights.h"

#include <cmath>
#include <cstring>
#include <thread>

#include "gemvz/format.h"

namespace gemvz::testing {

uint64_t FreshSeed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

std::vector<uint16_t> RandomMatrix(int64_t rows, int64_t cols, Distribution dist, uint64_t seed) {
  std::vector<uint16_t> w(static_cast<size_t>(rows * cols));
  const double scale = 1.0 / std::sqrt(static_cast<double>(cols));
  const int threads = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + t + 1);
      std::normal_distribution<float> normal(0.f, static_cast<float>(scale));
      std::student_t_distribution<float> student(3.f);
      std::uniform_int_distribution<uint32_t> bits16(0, 0xFFFF);
      std::uniform_real_distribution<float> unit(0.f, 1.f);
      const int64_t b = rows * t / threads, e = rows * (t + 1) / threads;
      for (int64_t i = b * cols; i < e * cols; ++i) {
        uint16_t v = 0;
        switch (dist) {
          case Distribution::kNormal:
            v = FloatToBf16(normal(rng));
            break;
          case Distribution::kStudentT3:
            v = FloatToBf16(static_cast<float>(student(rng) * scale));
            break;
          case Distribution::kFullRange:
            do {
              v = static_cast<uint16_t>(bits16(rng));
            } while ((v & 0x7F80) == 0x7F80);
            break;
          case Distribution::kSparseZeros: {
            const float u = unit(rng);
            v = u < 0.025f ? 0x0000 : u < 0.05f ? 0x8000 : FloatToBf16(normal(rng));
            break;
          }
          case Distribution::kTiny: {
            if (unit(rng) < 0.01f) {
              // e7 from 0 to 40: subnormals and values down to ~2^-126
              const uint16_t e7 = static_cast<uint16_t>(unit(rng) * 40);
              v = static_cast<uint16_t>((bits16(rng) & 0x80FF) | (e7 << 8));
            } else {
              v = FloatToBf16(normal(rng));
            }
            break;
          }
        }
        w[static_cast<size_t>(i)] = v;
      }
    });
  }
  for (auto& th : pool) th.join();
  return w;
}

std::vector<uint16_t> RandomActivations(int64_t m, int64_t k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 0.5f);
  std::vector<uint16_t> x(static_cast<size_t>(m * k));
  for (auto& v : x) v = FloatToBf16(std::clamp(normal(rng), -1.f, 1.f));
  return x;
}

}  // namespace gemvz::testing
