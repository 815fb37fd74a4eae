// Session 35 study: does a GEMV-shaped read (each CTA streams its own contiguous row-block
// range, each warp its own share of it) read faster when the row blocks are padded apart?
// Block-major 12-bit row blocks are K/64 * 1536 bytes apart (98304 at K = 4096: 3 * 2^15).
// Variants per shape: ranges 0..32768 bytes apart, each warp streaming its own share; the same
// ranges read as one front per CTA; grid-stride over the same bytes on the same grid; the bench
// probe's form for these sizes (u2.t256.b8). Each in a CUDA graph of 64 launches rotating
// through copies above 512 MiB, checked first to read every word of its ranges; argv[1] replays
// per variant (default 20), in shuffled rounds; the median. BENCHMARKS.md, "Session 35".
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__device__ __forceinline__ uint4 LoadStream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void Fold(uint32_t acc, uint32_t* out) {
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicXor(out + (blockIdx.x & 1023), acc);
}

// Block b reads [b * stride, b * stride + range); warp w its w-th share, U loads of 512 bytes
// in flight per warp.
template <int U>
__global__ void RangeRead(const char* base, size_t stride, size_t range, uint32_t* out) {
  const int warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t share = range / warps;
  const char* p = base + blockIdx.x * stride + warp * share;
  uint32_t acc = 0;
  for (size_t off = lane * 16; off < share; off += 512 * U) {
    uint4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (off + j * 512 < share)
        v[j] = LoadStream(p + off + j * 512);
      else
        v[j] = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < U; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  Fold(acc, out);
}

// Block b reads its range as one front: warp w takes 512-byte chunks w, w + W, ...
template <int U>
__global__ void RangeFront(const char* base, size_t stride, size_t range, uint32_t* out) {
  const int warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const char* p = base + blockIdx.x * stride;
  const size_t step = size_t(warps) * 512;
  uint32_t acc = 0;
  for (size_t off = warp * 512 + lane * 16; off < range; off += step * U) {
    uint4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (off + j * step < range)
        v[j] = LoadStream(p + off + j * step);
      else
        v[j] = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < U; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  Fold(acc, out);
}

// Grid-stride over total bytes (contiguous), U loads in flight per thread.
template <int U>
__global__ void GridStride(const char* base, size_t total, uint32_t* out) {
  const size_t step = size_t(gridDim.x) * blockDim.x * 16;
  uint32_t acc = 0;
  for (size_t off = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) * 16; off < total;
       off += step * U) {
    uint4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (off + j * step < total)
        v[j] = LoadStream(base + off + j * step);
      else
        v[j] = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < U; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  Fold(acc, out);
}

// Reference: one thread per 16-byte chunk of the block ranges.
__global__ void RefRanges(const char* base, size_t stride, size_t range, int blocks,
                          uint32_t* out) {
  size_t chunks = range / 16 * blocks;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t b = i / (range / 16), c = i % (range / 16);
    uint4 v = *reinterpret_cast<const uint4*>(base + b * stride + c * 16);
    atomicXor(out + (i & 1023), v.x ^ v.y ^ v.z ^ v.w);
  }
}

__global__ void Fill(uint32_t* p, size_t words, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    p[i] = x ^ (x >> 13);
  }
}

struct Variant {
  std::string name;
  int kind;  // 0 range, 1 grid-stride, 2 range as one front
  int u, threads, grid;
  size_t stride, range, bytes;  // bytes: the footprint of one copy
  std::vector<char*> copies;
  cudaGraphExec_t exec = nullptr;
  std::vector<float> times;
};

static uint32_t* g_out;

static void Launch(const Variant& v, const char* base, cudaStream_t s) {
  if (v.kind == 0) {
    if (v.u == 2)
      RangeRead<2><<<v.grid, v.threads, 0, s>>>(base, v.stride, v.range, g_out);
    else
      RangeRead<4><<<v.grid, v.threads, 0, s>>>(base, v.stride, v.range, g_out);
  } else if (v.kind == 2) {
    if (v.u == 2)
      RangeFront<2><<<v.grid, v.threads, 0, s>>>(base, v.stride, v.range, g_out);
    else
      RangeFront<4><<<v.grid, v.threads, 0, s>>>(base, v.stride, v.range, g_out);
  } else {
    const size_t total = v.range;  // for grid-stride, range holds the total
    if (v.u == 2)
      GridStride<2><<<v.grid, v.threads, 0, s>>>(base, total, g_out);
    else
      GridStride<4><<<v.grid, v.threads, 0, s>>>(base, total, g_out);
  }
  CK(cudaGetLastError());
}

