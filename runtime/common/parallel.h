// Running a fixed set of workers on threads, as every thread pool of the library and the CLI does.
#pragma once

#include <cstdint>
#include <functional>

namespace gemvz::internal {

// The most workers any pool of the library starts: more threads than that only fail to start or
// take memory (a packing worker's tables) for no speed.
inline constexpr int kMaxWorkers = 1024;

// How many workers to run for `work_items` items when the caller asked for `requested`: 0 or less
// means every hardware thread; never more than the items (at least 1) or kMaxWorkers.
int WorkerCount(int requested, int64_t work_items);

// Runs fn(0), ..., fn(workers - 1), each exactly once: fn(0) on the calling thread, the others on
// threads of their own. A worker whose thread cannot be started (std::system_error: out of memory,
// a limit on threads) runs on the calling thread after fn(0), so the work is done whatever the
// machine allows. An exception a worker throws (std::bad_alloc, say) is rethrown here once every
// worker has ended, the first in worker order: on its own thread it would end the process, and a
// pool unwound with threads still running would too.
void RunWorkers(int workers, const std::function<void(int worker)>& fn);

}  // namespace gemvz::internal
