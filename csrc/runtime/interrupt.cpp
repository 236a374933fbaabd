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

std::atomic<uint64_t> signals_seen{0};
std::mutex mu;                       // guards `check` and `waiting`
std::function<void()> check;         // set_interrupt_check
std::set<c10d::Work*> waiting;       // works a thread is blocked on right now
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
    signals_seen.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    for (auto* work : waiting) {
      try {
        work->abort();  // Gloo: the wait returns false, the connection stays up
      } catch (const std::exception&) {
        // a backend without abort: its wait ends at its timeout, as before
      }
    }
  }
}

// Registers a work as waited on for the lifetime of the scope.
class Waiting {
 public:
  explicit Waiting(c10d::Work* work) : work_(work) {
    std::lock_guard<std::mutex> lock(mu);
    waiting.insert(work_);
  }
  ~Waiting() {
    std::lock_guard<std::mutex> lock(mu);
    waiting.erase(work_);
  }

 private:
  c10d::Work* work_;
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
  uint64_t seen = interrupt_count();
  while (true) {
    bool done = false;
    {
      Waiting registered(&work);
      if (interrupt_count() == seen) {  // a signal that came before the registration would abort nothing
        auto left = std::chrono::milliseconds(-1);  // no limit: Gloo then waits its own timeout
        if (timeout >= std::chrono::milliseconds(0)) {
          left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
          left = std::max(left, std::chrono::milliseconds(1));  // 0 would mean "no timeout" to c10d
        }
        done = work.wait(left);
      }
    }
    if (done) return true;
    if (interrupt_count() == seen) return false;  // a backend that says "timed out" by returning false
    check_interrupts(seen);                       // raises when a handler does (Ctrl-C)
  }
}

}  // namespace pipeline_ext
