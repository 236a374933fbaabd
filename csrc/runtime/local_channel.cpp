#include "runtime/local_channel.h"

#include <functional>

#include "kernels/copy.h"

namespace pipeline_ext {
namespace {

class LocalRecvRequest : public Request {
 public:
  LocalRecvRequest(std::shared_ptr<LocalHub> hub, int src, int dst, int64_t tag)
      : hub_(std::move(hub)), src_(src), dst_(dst), tag_(tag) {}

  bool is_completed() override { return hub_->ready(src_, dst_, tag_); }

 protected:
  std::vector<at::Tensor> do_wait(Millis timeout, const std::string& what) override {
    return consume(hub_->take(src_, dst_, tag_, timeout, what), hub_->device(dst_));
  }

 private:
  std::shared_ptr<LocalHub> hub_;
  int src_, dst_;
  int64_t tag_;
};

bool wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, Millis timeout,
                const std::function<bool()>& done) {
  if (timeout < Millis(0)) {
    cv.wait(lock, done);
    return true;
  }
  return cv.wait_for(lock, timeout, done);
}

// The tensor to copy from. A host->device copy from pageable memory is staged
// by the driver and runs without overlapping any kernel (measured:
// benchmarks/bench_overlap.py, 0 % hidden), so the sender first copies it into
// a pinned block of torch's caching host allocator: the DMA from there is truly
// asynchronous, and the allocator keeps the block until the copy has finished.
at::Tensor staged(const at::Tensor& t, const at::Device& dst) {
  at::Tensor s = t.detach();
  if (dst.is_cuda() && s.is_cpu() && s.numel() > 0 && !s.is_pinned()) s = s.pin_memory();
  return s;
}

}  // namespace

LocalMessage transfer(const std::vector<at::Tensor>& tensors, const at::Device& src, const at::Device& dst,
                      bool copy_streams, bool owned) {
  LocalMessage msg;
  if (src == dst) {
    // Handed over as a copy made now, on the producer's stream: a stage may
    // write the tensor it returned again in its next forward (a reused output
    // buffer) while the consumer is still reading it.
    for (const auto& t : tensors) msg.tensors.push_back(owned ? t.detach() : t.detach().clone());
    msg.ready.record(Stream::current(src));
    return msg;
  }
  // The producer's current stream may still be writing the tensors: everything
  // downstream is ordered after this event (no-op on CPU).
  Event produced;
  produced.record(Stream::current(src));
  if (!copy_streams) {
    // ATen queues a cross-device copy on the current streams; nothing overlaps.
    for (const auto& t : tensors) msg.tensors.push_back(staged(t, dst).to(dst, /*non_blocking=*/true));
    msg.ready.record(Stream::current(src.is_cuda() ? src : dst));
    return msg;
  }
  const Stream out = Stream::copy(src, CopyDirection::FromDevice);
  const Stream in = Stream::copy(dst, CopyDirection::ToDevice);
  out.wait(produced);
  {
    // ATen copies across devices on the source's current stream, fenced with
    // the destination's current stream, and allocates on the latter: make both
    // the copy streams so compute streams never stall behind the copy. A
    // device->host copy with non_blocking lands in pinned memory, so it is
    // truly asynchronous; the reader synchronizes `ready` before reading.
    StreamGuard out_guard(out), in_guard(in);
    for (const auto& t : tensors) {
      msg.tensors.push_back(staged(t, dst).to(dst, /*non_blocking=*/true));
      record_stream(t, out);  // the source must live until the copy stream is done with it
    }
  }
  msg.ready.record(in.is_cuda() ? in : out);
  return msg;
}

std::vector<at::Tensor> consume(LocalMessage message, const at::Device& device) {
  if (!device.is_cuda()) {
    message.ready.synchronize();  // a device->host copy must land before the host reads it
    return std::move(message.tensors);
  }
  // The reader's stream waits for the copy, and the allocator learns the
  // tensors are used there (they were allocated on the copy stream).
  Stream reader = Stream::current(device);
  reader.wait(message.ready);
  for (const auto& t : message.tensors) record_stream(t, reader);
  return std::move(message.tensors);
}

