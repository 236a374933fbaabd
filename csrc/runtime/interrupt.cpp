#include "runtime/interrupt.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

namespace pipeline_ext {
namespace {

// One wait on a c10d work, registered with the watcher for the wait's whole
// length. `aborts` counts the aborts the watcher sent it that no wait() has
// consumed yet: Gloo remembers an abort until the next wait() on the work
// returns false for it, so an abort sent while the waiter ran the handlers (or
// just before its wait began) still ends one later wait(). A false return is a
// signal's only while such an abort is outstanding; otherwise it is the
// backend's timeout.
struct Waiter {
  c10d::Work* work;
  int aborts = 0;  // guarded by `mu`
};

std::atomic<uint64_t> signals_seen{0};
std::mutex mu;                       // guards `check`, `waiting` and every Waiter's `aborts`
std::function<void()> check;         // set_interrupt_check
std::set<Waiter*> waiting;           // waits blocked on a work right now
int write_end = -1;
std::once_flag started;

void watch(int read_end) {
  // Signals go to the other threads: this one only reads what Python's handler wrote.
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  uint8_t bytes[64];
  while (true) {
    pollfd fd{read_end, POLLIN, 0};
    if (poll(&fd, 1, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    const ssize_t n = read(read_end, bytes, sizeof(bytes));
    if (n <= 0) {
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      return;
    }
    std::lock_guard<std::mutex> lock(mu);
    signals_seen.fetch_add(1);
    for (auto* waiter : waiting) {
      try {
        waiter->work->abort();  // Gloo: the next wait() returns false, the connection stays up
        ++waiter->aborts;
      } catch (const std::exception&) {
        // a backend without abort: its wait ends at its timeout, as before
      }
    }
  }
}

// Registers a wait with the watcher for the lifetime of the scope.
class Registered {
 public:
  explicit Registered(c10d::Work* work) : waiter_{work} {
    std::lock_guard<std::mutex> lock(mu);
    waiting.insert(&waiter_);
  }
  ~Registered() {
    std::lock_guard<std::mutex> lock(mu);
    waiting.erase(&waiter_);
  }

  // True (and one abort fewer outstanding) when the watcher aborted this wait since the last call.
  bool take_abort() {
    std::lock_guard<std::mutex> lock(mu);
    if (waiter_.aborts == 0) return false;
    --waiter_.aborts;
    return true;
  }

 private:
  Waiter waiter_;
};

}  // namespace

int interrupt_fd() {
  std::call_once(started, [] {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("interrupt_fd: pipe: ") + std::strerror(errno));
    fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK);  // signal.set_wakeup_fd requires it
    write_end = fds[1];
    std::thread(watch, fds[0]).detach();
  });
  return write_end;
}

void set_interrupt_check(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu);
  check = std::move(fn);
}

uint64_t interrupt_count() { return signals_seen.load(); }

void check_interrupts(uint64_t& seen) {
  const uint64_t now = signals_seen.load();
  if (now == seen) return;
  seen = now;
  std::function<void()> fn;
  {
    std::lock_guard<std::mutex> lock(mu);
    fn = check;
  }
  if (fn) fn();
}

bool wait_interruptibly(c10d::Work& work, std::chrono::milliseconds timeout,
                        std::chrono::steady_clock::time_point deadline) {
  // `seen` is read before the registration: a signal in between aborts nothing, but moves the count, so the
  // first check below runs its handlers instead of leaving them until the wait ends.
  uint64_t seen = interrupt_count();
  Registered registered(&work);
  while (true) {
    check_interrupts(seen);  // raises when a handler does (Ctrl-C)
    auto left = std::chrono::milliseconds(-1);  // no limit: Gloo then waits its own timeout
    if (timeout >= std::chrono::milliseconds(0)) {
      left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      left = std::max(left, std::chrono::milliseconds(1));  // 0 would mean "no timeout" to c10d
    }
    if (work.wait(left)) return true;
    if (!registered.take_abort()) return false;  // not a signal's: a backend that says "timed out" with false
  }
}

}  // namespace pipeline_ext
