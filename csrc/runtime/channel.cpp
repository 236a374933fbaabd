#include "runtime/channel.h"

#include <functional>

#include "kernels/copy.h"

namespace pipeline_ext {
namespace {

using Clock = std::chrono::steady_clock;

// Time left until `deadline` (kWaitForever stays forever; never below 1 ms so
// a c10d wait still polls once rather than meaning "no timeout").
Millis remaining(Clock::time_point deadline, Millis total) {
  if (total < Millis(0)) return kWaitForever;
  auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
  return std::max(left, Millis(1));
}

bool looks_like_timeout(const std::string& message) {
  return message.find("imed out") != std::string::npos || message.find("imeout") != std::string::npos;
}

// Requests over c10d works: completes when every work has, then `finish`
// turns the buffers into the result (unpack for receives).
//
// On a CUDA channel (NCCL) the wait is device-side: Work::wait() with no
// timeout only makes the current stream wait for the communication stream, so
// the host goes on queueing work. Any timeout argument would make NCCL's
// WorkNCCL::wait spin the host until the GPU finished (a host-device
// synchronisation on every receive), so there a hang is caught by the process
// group's own timeout (NCCL's watchdog) instead of ours.
class WorkRequest : public Request {
 public:
  WorkRequest(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::function<std::vector<at::Tensor>()> finish,
              bool device_side)
      : works_(std::move(works)), finish_(std::move(finish)), device_side_(device_side) {}

  // Gloo marks send/recv works completed only inside wait(), so for Gloo this
  // stays false until waited; NCCL and in-process works report real progress.
  bool is_completed() override {
    for (auto& w : works_) {
      if (!w->isCompleted()) return false;
    }
    return true;
  }

 protected:
  std::vector<at::Tensor> do_wait(Millis timeout, const std::string& what) override {
    const auto start = Clock::now();
    const auto deadline = start + timeout;
    for (auto& w : works_) {
      bool done = false;
      try {
        done = device_side_ ? w->wait() : w->wait(remaining(deadline, timeout));
      } catch (const std::exception& e) {
        // Gloo's own clock may fire a hair early; a timeout is a timeout-shaped
        // error near the deadline, anything else is the peer's failure.
        const bool late = timeout >= Millis(0) && (Clock::now() - start) * 10 >= timeout * 9;
        if (late && looks_like_timeout(e.what())) throw_timeout(what, timeout);
        throw_failure(what, e.what());
      }
      if (!done) throw_timeout(what, timeout);  // backends that report a timeout by returning false
    }
    auto result = finish_ ? finish_() : std::vector<at::Tensor>{};
    works_.clear();  // drop the buffers the works hold as soon as we are done
    return result;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::function<std::vector<at::Tensor>()> finish_;
  bool device_side_;
};

// Gloo dislikes zero-byte messages: every buffer on the wire has at least one byte.
int64_t wire_bytes(int64_t nbytes) { return std::max<int64_t>(nbytes, 1); }

}  // namespace

void throw_timeout(const std::string& what, Millis timeout) {
  throw ChannelTimeout(what + ": timed out after " + std::to_string(timeout.count()) + " ms");
}

void throw_failure(const std::string& what, const std::string& reason) { throw ChannelError(what + ": " + reason); }

std::vector<at::Tensor> Request::wait(int64_t timeout_ms, const std::string& what) {
  if (waited_.exchange(true)) {
    throw ChannelError(what + ": this request was already waited on (wait() hands its tensors over once)");
  }
  return do_wait(Millis(timeout_ms), what);
}

ProcessGroupChannel::ProcessGroupChannel(c10::intrusive_ptr<c10d::ProcessGroup> group, at::Device device)
    : group_(std::move(group)), device_(device) {
  TORCH_CHECK_VALUE(group_, "ProcessGroupChannel: the process group is None (is torch.distributed initialised?)");
}

void ProcessGroupChannel::check_peer(int peer, int tag) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size() && peer != rank(), "ProcessGroupChannel: peer ", peer,
                    " is not another rank of this group (rank ", rank(), " of ", size(), ")");
  TORCH_CHECK_VALUE(tag >= 0 && tag < kLayoutTagBit, "ProcessGroupChannel: tag ", tag, " is outside [0, 2^30)");
}

