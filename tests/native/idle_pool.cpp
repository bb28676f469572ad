// tests/unit/test_idle_pool.py: src/native/idle_pool.hpp on its own. Prints one line per
// check ("ok <what>" or "FAIL <what>") and exits 1 on any failure.
#include "idle_pool.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>

namespace tr = triton_rec;

namespace {

struct Buffers {
  int id = 0;
};

int failures = 0;
void check(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok" : "FAIL", what);
  if (!ok) ++failures;
}

// Waits until the pool holds none (the reaper dropped them), at most `seconds`.
bool dropped_within(double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (tr::IdlePool<Buffers>::instance().held() == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return tr::IdlePool<Buffers>::instance().held() == 0;
}

}  // namespace

int main() {
  auto& pool = tr::IdlePool<Buffers>::instance();
  const Buffers* first = nullptr;
  {
    const tr::IdleLease<Buffers> a;
    const tr::IdleLease<Buffers> b;
    first = a.get();
    check(a.get() != b.get(), "two leases at once hold two");
  }
  check(pool.held() == 2, "both given back are held");
  {
    const tr::IdleLease<Buffers> c;  // a was given back last (b, declared after it, ends first)
    check(c.get() == first, "a lease takes the one given back last");
  }
  check(dropped_within(10), "what no request used for a while is dropped");

  std::fflush(stdout);
  const pid_t child = fork();
  if (child == 0) {  // the parent's reaper is not here: the child's own drops
    {
      const tr::IdleLease<Buffers> d;
    }
    check(pool.held() == 1, "fork: the child's lease given back is held");
    check(dropped_within(10), "fork: the child's reaper drops it");
    std::fflush(stdout);
    _exit(failures == 0 ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "fork: the child's checks passed");
  return failures == 0 ? 0 : 1;
}
