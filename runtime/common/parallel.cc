#include "runtime/common/parallel.h"

#include <algorithm>
#include <exception>
#include <thread>
#include <vector>

namespace gemvz::internal {

int WorkerCount(int requested, int64_t work_items) {
  const int64_t want =
      requested > 0 ? requested : static_cast<int64_t>(std::thread::hardware_concurrency());
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({want, work_items, int64_t{kMaxWorkers}})));
}

void RunWorkers(int workers, const std::function<void(int worker)>& fn) {
  if (workers < 1) return;
  std::vector<std::exception_ptr> errors(workers);
  auto run = [&](int w) {
    try {
      fn(w);
    } catch (...) {
      errors[w] = std::current_exception();
    }
  };
  // Reserved first: once a thread runs, nothing here may throw.
  std::vector<std::thread> pool;
  std::vector<int> inline_workers;
  pool.reserve(workers - 1);
  inline_workers.reserve(workers - 1);
  for (int w = 1; w < workers; ++w) {
    try {
      pool.emplace_back(run, w);
    } catch (...) {  // std::system_error, or std::bad_alloc for the thread's state
      inline_workers.push_back(w);
    }
  }
  run(0);
  for (int w : inline_workers) run(w);
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace gemvz::internal
