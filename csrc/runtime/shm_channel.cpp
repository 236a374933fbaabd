#include "runtime/shm_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>

#include "kernels/copy.h"
#include "runtime/interrupt.h"
#include "runtime/shm_segment.h"

namespace pipeline_ext {
namespace {

using namespace shm;  // the segment's layout and primitives (shm_segment.h)
using Clock = std::chrono::steady_clock;

// Messages are matched by (step, tag): a tag alone repeats in every step.
using Key = std::pair<int64_t, int64_t>;

// A message arriving from a peer; `dst` is where its bytes land (nullptr: dropped).
struct Message {
  int64_t step = 0;
  int64_t tag = 0;
  int64_t total = 0;
  int64_t filled = 0;
  at::Tensor buffer;
  uint8_t* dst = nullptr;
  bool complete() const { return filled == total; }
};

struct RecvOp {
  int peer = 0;
  int64_t step = 0;
  int64_t tag = 0;
  bool is_layout = false;
  PackLayout layout;
  at::Tensor buffer;  // preallocated: the layout's bytes, or kLayoutWords zeroed int64
  std::shared_ptr<Message> msg;
  std::string error;
  bool done() const { return msg && msg->complete(); }
};

struct SendOp {
  int64_t step = 0;
  int64_t tag = 0;
  at::Tensor source;  // keeps the bytes alive until they are in the ring
  bool borrowed = false;  // source is the caller's own tensor (it may write it again once send returns)
  const uint8_t* src = nullptr;  // the bytes from offset `base` of the message on
  int64_t base = 0;
  int64_t total = 0;
  int64_t sent = 0;
  bool started = false;
  bool done() const { return started && sent == total; }
};

struct PeerState {
  Mapping inbox;  // the peer's segment (this rank writes into its ring there)
  int64_t pid = 0;
  int pidfd = -1;
  bool attached = false;
  std::map<Key, std::deque<std::shared_ptr<RecvOp>>> posted;
  std::map<Key, std::deque<std::shared_ptr<Message>>> unexpected;
  std::shared_ptr<Message> current;  // a message whose later chunks are still coming
  std::deque<std::shared_ptr<SendOp>> pending;
  // The latest step the peer said failed on it (notify_failure), and how; -1: none.
  int64_t failed_step = -1;
  std::string failure;
};

}  // namespace

struct ShmState {
  int rank = 0;
  int size = 0;
  int64_t ring_bytes = 0;
  std::chrono::microseconds spin{20};
  Millis slice{50};
  // This rank's step on the group (begin_step): what sends are stamped with and
  // receives match; a message of an earlier step is a failed step's leftover.
  int64_t step = 0;
  int64_t discarded = 0;  // leftovers dropped so far
  std::string name;  // where peers open the segment: /proc/<pid>/fd/<fd>
  int fd = -1;       // the segment's descriptor (memfd), open while peers may still attach
  Mapping own;
  std::vector<PeerState> peers;
  std::mutex mu;

  ~ShmState() {
    if (fd >= 0) close(fd);
    own.unmap();
    for (auto& p : peers) {
      p.inbox.unmap();
      if (p.pidfd >= 0) close(p.pidfd);
    }
  }

  SegmentHeader* bell() const { return own.header(); }

  // False once the peer's process has exited (zombies included).
  bool alive(int peer) const { return shm::process_alive(peers[peer].pidfd, peers[peer].pid); }

  std::string peer_gone(int peer) const {
    return "rank " + std::to_string(peer) + " (pid " + std::to_string(peers[peer].pid) +
           ") exited (shared-memory transport: its process is gone)";
  }

  // ---- receiving (under mu) ----
  // Gives `msg` to `op`: checks the size, then the bytes land in op's buffer when
  // the message is fresh (`place`), or stay in the message's own buffer.
  static void bind(RecvOp& op, const std::shared_ptr<Message>& msg, bool place) {
    op.msg = msg;
    const int64_t room = op.buffer.numel() * op.buffer.element_size();
    const bool fits = op.is_layout ? (msg->total <= room && msg->total % 8 == 0) : msg->total == op.layout.nbytes;
    if (!fits) {
      op.error = "rank " + std::to_string(op.peer) + " sent a message of " + std::to_string(msg->total) +
                 " bytes where this receive expects " +
                 (op.is_layout ? "a layout message" : std::to_string(op.layout.nbytes) + " bytes (" + op.layout.repr() + ")");
      if (place) msg->dst = nullptr;
      return;
    }
    if (place) {
      msg->buffer = op.buffer;
      msg->dst = static_cast<uint8_t*>(op.buffer.data_ptr());
    }
  }

