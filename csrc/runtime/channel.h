// Channels move lists of tensors between pipeline ranks, matched by (peer, tag).
// A send returns at once with a Request; a receive is posted early and waited on
// right before its data is needed, so transfers overlap compute. Every wait has
// a timeout and names what it was waiting for when it fails.
//
// This header holds what every channel shares (errors, Request), the base of
// the multi-process channels (Channel) and its subclass over
// c10d::ProcessGroup; the shared-memory subclass is in shm_channel.h, the
// in-process channel (a different contract: tensors handed over, no layouts)
// in local_channel.h.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <functional>
#include <unordered_map>
#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/pack.h"
#include "runtime/stream.h"

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
// Waits for one c10d work begun at `start`, bounded by `timeout` (< 0: none)
// and ended early by a signal whose handler raises (runtime/interrupt.h); a
// failure or a timeout is a ChannelError / ChannelTimeout naming `what`.
void wait_work(c10d::Work& work, std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point start,
               const std::string& what);

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

// A channel between the processes of one group: several tensors to one peer
// travel as ONE packed message, matched by (peer, tag); a receive lands in a
// buffer preallocated from the message's layout and comes back as views of it.
// A receiver that does not know the layout yet posts recv_layout(): the sender
// then sends the layout first (with_layout) as a fixed-size message.
//
// Every subclass keeps this contract, so the executor (Python DistChannel) and
// its protocol (the layouts a step exchanges) work over any of them: a
// process group (ProcessGroupChannel), same-host shared memory (ShmChannel).
// What a send must satisfy is checked here, once, before a subclass sees it
// (send() validates, then calls do_send()).
class Channel {
 public:
  // Layouts travel in a fixed-size int64 message so the receiver can post its
  // buffer before knowing the layout; the tag bit keeps them apart from data,
  // so data tags lie in [0, kLayoutTagBit).
  static constexpr int64_t kLayoutWords = 512;
  static constexpr int kLayoutTagBit = 1 << 30;

  virtual ~Channel() = default;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where received tensors live; a message that is one plain tensor here can be sent as itself.
  virtual at::Device device() const = 0;

  // [Note: a send owns its bytes]
  // Sends `tensors` to `peer` as one message. The send owns its bytes when it
  // returns, whatever the caller writes afterwards (a stage may write the
  // tensor it returned again in its next forward): a subclass packs (copies)
  // them into `out` when given (a reused buffer, see pack()) or a fresh
  // buffer, or has copied them out of the caller's tensor before returning.
  // `owned` tensors are the pipeline's own (autograd's gradients: no one else
  // can write them): a single contiguous one on the channel's device is sent
  // as itself, without the copy. LocalChannel (local_channel.h) and the Python
  // StepContext protocol (runtime/channel.py) keep the same rule. If `expected` is
  // given the layout must equal it (checked before anything is sent). If
  // `with_layout`, the layout goes first under tag | kLayoutTagBit. Returns the
  // request (it keeps the buffers alive) and the layout that was sent. The
  // channel keeps no state about layouts between calls: which layouts are
  // known is the caller's business.
  std::pair<std::shared_ptr<Request>, PackLayout> send(const std::vector<at::Tensor>& tensors, int peer, int tag,
                                                       const std::optional<PackLayout>& expected, bool with_layout,
                                                       const std::optional<at::Tensor>& out = std::nullopt,
                                                       bool owned = false);
  // Posts a receive of a message packed as `layout`; wait() unpacks it.
  virtual std::shared_ptr<Request> recv(const PackLayout& layout, int peer, int tag) = 0;
  // Posts the receive of the layout sent with with_layout=true; wait() returns
  // the zero-padded 1-D int64 message of kLayoutWords, for PackLayout::from_tensor.
  virtual std::shared_ptr<Request> recv_layout(int peer, int tag) = 0;
  // This rank begins step `step` on the group (step numbers only go forward).
  // A channel that could hold a message no receive took (a failed step's
  // leftover) drops earlier steps' messages here.
  virtual void begin_step(int64_t step) = 0;

 protected:
  // `type_name` starts the channel's argument errors ("ShmChannel: peer 3 ...").
  explicit Channel(const char* type_name) : type_name_(type_name) {}

  // A send that passed validation, as do_send() gets it. References point
  // into send()'s arguments.
  struct Outgoing {
    const std::vector<at::Tensor>& tensors;
    int peer;
    int tag;
    PackLayout layout;
    // The encoded layout (at most kLayoutWords) when it goes first (with_layout); else empty.
    std::vector<int64_t> layout_words;
    bool with_layout;
    // The message's bytes as they are, flat uint8, when it is a single
    // contiguous tensor on device() (already its packed form); else undefined.
    at::Tensor flat;
    const std::optional<at::Tensor>& out;
    bool owned;

    // The tensors packed (copied) into `out` when it is on their device, else into a fresh buffer.
    at::Tensor pack() const;
  };