int main(int argc, char** argv) {
  int replays = argc > 1 ? std::atoi(argv[1]) : 20;
  CK(cudaMalloc(&g_out, 4096));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct Shape {
    const char* name;
    int blocks;
    size_t range;
    int warps;
  };
  std::vector<Shape> shapes = {{"8b_o 4096x4096", 256, 98304, 16},
                               {"8b_qkv 6144x4096", 384, 98304, 8},
                               {"pooler 4096x8192", 256, 196608, 16}};
  const size_t kRotate = size_t(512) << 20;
  for (const Shape& sh : shapes) {
    std::vector<Variant> vs;
    for (int u : {2, 4})
      for (size_t pad : {0, 128, 256, 512, 1024, 4096, 8192, 32768}) {
        Variant v;
        v.name = "range u" + std::to_string(u) + " pad " + std::to_string(pad);
        v.kind = 0;
        v.u = u;
        v.threads = 32 * sh.warps;
        v.grid = sh.blocks;
        v.stride = sh.range + pad;
        v.range = sh.range;
        v.bytes = v.stride * sh.blocks;
        vs.push_back(v);
      }
    for (int u : {2, 4})
      for (size_t pad : {0, 1024}) {
        Variant v;
        v.name = "front u" + std::to_string(u) + " pad " + std::to_string(pad);
        v.kind = 2;
        v.u = u;
        v.threads = 32 * sh.warps;
        v.grid = sh.blocks;
        v.stride = sh.range + pad;
        v.range = sh.range;
        v.bytes = v.stride * sh.blocks;
        vs.push_back(v);
      }
    for (int u : {2, 4}) {
      Variant v;
      v.name = "grid-stride same grid u" + std::to_string(u);
      v.kind = 1;
      v.u = u;
      v.threads = 32 * sh.warps;
      v.grid = sh.blocks;
      v.range = sh.range * sh.blocks;
      v.stride = 0;
      v.bytes = v.range;
      vs.push_back(v);
    }
    {
      Variant v;
      v.name = "probe u2.t256.b8";
      v.kind = 1;
      v.u = 2;
      v.threads = 256;
      v.grid = 1056;
      v.range = sh.range * sh.blocks;
      v.stride = 0;
      v.bytes = v.range;
      vs.push_back(v);
    }
    // Copies, checked, graphs.
    for (Variant& v : vs) {
      size_t n = std::min<size_t>(64, (kRotate + v.bytes - 1) / v.bytes);
      for (size_t i = 0; i < n; ++i) {
        char* p;
        CK(cudaMalloc(&p, v.bytes));
        Fill<<<1024, 256, 0, s>>>(reinterpret_cast<uint32_t*>(p), v.bytes / 4,
                                  uint32_t(i * 7919 + 1));
        CK(cudaGetLastError());
        v.copies.push_back(p);
      }
      // check: one launch on copy 0 against the reference
      uint32_t got = 0, want = 0, words[1024];
      CK(cudaMemsetAsync(g_out, 0, 4096, s));
      Launch(v, v.copies[0], s);
      CK(cudaMemcpyAsync(words, g_out, 4096, cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      for (uint32_t w : words) got ^= w;
      CK(cudaMemsetAsync(g_out, 0, 4096, s));
      if (v.kind != 1)
        RefRanges<<<1024, 256, 0, s>>>(v.copies[0], v.stride, v.range, sh.blocks, g_out);
      else
        RefRanges<<<1024, 256, 0, s>>>(v.copies[0], v.range, v.range, 1, g_out);
      CK(cudaGetLastError());
      CK(cudaMemcpyAsync(words, g_out, 4096, cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      for (uint32_t w : words) want ^= w;
      if (got != want) {
        std::fprintf(stderr, "%s %s: read check failed %08x != %08x\n", sh.name, v.name.c_str(),
                     got, want);
        return 1;
      }
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < 64; ++i) Launch(v, v.copies[i % v.copies.size()], s);
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&v.exec, g, 0));
      CK(cudaGraphDestroy(g));
      for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(v.exec, s));
    }
    CK(cudaStreamSynchronize(s));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::mt19937 rng(42);
    std::vector<int> order(vs.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
    for (int r = 0; r < replays; ++r) {
      std::shuffle(order.begin(), order.end(), rng);
      for (int i : order) {
        CK(cudaEventRecord(a, s));
        CK(cudaGraphLaunch(vs[i].exec, s));
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        vs[i].times.push_back(ms * 1000.f / 64);
      }
    }
    std::printf("%s: %d blocks x %zu bytes (%.1f MB), %d warps\n", sh.name, sh.blocks, sh.range,
                sh.blocks * sh.range / 1e6, sh.warps);
    float base = 0;
    for (Variant& v : vs) {
      std::sort(v.times.begin(), v.times.end());
      float med = v.times[v.times.size() / 2];
      if (base == 0) base = med;
      std::printf("  %-32s %8.3f us  (min %7.3f)  %+6.2f %% vs first  %.3f TB/s  copies %zu\n",
                  v.name.c_str(), med, v.times.front(), 100.f * (med / base - 1.f),
                  sh.blocks * sh.range / (med * 1e6), v.copies.size());
    }
    for (Variant& v : vs) {
      CK(cudaGraphExecDestroy(v.exec));
      for (char* p : v.copies) CK(cudaFree(p));
    }
    std::fflush(stdout);
  }
  return 0;
}
