// A per-thread front for a process-wide memo that a mutex guards, for the lookups every Gemv makes
// (its device's context and facts, its plan, its kernel, its stream's workspace). From several
// threads at once the shared lock of each memo was the largest part of a call: on the H200 host,
// 8 threads each on its own stream, one reader lock of an absl::Mutex took about 5 us a call where
// the lookup under it takes 0.2 (docs/BENCHMARKS.md, "The JIT"). A hit here reads only the calling
// thread's own map and one atomic counter that nothing but an invalidation writes.
//
// Use: FindOrAsk(key, ask), where ask() asks the shared memo. It is the protocol in one call:
// Find; on a miss, read generation() *before* asking, then Insert the answer with that generation,
// so that an answer that raced an Invalidate is not kept. Call Invalidate after the shared memo
// forgot or changed an answer: every thread's copies are dropped at its next Find. Answers that
// never change (a device's context) need no invalidation.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace gemvz::internal {

template <typename Key, typename Value>
class PerThreadCache {
 public:
  PerThreadCache() : id_(NextId()) {}
  PerThreadCache(const PerThreadCache&) = delete;
  PerThreadCache& operator=(const PerThreadCache&) = delete;

  // This thread's copy of the answer for `key`, else ask()'s, which is kept as a copy when it is
  // one: ask() returns a Value, or an absl::StatusOr or std::optional of one (an error or nullopt
  // is returned and not kept).
  template <typename Ask>
  auto FindOrAsk(const Key& key, Ask&& ask) -> decltype(ask()) {
    if (const Value* hit = Find(key)) return *hit;
    const uint64_t asked_at = generation();
    auto answer = ask();
    if (const Value* value = AnswerIn(answer)) Insert(key, *value, asked_at);
    return answer;
  }

  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // Drops every thread's copies (at each thread's next Find). Call it after the shared memo
  // changed, not before: a thread between the two could copy the old answer under the new
  // generation.
  void Invalidate() { generation_.fetch_add(1, std::memory_order_acq_rel); }

  // The calling thread's copy of the answer for `key`, or null. The pointer is valid until this
  // thread's next Insert into any cache of the same Key and Value types.
  const Value* Find(const Key& key) const {
    Slot* slot = LocalSlot(/*create=*/false);
    if (slot == nullptr || slot->generation != generation()) return nullptr;
    const auto it = slot->map.find(key);
    return it == slot->map.end() ? nullptr : &it->second;
  }

  // Keeps a copy of `value` for this thread, stamped with `generation`: a copy stamped before an
  // invalidation is never found (Find compares the stamp), and the next Insert drops it.
  // Does nothing on a thread whose copies were destroyed (below).
  void Insert(const Key& key, Value value, uint64_t generation) {
    Slot* const slot = LocalSlot(/*create=*/true);
    if (slot == nullptr) return;
    if (slot->generation != generation || slot->map.size() >= kMaxEntries) {
      slot->map.clear();
      slot->generation = generation;
    }
    slot->map.insert_or_assign(key, std::move(value));
  }

 private:
  struct Slot {
    uint64_t generation = 0;
    absl::flat_hash_map<Key, Value> map;
  };
  // A thread that sweeps shapes keeps at most this many answers a cache; past it, it starts over.
  static constexpr size_t kMaxEntries = 4096;
  // Caches of one type a thread has slots for: a destroyed cache's slot is never found again (ids
  // are not reused), so past this many they all go and the live ones refill.
  static constexpr size_t kMaxCaches = 64;

  // Cache id -> this thread's copies. A thread's thread_local objects are destroyed as it ends
  // (the main thread's before any static object), and a lookup may come later: from the
  // destructor of a DeviceMatrix that is static or thread_local, which enters its device's
  // context. Once the map is gone `dead` is set, and such a lookup asks the shared memo instead.
  struct Slots {
    absl::flat_hash_map<uint64_t, Slot> map;
    ~Slots() { Dead() = true; }
  };
  static bool& Dead() {
    thread_local bool dead = false;  // trivially destructible: never destroyed before use
    return dead;
  }

  // This thread's slot for this cache; null when it has none (and !create), or its copies were
  // destroyed.
  Slot* LocalSlot(bool create) const {
    if (Dead()) return nullptr;
    thread_local Slots slots;
    const auto it = slots.map.find(id_);
    if (it != slots.map.end()) return &it->second;
    if (!create) return nullptr;
    if (slots.map.size() >= kMaxCaches) slots.map.clear();
    return &slots.map[id_];
  }

  static const Value* AnswerIn(const Value& v) { return &v; }
  static const Value* AnswerIn(const absl::StatusOr<Value>& v) { return v.ok() ? &*v : nullptr; }
  static const Value* AnswerIn(const std::optional<Value>& v) { return v ? &*v : nullptr; }

  static uint64_t NextId() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
  }

  const uint64_t id_;
  // On a cache line of its own: read by every lookup of every thread, so nothing else that is
  // written may share it.
  alignas(64) std::atomic<uint64_t> generation_{0};
  char pad_[64 - sizeof(std::atomic<uint64_t>)] = {};
};

}  // namespace gemvz::internal
