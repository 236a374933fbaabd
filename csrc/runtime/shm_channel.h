// Same-host shared-memory transport for CPU ranks: a Channel (send / recv /
// recv_layout, matched by (peer, tag) like Gloo) whose bytes go through POSIX
// shared memory instead of sockets.
//
// Why: a Gloo message costs the receiver an IO-thread and a condition-variable
// wake-up (milliseconds on a loaded 2-core box); here the sender writes the
// message into the receiver's inbox and rings its doorbell, a futex word the
// receiver sleeps on after a short spin.
//
// Layout: every rank owns one segment, its inbox: a header (doorbell futex word,
// owner pid) and one ring per peer (single producer: that peer; single consumer:
// the owner). Every rank maps every other rank's inbox. A message travels as one
// or more records [64-byte header | payload] in the sender's ring; the receiver
// copies each record out (one memcpy) into the posted receive's buffer, or, when
// no receive is posted yet for that tag, into a buffer of its own that a later
// receive takes over (like MPI's unexpected messages).
// [Note: drain always] Draining always, whatever the tag, is what keeps a full
// ring from deadlocking two ranks; a message larger than the free space goes in
// chunks as the receiver frees it.
//
// Progress is made by whichever thread of the process is inside a call (send,
// is_completed, wait): no background thread. A send that does not fit now stays
// queued in the sender and is pushed by its later calls.
//
// Crashes: an inbox is an anonymous file (memfd_create) that peers open through
// /proc/<owner pid>/fd/<fd>: it has no name in /dev/shm or anywhere, so it is
// freed with its last mapping whatever the exit (SIGKILL before or after the
// first step included). A peer that exits is seen through a pidfd within one
// sleep slice.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/pack.h"
#include "runtime/channel.h"

namespace pipeline_ext {

struct ShmState;  // mappings, per-peer queues, the lock (shm_channel.cpp)

class ShmChannel : public Channel {
 public:
  // Creates this rank's inbox (one ring of ring_bytes per peer). spin_us: how
  // long a wait spins before it sleeps on the futex; slice_ms: how often a
  // sleeping wait checks that its peer is alive.
  ShmChannel(int rank, int size, int64_t ring_bytes, int64_t spin_us = 20, int64_t slice_ms = 50);
  ~ShmChannel() override;

  int rank() const override;
  int size() const override;
  at::Device device() const override { return at::Device(at::kCPU); }
  // Where the peers open this rank's inbox (attach()); empty once withdrawn.
  std::string name() const;
  // Maps `peer`'s inbox (opened at `name`) and watches its process.
  void attach(int peer, const std::string& name);
  // Closes the descriptor peers open the inbox through (the mapping stays), e.g.
  // when the group will not use shared memory; idempotent; the destructor does it too.
  void withdraw();

  std::shared_ptr<Request> recv(const PackLayout& layout, int peer, int tag) override;
  std::shared_ptr<Request> recv_layout(int peer, int tag) override;

  // Sends are stamped with the step and receives match (step, tag), so a
  // message is only ever taken by the step that sent it; messages of earlier
  // steps (a failed step's leftovers) are dropped, now and when they arrive later.
  void begin_step(int64_t step) override;
  // Tells every peer that step `step` failed on this rank (`text`: how, at most
  // 1 KB kept): their waits in that step end now with `text` instead of at their
  // timeout. Queued behind this rank's earlier sends, never waited on.
  void notify_failure(int64_t step, const std::string& text);

  // Messages received that no receive has taken yet (a leak check for tests).
  int64_t unexpected() const;
  // Leftovers of earlier steps dropped so far.
  int64_t discarded() const;

 protected:
  // Also: `peer`'s inbox is attached.
  void check_peer(int peer, int tag) const override;
  // CPU tensors only.
  void check_tensors(const std::vector<at::Tensor>& tensors, int peer) const override;
  std::shared_ptr<Request> do_send(const Outgoing& msg) override;

 private:
  std::shared_ptr<ShmState> state_;
};

}  // namespace pipeline_ext
