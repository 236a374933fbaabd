// LocalHub/LocalChannel from two std::threads: send/recv, bound, timeout, close.
// Channel (the multi-process base): the send validation every subclass gets,
// through a subclass that needs no process group.
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "runtime/channel.h"
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

// A Channel whose do_send records what validation handed it (and packs like
// a subclass would), so the base's checks run without a process group.
class RecordingChannel : public Channel {
 public:
  RecordingChannel(int rank, int size, at::Device device)
      : Channel("RecordingChannel"), rank_(rank), size_(size), device_(device) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  at::Device device() const override { return device_; }
  std::shared_ptr<Request> recv(const PackLayout&, int, int) override { return std::make_shared<CompletedRequest>(); }
  std::shared_ptr<Request> recv_layout(int, int) override { return std::make_shared<CompletedRequest>(); }
  void begin_step(int64_t) override {}

  int sends = 0;
  bool flat = false;          // the message went as itself
  size_t layout_words = 0;    // words of the layout sent first
  at::Tensor bytes;           // what would go on the wire

 protected:
  std::shared_ptr<Request> do_send(const Outgoing& msg) override {
    ++sends;
    flat = msg.flat.defined();
    layout_words = msg.layout_words.size();
    bytes = flat ? msg.flat : msg.pack();
    return std::make_shared<CompletedRequest>();
  }

 private:
  int rank_, size_;
  at::Device device_;
};

void test_base_send_validation() {
  RecordingChannel ch(0, 2, at::kCPU);
  const auto t = at::arange(6, at::kFloat);
  expect_throw<c10::ValueError>([&] { ch.send({t}, 0, 1, std::nullopt, false); },
                                "RecordingChannel: peer 0 is not another rank of this group (rank 0 of 2)",
                                "send to itself is refused");
  expect_throw<c10::ValueError>([&] { ch.send({t}, 1, Channel::kLayoutTagBit, std::nullopt, false); },
                                "RecordingChannel: tag 1073741824 is outside [0, 2^30)", "a layout tag is refused");
  expect_throw<ChannelError>([&] { ch.send({t}, 1, 3, layout_of({at::zeros({5})}), false); },
                             "send to rank 1 with tag 3: the tensors changed shape or dtype",
                             "a layout other than the expected one is refused");
  expect_throw<c10::ValueError>(
      [&] { ch.send(std::vector<at::Tensor>(200, at::zeros({1})), 1, 3, std::nullopt, true); },
      "needs 804 words, more than the 512 a layout message holds", "a layout larger than its message is refused");
  check(ch.sends == 0, "nothing reaches do_send when validation fails");

  auto [request, layout] = ch.send({t}, 1, 3, layout_of({t}), true);
  check(ch.sends == 1 && layout == layout_of({t}) && ch.layout_words == layout.encode().size(),
        "a valid send reaches do_send with its layout and layout words");
  check(ch.flat && ch.bytes.data_ptr() == t.data_ptr() && ch.bytes.numel() == 24,
        "one contiguous tensor on the device goes as itself (its bytes, not a copy)");

  ch.send({at::arange(6, at::kFloat).view({2, 3}).t()}, 1, 3, std::nullopt, false);
  check(!ch.flat, "a non-contiguous tensor is packed");
  ch.send({t, t}, 1, 3, std::nullopt, false);
  check(!ch.flat, "two tensors are packed");
  ch.send({at::zeros({0})}, 1, 3, std::nullopt, false);
  check(!ch.flat, "an empty message has no bytes to send as they are");
  RecordingChannel meta(0, 2, at::Device("meta"));
  meta.send({t}, 1, 3, std::nullopt, false);
  check(!meta.flat, "a tensor on another device than the channel's is packed");

  const auto out = at::empty({1024}, at::kByte);
  ch.send({t, t}, 1, 3, std::nullopt, false, out);
  check(ch.bytes.data_ptr() == out.data_ptr(), "a message is packed into `out` when it is on the tensors' device");
}

}  // namespace

int main() {
  test_send_recv_between_threads();
  test_timeout_and_double_wait();
  test_bound_blocks_then_times_out();
  test_close_wakes_waiters();
  test_base_send_validation();
  if (failures == 0) std::cout << "test_channel: all passed\n";
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
