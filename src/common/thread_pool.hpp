// A fixed pool of worker threads for encode/decode tasks, and a latch for a group of tasks.
#pragma once

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ciera {

// Counts outstanding tasks of one batch and keeps the first exception one of them threw.
class TaskGroup {
 public:
  void add(size_t n = 1) {
    std::lock_guard lock(mutex_);
    pending_ += n;
  }
  void finish(std::exception_ptr error = nullptr) {
    std::lock_guard lock(mutex_);
    if (error && !error_) error_ = error;
    if (--pending_ == 0) {
      finished_at_ = std::chrono::steady_clock::now();
      done_.notify_all();
    }
  }
  bool done() {
    std::lock_guard lock(mutex_);
    return pending_ == 0;
  }
  // Seconds from `since` to when the last task finished (0 if none ran).
  double seconds_since(std::chrono::steady_clock::time_point since) {
    std::lock_guard lock(mutex_);
    if (finished_at_ < since) return 0.0;
    return std::chrono::duration<double>(finished_at_ - since).count();
  }
  // Waits for every task; rethrows the first exception.
  void wait() {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    if (error_) {
      auto error = error_;
      error_ = nullptr;
      std::rethrow_exception(error);
    }
  }
  // Waits for every task and drops their exception: for a caller that already has a failure of
  // its own to report, and must only know that no task still reads its buffers.
  void settle() {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    error_ = nullptr;
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  size_t pending_ = 0;
  std::exception_ptr error_;
  std::chrono::steady_clock::time_point finished_at_{};
};

class ThreadPool {
 public:
  // With zero threads, tasks run inline in the submitting thread. With `niceness` above the
  // creating thread's nice value, the workers run at that lower priority (Linux; elsewhere
  // ignored), so that where cores are shared the threads they work beside, a transport's
  // progress above all, get a core as soon as they wake.
  explicit ThreadPool(unsigned threads, int niceness = 0) {
    for (unsigned i = 0; i < threads; ++i) {
      workers_.emplace_back([this, niceness] {
        lower_priority(niceness);
        work();
      });
    }
  }
  ~ThreadPool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    for (auto& t : workers_) t.join();
  }

  // Runs `task` as part of `group`; its exception, if any, goes to the group.
  void submit(TaskGroup& group, std::function<void()> task) {
    group.add();
    auto wrapped = [&group, task = std::move(task)] {
      try {
        task();
        group.finish();
      } catch (...) {
        group.finish(std::current_exception());
      }
    };
    if (workers_.empty()) {
      wrapped();
      return;
    }
    try {
      std::lock_guard lock(mutex_);
      queue_.push_back({&group, std::move(wrapped)});
    } catch (...) {
      group.finish();  // never queued (out of memory): the group must not wait for it
      throw;
    }
    ready_.notify_one();
  }

  // Waits for every task of `group`, first running on the calling thread those no worker has
  // started yet; rethrows the first exception. With workers of a lower priority than the caller,
  // a caller that would otherwise wait on a worker starved by busier threads does the work
  // itself; where the workers keep up, their tasks have started and the caller only waits.
  void wait(TaskGroup& group) {
    run_queued(group);
    group.wait();
  }

  // wait(), dropping the tasks' exception (TaskGroup::settle): for a caller with a failure of its
  // own to report, that must only know that no task of `group` still reads its buffers.
  void settle(TaskGroup& group) {
    run_queued(group);
    group.settle();
  }

  // Runs on the calling thread the tasks of `group` that no worker has started yet (their
  // exceptions go to the group, as on a worker); returns whether there were any.
  bool run_queued(TaskGroup& group) {
    bool ran = false;
    for (;;) {
      std::function<void()> task;
      {
        std::lock_guard lock(mutex_);
        auto it = std::find_if(queue_.begin(), queue_.end(),
                               [&](const Queued& q) { return q.group == &group; });
        if (it == queue_.end()) return ran;
        task = std::move(it->task);
        queue_.erase(it);
      }
      task();
      ran = true;
    }
  }

 private:
  static void lower_priority(int niceness) {
#if defined(__linux__)
    // Linux keeps a nice value per thread (inherited from the thread that made the pool); only
    // ever raised here, which needs no privilege. Best effort: workers that keep their priority
    // still compute the same results.
    const auto thread = static_cast<id_t>(syscall(SYS_gettid));
    errno = 0;
    const int current = getpriority(PRIO_PROCESS, thread);
    if (errno == 0 && niceness > current) setpriority(PRIO_PROCESS, thread, niceness);
#else
    (void)niceness;
#endif
  }

  void work() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front().task);
        queue_.pop_front();
      }
      task();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  struct Queued {
    TaskGroup* group;
    std::function<void()> task;
  };
  std::deque<Queued> queue_;
  std::vector<std::thread> workers_;
  bool stopping_ = false;
};

}  // namespace ciera
