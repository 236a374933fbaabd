// Declarations shared by the copy-plan kernel (copy_kernel.cu) and its host side
// (copy_cuda.cpp). Plain C++ so that the .cu does not have to parse ATen.
#pragma once

#include <cstdint>

namespace pipeline_ext {

// One segment (rows x nbytes, strided rows) as the kernel sees it. Its tiles
// are [tile_begin, next tile_begin) of the launch, so a block finds its segment
// by binary search. Long rows are cut into tiles_per_row tiles; short rows are
// grouped rows_per_tile to a tile (one warp per row).
struct CopyTileDesc {
  const void* src;
  void* dst;
  int64_t nbytes;
  int64_t rows;
  int64_t src_stride;
  int64_t dst_stride;
  int64_t tile_begin;
  int64_t tiles_per_row;
  int64_t rows_per_tile;
};
// Plans this small travel as a kernel argument instead of a device-side table,
// saving a host-to-device upload for the common few-tensor case.
constexpr int kInlineSegments = 32;
struct InlineCopyTable {
  CopyTileDesc descs[kInlineSegments];
};
constexpr int64_t kCopyTileBytes = 16 * 1024;

// copy_kernel.cu: exactly one kernel launch on `stream`. `table` is a device pointer
// used when n_segments > kInlineSegments, else `inline_table` is used.
void launch_copy_plan_kernel(const CopyTileDesc* table, const InlineCopyTable& inline_table,
                             int64_t n_segments, int64_t total_tiles, void* stream);

}  // namespace pipeline_ext
