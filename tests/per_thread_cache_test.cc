// The per-thread front of the launch path's memos: what one thread keeps, another does not see;
// an invalidation drops every thread's copies; an answer read before an invalidation is not kept.
#include "runtime/common/per_thread_cache.h"

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace gemvz::internal {
namespace {

using Cache = PerThreadCache<int, std::string>;

TEST(PerThreadCacheTest, FindsWhatThisThreadInserted) {
  Cache cache;
  EXPECT_EQ(cache.Find(1), nullptr);
  cache.Insert(1, "one", cache.generation());
  cache.Insert(2, "two", cache.generation());
  ASSERT_NE(cache.Find(1), nullptr);
  EXPECT_EQ(*cache.Find(1), "one");
  EXPECT_EQ(*cache.Find(2), "two");
  EXPECT_EQ(cache.Find(3), nullptr);
  cache.Insert(1, "uno", cache.generation());  // a newer answer replaces the copy
  EXPECT_EQ(*cache.Find(1), "uno");
}

TEST(PerThreadCacheTest, AnotherThreadHasCopiesOfItsOwn) {
  Cache cache;
  cache.Insert(7, "main", cache.generation());
  std::string seen = "unset";
  std::thread other([&] {
    const std::string* before = cache.Find(7);
    seen = before == nullptr ? "none" : *before;
    cache.Insert(7, "other", cache.generation());
  });
  other.join();
  EXPECT_EQ(seen, "none");
  ASSERT_NE(cache.Find(7), nullptr);
  EXPECT_EQ(*cache.Find(7), "main");  // the other thread's insert is its own
}

TEST(PerThreadCacheTest, InvalidateDropsEveryThreadsCopies) {
  Cache cache;
  cache.Insert(1, "main", cache.generation());
  std::vector<std::thread> threads;
  std::vector<int> found_after(4, -1);
  std::atomic<int> inserted{0};
  std::atomic<bool> invalidated{false};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      cache.Insert(1, "thread", cache.generation());
      inserted.fetch_add(1);
      while (!invalidated.load()) std::this_thread::yield();
      found_after[t] = cache.Find(1) != nullptr;
    });
  }
  while (inserted.load() < 4) std::this_thread::yield();
  const uint64_t before = cache.generation();
  cache.Invalidate();
  EXPECT_NE(cache.generation(), before);
  invalidated = true;
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(found_after[t], 0) << "thread " << t;
  EXPECT_EQ(cache.Find(1), nullptr);
  cache.Insert(1, "fresh", cache.generation());  // and the cache fills again
  EXPECT_EQ(*cache.Find(1), "fresh");
}

// The protocol's race: a thread read the generation, then asked the shared memo, and an
// invalidation came between; its answer may be the old one and must not be kept.
TEST(PerThreadCacheTest, AnAnswerThatRacedAnInvalidationIsNotKept) {
  Cache cache;
  const uint64_t read_before_asking = cache.generation();
  cache.Invalidate();
  cache.Insert(1, "stale", read_before_asking);
  EXPECT_EQ(cache.Find(1), nullptr);
  // Copies made under the old generation are gone too, not only the raced insert.
  const uint64_t g = cache.generation();
  cache.Insert(2, "two", g);
  cache.Invalidate();
  EXPECT_EQ(cache.Find(2), nullptr);
}

// FindOrAsk: the thread's copy when it has one; else the memo's answer, kept when it is one (a
// value, an ok StatusOr, an engaged optional), and not kept when the memo was invalidated while it
// was being asked (the generation is read before asking).
TEST(PerThreadCacheTest, FindOrAskKeepsAnswersButNotErrorsNorOnesThatRacedAnInvalidation) {
  Cache cache;
  int asked = 0;
  auto value = [&] {
    ++asked;
    return std::string("v");
  };
  EXPECT_EQ(cache.FindOrAsk(1, value), "v");
  EXPECT_EQ(cache.FindOrAsk(1, value), "v");
  EXPECT_EQ(asked, 1);

  auto error = [&]() -> absl::StatusOr<std::string> {
    ++asked;
    return absl::NotFoundError("no");
  };
  EXPECT_FALSE(cache.FindOrAsk(2, error).ok());
  EXPECT_FALSE(cache.FindOrAsk(2, error).ok());
  EXPECT_EQ(asked, 3) << "an error was kept";
  auto found = [&]() -> absl::StatusOr<std::string> {
    ++asked;
    return std::string("s");
  };
  EXPECT_EQ(*cache.FindOrAsk(2, found), "s");
  EXPECT_EQ(*cache.FindOrAsk(2, found), "s");
  EXPECT_EQ(asked, 4);

  auto none = [&]() -> std::optional<std::string> {
    ++asked;
    return std::nullopt;
  };
  EXPECT_FALSE(cache.FindOrAsk(3, none).has_value());
  EXPECT_FALSE(cache.FindOrAsk(3, none).has_value());
  EXPECT_EQ(asked, 6) << "a nullopt was kept";

  auto racing = [&] {
    ++asked;
    cache.Invalidate();  // another thread changed the memo while this one asked it
    return std::string("stale");
  };
  EXPECT_EQ(cache.FindOrAsk(4, racing), "stale");
  EXPECT_EQ(cache.FindOrAsk(4, value), "v") << "an answer that raced an invalidation was kept";
  EXPECT_EQ(asked, 8);
}