  // Everything a send must satisfy, checked before anything is sent: the peer
  // and tag (check_peer), the tensors (layout_of, check_tensors), the layout
  // against `expected`, the layout message's size; and whether the message
  // can go as itself (Outgoing::flat). Throws ValueError / ChannelError.
  Outgoing validate_send(const std::vector<at::Tensor>& tensors, int peer, int tag,
                         const std::optional<PackLayout>& expected, bool with_layout,
                         const std::optional<at::Tensor>& out, bool owned) const;
  // `peer` is another rank of the group and `tag` a data tag (below kLayoutTagBit).
  // Subclasses may add what their peers need (the base's checks first).
  virtual void check_peer(int peer, int tag) const;
  // What a subclass cannot send (e.g. tensors on another device); runs after
  // layout_of has checked the tensors share a device and are dense.
  virtual void check_tensors(const std::vector<at::Tensor>& /*tensors*/, int /*peer*/) const {}
  // Starts the validated send; the returned request completes when it has gone.
  virtual std::shared_ptr<Request> do_send(const Outgoing& msg) = 0;

 private:
  const char* type_name_;
};

// Channel over any c10d::ProcessGroup (Gloo on CPU, NCCL on GPU).
//
// On a CUDA device (NCCL) three things keep communication off the compute
// stream's critical path and out of each other's way:
// - Own streams. Sends are issued with the channel's send stream current
//   (fenced after the compute stream at the moment of the send, so they wait
//   for the tensor's producer and nothing later); receives with its receive
//   stream current, so a receive posted early never waits for compute queued
//   before it (NCCL fences its internal stream with the *current* stream).
//   record_stream keeps every buffer alive for the streams that use it.
// - Routes. With set_route(), the messages to a peer and from it go over two
//   different process groups (two 2-rank groups per pair of ranks, see
//   comm/groups.py). NCCL runs all P2P of one communicator on one
//   stream in issue order; a pipeline posts receives ahead, so a receive
//   waiting there would block a later send to the same peer, on both ranks at
//   once (a deadlock). One direction per communicator keeps each stream FIFO
//   in the order both ends issue.
// - Batches. [Note: always batch on NCCL]
//   On a backend that coalesces (NCCL), every operation is issued in
//   a coalesced batch (torch's batch_isend_irecv): a batch of one when alone,
//   or all operations between begin_batch() and end_batch() that go on the
//   same group consecutively, as ONE launch. Always batching keeps both ends on
//   the same NCCL communicator (torch picks a different one for batched and
//   single P2P). Only operations that are waited on together belong in one
//   batch: a batched receive completes when the whole batch has. A send with
//   its layout goes as one batch.
// One thread issues on a channel at a time (a process's executor).
class ProcessGroupChannel : public Channel {
 public:
  ProcessGroupChannel(c10::intrusive_ptr<c10d::ProcessGroup> group, at::Device device);

  int rank() const override { return group_->getRank(); }
  int size() const override { return group_->getSize(); }
  at::Device device() const override { return device_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }
  // True when operations are issued in coalesced batches (a CUDA device on a backend that coalesces).
  bool batches() const { return coalesce_; }

  // Messages to `peer` (a rank of the channel's group) go over `send_group` to
  // its rank `send_peer`; messages from `peer` come over `recv_group` from its
  // rank `recv_peer`. Without a route, the channel's own group carries both.
  void set_route(int peer, c10::intrusive_ptr<c10d::ProcessGroup> send_group, int send_peer,
                 c10::intrusive_ptr<c10d::ProcessGroup> recv_group, int recv_peer);

  std::shared_ptr<Request> recv(const PackLayout& layout, int peer, int tag) override;
  std::shared_ptr<Request> recv_layout(int peer, int tag) override;
  // Nothing to drop: Gloo delivers a send only into a receive posted with its
  // tag (a send nobody receives fails on its sender), NCCL matches by order.
  void begin_step(int64_t /*step*/) override {}

  // Operations until the matching end_batch() are coalesced (when batches());
  // their requests can be waited on only after end_batch(). Nests: the
  // outermost end_batch() issues. A no-op on backends that do not coalesce.
  void begin_batch();
  void end_batch();
  int batch_depth() const { return batch_depth_; }

  struct Route {
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    int peer;
  };
  struct Slot;  // the works of one request, known once its batch is issued

 protected:
  std::shared_ptr<Request> do_send(const Outgoing& msg) override;

 private:
  at::Tensor on_device(at::Tensor t) const;
  // The route to or from `peer` (the channel's own group when none was set).
  Route route(const std::unordered_map<int, Route>& routes, int peer) const;
  // Posts a receive into a fresh buffer of `numel` `dtype` on the receive
  // stream; wait() hands `finish(buffer)` over, marked for the waiting stream.
  std::shared_ptr<Request> post_recv(int peer, int tag, int64_t numel, at::ScalarType dtype,
                                     std::function<std::vector<at::Tensor>(at::Tensor)> finish);
  // Issues `op` on `group` (inside the open batch, or in a batch of its own)
  // and fills `slot` with its work once issued.
  void issue(const Route& to, const std::function<c10::intrusive_ptr<c10d::Work>(c10d::ProcessGroup&, int)>& op,
             const std::shared_ptr<Slot>& slot);
  void make_streams();
  void flush();  // end the coalescing run on the current group, handing its work to its slots

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::Device device_;
  bool coalesce_ = false;
  std::optional<Stream> send_stream_, recv_stream_;  // CUDA only
  std::unordered_map<int, Route> send_routes_, recv_routes_;
  int batch_depth_ = 0;
  c10d::ProcessGroup* open_group_ = nullptr;  // the group a coalescing run is open on
  std::vector<std::shared_ptr<Slot>> open_slots_;
};

}  // namespace pipeline_ext