at::Tensor ProcessGroupChannel::on_device(at::Tensor t) const {
  // Non-blocking only into a CUDA buffer: the copy is then ordered before the
  // send on the stream. Into host memory the backend reads it at once, so the
  // copy must have landed.
  return t.device() == device_ ? t : t.to(device_, /*non_blocking=*/device_.is_cuda());
}

std::pair<std::shared_ptr<Request>, PackLayout> ProcessGroupChannel::send(const std::vector<at::Tensor>& tensors,
                                                                          int peer, int tag,
                                                                          const std::optional<PackLayout>& expected,
                                                                          bool with_layout,
                                                                          const std::optional<at::Tensor>& out) {
  check_peer(peer, tag);
  PackLayout layout = layout_of(tensors);
  if (expected && !(*expected == layout)) {
    throw ChannelError("send to rank " + std::to_string(peer) + " with tag " + std::to_string(tag) +
                       ": the tensors changed shape or dtype since the layout was exchanged (expected " +
                       expected->repr() + ", got " + layout.repr() +
                       "); start a new step signature so the layout is exchanged again");
  }
  // One contiguous tensor already is its packed form (offset 0, same bytes): send its storage as is.
  at::Tensor packed;
  if (tensors.size() == 1 && layout.nbytes > 0 && tensors[0].device() == device_ && is_plain(tensors[0])) {
    packed = tensors[0].reshape({-1}).view(at::kByte);
  } else {
    const bool reuse = out && !tensors.empty() && out->device() == tensors.front().device();
    packed = pack(tensors, reuse ? out : std::nullopt).first;
  }
  std::vector<at::Tensor> buffers;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (with_layout) {
    auto words = layout.encode();
    TORCH_CHECK_VALUE(static_cast<int64_t>(words.size()) <= kLayoutWords, "send to rank ", peer, " with tag ", tag,
                      ": the layout of ", layout.entries.size(), " tensors needs ", words.size(),
                      " words, more than the ", kLayoutWords, " a layout message holds; send fewer tensors");
    // Pinned on a CUDA channel so the upload does not synchronise the host.
    at::Tensor msg = at::zeros({kLayoutWords}, at::TensorOptions().dtype(at::kLong).pinned_memory(device_.is_cuda()));
    std::copy(words.begin(), words.end(), msg.mutable_data_ptr<int64_t>());
    buffers.push_back(on_device(msg));
    std::vector<at::Tensor> one{buffers.back()};
    works.push_back(group_->send(one, peer, tag | kLayoutTagBit));
  }
  at::Tensor data = layout.nbytes > 0 ? on_device(packed)
                                      : at::zeros({1}, at::TensorOptions().dtype(at::kByte).device(device_));
  buffers.push_back(data);
  std::vector<at::Tensor> one{data};
  works.push_back(group_->send(one, peer, tag));
  // The buffers must outlive the works: the finisher owns them.
  auto request = std::make_shared<WorkRequest>(
      std::move(works), [buffers]() { return std::vector<at::Tensor>{}; }, device_.is_cuda());
  return {request, layout};
}

std::shared_ptr<Request> ProcessGroupChannel::recv(const PackLayout& layout, int peer, int tag) {
  check_peer(peer, tag);
  layout.validate();
  at::Tensor buffer = at::empty({wire_bytes(layout.nbytes)}, at::TensorOptions().dtype(at::kByte).device(device_));
  std::vector<at::Tensor> one{buffer};
  auto work = group_->recv(one, peer, tag);
  return std::make_shared<WorkRequest>(
      std::vector<c10::intrusive_ptr<c10d::Work>>{work}, [buffer, layout]() { return unpack(buffer, layout); },
      device_.is_cuda());
}

std::shared_ptr<Request> ProcessGroupChannel::recv_layout(int peer, int tag) {
  check_peer(peer, tag);
  at::Tensor buffer = at::empty({kLayoutWords}, at::TensorOptions().dtype(at::kLong).device(device_));
  std::vector<at::Tensor> one{buffer};
  auto work = group_->recv(one, peer, tag | kLayoutTagBit);
  // The layout is read on the host (it sizes the data buffer): a discovery
  // step synchronises here once per message; known steps never do.
  return std::make_shared<WorkRequest>(
      std::vector<c10::intrusive_ptr<c10d::Work>>{work},
      [buffer]() { return std::vector<at::Tensor>{buffer}; }, device_.is_cuda());
}

}  // namespace pipeline_ext
