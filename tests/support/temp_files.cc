#include "tests/support/temp_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>

#include "gtest/gtest.h"

namespace gemvz::testing {
namespace {

std::vector<std::string>& TempDirs() {
  static std::vector<std::string>* dirs = new std::vector<std::string>();
  return *dirs;
}

class RemoveTempDirs : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!::testing::UnitTest::GetInstance()->Passed()) return;
    for (const std::string& d : TempDirs()) {
      ::nftw(
          d.c_str(),
          [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
          FTW_DEPTH | FTW_PHYS);
    }
  }
};

}  // namespace

std::string MakeTempDir(const std::string& prefix) {
  // Registered on first use: a static initializer in a static library may never run.
  static const auto* const kRemove = ::testing::AddGlobalTestEnvironment(new RemoveTempDirs());
  (void)kRemove;
  std::string tmpl = ::testing::TempDir() + "/" + prefix + ".XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) return "";
  TempDirs().push_back(buf.data());
  return std::string(buf.data());
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string ReadAll(const std::string& path) {
  std::string s;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return s;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) s.append(buf, n);
  std::fclose(f);
  return s;
}

bool Exists(const std::string& path) {
  struct stat info;
  return ::lstat(path.c_str(), &info) == 0;
}

void WriteAll(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size()) << path;
  std::fclose(f);
}

bool ReturnsWithoutAWriter(const std::string& fifo, const std::function<void()>& open) {
  auto done = std::async(std::launch::async, open);
  if (done.wait_for(std::chrono::seconds(10)) == std::future_status::ready) return true;
  const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
  if (fd >= 0) ::close(fd);
  done.wait();
  return false;
}

}  // namespace gemvz::testing
