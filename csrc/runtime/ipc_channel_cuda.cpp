// IpcChannel (runtime/ipc_channel.h): GPU payloads between the processes of one
// host through CUDA IPC, control messages over ShmChannel rings. Compiled only
// WITH_CUDA. The memory handles are torch's (CUDACachingAllocator
// shareIpcHandle / getIpcDevPtr: exported blocks come from the caching
// allocator, and torch maps each segment once per process however many blocks
// or channels refer to it); the events are plain interprocess CUDA events.
#include "runtime/ipc_channel.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "runtime/handle_cache.h"
#include "runtime/stream.h"

namespace pipeline_ext {
namespace {

constexpr int64_t kMagic = 0x3163706965705fLL;  // "_pepic1"
// Words of a control message's header.
enum : int64_t {
  kMagicWord = 0,
  kBlockWord = 1,       // the sender's block id (-1: an empty payload, nothing to copy)
  kOffsetWord = 2,      // where the block starts in the exported segment (torch's ShareableHandle offset)
  kBytesWord = 3,       // payload bytes
  kWithLayoutWord = 4,  // the sender sent with_layout (a recv_layout may take it)
  kPidWord = 5,
  kHandleLenWord = 6,   // bytes of the memory handle string
  kHandleWord = 8,      // the memory handle (torch's string), up to kHandleBytes
  kReadyWord = 24,      // cudaIpcEventHandle_t of the block's "ready" event
  kDoneWord = 32,       // cudaIpcEventHandle_t of the block's "done" event
};
constexpr int64_t kHandleBytes = (kReadyWord - kHandleWord) * 8;
static_assert(sizeof(cudaIpcEventHandle_t) <= 8 * (kDoneWord - kReadyWord), "an event handle takes 8 words");
static_assert(kDoneWord + 8 <= IpcChannel::kHeaderWords, "the header holds the done event's handle");
// Exported blocks are sized in multiples of this (the caching allocator's large-segment granularity).
constexpr int64_t kBlockGranularity = 2 << 20;

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the next call does not see it
  throw ChannelError(std::string("IpcChannel: ") + what + ": " + cudaGetErrorString(err));
}

cudaStream_t raw(const Stream& s) {
  return c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, s.native()).stream();
}

// One exported block of the sender's pool.
struct Block {
  int64_t id = 0;
  at::Tensor memory;  // 1-D uint8 on the channel's device, from the caching allocator
  std::string handle;  // torch's IPC handle of memory's segment
  int64_t offset = 0;  // memory's offset in that segment
  cudaEvent_t ready = nullptr, done = nullptr;  // interprocess: recorded by the sender, by the receiver
  cudaIpcEventHandle_t ready_handle{}, done_handle{};
  bool done_pending = false;  // a receiver recorded `done` after its copy: wait for it before writing again

  int64_t capacity() const { return memory.numel(); }
  ~Block() {
    // cudaEventDestroy returns at once; a pending wait on the event still completes.
    if (ready) (void)cudaEventDestroy(ready);
    if (done) (void)cudaEventDestroy(done);
  }
};

// What a control message says about the block to open (the cache's open argument).
struct Exported {
  std::string handle;
  cudaIpcEventHandle_t ready{}, done{};
};

// A peer's block as this process opened it.
struct Opened {
  std::shared_ptr<void> base;  // torch's mapping of the segment; released when the last holder drops it
  cudaEvent_t ready = nullptr, done = nullptr;
};

struct InFlight {
  std::shared_ptr<Block> block;
  int peer;
  std::shared_ptr<Request> ack;
};

// The receipt of one control message, shared by a recv_layout() and the recv() that takes its payload.
struct ControlSlot {
  std::shared_ptr<Request> request;
  std::optional<std::vector<int64_t>> words;

