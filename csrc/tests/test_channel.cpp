// LocalHub/LocalChannel from two std::threads: send/recv, bound, timeout, close.
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "runtime/local_channel.h"

using namespace pipeline_ext;

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "FAIL: " << what << "\n";
    ++failures;
  }
}

// Runs fn, expecting exception E whose message contains `needle`.
template <typename E, typename Fn>
void expect_throw(Fn&& fn, const std::string& needle, const std::string& what) {
  try {
    fn();
  } catch (const E& e) {
    check(std::string(e.what()).find(needle) != std::string::npos, what + ": message was '" + e.what() + "'");
    return;
  }
  check(false, what + ": no exception");
}

std::shared_ptr<LocalHub> cpu_hub(int n, int64_t capacity = 4096, int64_t send_timeout_ms = 300000) {
  return std::make_shared<LocalHub>(std::vector<at::Device>(n, at::kCPU), capacity, send_timeout_ms);
}

void test_send_recv_between_threads() {
  auto hub = cpu_hub(2);
  LocalChannel a(hub, 0), b(hub, 1);
  std::thread producer([&] {
    for (int i = 0; i < 100; ++i) a.send({at::full({3}, i), at::scalar_tensor(i)}, 1, i % 7);
  });
  bool ok = true;
  for (int i = 0; i < 100; ++i) {  // FIFO per (peer, tag)
    auto got = b.recv(0, i % 7)->wait(5000, "rank 1 recv " + std::to_string(i));
    ok = ok && got.size() == 2 && at::equal(got[0], at::full({3}, i)) && got[1].item<int64_t>() == i;
  }
  producer.join();
  check(ok, "100 messages arrive in order with their tensors");
  check(hub->pending() == 0, "nothing left in the hub");
}

void test_timeout_and_double_wait() {
  auto hub = cpu_hub(2);
  LocalChannel b(hub, 1);
  const auto start = std::chrono::steady_clock::now();
  expect_throw<ChannelTimeout>([&] { b.recv(0, 1)->wait(200, "rank 1 waiting on RECV_F"); },
                               "rank 1 waiting on RECV_F: timed out after 200 ms", "recv times out");
  check(std::chrono::steady_clock::now() - start < std::chrono::seconds(2), "timeout is prompt");
  LocalChannel(hub, 0).send({at::ones({1})}, 1, 2);
  auto req = b.recv(0, 2);
  check(req->is_completed(), "a queued message is complete");
  req->wait(100, "first");
  expect_throw<ChannelError>([&] { req->wait(100, "second"); }, "already waited", "second wait fails");
}

void test_bound_blocks_then_times_out() {
  auto hub = cpu_hub(2, /*capacity=*/2, /*send_timeout_ms=*/100);
  LocalChannel a(hub, 0), b(hub, 1);
  a.send({at::ones({1})}, 1, 0);
  a.send({at::ones({1})}, 1, 0);
  expect_throw<ChannelTimeout>([&] { a.send({at::ones({1})}, 1, 0); }, "per peer", "full bound times out");
  // With a longer send timeout the blocked send resumes once a receive makes room.
  auto slow = cpu_hub(2, /*capacity=*/1, /*send_timeout_ms=*/5000);
  LocalChannel sa(slow, 0), sb(slow, 1);
  sa.send({at::ones({1})}, 1, 0);
  std::thread drain([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    sb.recv(0, 0)->wait(1000, "drain");
  });
  sa.send({at::ones({1})}, 1, 0);
  drain.join();
  check(slow->pending() == 1, "blocked send delivered after room was made");
}

void test_close_wakes_waiters() {
  auto hub = cpu_hub(2);
  LocalChannel b(hub, 1);
  std::string message;
  std::thread waiter([&] {
    try {
      b.recv(0, 3)->wait(20000, "rank 1 waiting");
    } catch (const ChannelTimeout&) {
      message = "timeout";
    } catch (const ChannelError& e) {
      message = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  hub->close("worker 0 failed");
  waiter.join();
  check(message.find("worker 0 failed") != std::string::npos, "close reason reaches the waiter: " + message);
  check(std::chrono::steady_clock::now() - start < std::chrono::seconds(2), "close wakes at once");
  expect_throw<ChannelError>([&] { LocalChannel(hub, 0).send({}, 1, 0); }, "closed", "send after close fails");
}

}  // namespace

int main() {
  test_send_recv_between_threads();
  test_timeout_and_double_wait();
  test_bound_blocks_then_times_out();
  test_close_wakes_waiters();
  if (failures == 0) std::cout << "test_channel: all passed\n";
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
