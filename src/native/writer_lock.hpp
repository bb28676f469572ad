// The writer lock of a cache in device (or host array) memory that several processes
// share (triton_rec/cache/gpu_share.py, FileLock): `flock` on the cache's lock file, which
// excludes the other processes, plus a mutex, which excludes this process's other threads
// (`flock` does not: they share one open file). One object for both languages: Python's
// writers (FileLock) and the native ones (a device cache's MissCache) take the same lock.
//
// Two modes. Exclusive (lock/unlock): the only writer of the cache; Python's writers, the
// clear and repair, a write that heals sets a dead writer left half-written. Shared
// (lock_shared/unlock_shared): the native miss writes, which lock each set they write in
// the write kernel (array_cache_rules.hpp begin_write), so they run side by side across
// threads and processes; a set they find held past the wait is left to an exclusive retry.
//
// Writers first. Neither flock nor glibc's shared mutex keeps new shared holders out while
// a writer waits, and a process holds the file's lock shared while any of its threads
// does: shared holders that overlap (instances inserting misses under load) would keep a
// writer (an online update, a heal) waiting for as long as they overlap. So a writer, while
// it waits, holds a gate that every shared holder passes on its way in: a mutex for the
// threads of this object, and a write lock on byte 0 of the lock file (an open file
// description lock, fcntl F_OFD_SETLKW: independent of flock) for every other holder. The
// holders already in finish; the writer then gets the lock and opens the gate.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <system_error>
#include <tuple>

namespace triton_rec {

class WriterLock {
 public:
  // fd: the lock file, duplicated (the lock stays usable after the caller closes its own
  // descriptor); -1: threads of this process only (a cache no other process opens).
  explicit WriterLock(int fd) : fd_(fd < 0 ? -1 : ::dup(fd)) {
    if (fd >= 0 && fd_ < 0) throw std::system_error(errno, std::generic_category(), "dup");
    struct stat st{};
    if (fd_ < 0) {
      order_ = {0, 0, reinterpret_cast<uintptr_t>(this)};
    } else if (::fstat(fd_, &st) == 0) {
      order_ = {1, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
    } else {  // no order shared with the other processes: refuse rather than risk a cycle
      const int e = errno;
      ::close(fd_);
      throw std::system_error(e, std::generic_category(), "fstat of the cache's writer lock");
    }
  }
  ~WriterLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

  void lock() {
    const std::lock_guard<std::mutex> gate(gate_);  // closed until the lock is ours
    const FileGate file_gate(fd_);
    mutex_.lock();
    try {
      take_flock(LOCK_EX);
    } catch (...) {
      mutex_.unlock();
      throw;
    }
  }
  void unlock() {
    if (fd_ >= 0) ::flock(fd_, LOCK_UN);
    mutex_.unlock();
  }
  // The process holds the file's lock shared while any of its threads does: the first
  // takes it, the last gives it back (one open file: a second flock would convert it).
  void lock_shared() {
    {  // through the gates: a writer waiting holds them
      const std::lock_guard<std::mutex> gate(gate_);
      const FileGate file_gate(fd_);
    }
    mutex_.lock_shared();
    std::lock_guard<std::mutex> count(count_mutex_);
    if (shared_ == 0) {
      try {
        take_flock(LOCK_SH);
      } catch (...) {
        mutex_.unlock_shared();
        throw;
      }
    }
    ++shared_;
  }
  void unlock_shared() {
    {
      std::lock_guard<std::mutex> count(count_mutex_);
      if (--shared_ == 0 && fd_ >= 0) ::flock(fd_, LOCK_UN);
    }
    mutex_.unlock_shared();
  }

  // The order in which a thread takes several writer locks: the same in every process
  // (the lock file's device and inode), so two writers of the same caches never wait on
  // each other in a circle. A lock without a file (this process only): its address.
  using Order = std::tuple<int, uint64_t, uint64_t>;
  const Order& order() const { return order_; }

 private:
  // Byte 0 of the lock file, write-locked for its scope (an open file description lock:
  // per open file, as flock, so every WriterLock's descriptor is its own holder).
  class FileGate {
   public:
    explicit FileGate(int fd) : fd_(fd) {
      if (fd_ >= 0) set(F_WRLCK);
    }
    ~FileGate() {
      if (fd_ >= 0) set(F_UNLCK);
    }
    FileGate(const FileGate&) = delete;
    FileGate& operator=(const FileGate&) = delete;

   private:
    void set(short type) const {
      struct flock f{};
      f.l_type = type;
      f.l_whence = SEEK_SET;
      f.l_start = 0;
      f.l_len = 1;
      while (::fcntl(fd_, F_OFD_SETLKW, &f) != 0) {
        if (errno != EINTR) {
          if (type == F_UNLCK) return;  // (a destructor's: not on an open descriptor)
          throw std::system_error(errno, std::generic_category(),
                                  "fcntl lock on the cache's writer lock file");
        }
      }
    }
    const int fd_;
  };

  void take_flock(int how) {
    while (fd_ >= 0 && ::flock(fd_, how) != 0) {
      if (errno != EINTR) {
        throw std::system_error(errno, std::generic_category(), "flock on the cache's writer lock");
      }
    }
  }

  const int fd_;
  Order order_;
  std::mutex gate_;          // held by a writer of this object until it has the lock
  std::shared_mutex mutex_;  // this process's threads: shared or exclusive
  std::mutex count_mutex_;   // shared_, and the file's lock taken or given back with it
  int shared_ = 0;           // threads holding the lock shared
};

}  // namespace triton_rec
