// Temporary directories and whole-file reads and writes for the storage tests. Directories are
// removed when every test of the binary has passed and kept for inspection after a failure.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace gemvz::testing {

// A fresh directory under the test temp dir, named after `prefix`; "" if it cannot be made.
std::string MakeTempDir(const std::string& prefix);

// The entries of `dir` (no "." or ".."), sorted.
std::vector<std::string> ListDir(const std::string& dir);

// The whole file, or "" when it cannot be read.
std::string ReadAll(const std::string& path);

// Whether anything (a file, a directory, a dangling link) is at `path`.
bool Exists(const std::string& path);

// Writes `bytes` to `path`, failing the current test on error.
void WriteAll(const std::string& path, const std::string& bytes);

// Runs `open` on the FIFO at `fifo`; true when it returns by itself. A reader that blocks waiting
// for a writer is released after 10 s by opening the FIFO for writing, so that the test fails
// instead of hanging.
bool ReturnsWithoutAWriter(const std::string& fifo, const std::function<void()>& open);

}  // namespace gemvz::testing
