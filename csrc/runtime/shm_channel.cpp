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

namespace pipeline_ext {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x31306d68735f6570ULL;  // "pe_shm01"
constexpr uint32_t kVersion = 4;
constexpr int64_t kAlign = 64;
constexpr int64_t kRecordHeader = 64;
constexpr int64_t kPadTag = -1;
// A failure notice: a peer's step (the record's) failed; the payload says how (notify_failure).
constexpr int64_t kFailureTag = -2;
constexpr int64_t kMaxFailureText = 1024;
// A message that does not fit goes in chunks; none smaller than this (or than
// what is left of the message), so a nearly full ring does not cut it to crumbs.
constexpr int64_t kMinChunk = 64 * 1024;

int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory rings need lock-free atomics (they are shared between processes)");

// One ring's counters: bytes published by the producer, bytes released by the
// consumer (both only grow; position = counter % ring_bytes). Own cache lines.
struct RingControl {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
};

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t nranks;
  int64_t owner_rank;
  int64_t owner_pid;
  int64_t ring_bytes;
  // Bumped by anyone with news for the owner (a record in one of its rings, or
  // space freed in a ring the owner writes to); the owner sleeps on it (futex).
  alignas(64) std::atomic<uint32_t> doorbell;
  alignas(64) std::atomic<uint32_t> sleepers;  // owner threads asleep (or about to be) on the doorbell
};

struct RecordHeader {
  int64_t record_bytes;  // header + payload, rounded up to kAlign; the next record starts after it
  int64_t tag;           // kPadTag: filler up to the end of the ring; kFailureTag: a failure notice
  int64_t total;         // bytes of the whole message
  int64_t offset;        // where this chunk goes in the message
  int64_t chunk;         // payload bytes in this record
  int64_t step;          // the sender's step when it sent the message (ShmChannel::begin_step)
  int64_t reserved[2];
};
static_assert(sizeof(RecordHeader) == kRecordHeader);

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

void ring_doorbell(SegmentHeader* h) {
  h->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) > 0) futex(&h->doorbell, FUTEX_WAKE, INT_MAX, nullptr);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string errno_text() { return std::strerror(errno); }

// One mapped inbox. Rings are numbered by producer rank; the owner has none of its own.
struct Mapping {
  void* base = nullptr;
  size_t bytes = 0;

  static size_t controls_offset() { return static_cast<size_t>(round_up(sizeof(SegmentHeader), kAlign)); }
  static size_t data_offset(int nranks) {
    return static_cast<size_t>(round_up(controls_offset() + nranks * sizeof(RingControl), 4096));
  }
  static size_t total_bytes(int nranks, int64_t ring_bytes) {
    return data_offset(nranks) + static_cast<size_t>(nranks - 1) * static_cast<size_t>(ring_bytes);
  }

  SegmentHeader* header() const { return static_cast<SegmentHeader*>(base); }
  RingControl* ring(int producer) const {
    return reinterpret_cast<RingControl*>(static_cast<uint8_t*>(base) + controls_offset()) + producer;
  }
  uint8_t* data(int producer) const {
    const auto* h = header();
    const int slot = producer < h->owner_rank ? producer : producer - 1;
    return static_cast<uint8_t*>(base) + data_offset(static_cast<int>(h->nranks)) + slot * h->ring_bytes;
  }
  void unmap() {
    if (base) munmap(base, bytes);
    base = nullptr;
  }
};

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

  // False once the peer's process has exited (zombies included: the pidfd is readable then).
  bool alive(int peer) const {
    const auto& p = peers[peer];
    if (p.pidfd >= 0) {
      pollfd fd{p.pidfd, POLLIN, 0};
      return poll(&fd, 1, 0) == 0;
    }
    return !(kill(static_cast<pid_t>(p.pid), 0) != 0 && errno == ESRCH);
  }

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
  // An anonymous file (memfd): it has no name anywhere, so it cannot outlive its last user, whatever
  // the exit (SIGKILL included). Peers reach it through /proc/<pid>/fd while this rank lives.
  const int fd = static_cast<int>(syscall(SYS_memfd_create, "pipeline_ext_shm", MFD_CLOEXEC));
  if (fd < 0) throw ChannelError("shared-memory transport: cannot create an inbox (memfd_create): " + errno_text());
  s.fd = fd;
  s.name = "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(fd);
  const size_t bytes = Mapping::total_bytes(size, ring_bytes);
  // Allocated now (not sparse): no room is an error here, not a SIGBUS in a later write.
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    throw ChannelError("shared-memory transport: cannot allocate " + std::to_string(bytes) + " bytes of shared "
                       "memory for an inbox: " + std::strerror(err) + " (set PIPELINE_EXT_TRANSPORT=gloo, or a smaller "
                       "PIPELINE_EXT_SHM_RING_BYTES)");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw ChannelError("shared-memory transport: cannot map the inbox: " + errno_text());
  s.own.base = base;
  s.own.bytes = bytes;
  auto* h = new (base) SegmentHeader();
  h->magic = kMagic;
  h->version = kVersion;
  h->nranks = static_cast<uint32_t>(size);
  h->owner_rank = rank;
  h->owner_pid = getpid();
  h->ring_bytes = ring_bytes;
  for (int p = 0; p < size; ++p) new (s.own.ring(p)) RingControl();
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
  const int fd = open(name.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    throw ChannelError("shared-memory transport: cannot open rank " + std::to_string(peer) + "'s inbox " + name +
                       ": " + errno_text() + " (has that rank exited? is it on this host, in this pid namespace?)");
  }
  struct stat st {};
  const bool ok = fstat(fd, &st) == 0;
  const size_t bytes = Mapping::total_bytes(s.size, s.ring_bytes);
  void* base = ok && static_cast<size_t>(st.st_size) == bytes
                   ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                   : MAP_FAILED;
  close(fd);
  if (base == MAP_FAILED) {
    throw ChannelError("shared-memory transport: rank " + std::to_string(peer) + "'s segment " + name +
                       " cannot be mapped or has another size (ranks must agree on the ring size)");
  }
  Mapping m{base, bytes};
  auto* h = m.header();
  if (h->magic != kMagic || h->version != kVersion || h->nranks != static_cast<uint32_t>(s.size) ||
      h->owner_rank != peer || h->ring_bytes != s.ring_bytes) {
    m.unmap();
    throw ChannelError("shared-memory transport: " + name + " is not rank " + std::to_string(peer) +
                       "'s segment of this group (other version or ring size?)");
  }
  std::lock_guard<std::mutex> lock(s.mu);
  auto& ps = s.peers[peer];
  ps.inbox.unmap();
  if (ps.pidfd >= 0) close(ps.pidfd);
  ps.inbox = m;
  ps.pid = h->owner_pid;
  ps.pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(ps.pid), 0));  // -1: kill(pid, 0) instead
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