  void deliver(int peer, const RecordHeader& rec, const uint8_t* payload) {
    auto& ps = peers[peer];
    if (rec.offset == 0) {
      if (ps.current) throw ChannelError("shared-memory transport: rank " + std::to_string(peer) +
                                         " started a message before finishing the previous one (corrupt ring)");
      auto msg = std::make_shared<Message>();
      msg->step = rec.step;
      msg->tag = rec.tag;
      msg->total = rec.total;
      const Key key{rec.step, rec.tag};
      auto it = ps.posted.find(key);
      if (rec.step < step) {
        ++discarded;  // a failed step's message, arriving late: its chunks are skipped (dst stays null)
      } else if (it != ps.posted.end()) {
        auto op = it->second.front();
        it->second.pop_front();
        if (it->second.empty()) ps.posted.erase(it);
        bind(*op, msg, /*place=*/true);
      } else {
        msg->buffer = at::empty({std::max<int64_t>(rec.total, 1)}, at::TensorOptions().dtype(at::kByte));
        msg->dst = static_cast<uint8_t*>(msg->buffer.data_ptr());
        ps.unexpected[key].push_back(msg);
      }
      ps.current = msg;
    }
    auto& msg = ps.current;
    if (!msg || msg->tag != rec.tag || msg->step != rec.step || rec.offset != msg->filled || rec.offset + rec.chunk > msg->total) {
      throw ChannelError("shared-memory transport: a chunk from rank " + std::to_string(peer) +
                         " does not continue its message (corrupt ring)");
    }
    if (rec.chunk > 0 && msg->dst) std::memcpy(msg->dst + rec.offset, payload, static_cast<size_t>(rec.chunk));
    msg->filled += rec.chunk;
    if (msg->complete()) ps.current.reset();
  }

  // Copies every record `peer` published in this rank's inbox out of the ring.
  bool drain(int peer) {
    RingControl* ctl = own.ring(peer);
    uint8_t* data = own.data(peer);
    uint64_t tail = ctl->tail.load(std::memory_order_relaxed);
    const uint64_t head = ctl->head.load(std::memory_order_acquire);
    if (tail == head) return false;
    while (tail != head) {
      const int64_t pos = static_cast<int64_t>(tail % static_cast<uint64_t>(ring_bytes));
      RecordHeader rec;
      std::memcpy(&rec, data + pos, sizeof(rec));
      if (rec.record_bytes < kRecordHeader || rec.record_bytes % kAlign != 0 || pos + rec.record_bytes > ring_bytes ||
          (rec.tag != kPadTag && rec.record_bytes < kRecordHeader + rec.chunk)) {
        throw ChannelError("shared-memory transport: malformed record from rank " + std::to_string(peer));
      }
      if (rec.tag == kFailureTag) {
        if (rec.offset != 0 || rec.chunk != rec.total || rec.total > kMaxFailureText) {
          throw ChannelError("shared-memory transport: malformed failure notice from rank " + std::to_string(peer));
        }
        auto& ps = peers[peer];
        if (rec.step >= ps.failed_step) {
          ps.failed_step = rec.step;
          ps.failure.assign(reinterpret_cast<const char*>(data + pos + kRecordHeader), static_cast<size_t>(rec.chunk));
        }
      } else if (rec.tag != kPadTag) {
        deliver(peer, rec, data + pos + kRecordHeader);
      }
      tail += static_cast<uint64_t>(rec.record_bytes);
      ctl->tail.store(tail, std::memory_order_release);
    }
    ring_doorbell(peers[peer].inbox.header());  // the peer may be waiting for this space
    return true;
  }