  bool arrived() { return words.has_value() || request->is_completed(); }
  const std::vector<int64_t>& get(Millis timeout, const std::string& what) {
    if (!words) {
      auto got = request->wait(timeout.count(), what);
      at::Tensor t = got.at(0).contiguous();
      words.emplace(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
      if ((*words)[kMagicWord] != kMagic) {
        throw ChannelError(what + ": the message is not a CUDA IPC control message (do both ranks use transport 'ipc'?)");
      }
    }
    return *words;
  }
};

Opened open_block(at::Device device, const Exported& e) {
  c10::cuda::CUDAGuard guard(device.index());
  Opened o;
  o.base = c10::cuda::CUDACachingAllocator::getIpcDevPtr(e.handle);
  check(cudaIpcOpenEventHandle(&o.ready, e.ready), "opening a peer's ready event");
  cudaError_t err = cudaIpcOpenEventHandle(&o.done, e.done);
  if (err != cudaSuccess) {
    (void)cudaEventDestroy(o.ready);
    check(err, "opening a peer's done event");
  }
  return o;
}

void close_block(Opened& o) {
  // The last copy out of the block (recorded `done` after it) must be over before the mapping may go.
  if (o.done) {
    (void)cudaEventSynchronize(o.done);
    (void)cudaEventDestroy(o.done);
  }
  if (o.ready) (void)cudaEventDestroy(o.ready);
  o.base.reset();
  (void)cudaGetLastError();  // a peer that exited: its events may be gone, nothing to report on a close
}

}  // namespace

struct IpcState {
  IpcState(std::shared_ptr<ShmChannel> control_, std::shared_ptr<ShmChannel> acks_, at::Device device_,
           size_t pool_blocks_, size_t cache_entries)
      : control(std::move(control_)),
        acks(std::move(acks_)),
        device(device_),
        pool_blocks(pool_blocks_),
        cache(
            cache_entries,
            [device = device_](int, int64_t, const Exported& e) { return open_block(device, e); },
            [](int, int64_t, Opened& o) { close_block(o); }),
        control_layout(layout_of({at::empty({IpcChannel::kControlWords}, at::kLong)})),
        ack_layout(layout_of({at::empty({1}, at::kLong)})) {}

  ~IpcState() {
    // Idle and in-flight blocks go with their tensors (the caching allocator keeps the memory); the handles
    // this process opened are closed by the cache.
    in_flight.clear();
    idle.clear();
  }

  void make_streams() {
    if (send_stream) return;
    send_stream = Stream::from_pool(device);
    recv_stream = Stream::from_pool(device);
  }

  // An idle block of at least `nbytes`, or a new one exported now.
  std::shared_ptr<Block> take_block(int64_t nbytes) {
    auto fit = std::find_if(idle.begin(), idle.end(), [&](const auto& b) { return b->capacity() >= nbytes; });
    if (fit != idle.end()) {
      auto b = *fit;
      idle.erase(fit);
      return b;
    }
    c10::cuda::CUDAGuard guard(device.index());
    auto b = std::make_shared<Block>();
    b->id = next_block++;
    {
      StreamGuard on_send(*send_stream);  // allocated for the send stream, where it is written
      int64_t cap = std::max<int64_t>(nbytes, kBlockGranularity);
      cap = (cap + kBlockGranularity - 1) / kBlockGranularity * kBlockGranularity;
      b->memory = at::empty({cap}, at::TensorOptions().dtype(at::kByte).device(device));
    }
    auto shared = c10::cuda::CUDACachingAllocator::shareIpcHandle(b->memory.data_ptr());
    if (static_cast<int64_t>(shared.handle.size()) > kHandleBytes) {
      throw ChannelError("IpcChannel: torch's IPC handle takes " + std::to_string(shared.handle.size()) +
                         " bytes, more than the " + std::to_string(kHandleBytes) + " a control message holds");
    }
    b->handle = shared.handle;
    b->offset = shared.offset;
    const unsigned flags = cudaEventDisableTiming | cudaEventInterprocess;
    check(cudaEventCreateWithFlags(&b->ready, flags), "creating a block's ready event");
    check(cudaEventCreateWithFlags(&b->done, flags), "creating a block's done event");
    check(cudaIpcGetEventHandle(&b->ready_handle, b->ready), "exporting a block's ready event");
    check(cudaIpcGetEventHandle(&b->done_handle, b->done), "exporting a block's done event");
    ++exported;
    return b;
  }

