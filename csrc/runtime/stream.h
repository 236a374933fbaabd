// Device-agnostic streams and events. Every pipeline rank has a compute stream
// and one copy stream per direction on its device; on CPU they all collapse to
// no-ops, so the runtime (and Python above it) never branches on device type.
// The CUDA parts live in stream_cuda.cpp, compiled only WITH_CUDA.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>
#include <optional>

namespace pipeline_ext {

class Event;

// Which copy stream: into a device (host->device, peer->device) or out of it.
enum class CopyDirection { ToDevice = 0, FromDevice = 1 };

class Stream {
 public:
  // The stream work on `device` is currently issued to (the compute stream).
  static Stream current(const at::Device& device);
  // The dedicated copy stream of `device` for `direction`, created once per
  // process so copies never queue behind compute.
  static Stream copy(const at::Device& device, CopyDirection direction);
  // A stream of its own from the device's pool, for an owner that keeps it
  // (a channel's send and receive streams); the current stream on CPU.
  static Stream from_pool(const at::Device& device);

  explicit Stream(c10::Stream stream) : stream_(stream) {}

  at::Device device() const { return stream_.device(); }
  bool is_cuda() const { return stream_.device().is_cuda(); }
  const c10::Stream& native() const { return stream_; }

  // Makes this stream wait (on the device, not the host) until `event` fires.
  void wait(const Event& event) const;
  void synchronize() const;
  bool query() const;  // true once all work queued so far has finished
  bool operator==(const Stream& other) const { return stream_ == other.stream_; }

 private:
  c10::Stream stream_;
};

// Marks a point on a stream. A default-constructed or CPU-recorded event is
// always complete, so waiting on it costs nothing.
class Event {
 public:
  Event() = default;

  void record(const Stream& stream);
  void block(const Stream& stream) const;  // stream waits for this event
  void synchronize() const;                // host waits for this event
  bool query() const;
  bool is_recorded() const { return event_ != nullptr; }

 private:
  // shared: an Event is a cheap handle passed between producer and consumer.
  std::shared_ptr<c10::Event> event_;
};

// Makes `stream` current on its device for a scope (no-op for CPU streams).
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  std::optional<c10::Stream> previous_;
};

// Tells the caching allocator that `tensor` is used on `stream`, so its memory
// is not handed out again before that stream's work on it is done. No-op on CPU.
void record_stream(const at::Tensor& tensor, const Stream& stream);

#ifdef WITH_CUDA
// stream_cuda.cpp: the CUDA halves of the calls above.
namespace cuda_impl {
c10::Stream current_stream(c10::DeviceIndex index);
c10::Stream copy_stream(c10::DeviceIndex index, CopyDirection direction);
c10::Stream pool_stream(c10::DeviceIndex index);
void set_current_stream(const c10::Stream& stream);
void record_stream(const at::Tensor& tensor, const c10::Stream& stream);
}  // namespace cuda_impl
#endif

}  // namespace pipeline_ext