  // ---- sending (under mu) ----
  // Writes as much of the queued messages to `peer` as its ring has room for.
  bool push(int peer) {
    auto& ps = peers[peer];
    if (ps.pending.empty()) return false;
    RingControl* ctl = ps.inbox.ring(rank);
    uint8_t* data = ps.inbox.data(rank);
    uint64_t head = ctl->head.load(std::memory_order_relaxed);
    bool wrote = false;
    while (!ps.pending.empty()) {
      SendOp& op = *ps.pending.front();
      const uint64_t tail = ctl->tail.load(std::memory_order_acquire);
      const int64_t free = ring_bytes - static_cast<int64_t>(head - tail);
      const int64_t pos = static_cast<int64_t>(head % static_cast<uint64_t>(ring_bytes));
      const int64_t contiguous = ring_bytes - pos;
      const int64_t remaining = op.total - op.sent;
      const int64_t want = kRecordHeader + round_up(remaining, kAlign);
      const int64_t room = std::min(free, contiguous);
      int64_t chunk = 0;
      if (want <= room) {
        chunk = remaining;
      } else if (contiguous < want && contiguous - kRecordHeader < std::min(remaining, kMinChunk)) {
        if (free < contiguous) break;  // the filler would overwrite unread records: wait for space
        RecordHeader pad{};
        pad.record_bytes = contiguous;
        pad.tag = kPadTag;
        std::memcpy(data + pos, &pad, sizeof(pad));
        head += static_cast<uint64_t>(contiguous);
        ctl->head.store(head, std::memory_order_release);
        continue;
      } else {
        const int64_t usable = (room - kRecordHeader) / kAlign * kAlign;
        if (usable <= 0 || usable < std::min(remaining, kMinChunk)) break;  // wait for space
        chunk = std::min(remaining, usable);
      }
      RecordHeader rec{};
      rec.record_bytes = kRecordHeader + round_up(chunk, kAlign);
      rec.tag = op.tag;
      rec.total = op.total;
      rec.offset = op.sent;
      rec.chunk = chunk;
      rec.step = op.step;
      std::memcpy(data + pos, &rec, sizeof(rec));
      if (chunk > 0) std::memcpy(data + pos + kRecordHeader, op.src + (op.sent - op.base), static_cast<size_t>(chunk));
      head += static_cast<uint64_t>(rec.record_bytes);
      ctl->head.store(head, std::memory_order_release);
      ring_doorbell(ps.inbox.header());
      wrote = true;
      op.sent += chunk;
      op.started = true;
      if (op.done()) {
        op.source = at::Tensor();
        op.src = nullptr;
        ps.pending.pop_front();
      }
    }
    return wrote;
  }

  void progress() {
    for (int p = 0; p < size; ++p) {
      if (p == rank || !peers[p].attached) continue;
      drain(p);
      push(p);
    }
  }