  // Progress without waiting: acknowledged blocks back to the pool, acknowledgements pushed out.
  void poll() {
    for (auto it = in_flight.begin(); it != in_flight.end();) {
      bool back = false;
      try {
        if (it->ack->is_completed()) {
          it->ack->wait(0, "IpcChannel: an acknowledgement");
          back = true;
        }
      } catch (const ChannelError&) {
        // The receiver is gone (its context with it): nothing reads the block, and its `done` may never fire.
        it->block->done_pending = false;
        back = true;
      }
      if (back) {
        idle.push_back(std::move(it->block));
        it = in_flight.erase(it);
      } else {
        ++it;
      }
    }
    while (idle.size() > pool_blocks) {  // more idle than the pool keeps: the oldest goes
      auto& b = idle.front();
      if (b->done_pending) {
        // Its memory returns to the allocator only once the receiver's copy is over (device side).
        check(cudaStreamWaitEvent(raw(*send_stream), b->done, 0), "ordering a retired block after its last read");
        record_stream(b->memory, *send_stream);
      }
      idle.erase(idle.begin());
    }
    acks_out.erase(std::remove_if(acks_out.begin(), acks_out.end(),
                                  [](const auto& r) {
                                    try {
                                      return r->is_completed();
                                    } catch (const ChannelError&) {
                                      return true;  // its peer is gone
                                    }
                                  }),
                   acks_out.end());
  }

  // The control message a recv() of (peer, tag) takes: the one a recv_layout() posted, else a receive of its own.
  std::shared_ptr<ControlSlot> take_slot(int peer, int tag) {
    auto it = layout_slots.find({peer, tag});
    if (it != layout_slots.end() && !it->second.empty()) {
      auto slot = it->second.front();
      it->second.pop_front();
      return slot;
    }
    auto slot = std::make_shared<ControlSlot>();
    slot->request = control->recv(control_layout, peer, tag);
    return slot;
  }

  std::shared_ptr<ShmChannel> control, acks;
  at::Device device;
  size_t pool_blocks;
  std::mutex mu;  // one executor thread issues; waits may come from another thread
  std::optional<Stream> send_stream, recv_stream;
  std::vector<std::shared_ptr<Block>> idle;
  std::deque<InFlight> in_flight;
  std::vector<std::shared_ptr<Request>> acks_out;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<ControlSlot>>> layout_slots;
  HandleCache<Opened, Exported> cache;
  PackLayout control_layout, ack_layout;
  int64_t next_block = 0, exported = 0;
};

namespace {

class LayoutRequest : public Request {
 public:
  explicit LayoutRequest(std::shared_ptr<ControlSlot> slot) : slot_(std::move(slot)) {}
  bool is_completed() override { return slot_->arrived(); }

 protected:
  std::vector<at::Tensor> do_wait(Millis timeout, const std::string& what) override {
    const auto& words = slot_->get(timeout, what);
    at::Tensor layout = at::zeros({Channel::kLayoutWords}, at::kLong);
    std::copy(words.begin() + IpcChannel::kHeaderWords, words.end(), layout.data_ptr<int64_t>());
    return {layout};
  }

 private:
  std::shared_ptr<ControlSlot> slot_;
};

class IpcRecvRequest : public Request {
 public:
  IpcRecvRequest(std::shared_ptr<IpcState> state, std::shared_ptr<ControlSlot> slot, PackLayout layout, int peer,
                 int tag)
      : state_(std::move(state)), slot_(std::move(slot)), layout_(std::move(layout)), peer_(peer), tag_(tag) {}
  bool is_completed() override { return slot_->arrived(); }

