// CUDA halves of runtime/stream.h. Only c10/cuda headers: ATen/cuda/CUDAContext.h
// drags in cuBLAS/cuSPARSE headers the runtime does not need.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <mutex>
#include <unordered_map>

#include "runtime/stream.h"

namespace pipeline_ext {
namespace cuda_impl {

c10::Stream current_stream(c10::DeviceIndex index) { return c10::cuda::getCurrentCUDAStream(index).unwrap(); }

c10::Stream copy_stream(c10::DeviceIndex index, CopyDirection direction) {
  // One stream per (device, direction) for the life of the process: the pool
  // hands out streams round-robin, so asking it on every copy would spread
  // copies over streams and defeat the point of a dedicated one.
  static std::mutex mu;
  static std::unordered_map<c10::DeviceIndex, std::array<std::optional<c10::Stream>, 2>> streams;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = streams[index][static_cast<int>(direction)];
  if (!slot) slot = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index).unwrap();
  return *slot;
}

c10::Stream pool_stream(c10::DeviceIndex index) {
  return c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index).unwrap();
}

void set_current_stream(const c10::Stream& stream) {
  c10::cuda::setCurrentCUDAStream(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream));
}

void record_stream(const at::Tensor& tensor, const c10::Stream& stream) {
  c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(),
                                                c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream));
}

}  // namespace cuda_impl
}  // namespace pipeline_ext
