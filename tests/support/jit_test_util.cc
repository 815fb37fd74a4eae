// Helpers for the JIT tests (see jit_test_util.h).
#include "tests/support/jit_test_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace gemvz::jit_test {
namespace {

int RemoveOne(const char* path, const struct stat*, int, struct FTW*) {
  // Make read-only directories writable again so their contents can go.
  ::chmod(path, 0755);
  return ::remove(path);
}

constexpr char kParams[] = R"(// Stand-in for kernel_sources/gemv_params.cuh.
#pragma once
struct Z12Params {
  const unsigned short* x;
  const void* w;
  unsigned short* out;
  int M, N, K, S;
  unsigned int tl, th;
  int flags;
};
struct Bf16Params {
  const unsigned short* x;
  const unsigned short* w;
  unsigned short* out;
  int M, N, K, S;
  int flags;
};
)";

constexpr char kCommon[] = R"(// Stand-in for kernel_sources/common.cuh.
#pragma once
#include "gemv_params.cuh"
namespace standin {
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint4 a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
}  // namespace standin
)";

constexpr char kZ12[] = R"(// Stand-in for kernel_sources/z12_gemv.cuh.
#pragma once
#include "common.cuh"
template <int NW, int UG, int NB, int PIPE>
__global__ void __launch_bounds__((NW + 1) * 32) gemvz_z12_kernel(const Z12Params p) {
  static_assert(NW >= NB, "need at least NB warps for the final reduction");
  const uint4* w = static_cast<const uint4*>(p.w);
  float acc[NB][4] = {};
  for (int i = threadIdx.x; i < p.K; i += blockDim.x * UG) {
#pragma unroll
    for (int u = 0; u < UG; ++u) {
      uint4 a = w[i + u];
      a.x = standin::prmt(a.x, p.tl, p.th);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) standin::mma_bf16(acc[nb], a, a.y + nb, a.z + PIPE);
    }
  }
  float s = 0.f;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) s += acc[nb][0] + acc[nb][1] + acc[nb][2] + acc[nb][3];
  p.out[blockIdx.x * blockDim.x + threadIdx.x] = static_cast<unsigned short>(s);
}
)";

constexpr char kBf16[] = R"(// Stand-in for kernel_sources/bf16_gemv.cuh.
#pragma once
#include "common.cuh"
template <int NW, int UG, int NB, int PIPE>
__global__ void __launch_bounds__(NW * 32) gemvz_bf16_kernel(const Bf16Params p) {
  const uint4* w = reinterpret_cast<const uint4*>(p.w);
  float acc[NB][4] = {};
  for (int i = threadIdx.x; i < p.K; i += blockDim.x * UG) {
#pragma unroll
    for (int u = 0; u < UG; ++u) {
      const uint4 a = w[i + u];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) standin::mma_bf16(acc[nb], a, a.y + nb, a.z + PIPE);
    }
  }
  p.out[threadIdx.x] = static_cast<unsigned short>(acc[0][0] + acc[NB - 1][3]);
}
)";

}  // namespace

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern = std::string(base && *base ? base : "/tmp") + "/gemvz_jit_test.XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    std::perror("mkdtemp");
    std::abort();
  }
  path_ = buf.data();
}

TempDir::~TempDir() { ::nftw(path_.c_str(), RemoveOne, 16, FTW_DEPTH | FTW_PHYS); }

ScopedEnv::ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
  if (const char* old = std::getenv(name)) old_ = old;
  if (value) {
    ::setenv(name, value->c_str(), 1);
  } else {
    ::unsetenv(name);
  }
}

ScopedEnv::~ScopedEnv() {
  if (old_) {
    ::setenv(name_.c_str(), old_->c_str(), 1);
  } else {
    ::unsetenv(name_.c_str());
  }
}

std::vector<std::pair<std::string, std::string>> StandInKernelFiles(const std::string& salt) {
  std::string common = kCommon;
  if (!salt.empty()) common += "// salt: " + salt + "\n";
  return {{"gemv_params.cuh", kParams},
          {"common.cuh", common},
          {"z12_gemv.cuh", kZ12},
          {"bf16_gemv.cuh", kBf16}};
}

std::shared_ptr<const internal::SourceSet> StandInSources(const std::string& salt) {
  return internal::SourceSet::FromFiles(StandInKernelFiles(salt));
}

internal::KernelCacheOptions StandInOptions(const std::string& disk_directory) {
  internal::KernelCacheOptions o;
  o.sources = StandInSources();
  o.disk_directory = disk_directory;
  o.extra_options = std::vector<std::string>{};
  o.dump_directory = "";
  return o;
}

std::mt19937_64& Rng() {
  static std::mt19937_64* const rng = [] {
    uint64_t seed = (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
    if (const char* s = std::getenv("GEMVZ_TEST_SEED")) seed = std::strtoull(s, nullptr, 10);
    std::fprintf(stderr, "jit tests: random seed %llu (replay with GEMVZ_TEST_SEED)\n",
                 static_cast<unsigned long long>(seed));
    return new std::mt19937_64(seed);
  }();
  return *rng;
}

KernelConfig RandomValidConfig(std::mt19937_64& rng, int max_nw) {
  KernelConfig c;
  c.format = rng() % 2 == 0 ? WeightFormat::kZ12 : WeightFormat::kBf16;
  c.nb = 1 + static_cast<int>(rng() % 4);
  c.nw = c.nb + static_cast<int>(rng() % (max_nw - c.nb + 1));
  c.ug = 1 + static_cast<int>(rng() % 4);
  c.pipe = static_cast<int>(rng() % 4);
  c.splits = 1 + static_cast<int>(rng() % 4);
  return c;
}

int RunInChild(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    const int code = body();
    std::fflush(nullptr);
    ::_exit(code);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::vector<std::string> ListFiles(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    struct stat st;
    if (::stat((dir + "/" + name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) out.push_back(name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

int CountOccurrences(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t p = haystack.find(needle); p != std::string::npos;
       p = haystack.find(needle, p + needle.size())) {
    ++n;
  }
  return n;
}

void FlipByte(const std::string& path, int64_t offset, uint8_t mask) {
  const int fd = ::open(path.c_str(), O_RDWR);
  if (fd < 0) std::abort();
  uint8_t b = 0;
  if (::pread(fd, &b, 1, offset) != 1) std::abort();
  b ^= mask;
  if (::pwrite(fd, &b, 1, offset) != 1) std::abort();
  ::close(fd);
}

void TruncateFile(const std::string& path, int64_t size) {
  if (::truncate(path.c_str(), size) != 0) std::abort();
}

int64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

}  // namespace gemvz::jit_test