// After an invalidation the thread's next answer, for any key, must not bring back the copies
// from before it: they are dropped, not merely restamped.
TEST(PerThreadCacheTest, ANewAnswerDoesNotRestoreCopiesFromBeforeAnInvalidation) {
  Cache cache;
  cache.Insert(1, "old", cache.generation());
  cache.Invalidate();
  cache.Insert(2, "two", cache.generation());
  EXPECT_EQ(cache.Find(1), nullptr);
  ASSERT_NE(cache.Find(2), nullptr);
  EXPECT_EQ(*cache.Find(2), "two");
}

// A lookup after the thread's copies were destroyed (a static or thread_local object's destructor
// that calls into the library as the thread ends) finds nothing and keeps nothing, rather than use
// a destroyed map.
Cache* late_cache = nullptr;
std::atomic<int> late_lookups{0}, late_found{0};
struct LookupAtThreadExit {
  ~LookupAtThreadExit() {
    late_cache->Insert(9, "late", late_cache->generation());
    late_lookups.fetch_add(1);
    if (late_cache->Find(9) != nullptr) late_found.fetch_add(1);
  }
};

TEST(PerThreadCacheTest, ALookupAfterTheThreadsCopiesAreGoneFindsNothing) {
  Cache cache;
  late_cache = &cache;
  std::thread t([&] {
    // Made before the thread's first use of the cache, so destroyed after its copies.
    thread_local LookupAtThreadExit at_exit;
    (void)&at_exit;
    cache.Insert(1, "one", cache.generation());
    ASSERT_NE(cache.Find(1), nullptr);
  });
  t.join();
  EXPECT_EQ(late_lookups.load(), 1);
  EXPECT_EQ(late_found.load(), 0) << "a copy was kept in the thread's destroyed map";
  late_cache = nullptr;
}

TEST(PerThreadCacheTest, CachesOfOneTypeDoNotShareCopies) {
  Cache a, b;
  a.Insert(1, "a", a.generation());
  EXPECT_EQ(b.Find(1), nullptr);
  b.Insert(1, "b", b.generation());
  EXPECT_EQ(*a.Find(1), "a");
  EXPECT_EQ(*b.Find(1), "b");
  a.Invalidate();
  EXPECT_EQ(a.Find(1), nullptr);
  ASSERT_NE(b.Find(1), nullptr) << "invalidating one cache dropped another's copies";
  EXPECT_EQ(*b.Find(1), "b");
}

// A cache made where a destroyed one was (tests make and drop caches) starts empty: ids are not
// reused, and many dead caches do not keep a thread's slots growing.
TEST(PerThreadCacheTest, ANewCacheStartsEmptyAfterManyWereDestroyed) {
  for (int i = 0; i < 200; ++i) {
    auto cache = std::make_unique<Cache>();
    EXPECT_EQ(cache->Find(5), nullptr) << "cache " << i;
    cache->Insert(5, "x", cache->generation());
    EXPECT_EQ(*cache->Find(5), "x");
  }
}

TEST(PerThreadCacheTest, AThreadThatSweepsManyKeysStillFindsTheLatest) {
  Cache cache;
  for (int i = 0; i < 10000; ++i) {
    cache.Insert(i, std::to_string(i), cache.generation());
    ASSERT_NE(cache.Find(i), nullptr) << i;
    EXPECT_EQ(*cache.Find(i), std::to_string(i));
  }
}

}  // namespace
}  // namespace gemvz::internal