 protected:
  std::vector<at::Tensor> do_wait(Millis timeout, const std::string& what) override {
    IpcState& s = *state_;
    std::vector<int64_t> words;
    try {
      words = slot_->get(timeout, what);
    } catch (const ChannelTimeout&) {
      throw;
    } catch (const ChannelError&) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.cache.erase_peer(peer_);  // the peer is gone: nothing of it stays mapped here
      throw;
    }
    const PackLayout sent =
        PackLayout::decode(std::vector<int64_t>(words.begin() + IpcChannel::kHeaderWords, words.end()));
    if (!(sent == layout_)) {
      throw ChannelError(what + ": rank " + std::to_string(peer_) + " sent " + sent.repr() +
                         ", the receive was posted for " + layout_.repr());
    }
    const int64_t nbytes = words[kBytesWord];
    std::lock_guard<std::mutex> lock(s.mu);
    s.make_streams();
    c10::cuda::CUDAGuard guard(s.device.index());
    at::Tensor buffer;
    {
      StreamGuard on_recv(*s.recv_stream);
      buffer = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(s.device));
      if (nbytes > 0) {
        Exported e;
        const int64_t len = words[kHandleLenWord];
        e.handle.assign(reinterpret_cast<const char*>(words.data() + kHandleWord), static_cast<size_t>(len));
        std::memcpy(&e.ready, words.data() + kReadyWord, sizeof(e.ready));
        std::memcpy(&e.done, words.data() + kDoneWord, sizeof(e.done));
        const int64_t block = words[kBlockWord];
        Opened& o = s.cache.get(peer_, block, e);
        cudaStream_t stream = raw(*s.recv_stream);
        check(cudaStreamWaitEvent(stream, o.ready, 0), "waiting for a peer's ready event");
        const char* src = static_cast<const char*>(o.base.get()) + words[kOffsetWord];
        check(cudaMemcpyAsync(buffer.data_ptr(), src, static_cast<size_t>(nbytes), cudaMemcpyDeviceToDevice, stream),
              "copying a peer's block");
        check(cudaEventRecord(o.done, stream), "recording a peer's done event");
        // The block may be written again once this copy is over: tell the sender (it waits on `done`).
        at::Tensor ack = at::full({1}, block, at::kLong);
        try {
          s.acks_out.push_back(s.acks->send({ack}, peer_, tag_, std::nullopt, false).first);
        } catch (const ChannelError&) {
          // the sender exited after its message arrived: the copy is queued, nobody waits for the acknowledgement
        }
      }
    }
    // The consumer (the current stream) waits for the copy, and the buffer lives until it is done with it.
    Event copied;
    copied.record(*s.recv_stream);
    copied.block(Stream::current(s.device));
    record_stream(buffer, Stream::current(s.device));
    s.poll();
    return unpack(buffer, layout_);
  }

 private:
  std::shared_ptr<IpcState> state_;
  std::shared_ptr<ControlSlot> slot_;
  PackLayout layout_;
  int peer_, tag_;
};

}  // namespace

IpcChannel::IpcChannel(std::shared_ptr<ShmChannel> control, std::shared_ptr<ShmChannel> acks, at::Device device,
                       int64_t pool_blocks, int64_t cache_entries)
    : Channel("IpcChannel") {
  TORCH_CHECK_VALUE(control && acks, "IpcChannel: the control and acknowledgement channels must be given");
  TORCH_CHECK_VALUE(device.is_cuda() && device.has_index(), "IpcChannel: a CUDA device with an index, not ", device);
  TORCH_CHECK_VALUE(control->rank() == acks->rank() && control->size() == acks->size(),
                    "IpcChannel: the control and acknowledgement channels are of different ranks");
  TORCH_CHECK_VALUE(pool_blocks >= 0 && cache_entries >= 1, "IpcChannel: pool_blocks >= 0 and cache_entries >= 1");
  state_ = std::make_shared<IpcState>(std::move(control), std::move(acks), device, static_cast<size_t>(pool_blocks),
                                      static_cast<size_t>(cache_entries));
}

IpcChannel::~IpcChannel() = default;

int IpcChannel::rank() const { return state_->control->rank(); }
int IpcChannel::size() const { return state_->control->size(); }
at::Device IpcChannel::device() const { return state_->device; }

void IpcChannel::check_tensors(const std::vector<at::Tensor>& tensors, int peer) const {
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(t.device() == state_->device, "IpcChannel: a tensor to peer ", peer, " is on ", t.device(),
                      "; this channel moves ", state_->device, " tensors (CPU stages use transport='shm')");
  }
}

