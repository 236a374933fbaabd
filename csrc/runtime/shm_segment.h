// One rank's inbox in shared memory, as bytes: the segment's layout (header,
// ring counters, rings of records), the doorbell its owner sleeps on, how a
// segment is made (an anonymous memfd) and opened by a peer, and how a peer's
// liveness is read (a pidfd). What the bytes mean to a channel (matching by
// step and tag, requests, failure notices) is shm_channel.cpp's; the layout
// and the reasons for it are in shm_channel.h's header comment.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <string>

namespace pipeline_ext::shm {

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

inline int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

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

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const struct timespec* timeout);

// Tells the owner there is news (a record, or room freed); wakes it if it sleeps.
void ring_doorbell(SegmentHeader* h);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string errno_text();

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
  void unmap();
};

struct OwnSegment {
  int fd = -1;       // the memfd; peers open it as `name` while it is open
  std::string name;  // /proc/<pid>/fd/<fd>
  Mapping map;
};

// This rank's inbox for `size` ranks with rings of `ring_bytes`, initialised; throws ChannelError.
OwnSegment create_segment(int rank, int size, int64_t ring_bytes);

// Rank `peer`'s inbox, opened from its `name` and checked (magic, version, ranks, owner, ring size);
// throws ChannelError naming what does not match.
Mapping open_segment(int peer, int size, int64_t ring_bytes, const std::string& name);

// A pidfd for `pid`, or -1 where the kernel has none (process_alive then uses kill(pid, 0)).
int open_pidfd(int64_t pid);

// False once the process has exited (zombies included: the pidfd is readable then).
bool process_alive(int pidfd, int64_t pid);

}  // namespace pipeline_ext::shm
