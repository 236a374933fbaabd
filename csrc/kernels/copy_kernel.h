// Declarations shared by the copy-plan kernel (copy.cu) and its host side
// (copy_cuda.cpp). Plain C++ so that the .cu does not have to parse ATen.
#pragma once

#include <cstdint>

namespace pipeline_ext {

// One segment as the kernel sees it: tiles [tile_begin, next tile_begin) of the
// launch belong to it, so a block finds its segment by binary search.
struct CopyTileDesc {
  const void* src;
  void* dst;
  int64_t nbytes;
  int64_t tile_begin;
};
// Plans this small travel as a kernel argument instead of a device-side table,
// saving a host-to-device upload for the common few-tensor case.
constexpr int kInlineSegments = 32;
struct InlineCopyTable {
  CopyTileDesc descs[kInlineSegments];
};
constexpr int64_t kCopyTileBytes = 16 * 1024;

// copy.cu: exactly one kernel launch on `stream`. `table` is a device pointer
// used when n_segments > kInlineSegments, else `inline_table` is used.
void launch_copy_plan_kernel(const CopyTileDesc* table, const InlineCopyTable& inline_table,
                             int64_t n_segments, int64_t total_tiles, void* stream);

}  // namespace pipeline_ext
