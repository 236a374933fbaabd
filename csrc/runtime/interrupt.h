// Waits that a signal ends: Ctrl-C must reach a rank that is waiting for a
// peer within about 100 ms, not after the timeout.
//
// Why a watcher: a wait releases the GIL and blocks in C++ (a futex for shared
// memory, a condition variable inside Gloo), where Python's signal handler
// only sets a flag. Python's signal module writes each signal's number to a
// "wakeup fd" (signal.set_wakeup_fd); here that fd is a pipe read by one
// watcher thread per process. On every signal it bumps a counter and aborts
// the c10d works being waited on (Gloo's abort ends the wait without closing
// the connection, unlike a wait that times out); shared-memory waits look at
// the counter between their sleep slices. The waiting thread then runs the
// check the bindings installed (Python's handlers, on the main thread:
// KeyboardInterrupt for Ctrl-C), and waits on when no handler raised.
//
// [Note: a signal never ends a wait as a timeout] Gloo keeps an abort until
// the next wait() on the work consumes it (that wait returns false), so an
// abort can land before the wait it ends, or while the waiter runs the
// handlers. Each wait therefore counts the aborts the watcher sent it, under
// the watcher's lock, and takes a false return for a signal's only while one
// is outstanding; any other false return is the backend's timeout. Comparing
// signal counts is not enough: a signal already counted may still abort the
// next wait, which would then read as a timeout within milliseconds.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace pipeline_ext {

// The write end of the watcher's pipe, for signal.set_wakeup_fd (non-blocking,
// close-on-exec); starts the watcher thread on the first call.
int interrupt_fd();

// What a waiting thread runs once a signal came; throws to end the wait. The
// bindings install one that runs Python's signal handlers on the main thread.
void set_interrupt_check(std::function<void()> check);

// How many signals the watcher has seen: a wait compares it between slices.
uint64_t interrupt_count();

// Runs the installed check when the count moved past `seen` (then `seen` catches up).
void check_interrupts(uint64_t& seen);

// Waits on one c10d work until `deadline` (timeout < 0: no limit), ending early
// for a signal whose handler raises (see above). Returns the work's wait()
// result; throws what the work or the check throws.
bool wait_interruptibly(c10d::Work& work, std::chrono::milliseconds timeout,
                        std::chrono::steady_clock::time_point deadline);

}  // namespace pipeline_ext
