// CUDA host side of the copy plan: tile table + one launch on the current stream.
#include "kernels/copy.h"
#include "kernels/copy_kernel.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace pipeline_ext {

void run_copy_plan_cuda(const std::vector<CopySegment>& segments, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(segments.size());
  const int64_t desc_words = sizeof(CopyTileDesc) / sizeof(int64_t);
  static_assert(sizeof(CopyTileDesc) % sizeof(int64_t) == 0, "CopyTileDesc must be int64-sized");

  InlineCopyTable inline_table{};
  at::Tensor host;
  CopyTileDesc* descs = inline_table.descs;
  if (n > kInlineSegments) {
    // Pinned so the upload is asynchronous; the caching host allocator keeps it
    // alive until the copy on this stream has finished.
    host = at::empty({n * desc_words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    descs = reinterpret_cast<CopyTileDesc*>(host.data_ptr<int64_t>());
  }
  int64_t tiles = 0;
  for (int64_t i = 0; i < n; ++i) {
    descs[i] = {segments[i].src, segments[i].dst, segments[i].nbytes, tiles};
    tiles += (segments[i].nbytes + kCopyTileBytes - 1) / kCopyTileBytes;
  }
  at::Tensor table;
  if (n > kInlineSegments) table = host.to(device, /*non_blocking=*/true);
  auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  launch_copy_plan_kernel(
      n > kInlineSegments ? reinterpret_cast<const CopyTileDesc*>(table.data_ptr<int64_t>()) : nullptr,
      inline_table, n, tiles, static_cast<void*>(stream.stream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pipeline_ext