LocalHub::LocalHub(std::vector<at::Device> devices, int64_t capacity, int64_t send_timeout_ms, bool copy_streams)
    : devices_(std::move(devices)), capacity_(capacity), send_timeout_(send_timeout_ms), copy_streams_(copy_streams) {
  TORCH_CHECK_VALUE(!devices_.empty(), "LocalHub: needs at least one rank (one device per rank)");
  TORCH_CHECK_VALUE(capacity_ > 0, "LocalHub: capacity must be positive, got ", capacity_);
  queued_.assign(devices_.size() * devices_.size(), 0);
}

const at::Device& LocalHub::device(int rank) const {
  check_rank(rank, "rank");
  return devices_[rank];
}

void LocalHub::check_rank(int rank, const char* role) const {
  TORCH_CHECK_VALUE(rank >= 0 && rank < size(), "LocalHub: ", role, " ", rank, " is not in [0, ", size(), ")");
}

void LocalHub::check_open(const std::string& what) const {
  if (closed_) throw_failure(what, "the channel hub was closed: " + reason_);
}

void LocalHub::put(int src, int dst, int64_t tag, LocalMessage message) {
  check_rank(src, "source rank");
  check_rank(dst, "destination rank");
  const std::string what = "rank " + std::to_string(src) + " sending to rank " + std::to_string(dst) + " with tag " +
                           std::to_string(tag);
  std::unique_lock<std::mutex> lock(mu_);
  int64_t& queued = queued_[src * size() + dst];
  if (!wait_until(cv_, lock, send_timeout_, [&] { return closed_ || queued < capacity_; })) {
    throw ChannelTimeout(what + ": timed out after " + std::to_string(send_timeout_.count()) + " ms: the " +
                         std::to_string(capacity_) + " messages the hub holds per peer are all unreceived");
  }
  check_open(what);
  boxes_[{src, dst, tag}].push_back(std::move(message));
  ++queued;
  cv_.notify_all();
}

LocalMessage LocalHub::take(int src, int dst, int64_t tag, Millis timeout, const std::string& what) {
  check_rank(src, "source rank");
  check_rank(dst, "destination rank");
  std::unique_lock<std::mutex> lock(mu_);
  const auto key = std::make_tuple(src, dst, tag);
  auto has_message = [&] {
    auto it = boxes_.find(key);
    return closed_ || (it != boxes_.end() && !it->second.empty());
  };
  if (!wait_until(cv_, lock, timeout, has_message)) throw_timeout(what, timeout);
  check_open(what);
  auto it = boxes_.find(key);
  LocalMessage msg = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) boxes_.erase(it);
  --queued_[src * size() + dst];
  cv_.notify_all();  // a sender may be waiting for room
  return msg;
}

bool LocalHub::ready(int src, int dst, int64_t tag) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = boxes_.find({src, dst, tag});
  return it != boxes_.end() && !it->second.empty() && it->second.front().ready.query();
}

int64_t LocalHub::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (int64_t q : queued_) n += q;
  return n;
}

void LocalHub::close(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!closed_) {
    closed_ = true;
    reason_ = reason;
  }
  cv_.notify_all();
}

bool LocalHub::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

LocalChannel::LocalChannel(std::shared_ptr<LocalHub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {
  TORCH_CHECK_VALUE(hub_, "LocalChannel: hub is None");
  hub_->device(rank_);  // validates the rank
}

std::shared_ptr<Request> LocalChannel::send(const std::vector<at::Tensor>& tensors, int peer, int64_t tag, bool owned) {
  TORCH_CHECK_VALUE(peer != rank_, "LocalChannel: rank ", rank_, " cannot send to itself");
  // What crosses a stage boundary in one process is what may cross one between processes.
  for (size_t i = 0; i < tensors.size(); ++i) check_readable(tensors[i], "send", static_cast<int64_t>(i));
  hub_->put(rank_, peer, tag, transfer(tensors, hub_->device(rank_), hub_->device(peer), hub_->copy_streams(), owned));
  return std::make_shared<CompletedRequest>();
}

std::shared_ptr<Request> LocalChannel::recv(int peer, int64_t tag) {
  TORCH_CHECK_VALUE(peer != rank_, "LocalChannel: rank ", rank_, " cannot receive from itself");
  hub_->device(peer);  // validates the peer
  return std::make_shared<LocalRecvRequest>(hub_, peer, rank_, tag);
}

}  // namespace pipeline_ext