  // Blocks until done() (checked under mu after progress) or the timeout; spins
  // for `spin`, then sleeps on this rank's doorbell in slices, checking between
  // slices that `peer` is still alive and whether a signal came (a handler that
  // raises, Ctrl-C's, ends the wait: runtime/interrupt.h).
  template <class Done>
  void wait_for(int peer, Done done, Millis timeout, const std::string& what) {
    const auto start = Clock::now();
    const auto deadline = start + timeout;
    const auto spin_until = start + spin;
    auto next_check = start + slice;
    SegmentHeader* h = bell();
    uint64_t signals = interrupt_count();
    while (true) {
      const uint32_t seq = h->doorbell.load(std::memory_order_acquire);
      std::string failed;  // a peer's notice that this step failed on it: the wait cannot complete
      {
        std::lock_guard<std::mutex> lock(mu);
        progress();
        if (done()) return;
        for (const auto& ps : peers) {
          if (ps.failed_step == step) failed = ps.failure;
        }
      }
      if (!failed.empty()) throw_failure(what, failed);
      check_interrupts(signals);  // outside mu: the check takes the GIL
      auto now = Clock::now();
      if (now >= next_check) {
        next_check = now + slice;
        if (!alive(peer)) {
          std::lock_guard<std::mutex> lock(mu);
          progress();  // what it sent before it went is still good
          if (done()) return;
          throw_failure(what, peer_gone(peer));
        }
      }
      if (timeout >= Millis(0) && now >= deadline) throw_timeout(what, timeout);
      if (now < spin_until) {
        for (int i = 0; i < 64 && h->doorbell.load(std::memory_order_acquire) == seq; ++i) cpu_relax();
        continue;
      }
      auto nap = std::chrono::duration_cast<std::chrono::nanoseconds>(next_check - now);
      if (timeout >= Millis(0)) nap = std::min(nap, std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now));
      nap = std::max(nap, std::chrono::nanoseconds(1000));
      timespec ts{static_cast<time_t>(nap.count() / 1000000000), static_cast<long>(nap.count() % 1000000000)};
      h->sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (h->doorbell.load(std::memory_order_seq_cst) == seq) futex(&h->doorbell, FUTEX_WAIT, seq, &ts);
      h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // Posts a receive: it takes the oldest early message with its tag, else waits in the queue.
  void post(const std::shared_ptr<RecvOp>& op) {
    std::lock_guard<std::mutex> lock(mu);
    auto& ps = peers[op->peer];
    progress();
    op->step = step;
    const Key key{op->step, op->tag};
    auto it = ps.unexpected.find(key);
    if (it == ps.unexpected.end()) {
      ps.posted[key].push_back(op);
      return;
    }
    auto msg = it->second.front();
    it->second.pop_front();
    if (it->second.empty()) ps.unexpected.erase(it);
    bind(*op, msg, /*place=*/false);
  }

  // Step `s` begins on this rank. Every step before it has ended here (done or
  // failed), so their messages still waiting (a failed step's, taken by no
  // receive) are dropped now, and any arriving later are skipped on arrival.
  void begin_step(int64_t s) {
    std::lock_guard<std::mutex> lock(mu);
    if (s < step) {
      throw ChannelError("shared-memory transport: step " + std::to_string(s) + " begun after step " +
                         std::to_string(step) + " (step numbers on a group only go forward)");
    }
    progress();
    step = s;
    for (auto& ps : peers) {
      for (auto it = ps.unexpected.begin(); it != ps.unexpected.end();) {
        if (it->first.first >= s) {
          ++it;
          continue;
        }
        for (auto& msg : it->second) {
          if (msg == ps.current) {  // still arriving: skip its remaining chunks
            msg->dst = nullptr;
            msg->buffer = at::Tensor();
          }
        }
        discarded += static_cast<int64_t>(it->second.size());
        it = ps.unexpected.erase(it);
      }
    }
  }

  // A receive that will never be waited on leaves the queue, so a later message with its tag is not swallowed.
  void cancel(const std::shared_ptr<RecvOp>& op) {
    std::lock_guard<std::mutex> lock(mu);
    auto& posted = peers[op->peer].posted;
    auto it = posted.find(Key{op->step, op->tag});
    if (it == posted.end()) return;
    auto& q = it->second;
    q.erase(std::remove(q.begin(), q.end(), op), q.end());
    if (q.empty()) posted.erase(it);
  }
};

namespace {

class ShmSendRequest : public Request {
 public:
  ShmSendRequest(std::shared_ptr<ShmState> state, int peer, std::vector<std::shared_ptr<SendOp>> ops)
      : state_(std::move(state)), peer_(peer), ops_(std::move(ops)) {}

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->progress();
    return done();
  }

 protected:
  std::vector<at::Tensor> do_wait(Millis timeout, const std::string& what) override {
    state_->wait_for(peer_, [this] { return done(); }, timeout, what);
    return {};
  }

 private:
  bool done() const {
    return std::all_of(ops_.begin(), ops_.end(), [](const auto& op) { return op->done(); });
  }
  std::shared_ptr<ShmState> state_;
  int peer_;
  std::vector<std::shared_ptr<SendOp>> ops_;
};

class ShmRecvRequest : public Request {
 public:
  ShmRecvRequest(std::shared_ptr<ShmState> state, std::shared_ptr<RecvOp> op)
      : state_(std::move(state)), op_(std::move(op)) {}
  ~ShmRecvRequest() override { state_->cancel(op_); }

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->progress();
    return op_->done();
  }

