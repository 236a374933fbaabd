#include "runtime/stream.h"

namespace pipeline_ext {
namespace {

[[noreturn]] void no_cuda(const at::Device& device) {
  TORCH_CHECK(false, "pipeline_ext was built without CUDA support, so it cannot use streams on ", device,
              "; rebuild with a CUDA toolkit and a CUDA build of torch");
}

// Resolves an index-less "cuda" to the current device so streams compare equal.
at::Device concrete(const at::Device& device) {
  if (device.is_cuda() && !device.has_index()) {
    return at::Device(at::kCUDA, Stream::current(device).device().index());
  }
  return device;
}

}  // namespace

Stream Stream::current(const at::Device& device) {
  if (!device.is_cuda()) return Stream(c10::Stream(c10::Stream::DEFAULT, at::Device(device.type())));
#ifdef WITH_CUDA
  return Stream(cuda_impl::current_stream(device.has_index() ? device.index() : -1));
#else
  no_cuda(device);
#endif
}

Stream Stream::copy(const at::Device& device, CopyDirection direction) {
  if (!device.is_cuda()) return current(device);
#ifdef WITH_CUDA
  return Stream(cuda_impl::copy_stream(concrete(device).index(), direction));
#else
  (void)direction;
  no_cuda(device);
#endif
}

Stream Stream::from_pool(const at::Device& device) {
  if (!device.is_cuda()) return current(device);
#ifdef WITH_CUDA
  return Stream(cuda_impl::pool_stream(concrete(device).index()));
#else
  no_cuda(device);
#endif
}

void Stream::wait(const Event& event) const { event.block(*this); }

void Stream::synchronize() const {
  if (is_cuda()) stream_.synchronize();
}

bool Stream::query() const { return !is_cuda() || stream_.query(); }

void Event::record(const Stream& stream) {
  if (!stream.is_cuda()) {
    event_.reset();  // CPU work is done by the time the host gets here
    return;
  }
  // A fresh c10::Event per record keeps earlier copies of this handle valid.
  auto event = std::make_shared<c10::Event>(stream.device().type());
  event->record(stream.native());
  event_ = std::move(event);
}

void Event::block(const Stream& stream) const {
  if (event_ && stream.is_cuda()) event_->block(stream.native());
}

void Event::synchronize() const {
  if (event_) event_->synchronize();
}

bool Event::query() const { return !event_ || event_->query(); }

StreamGuard::StreamGuard(const Stream& stream) {
  if (!stream.is_cuda()) return;
#ifdef WITH_CUDA
  previous_ = Stream::current(stream.device()).native();
  cuda_impl::set_current_stream(stream.native());
#endif
}

StreamGuard::~StreamGuard() {
#ifdef WITH_CUDA
  if (previous_) cuda_impl::set_current_stream(*previous_);
#endif
}

void record_stream(const at::Tensor& tensor, const Stream& stream) {
  if (!stream.is_cuda() || !tensor.defined() || !tensor.is_cuda()) return;
#ifdef WITH_CUDA
  cuda_impl::record_stream(tensor, stream.native());
#endif
}

}  // namespace pipeline_ext
