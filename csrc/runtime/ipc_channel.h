// Same-host transport for GPU ranks: a Channel (send / recv / recv_layout,
// matched by (peer, tag) like Gloo and ShmChannel) whose payloads go from one
// process's device memory to another's through CUDA IPC.
//
// Control plane: the shared-memory rings of a ShmChannel (runtime/shm_channel.h).
// A send packs the tensors (on the channel's send stream, fenced after the
// compute stream) into a block of device memory the sender exported, records
// the block's IPC "ready" event, and sends one control message over the rings:
// the block's IPC memory handle and offset, its ready and "done" IPC event
// handles, the payload's size and its layout. The receiver opens the handles
// (cached per peer and block, bounded: runtime/handle_cache.h), makes its
// receive stream wait for "ready", copies the payload with cudaMemcpyAsync into
// a buffer of its own (a copy engine, no kernel), records "done" after the copy
// and acknowledges the block over a second ShmChannel (the acknowledgements').
// The sender takes a block back into its pool only once acknowledged, and its
// send stream waits for "done" before writing it again: no host
// synchronisation on the data path.
//
// Dead peers: every host wait is on the rings, which see a peer's exit through
// its pidfd (ShmChannel); the survivor's wait then fails with a ChannelError
// naming the peer, and the handles opened from that peer are closed.
// An acknowledgement that cannot come (its receiver exited) frees the block.
//
// Known limits: a block whose message no receive ever took (a failed step's
// leftover) stays with the sender until the channel goes; whether a peer's
// memory can be mapped is checked once, at setup, on one buffer per peer
// (comm/transport/setup.py); the copy is issued when the receive is waited on, not when the
// control message arrives; closing an evicted handle waits on the host for the
// last copy out of it (only when the cache overflows); a torch IPC handle
// longer than 128 bytes (expandable segments may give one) is refused with a
// ChannelError.
//
// This header has no CUDA type in it; the class is implemented in
// ipc_channel_cuda.cpp and exists only in a CUDA build (WITH_CUDA).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/channel.h"
#include "runtime/shm_channel.h"

namespace pipeline_ext {

struct IpcState;  // streams, the block pool, the handle cache (ipc_channel_cuda.cpp)

class IpcChannel : public Channel {
 public:
  // Words of a control message: a header (kHeaderWords) then the payload's encoded layout.
  static constexpr int64_t kHeaderWords = 48;
  static constexpr int64_t kControlWords = kHeaderWords + kLayoutWords;

  // `control` and `acks`: two ShmChannels of the same ranks, attached to every
  // peer. `device`: the CUDA device of this rank's stages. At most
  // `pool_blocks` exported blocks are kept idle for reuse; at most
  // `cache_entries` opened peer blocks are kept mapped.
  IpcChannel(std::shared_ptr<ShmChannel> control, std::shared_ptr<ShmChannel> acks, at::Device device,
             int64_t pool_blocks = 4, int64_t cache_entries = 64);
  ~IpcChannel() override;

  int rank() const override;
  int size() const override;
  at::Device device() const override;

  std::shared_ptr<Request> recv(const PackLayout& layout, int peer, int tag) override;
  // The layout travels in the data's control message: this posts the receive
  // of that message; the recv() that follows for (peer, tag) takes its payload
  // (a received layout other than the posted one is a ChannelError naming both).
  std::shared_ptr<Request> recv_layout(int peer, int tag) override;
  void begin_step(int64_t step) override;

  // For tests and the benchmark: blocks exported, idle, awaiting acknowledgement; opened peer blocks cached.
  int64_t blocks_exported() const;
  int64_t blocks_idle() const;
  int64_t blocks_in_flight() const;
  int64_t handles_cached() const;

 protected:
  // CUDA tensors on device() only.
  void check_tensors(const std::vector<at::Tensor>& tensors, int peer) const override;
  std::shared_ptr<Request> do_send(const Outgoing& msg) override;

 private:
  std::shared_ptr<IpcState> state_;
};

// The setup's probe (comm/transport/setup.py): whether this process can open memory another
// process exported. ipc_export_probe: the IPC handle of `tensor`'s memory (a CUDA
// tensor from the caching allocator; bytes to send to the peers).
// ipc_open_probe: opens a peer's handle on `device` and closes it again; empty
// when that worked, else why not.
std::string ipc_export_probe(const at::Tensor& tensor);
std::string ipc_open_probe(const std::string& handle, at::Device device);

}  // namespace pipeline_ext
