#include "runtime/channel.h"

#include <functional>

#include "kernels/copy.h"
#include "runtime/interrupt.h"

namespace pipeline_ext {
namespace {

using Clock = std::chrono::steady_clock;

bool looks_like_timeout(const std::string& message) {
  return message.find("imed out") != std::string::npos || message.find("imeout") != std::string::npos;
}

// Whether operations on `group` go in coalesced batches: CUDA tensors on a
// backend that coalesces (NCCL). Python-defined groups have no backend to ask.
bool coalesces(c10d::ProcessGroup& group, const at::Device& device) {
  if (!device.is_cuda()) return false;
  try {
    return group.getBackend(device.type())->supportsCoalescing();
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

// The works of one request. A batched operation has none until its batch is
// issued (end_batch): the coalesced batch's work then stands for all of it.
struct ProcessGroupChannel::Slot {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  bool issued = false;
};

namespace {

using Slot = ProcessGroupChannel::Slot;

// Requests over c10d works: completes when every work has, then `finish`
// turns the buffers into the result (unpack for receives).
//
// [Note: NCCL waits are device-side]
// On a CUDA channel (NCCL) the wait is device-side: Work::wait() with no
// timeout only makes the current stream wait for the communication stream, so
// the host goes on queueing work. Any timeout argument would make NCCL's
// WorkNCCL::wait spin the host until the GPU finished (a host-device
// synchronisation on every receive), so there a hang is caught by the process
// group's own timeout (NCCL's watchdog) instead of ours.
class WorkRequest : public Request {
 public:
  WorkRequest(std::shared_ptr<Slot> slot, std::function<std::vector<at::Tensor>()> finish, bool device_side)
      : slot_(std::move(slot)), finish_(std::move(finish)), device_side_(device_side) {}

  // Gloo marks send/recv works completed only inside wait(), so for Gloo this
  // stays false until waited; NCCL and in-process works report real progress.
  bool is_completed() override {
    if (!slot_->issued) return false;
    for (auto& w : slot_->works) {
      if (!w->isCompleted()) return false;
    }
    return true;
  }

 protected:
  std::vector<at::Tensor> do_wait(Millis timeout, const std::string& what) override {
    if (!slot_->issued) {
      throw ChannelError(what + ": waited on inside its batch; end the batch (end_batch) before waiting");
    }
    const auto start = Clock::now();
    for (auto& w : slot_->works) {
      if (device_side_) {
        w->wait();  // the current stream waits for the communication's: returns at once
      } else {
        wait_work(*w, timeout, start, what);
      }
    }
    auto result = finish_ ? finish_() : std::vector<at::Tensor>{};
    slot_->works.clear();  // drop the buffers the works hold as soon as we are done
    return result;
  }

 private:
  std::shared_ptr<Slot> slot_;
  std::function<std::vector<at::Tensor>()> finish_;
  bool device_side_;
};

// Ends the batch a scope began, also when the scope is left by an exception
// (then quietly: the first error is the one worth reporting).
class BatchScope {
 public:
  explicit BatchScope(ProcessGroupChannel& channel) : channel_(channel) { channel_.begin_batch(); }
  ~BatchScope() {
    if (open_) {
      try {
        channel_.end_batch();
      } catch (const std::exception&) {
      }
    }
  }
  void close() {
    open_ = false;
    channel_.end_batch();
  }

 private:
  ProcessGroupChannel& channel_;
  bool open_ = true;
};

// Gloo dislikes zero-byte messages: every buffer on the wire has at least one byte.
int64_t wire_bytes(int64_t nbytes) { return std::max<int64_t>(nbytes, 1); }

using Op = std::function<c10::intrusive_ptr<c10d::Work>(c10d::ProcessGroup&, int)>;

Op send_op(at::Tensor buffer, int tag) {
  return [buffer, tag](c10d::ProcessGroup& group, int peer) {
    std::vector<at::Tensor> one{buffer};
    return group.send(one, peer, tag);
  };
}

Op recv_op(at::Tensor buffer, int tag) {
  return [buffer, tag](c10d::ProcessGroup& group, int peer) {
    std::vector<at::Tensor> one{buffer};
    return group.recv(one, peer, tag);
  };
}

}  // namespace

void throw_timeout(const std::string& what, Millis timeout) {
  throw ChannelTimeout(what + ": timed out after " + std::to_string(timeout.count()) + " ms");
}

void throw_failure(const std::string& what, const std::string& reason) { throw ChannelError(what + ": " + reason); }

void wait_work(c10d::Work& work, Millis timeout, std::chrono::steady_clock::time_point start, const std::string& what) {
  // Gloo's own clock may fire a hair early; a timeout is a timeout-shaped
  // error near the deadline, anything else is the peer's failure.
  auto failed = [&](const std::string& text) {
    const bool late = timeout >= Millis(0) && (Clock::now() - start) * 10 >= timeout * 9;
    if (late && looks_like_timeout(text)) throw_timeout(what, timeout);
    throw_failure(what, text);
  };
  bool done = false;
  try {
    done = wait_interruptibly(work, timeout, start + timeout);
  } catch (const ChannelError&) {
    throw;
  } catch (const c10::Error& e) {  // what backends throw; a signal handler's exception passes through
    failed(e.what_without_backtrace());
  } catch (const std::runtime_error& e) {
    failed(e.what());
  }
  if (!done) throw_timeout(what, timeout);  // backends that report a timeout by returning false
}

std::vector<at::Tensor> Request::wait(int64_t timeout_ms, const std::string& what) {
  if (waited_.exchange(true)) {
    throw ChannelError(what + ": this request was already waited on (wait() hands its tensors over once)");
  }
  return do_wait(Millis(timeout_ms), what);
}

std::pair<std::shared_ptr<Request>, PackLayout> Channel::send(const std::vector<at::Tensor>& tensors, int peer, int tag,
                                                              const std::optional<PackLayout>& expected,
                                                              bool with_layout, const std::optional<at::Tensor>& out,
                                                              bool owned) {
  Outgoing msg = validate_send(tensors, peer, tag, expected, with_layout, out, owned);
  auto request = do_send(msg);
  return {std::move(request), std::move(msg.layout)};
}

Channel::Outgoing Channel::validate_send(const std::vector<at::Tensor>& tensors, int peer, int tag,
                                         const std::optional<PackLayout>& expected, bool with_layout,
                                         const std::optional<at::Tensor>& out, bool owned) const {
  check_peer(peer, tag);
  // Every transport reads the tensors' bytes directly (pack, or the one tensor as it is).
  for (size_t i = 0; i < tensors.size(); ++i) check_readable(tensors[i], "send", static_cast<int64_t>(i));
  Outgoing msg{tensors, peer, tag, layout_of(tensors), {}, with_layout, {}, out, owned};
  const PackLayout& layout = msg.layout;
  check_tensors(tensors, peer);
  if (expected && !(*expected == layout)) {
    throw ChannelError("send to rank " + std::to_string(peer) + " with tag " + std::to_string(tag) +
                       ": the tensors changed shape or dtype since the layout was exchanged (expected " +
                       expected->repr() + ", got " + layout.repr() +
                       "), while the step's inputs did not: a stage's output shapes must follow from its step's "
                       "inputs (their shapes, dtypes and plain non-tensor values), not from tensor data");
  }
  if (with_layout) {
    msg.layout_words = layout.encode();
    const auto& words = msg.layout_words;
    TORCH_CHECK_VALUE(static_cast<int64_t>(words.size()) <= kLayoutWords, "send to rank ", peer, " with tag ", tag,
                      ": the layout of ", layout.entries.size(), " tensors needs ", words.size(),
                      " words, more than the ", kLayoutWords, " a layout message holds; send fewer tensors");
  }
  if (tensors.size() == 1 && layout.nbytes > 0 && tensors[0].device() == device() && is_plain(tensors[0])) {
    msg.flat = tensors[0].reshape({-1}).view(at::kByte);
  }
  return msg;
}

at::Tensor Channel::Outgoing::pack() const {
  const bool reuse = out && !tensors.empty() && out->device() == tensors.front().device();
  return pipeline_ext::pack(tensors, reuse ? out : std::nullopt).first;
}

void Channel::check_peer(int peer, int tag) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size() && peer != rank(), type_name_, ": peer ", peer,
                    " is not another rank of this group (rank ", rank(), " of ", size(), ")");
  TORCH_CHECK_VALUE(tag >= 0 && tag < kLayoutTagBit, type_name_, ": tag ", tag, " is outside [0, 2^30)");
}

ProcessGroupChannel::ProcessGroupChannel(c10::intrusive_ptr<c10d::ProcessGroup> group, at::Device device)
    : Channel("ProcessGroupChannel"), group_(std::move(group)), device_(device) {
  TORCH_CHECK_VALUE(group_, "ProcessGroupChannel: the process group is None (is torch.distributed initialised?)");
  coalesce_ = coalesces(*group_, device_);
}

void ProcessGroupChannel::make_streams() {
  // On first use, not at construction: a channel for a CUDA device can be built (and inspected) anywhere.
  if (!device_.is_cuda() || send_stream_) return;
  send_stream_ = Stream::from_pool(device_);
  recv_stream_ = Stream::from_pool(device_);
}

void ProcessGroupChannel::set_route(int peer, c10::intrusive_ptr<c10d::ProcessGroup> send_group, int send_peer,
                                    c10::intrusive_ptr<c10d::ProcessGroup> recv_group, int recv_peer) {
  check_peer(peer, 0);
  for (auto* g : {&send_group, &recv_group}) {
    TORCH_CHECK_VALUE(*g, "ProcessGroupChannel.set_route: a group for peer ", peer, " is None");
  }
  TORCH_CHECK_VALUE(send_peer >= 0 && send_peer < send_group->getSize() && send_peer != send_group->getRank(),
                    "ProcessGroupChannel.set_route: send_peer ", send_peer, " is not another rank of its group");
  TORCH_CHECK_VALUE(recv_peer >= 0 && recv_peer < recv_group->getSize() && recv_peer != recv_group->getRank(),
                    "ProcessGroupChannel.set_route: recv_peer ", recv_peer, " is not another rank of its group");
  TORCH_CHECK_VALUE(coalesces(*send_group, device_) == coalesce_ && coalesces(*recv_group, device_) == coalesce_,
                    "ProcessGroupChannel.set_route: the groups for peer ", peer,
                    " must use the same backend as the channel's group");
  TORCH_CHECK(batch_depth_ == 0, "ProcessGroupChannel.set_route: not inside a batch");
  send_routes_[peer] = Route{std::move(send_group), send_peer};
  recv_routes_[peer] = Route{std::move(recv_group), recv_peer};
}

ProcessGroupChannel::Route ProcessGroupChannel::route(const std::unordered_map<int, Route>& routes, int peer) const {
  auto it = routes.find(peer);
  return it != routes.end() ? it->second : Route{group_, peer};
}

void ProcessGroupChannel::begin_batch() { ++batch_depth_; }

void ProcessGroupChannel::end_batch() {
  TORCH_CHECK(batch_depth_ > 0, "ProcessGroupChannel.end_batch: no batch is open");
  if (--batch_depth_ == 0) flush();
}

void ProcessGroupChannel::issue(const Route& to, const Op& op, const std::shared_ptr<Slot>& slot) {
  if (!coalesce_) {
    slot->works.push_back(op(*to.group, to.peer));
    slot->issued = true;
    return;
  }
  // One coalescing run per group at a time: torch's coalescing state is per
  // group but NCCL's group calls nest globally, so a run on another group
  // would only launch with the outer one.
  if (open_group_ != to.group.get()) {
    flush();
    to.group->startCoalescing(device_.type());
    open_group_ = to.group.get();
  }
  op(*to.group, to.peer);  // inside a coalescing run the batch's work (end_batch) stands for the operation
  open_slots_.push_back(slot);
  if (batch_depth_ == 0) flush();
}

void ProcessGroupChannel::flush() {
  if (open_group_ == nullptr) return;
  c10d::ProcessGroup* group = open_group_;
  auto slots = std::move(open_slots_);
  open_slots_.clear();
  open_group_ = nullptr;
  auto work = group->endCoalescing(device_.type());
  for (auto& slot : slots) {
    if (slot->issued) continue;  // two operations of one request (a layout and its data) in one run
    if (work) slot->works.push_back(work);
    slot->issued = true;
  }
}

at::Tensor ProcessGroupChannel::on_device(at::Tensor t) const {
  // Non-blocking only into a CUDA buffer: the copy is then ordered before the
  // send on the stream. Into host memory the backend reads it at once, so the
  // copy must have landed.
  return t.device() == device_ ? t : t.to(device_, /*non_blocking=*/device_.is_cuda());
}

std::shared_ptr<Request> ProcessGroupChannel::do_send(const Outgoing& msg) {
  const int peer = msg.peer, tag = msg.tag;
  const PackLayout& layout = msg.layout;
  // Packed on the current (compute) stream, where the tensors were produced,
  // into a buffer only this send holds, also for one contiguous tensor: the
  // backend reads the bytes later (Gloo once the peer posted its receive, NCCL
  // on its own stream), and a stage may write the tensor it returned again in
  // its next forward (a reused output buffer). The send owns its bytes when
  // it returns. Tensors the pipeline owns (gradients) go as they are when one
  // contiguous tensor already is its packed form.
  at::Tensor packed = msg.owned && msg.flat.defined() ? msg.flat : msg.pack();
  // The send stream waits for what the compute stream has queued so far (the
  // tensors' producers), and nothing queued later.
  make_streams();
  std::optional<StreamGuard> on_send_stream;
  if (send_stream_) {
    Event ready;
    ready.record(Stream::current(device_));
    ready.block(*send_stream_);
    on_send_stream.emplace(*send_stream_);
  }
  const Route to = route(send_routes_, peer);
  std::vector<at::Tensor> buffers;
  auto slot = std::make_shared<Slot>();
  BatchScope batch(*this);  // the layout and its data: one launch
  if (msg.with_layout) {
    // Pinned on a CUDA channel so the upload does not synchronise the host.
    at::Tensor words = at::zeros({kLayoutWords}, at::TensorOptions().dtype(at::kLong).pinned_memory(device_.is_cuda()));
    std::copy(msg.layout_words.begin(), msg.layout_words.end(), words.mutable_data_ptr<int64_t>());
    buffers.push_back(on_device(words));
    issue(to, send_op(buffers.back(), tag | kLayoutTagBit), slot);
  }
  at::Tensor data = layout.nbytes > 0 ? on_device(packed)
                                      : at::zeros({1}, at::TensorOptions().dtype(at::kByte).device(device_));
  buffers.push_back(data);
  issue(to, send_op(data, tag), slot);
  batch.close();
  if (send_stream_) {
    for (auto& b : buffers) record_stream(b, *send_stream_);
  }
  // The buffers must outlive the works: the finisher owns them.
  return std::make_shared<WorkRequest>(
      slot, [buffers]() { return std::vector<at::Tensor>{}; }, device_.is_cuda());
}

std::shared_ptr<Request> ProcessGroupChannel::post_recv(int peer, int tag, int64_t numel, at::ScalarType dtype,
                                                        std::function<std::vector<at::Tensor>(at::Tensor)> finish) {
  // Allocated and posted with the receive stream current: the communication
  // is fenced after that stream (idle), not after compute queued before it.
  make_streams();
  std::optional<StreamGuard> on_recv_stream;
  if (recv_stream_) on_recv_stream.emplace(*recv_stream_);
  at::Tensor buffer = at::empty({numel}, at::TensorOptions().dtype(dtype).device(device_));
  auto slot = std::make_shared<Slot>();
  issue(route(recv_routes_, peer), recv_op(buffer, tag), slot);
  const at::Device device = device_;
  return std::make_shared<WorkRequest>(
      slot,
      [buffer, device, finish = std::move(finish)]() {
        // The result is used on the stream that waited (the consumer's): keep
        // the memory from being reused before that stream is done with it.
        if (device.is_cuda()) record_stream(buffer, Stream::current(device));
        return finish(buffer);
      },
      device_.is_cuda());
}

std::shared_ptr<Request> ProcessGroupChannel::recv(const PackLayout& layout, int peer, int tag) {
  check_peer(peer, tag);
  layout.validate();
  return post_recv(peer, tag, wire_bytes(layout.nbytes), at::kByte,
                   [layout](at::Tensor buffer) { return unpack(buffer, layout); });
}

std::shared_ptr<Request> ProcessGroupChannel::recv_layout(int peer, int tag) {
  check_peer(peer, tag);
  // The layout is read on the host (it sizes the data buffer): a discovery
  // step synchronises here once per message; known steps never do.
  return post_recv(peer, tag | kLayoutTagBit, kLayoutWords, at::kLong,
                   [](at::Tensor buffer) { return std::vector<at::Tensor>{buffer}; });
}

}  // namespace pipeline_ext
