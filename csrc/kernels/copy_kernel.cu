// The copy-plan kernel: one launch copies every segment of a plan. Each block
// takes tiles of about 16 KiB (grid-stride), finds the tile's segment by binary
// search and copies it with 16-byte vector accesses when src and dst allow it.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/copy_kernel.h"

namespace pipeline_ext {
namespace {

__device__ __forceinline__ int64_t find_segment(const CopyTileDesc* d, int64_t n, int64_t tile) {
  int64_t lo = 0, hi = n - 1;  // last segment with tile_begin <= tile
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (d[mid].tile_begin <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Bytes [0, n) copied by `lanes` threads, this one being `lane`.
__device__ __forceinline__ void copy_bytes(const char* src, char* dst, int64_t n, int lane, int lanes) {
  int64_t i = 0;
  if (((reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const int64_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    for (int64_t k = lane; k < head && k < n; k += lanes) dst[k] = src[k];
    i = head < n ? head : n;
    const int64_t vecs = (n - i) / 16;
    const uint4* __restrict__ s4 = reinterpret_cast<const uint4*>(src + i);
    uint4* __restrict__ d4 = reinterpret_cast<uint4*>(dst + i);
    // Four loads in flight before the first store: a load-store-load loop
    // keeps one load per thread outstanding, which leaves HBM bandwidth unused.
    int64_t k = lane;
    for (; k + 3 * lanes < vecs; k += 4 * lanes) {
      const uint4 a = s4[k], b = s4[k + lanes], c = s4[k + 2 * lanes], e = s4[k + 3 * lanes];
      d4[k] = a;
      d4[k + lanes] = b;
      d4[k + 2 * lanes] = c;
      d4[k + 3 * lanes] = e;
    }
    for (; k < vecs; k += lanes) d4[k] = s4[k];
    i += vecs * 16;
  }
  for (int64_t k = i + lane; k < n; k += lanes) dst[k] = src[k];
}

// Whether every row of a segment is whole 16-byte vectors at 16-byte-aligned
// addresses in both src and dst.
__device__ __forceinline__ bool vector_rows(const char* src, const char* dst, const CopyTileDesc& d) {
  return ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | d.nbytes | d.src_stride |
           d.dst_stride) & 15) == 0;
}

template <bool kInline>
__global__ void copy_plan_kernel(const CopyTileDesc* table, InlineCopyTable inline_table,
                                 int64_t n_segments, int64_t total_tiles) {
  const CopyTileDesc* descs = kInline ? inline_table.descs : table;
  for (int64_t tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const CopyTileDesc d = descs[find_segment(descs, n_segments, tile)];
    const int64_t local = tile - d.tile_begin;
    const int64_t first_row = local / d.tiles_per_row * d.rows_per_tile;
    const char* src = static_cast<const char*>(d.src) + first_row * d.src_stride;
    char* dst = static_cast<char*>(d.dst) + first_row * d.dst_stride;
    if (d.rows_per_tile == 1) {  // part of one long row, whole block
      const int64_t off = local % d.tiles_per_row * kCopyTileBytes;
      const int64_t len = d.nbytes - off < kCopyTileBytes ? d.nbytes - off : kCopyTileBytes;
      copy_bytes(src + off, dst + off, len, threadIdx.x, blockDim.x);
    } else {  // several short rows
      const int64_t rows = d.rows - first_row < d.rows_per_tile ? d.rows - first_row : d.rows_per_tile;
      if (vector_rows(src, dst, d)) {
        // Every thread copies 16-byte vectors of the tile, rows back to back,
        // so no lane idles on rows shorter than a warp's 512 bytes (a 256-byte
        // row left half of every warp idle). A tile holds at most 16 KiB, so
        // the index math fits 32 bits.
        const unsigned per_row = static_cast<unsigned>(d.nbytes / 16);
        const unsigned total = static_cast<unsigned>(rows) * per_row;
        constexpr int kUnroll = 4;  // loads in flight per thread, as in copy_bytes
        for (unsigned base = threadIdx.x; base < total; base += kUnroll * blockDim.x) {
          uint4 v[kUnroll];
          uint4* out[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const unsigned k = base + u * blockDim.x;
            if (k < total) {
              const unsigned r = k / per_row, c = k - r * per_row;
              v[u] = reinterpret_cast<const uint4*>(src + r * d.src_stride)[c];
              out[u] = reinterpret_cast<uint4*>(dst + r * d.dst_stride) + c;
            }
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if (base + u * blockDim.x < total) *out[u] = v[u];
          }
        }
      } else {  // unaligned rows: one warp each
        const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
        for (int64_t r = threadIdx.x / 32; r < rows; r += warps) {
          copy_bytes(src + r * d.src_stride, dst + r * d.dst_stride, d.nbytes, lane, 32);
        }
      }
    }
  }
}

}  // namespace

void launch_copy_plan_kernel(const CopyTileDesc* table, const InlineCopyTable& inline_table,
                             int64_t n_segments, int64_t total_tiles, void* stream) {
  if (total_tiles == 0) return;
  constexpr int kThreads = 256;
  // Enough blocks to fill any current GPU several times over; the grid-stride
  // loop covers the rest.
  const int64_t blocks = total_tiles < 8192 ? total_tiles : 8192;
  auto s = static_cast<cudaStream_t>(stream);
  if (n_segments <= kInlineSegments) {
    copy_plan_kernel<true><<<blocks, kThreads, 0, s>>>(nullptr, inline_table, n_segments, total_tiles);
  } else {
    copy_plan_kernel<false><<<blocks, kThreads, 0, s>>>(table, inline_table, n_segments, total_tiles);
  }
}

}  // namespace pipeline_ext