 protected:
  std::vector<at::Tensor> do_wait(Millis timeout, const std::string& what) override {
    try {
      state_->wait_for(op_->peer, [this] { return op_->done(); }, timeout, what);
    } catch (...) {
      state_->cancel(op_);
      throw;
    }
    if (!op_->error.empty()) throw_failure(what, op_->error);
    at::Tensor bytes = op_->msg->buffer;
    op_->msg.reset();
    if (!op_->is_layout) return unpack(bytes, op_->layout);
    if (!bytes.is_same(op_->buffer) && bytes.numel() > 0) {  // an early message kept its own buffer
      std::memcpy(op_->buffer.data_ptr(), bytes.data_ptr(), static_cast<size_t>(std::min<int64_t>(
                                                                 bytes.numel(), op_->buffer.numel() * 8)));
    }
    return {op_->buffer};
  }

 private:
  std::shared_ptr<ShmState> state_;
  std::shared_ptr<RecvOp> op_;
};

std::shared_ptr<SendOp> send_op(at::Tensor bytes, int64_t tag, int64_t nbytes) {
  auto op = std::make_shared<SendOp>();
  op->tag = tag;
  op->total = nbytes;
  op->src = nbytes > 0 ? static_cast<const uint8_t*>(bytes.const_data_ptr()) : nullptr;
  op->source = std::move(bytes);
  return op;
}

}  // namespace

ShmChannel::ShmChannel(int rank, int size, int64_t ring_bytes, int64_t spin_us, int64_t slice_ms)
    : Channel("ShmChannel"), state_(std::make_shared<ShmState>()) {
  TORCH_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "ShmChannel: rank ", rank, " is not in [0, ", size, ")");
  TORCH_CHECK_VALUE(ring_bytes >= 4 * kMinChunk && ring_bytes % 4096 == 0, "ShmChannel: ring_bytes must be a multiple "
                    "of 4096 and at least ", 4 * kMinChunk, ", got ", ring_bytes);
  TORCH_CHECK_VALUE(spin_us >= 0 && slice_ms >= 1, "ShmChannel: spin_us must be >= 0 and slice_ms >= 1");
  auto& s = *state_;
  s.rank = rank;
  s.size = size;
  s.ring_bytes = ring_bytes;
  s.spin = std::chrono::microseconds(spin_us);
  s.slice = Millis(slice_ms);
  s.peers.resize(size);
  // An anonymous file (memfd): see shm_segment.h. Peers reach it through /proc/<pid>/fd while this rank lives.
  shm::OwnSegment own = shm::create_segment(rank, size, ring_bytes);
  s.fd = own.fd;
  s.name = std::move(own.name);
  s.own = own.map;
}

ShmChannel::~ShmChannel() { withdraw(); }

int ShmChannel::rank() const { return state_->rank; }
int ShmChannel::size() const { return state_->size; }

std::string ShmChannel::name() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->fd >= 0 ? state_->name : std::string();
}

void ShmChannel::withdraw() {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->fd >= 0) close(state_->fd);
  state_->fd = -1;
}

void ShmChannel::attach(int peer, const std::string& name) {
  auto& s = *state_;
  TORCH_CHECK_VALUE(peer >= 0 && peer < s.size && peer != s.rank, "ShmChannel.attach: ", peer,
                    " is not another rank of ", s.size);
  Mapping m = shm::open_segment(peer, s.size, s.ring_bytes, name);
  auto* h = m.header();
  std::lock_guard<std::mutex> lock(s.mu);
  auto& ps = s.peers[peer];
  ps.inbox.unmap();
  if (ps.pidfd >= 0) close(ps.pidfd);
  ps.inbox = m;
  ps.pid = h->owner_pid;
  ps.pidfd = shm::open_pidfd(ps.pid);  // -1: kill(pid, 0) instead
  ps.attached = true;
}

void ShmChannel::begin_step(int64_t step) { state_->begin_step(step); }

