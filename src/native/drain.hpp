// The drained stop (issue 24): what the launcher and every process of the server share
// while the server stops. A 64-byte file (its path in $TRITON_REC_DRAIN_FILE, made by the
// launcher: triton_rec/triton/drain.py) mapped by each of them:
//   [0, 8)   draining: 0 while serving; set once by the launcher when it is told to stop.
//            From then on every execute refuses its requests with UNAVAILABLE (HTTP 503,
//            gRPC UNAVAILABLE: retryable) before any work.
//   [8, 16)  in flight: executes in progress, all processes together. The launcher stops
//            tritonserver once this is 0 with draining set: every request that reached a
//            model before the stop has been answered.
// An execute adds 1 to in-flight *before* it reads draining (both sequentially
// consistent), and the launcher sets draining before it reads in-flight: either the
// execute sees the flag, or the launcher sees the execute.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace triton_rec {

constexpr size_t kDrainFileBytes = 64;
// The error message of a request refused because the server is stopping.
constexpr const char* kStoppingMessage =
    "the server is stopping: retry the request on another node";

struct DrainWords {
  std::atomic<uint64_t> draining;
  std::atomic<uint64_t> in_flight;
};
static_assert(sizeof(DrainWords) <= kDrainFileBytes, "drain file layout");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "lock-free across processes");

// The file at `path` mapped shared (it must exist and hold kDrainFileBytes); unmapped on
// destruction. Throws std::runtime_error naming the file when it cannot be mapped.
class DrainMap {
 public:
  explicit DrainMap(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error("drain file " + path + ": cannot open");
    void* p = mmap(nullptr, kDrainFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("drain file " + path + ": cannot map");
    words_ = static_cast<DrainWords*>(p);
  }
  ~DrainMap() { munmap(words_, kDrainFileBytes); }
  DrainMap(const DrainMap&) = delete;
  DrainMap& operator=(const DrainMap&) = delete;

  bool draining() const { return words_->draining.load() != 0; }
  void start_draining() { words_->draining.store(1); }
  uint64_t in_flight() const { return words_->in_flight.load(); }
  // An execute's start: counted, then whether it must refuse (the server is stopping).
  bool enter() {
    words_->in_flight.fetch_add(1);
    return words_->draining.load() != 0;
  }
  void leave() { words_->in_flight.fetch_sub(1); }

 private:
  DrainWords* words_ = nullptr;
};

}  // namespace triton_rec
