// Parent-death watchdog: a thread that needs no Python and no lock, and ends the
// process when its parent has been gone for a grace period.
//
// Why: a Triton Python-backend instance (the stub) notices that tritonserver died and
// exits by itself, but its exit path first takes the stub's IPC mutex. A call to the
// server that is in flight at that moment (a metric update: Metric.set/increment wait
// for the server's answer while holding that mutex, and Metric.set also holds the GIL)
// is never answered, so the stub never exits and keeps its memory and its cache
// attachment. This watchdog bounds that: it only checks getppid() (reparenting means the
// parent is gone) and calls _exit(), so nothing the stuck threads hold can block it.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace triton_rec {

// Starts the watchdog once per process (later calls return false and change nothing).
// The process exits with `exit_code` once getppid() has differed from the parent seen
// at the first call for `grace_seconds` (polled every `poll_ms`).
inline bool start_parent_watchdog(double grace_seconds, int exit_code, int poll_ms = 100) {
  static std::atomic<bool> started{false};
  if (started.exchange(true)) return false;
  const pid_t parent = getppid();
  std::thread([parent, grace_seconds, exit_code, poll_ms] {
    using clock = std::chrono::steady_clock;
    const auto grace = std::chrono::duration<double>(grace_seconds);
    bool orphaned = false;
    clock::time_point since{};
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(poll_ms));
      if (getppid() == parent) continue;
      if (!orphaned) {
        orphaned = true;
        since = clock::now();
      }
      // The stub's own exit path normally ends the process well within the grace period.
      if (clock::now() - since >= grace) _exit(exit_code);
    }
  }).detach();
  return true;
}

}  // namespace triton_rec
