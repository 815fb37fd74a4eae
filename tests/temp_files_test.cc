// Tests of the registry of live temporary files that a signal handler empties: registered files
// are removed and released ones kept, the writers register theirs (and remove them themselves when
// they fail), a full registry degrades to registering nothing, and a handler racing with
// registrations never removes a path that was not registered whole.
#include "runtime/common/temp_files.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/common/file_util.h"
#include "tests/support/temp_files.h"

namespace gemvz::internal {
namespace {

using ::gemvz::testing::Exists;
using ::gemvz::testing::ListDir;
using ::gemvz::testing::MakeTempDir;
using ::gemvz::testing::ReadAll;
using ::gemvz::testing::WriteAll;


TEST(TempFilesTest, RegisteredFilesAreRemovedAndReleasedOnesKept) {
  const std::string dir = MakeTempDir("temp_files_test");
  for (const char* n : {"a", "b", "c", "d"}) WriteAll(dir + "/" + n, n);
  TempFileRegistration a(dir + "/a");
  TempFileRegistration b(dir + "/b");
  TempFileRegistration c(dir + "/c");
  ASSERT_TRUE(a.registered() && b.registered() && c.registered());
  b.Release();
  EXPECT_FALSE(b.registered());
  TempFileRegistration moved = std::move(c);
  EXPECT_FALSE(c.registered());  // NOLINT(bugprone-use-after-move): checking the move
  EXPECT_TRUE(moved.registered());
  EXPECT_GE(UnlinkTempFilesForSignal(), 2);
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"b", "d"}));
}

TEST(TempFilesTest, ARegisteredDirectoryGoesAfterTheRegisteredFilesInIt) {
  const std::string dir = MakeTempDir("temp_files_test");
  ASSERT_TRUE(CreateDirectories(dir + "/scratch").ok());
  ASSERT_TRUE(CreateDirectories(dir + "/kept").ok());
  // The directory registered before its files, as PlotSpeedups does: the order must not matter.
  TempFileRegistration d(dir + "/scratch");
  TempFileRegistration f(dir + "/scratch/f");
  TempFileRegistration k(dir + "/kept");  // not empty: rmdir leaves it and what is in it
  WriteAll(dir + "/scratch/f", "f");
  WriteAll(dir + "/kept/g", "g");
  UnlinkTempFilesForSignal();
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"kept"}));
  EXPECT_TRUE(Exists(dir + "/kept/g"));
}

TEST(TempFilesTest, AFullRegistryRegistersNothingMoreAndRecovers) {
  const std::string dir = MakeTempDir("temp_files_test");
  std::vector<TempFileRegistration> all;
  for (int i = 0; i < kMaxTempFiles; ++i) all.emplace_back(dir + "/f" + std::to_string(i));
  // No other registration lives in this binary now: every slot is ours.
  int got = 0;
  for (const auto& r : all) got += r.registered();
  EXPECT_EQ(got, kMaxTempFiles);
  WriteAll(dir + "/extra", "x");
  TempFileRegistration extra(dir + "/extra");
  EXPECT_FALSE(extra.registered());
  UnlinkTempFilesForSignal();
  EXPECT_TRUE(Exists(dir + "/extra"));
  all.pop_back();
  TempFileRegistration again(dir + "/extra");
  EXPECT_TRUE(again.registered());
  all.clear();
  UnlinkTempFilesForSignal();
  EXPECT_FALSE(Exists(dir + "/extra"));
  EXPECT_FALSE(TempFileRegistration(std::string(kMaxTempPathBytes, 'x')).registered());
}

TEST(TempFilesTest, TheWritersRegisterTheirTemporaryFilesWhileTheyLive) {
  const std::string dir = MakeTempDir("temp_files_test");
  // A safetensors file half written: its temporary file is registered...
  auto w = SafetensorsWriter::Create(dir + "/m.safetensors", 256);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->BeginTensor("t", "U8", {4}).ok());
  ASSERT_TRUE((*w)->Write("abcd", 4).ok());
  ASSERT_TRUE(Exists((*w)->temp_path()));
  // ... and so is AtomicWriteFileStreamed's, while its content is produced.
  std::string atomic_temp;
  const absl::Status st = AtomicWriteFileStreamed(dir + "/f", [&](const auto& sink) {
    for (const std::string& n : ListDir(dir)) {
      if (n.rfind("f.tmp.", 0) == 0) atomic_temp = dir + "/" + n;
    }
    EXPECT_FALSE(atomic_temp.empty());
    UnlinkTempFilesForSignal();  // what the handler would do now
    EXPECT_FALSE(Exists(atomic_temp));
    EXPECT_FALSE(Exists((*w)->temp_path()));
    return absl::CancelledError("interrupted");
  });
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(ListDir(dir).empty());

  // Once published, the final file is no temporary file: a signal leaves it alone.
  auto p = SafetensorsWriter::Create(dir + "/p.safetensors", 256);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE((*p)->AddTensor("t", "U8", {4}, "abcd", 4).ok());
  ASSERT_TRUE((*p)->Finish().ok());
  ASSERT_TRUE((*p)->Publish().ok());
  ASSERT_TRUE(AtomicWriteFile(dir + "/g", "g").ok());
  UnlinkTempFilesForSignal();
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"g", "p.safetensors"}));
}

// Without a signal, a writer whose producer fails removes its temporary file itself: the test
// above empties the registry first, which would hide a writer that left it behind.
TEST(TempFilesTest, AWriterWhoseProducerFailsRemovesItsTemporaryFileItself) {
  const std::string dir = MakeTempDir("temp_files_test");
  WriteAll(dir + "/old", "old");  // published before: a failed write must leave it as it was
  for (const std::string name : {"new", "old"}) {
    std::string temp;
    const absl::Status st = AtomicWriteFileStreamed(dir + "/" + name, [&](const auto& sink) {
      for (const std::string& n : ListDir(dir)) {
        if (n.rfind(name + ".tmp.", 0) == 0) temp = dir + "/" + n;
      }
      EXPECT_TRUE(sink("partial", 7).ok());
      return absl::DataLossError("the producer failed");
    });
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
    EXPECT_NE(st.message().find("the producer failed"), std::string::npos) << st;
    ASSERT_FALSE(temp.empty()) << name << ": no temporary file while producing";
    EXPECT_FALSE(Exists(temp)) << name;
    EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"old"})) << name;
    EXPECT_EQ(ReadAll(dir + "/old"), "old");
  }
}

TEST(TempFilesTest, AHandlerRacingWithRegistrationsRemovesOnlyWholePaths) {
  // Two threads register and release paths of one length that differ in every character while
  // this one empties the registry as a handler would. A torn read could splice the two into one
  // of the `keep` names; the seqlock must never let it unlink those.
  const std::string dir = MakeTempDir("temp_files_test");
  const std::string a(40, 'a'), b(40, 'b');
  const std::vector<std::string> keep = {dir + "/" + a.substr(0, 20) + b.substr(0, 20),
                                         dir + "/" + b.substr(0, 20) + a.substr(0, 20)};
  for (const std::string& k : keep) WriteAll(k, "keep");
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (const std::string* name : {&a, &b}) {
    threads.emplace_back([&, name] {
      while (!stop.load()) TempFileRegistration r(dir + "/" + *name);
    });
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  while (std::chrono::steady_clock::now() < end) UnlinkTempFilesForSignal();
  stop = true;
  for (auto& t : threads) t.join();
  for (const std::string& k : keep) EXPECT_TRUE(Exists(k)) << k;
}

}  // namespace
}  // namespace gemvz::internal