void ShmChannel::notify_failure(int64_t step, const std::string& text) {
  const std::string body = text.empty() ? std::string("step failed") : text.substr(0, kMaxFailureText);
  std::lock_guard<std::mutex> lock(state_->mu);
  for (int p = 0; p < state_->size; ++p) {
    auto& ps = state_->peers[p];
    if (p == state_->rank || !ps.attached) continue;
    at::Tensor bytes = at::empty({static_cast<int64_t>(body.size())}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(bytes.data_ptr(), body.data(), body.size());
    auto op = send_op(bytes, kFailureTag, static_cast<int64_t>(body.size()));
    op->step = step;
    ps.pending.push_back(std::move(op));
  }
  state_->progress();  // what does not fit now goes with this rank's next call, like any send
}

int64_t ShmChannel::discarded() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->discarded;
}

int64_t ShmChannel::unexpected() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  int64_t n = 0;
  for (const auto& p : state_->peers) {
    for (const auto& [tag, q] : p.unexpected) n += static_cast<int64_t>(q.size());
  }
  return n;
}

void ShmChannel::check_peer(int peer, int tag) const {
  Channel::check_peer(peer, tag);
  if (!state_->peers[peer].attached) {
    throw ChannelError("shared-memory transport: rank " + std::to_string(peer) + "'s segment was never attached");
  }
}

void ShmChannel::check_tensors(const std::vector<at::Tensor>& tensors, int peer) const {
  if (!tensors.empty() && !tensors.front().device().is_cpu()) {
    throw ChannelError("send to rank " + std::to_string(peer) + ": the shared-memory transport moves CPU tensors, got " +
                       tensors.front().device().str());
  }
}

std::shared_ptr<Request> ShmChannel::do_send(const Outgoing& msg) {
  const int peer = msg.peer, tag = msg.tag;
  const PackLayout& layout = msg.layout;
  std::vector<std::shared_ptr<SendOp>> ops;
  if (msg.with_layout) {
    at::Tensor words = layout.to_tensor();  // only the words: the receiver's buffer is zero padded
    ops.push_back(send_op(words, tag | kLayoutTagBit, static_cast<int64_t>(msg.layout_words.size()) * 8));
  }
  at::Tensor bytes;
  bool borrowed = false;
  if (layout.nbytes == 0) {
    bytes = at::Tensor();
  } else if (msg.flat.defined()) {
    bytes = msg.flat;  // already its packed form: copied into the ring as is
    borrowed = !msg.owned;
  } else {
    bytes = msg.pack();
  }
  ops.push_back(send_op(bytes, tag, layout.nbytes));
  ops.back()->borrowed = borrowed;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (auto& op : ops) op->step = state_->step;
    auto& pending = state_->peers[peer].pending;
    pending.insert(pending.end(), ops.begin(), ops.end());
    state_->progress();
    // The send owns its bytes when it returns: what of the caller's tensor is
    // not in the ring yet (a message larger than the free space) is copied now,
    // so a stage that writes the same tensor again cannot change what is sent.
    for (auto& op : ops) {
      if (!op->borrowed || op->done()) continue;
      op->source = op->source.slice(0, op->sent, op->total).clone();
      op->src = static_cast<const uint8_t*>(op->source.const_data_ptr());
      op->base = op->sent;
      op->borrowed = false;
    }
  }
  return std::make_shared<ShmSendRequest>(state_, peer, std::move(ops));
}

std::shared_ptr<Request> ShmChannel::recv(const PackLayout& layout, int peer, int tag) {
  check_peer(peer, tag);
  layout.validate();
  auto op = std::make_shared<RecvOp>();
  op->peer = peer;
  op->tag = tag;
  op->layout = layout;
  op->buffer = at::empty({std::max<int64_t>(layout.nbytes, 1)}, at::TensorOptions().dtype(at::kByte));
  state_->post(op);
  return std::make_shared<ShmRecvRequest>(state_, op);
}

std::shared_ptr<Request> ShmChannel::recv_layout(int peer, int tag) {
  check_peer(peer, tag);
  auto op = std::make_shared<RecvOp>();
  op->peer = peer;
  op->tag = tag | kLayoutTagBit;
  op->is_layout = true;
  op->buffer = at::zeros({kLayoutWords}, at::TensorOptions().dtype(at::kLong));
  state_->post(op);
  return std::make_shared<ShmRecvRequest>(state_, op);
}

}  // namespace pipeline_ext