std::shared_ptr<Request> IpcChannel::do_send(const Outgoing& msg) {
  IpcState& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  s.make_streams();
  s.poll();
  std::vector<int64_t> encoded = msg.layout.encode();
  if (static_cast<int64_t>(encoded.size()) > kLayoutWords) {
    throw ChannelError("IpcChannel: the layout takes " + std::to_string(encoded.size()) + " words, more than the " +
                       std::to_string(kLayoutWords) + " a control message holds; send fewer tensors");
  }
  at::Tensor control = at::zeros({kControlWords}, at::kLong);
  int64_t* words = control.data_ptr<int64_t>();
  words[kMagicWord] = kMagic;
  words[kBlockWord] = -1;
  words[kBytesWord] = msg.layout.nbytes;
  words[kWithLayoutWord] = msg.with_layout ? 1 : 0;
  words[kPidWord] = static_cast<int64_t>(::getpid());
  std::copy(encoded.begin(), encoded.end(), words + kHeaderWords);
  std::shared_ptr<Block> block;
  if (msg.layout.nbytes > 0) {
    c10::cuda::CUDAGuard guard(s.device.index());
    block = s.take_block(msg.layout.nbytes);
    // The send stream waits for the tensors' producers (the compute stream so far), and for the last
    // receiver's copy out of this block.
    Event produced;
    produced.record(Stream::current(s.device));
    produced.block(*s.send_stream);
    if (block->done_pending) {
      check(cudaStreamWaitEvent(raw(*s.send_stream), block->done, 0), "waiting for a block's last reader");
    }
    {
      StreamGuard on_send(*s.send_stream);
      pipeline_ext::pack(msg.tensors, block->memory);
      for (const auto& t : msg.tensors) record_stream(t, *s.send_stream);
    }
    check(cudaEventRecord(block->ready, raw(*s.send_stream)), "recording a block's ready event");
    block->done_pending = true;
    words[kBlockWord] = block->id;
    words[kOffsetWord] = block->offset;
    words[kHandleLenWord] = static_cast<int64_t>(block->handle.size());
    std::memcpy(words + kHandleWord, block->handle.data(), block->handle.size());
    std::memcpy(words + kReadyWord, &block->ready_handle, sizeof(block->ready_handle));
    std::memcpy(words + kDoneWord, &block->done_handle, sizeof(block->done_handle));
  }
  auto sent = s.control->send({control}, msg.peer, msg.tag, std::nullopt, false).first;
  if (block) s.in_flight.push_back(InFlight{block, msg.peer, s.acks->recv(s.ack_layout, msg.peer, msg.tag)});
  return sent;
}

std::shared_ptr<Request> IpcChannel::recv(const PackLayout& layout, int peer, int tag) {
  check_peer(peer, tag);
  layout.validate();
  std::lock_guard<std::mutex> lock(state_->mu);
  return std::make_shared<IpcRecvRequest>(state_, state_->take_slot(peer, tag), layout, peer, tag);
}

std::shared_ptr<Request> IpcChannel::recv_layout(int peer, int tag) {
  check_peer(peer, tag);
  std::lock_guard<std::mutex> lock(state_->mu);
  auto slot = std::make_shared<ControlSlot>();
  slot->request = state_->control->recv(state_->control_layout, peer, tag);
  state_->layout_slots[{peer, tag}].push_back(slot);
  return std::make_shared<LayoutRequest>(slot);
}

void IpcChannel::begin_step(int64_t step) {
  // Control messages are stamped with the step (ShmChannel drops earlier steps' leftovers). The
  // acknowledgements are not: an acknowledgement of step s may arrive when the sender is in step s + 1.
  state_->control->begin_step(step);
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->layout_slots.clear();
  if (state_->send_stream) state_->poll();
}

std::string ipc_export_probe(const at::Tensor& tensor) {
  TORCH_CHECK_VALUE(tensor.is_cuda(), "ipc_export_probe: a CUDA tensor, not one on ", tensor.device());
  c10::cuda::CUDAGuard guard(tensor.device().index());
  auto shared = c10::cuda::CUDACachingAllocator::shareIpcHandle(tensor.storage().mutable_data());
  return shared.handle;
}

std::string ipc_open_probe(const std::string& handle, at::Device device) {
  try {
    c10::cuda::CUDAGuard guard(device.index());
    auto base = c10::cuda::CUDACachingAllocator::getIpcDevPtr(handle);
    base.reset();  // closed again (torch closes the mapping with its last holder)
    return "";
  } catch (const std::exception& exc) {
    (void)cudaGetLastError();
    return std::string(exc.what()).substr(0, 200);
  }
}

int64_t IpcChannel::blocks_exported() const { return state_->exported; }
int64_t IpcChannel::blocks_idle() const { return static_cast<int64_t>(state_->idle.size()); }
int64_t IpcChannel::blocks_in_flight() const { return static_cast<int64_t>(state_->in_flight.size()); }
int64_t IpcChannel::handles_cached() const { return static_cast<int64_t>(state_->cache.size()); }

}  // namespace pipeline_ext
