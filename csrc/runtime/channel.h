// Channels move lists of tensors between pipeline ranks, matched by (peer, tag).
// A send returns at once with a Request; a receive is posted early and waited on
// right before its data is needed, so transfers overlap compute. Every wait has
// a timeout and names what it was waiting for when it fails.
//
// This header holds what every channel shares (errors, Request) and the
// multi-process channel over c10d::ProcessGroup; the in-process one is in
// local_channel.h.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/pack.h"

namespace pipeline_ext {

// A peer failed, a hub was closed, or a channel was misused. Python: ChannelError (RuntimeError).
class ChannelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wait ran past its timeout. Python: ChannelTimeout (TimeoutError).
class ChannelTimeout : public ChannelError {
 public:
  using ChannelError::ChannelError;
};

[[noreturn]] void throw_timeout(const std::string& what, std::chrono::milliseconds timeout);
[[noreturn]] void throw_failure(const std::string& what, const std::string& reason);

// Negative timeouts mean "wait forever".
using Millis = std::chrono::milliseconds;
constexpr Millis kWaitForever{-1};

// One operation in flight. wait() may be called once: it hands the received
// tensors over (or nothing, for a send), so a second call has nothing to give.
class Request {
 public:
  virtual ~Request() = default;
  virtual bool is_completed() = 0;
  // Blocks at most timeout_ms (< 0: no limit). Returns the received tensors
  // (views into the receive buffer) or an empty list for a send. Throws
  // ChannelTimeout / ChannelError with `what` in the message.
  std::vector<at::Tensor> wait(int64_t timeout_ms, const std::string& what);

 protected:
  virtual std::vector<at::Tensor> do_wait(Millis timeout, const std::string& what) = 0;

 private:
  std::atomic<bool> waited_{false};
};

// A request that is done when it is created (in-process sends on CPU).
class CompletedRequest : public Request {
 public:
  explicit CompletedRequest(std::vector<at::Tensor> result = {}) : result_(std::move(result)) {}
  bool is_completed() override { return true; }

 protected:
  std::vector<at::Tensor> do_wait(Millis, const std::string&) override { return std::move(result_); }

 private:
  std::vector<at::Tensor> result_;
};

// Multi-process channel over any c10d::ProcessGroup (Gloo on CPU, NCCL on GPU).
// Several tensors to one peer travel as ONE packed message; receives land in a
// buffer preallocated from the layout, and come back as views of it.
class ProcessGroupChannel {
 public:
  // Layouts travel in a fixed-size int64 message so the receiver can post its
  // buffer before knowing the layout; the tag bit keeps them apart from data.
  static constexpr int64_t kLayoutWords = 512;
  static constexpr int kLayoutTagBit = 1 << 30;

  ProcessGroupChannel(c10::intrusive_ptr<c10d::ProcessGroup> group, at::Device device);

  int rank() const { return group_->getRank(); }
  int size() const { return group_->getSize(); }
  const at::Device& device() const { return device_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }

  // Sends `tensors` to `peer` as one message. A single contiguous tensor on
  // the channel's device goes as itself (no copy); several are packed, into
  // `out` when given (a reused buffer, see pack()). If `expected` is given the
  // layout must equal it (checked before anything is sent). If `with_layout`,
  // the layout goes first under tag | kLayoutTagBit. Returns the request (it
  // keeps the buffers alive) and the layout that was sent. The channel keeps
  // no state between calls: which layouts are known is the caller's business.
  std::pair<std::shared_ptr<Request>, PackLayout> send(const std::vector<at::Tensor>& tensors, int peer, int tag,
                                                       const std::optional<PackLayout>& expected, bool with_layout,
                                                       const std::optional<at::Tensor>& out = std::nullopt);
  // Posts a receive of a message packed as `layout`; wait() unpacks it.
  std::shared_ptr<Request> recv(const PackLayout& layout, int peer, int tag);
  // Posts the receive of the layout sent with with_layout=true; wait() returns
  // the zero-padded 1-D int64 message, for PackLayout::from_tensor.
  std::shared_ptr<Request> recv_layout(int peer, int tag);

 private:
  void check_peer(int peer, int tag) const;
  at::Tensor on_device(at::Tensor t) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::Device device_;
};

}  // namespace pipeline_ext
