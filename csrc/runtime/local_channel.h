// The in-process channel of the single-process Pipe: one worker thread per rank,
// all sharing a LocalHub of mailboxes. On CUDA a message between devices is
// copied on dedicated copy streams ordered after the producer's compute stream
// by an event, and the consumer's compute stream waits for the copy; on one
// device a copy made at once is handed over (see transfer(): a send owns its
// bytes), autograd's gradients as they are.
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/channel.h"
#include "runtime/stream.h"

namespace pipeline_ext {

// What travels through a mailbox: the tensors (already on the consumer's
// device) and the event after which they may be read.
struct LocalMessage {
  std::vector<at::Tensor> tensors;
  Event ready;
};

// Moves `tensors` (detached) from `src` to `dst` without stalling either
// device's compute stream: the copy runs on src's FromDevice and dst's ToDevice
// copy streams, after everything src's current stream has queued so far. The
// result is allocated on dst's copy stream and may be read once `ready` fires:
// a CUDA reader must wait for it on its stream and record_stream the tensors
// there (see `consume`), a host reader must synchronize it. Same device: a
// copy made on src's current stream (the producer may write its tensors again
// in its next forward), ready after it; `owned` tensors (the pipeline's own,
// e.g. autograd's gradients, which no one else writes) are handed over as they are. With
// `copy_streams=false` the copy is queued on the current streams instead.
// Shared by LocalChannel (activations, forward) and Pipe's Boundary (gradients,
// backward), so both directions follow one protocol.
LocalMessage transfer(const std::vector<at::Tensor>& tensors, const at::Device& src, const at::Device& dst,
                      bool copy_streams = true, bool owned = false);

// The reader's half of `transfer` on `device`: its current stream (or the
// host, for CPU) waits for `message.ready`, and the caching allocator learns
// that the tensors are used on that stream. Returns the tensors.
std::vector<at::Tensor> consume(LocalMessage message, const at::Device& device);

class LocalHub {
 public:
  // `devices[r]` is rank r's device. At most `capacity` messages may wait from
  // one rank to another; a send beyond that blocks up to `send_timeout_ms`.
  // `copy_streams=false` copies between devices on the producer's compute
  // stream instead: the baseline of benchmarks/bench_overlap.py, never faster.
  explicit LocalHub(std::vector<at::Device> devices, int64_t capacity = 4096, int64_t send_timeout_ms = 300000,
                    bool copy_streams = true);

  int size() const { return static_cast<int>(devices_.size()); }
  const at::Device& device(int rank) const;
  int64_t capacity() const { return capacity_; }
  bool copy_streams() const { return copy_streams_; }

  // Queues a message from src to dst under tag (blocks while src->dst is full).
  void put(int src, int dst, int64_t tag, LocalMessage message);
  // Takes the oldest message from src to dst under tag, waiting up to `timeout`.
  LocalMessage take(int src, int dst, int64_t tag, Millis timeout, const std::string& what);
  bool ready(int src, int dst, int64_t tag);
  // Messages queued and not yet taken (all mailboxes).
  int64_t pending();

  // Fails every current and future wait with `reason`, so when one worker
  // thread dies the others stop at once instead of waiting out their timeouts.
  void close(const std::string& reason);
  bool closed();

 private:
  void check_rank(int rank, const char* role) const;
  void check_open(const std::string& what) const;  // with mu_ held

  std::vector<at::Device> devices_;
  int64_t capacity_;
  Millis send_timeout_;
  bool copy_streams_;
  std::mutex mu_;
  std::condition_variable cv_;  // one for all: a handful of threads, notify_all is cheap
  std::map<std::tuple<int, int, int64_t>, std::deque<LocalMessage>> boxes_;
  std::vector<int64_t> queued_;  // per (src * size + dst)
  bool closed_ = false;
  std::string reason_;
};

class LocalChannel {
 public:
  LocalChannel(std::shared_ptr<LocalHub> hub, int rank);

  int rank() const { return rank_; }
  const std::shared_ptr<LocalHub>& hub() const { return hub_; }

  // Hands `tensors` (detached) to `peer`; the request is complete at once.
  std::shared_ptr<Request> send(const std::vector<at::Tensor>& tensors, int peer, int64_t tag, bool owned = false);
  // A request whose wait blocks until the message from `peer` under `tag` arrives.
  std::shared_ptr<Request> recv(int peer, int64_t tag);

 private:
  std::shared_ptr<LocalHub> hub_;
  int rank_;
};

}  // namespace pipeline_ext
