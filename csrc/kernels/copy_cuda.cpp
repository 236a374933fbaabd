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
    const CopySegment& g = segments[i];
    const bool long_rows = g.nbytes >= kCopyTileBytes;
    const int64_t tiles_per_row = long_rows ? (g.nbytes + kCopyTileBytes - 1) / kCopyTileBytes : 1;
    const int64_t rows_per_tile = long_rows ? 1 : kCopyTileBytes / g.nbytes;
    descs[i] = {g.src, g.dst, g.nbytes, g.rows, g.src_stride, g.dst_stride, tiles, tiles_per_row, rows_per_tile};
    tiles += (g.rows + rows_per_tile - 1) / rows_per_tile * tiles_per_row;
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
