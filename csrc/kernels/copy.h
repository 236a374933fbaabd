// Copy plans: every kernel here (split, concat, pack) reduces its byte moving to
// a list of contiguous (src, dst, nbytes) segments executed in ONE pass, so the
// cost is one parallel region on CPU or one kernel launch on CUDA, regardless of
// how many tensors or outer rows are involved.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdint>
#include <vector>

namespace pipeline_ext {

// `rows` rows of `nbytes` contiguous bytes; row r is copied from
// src + r * src_stride to dst + r * dst_stride. One segment describes e.g. one
// input of a concat across all outer indices, so plans stay O(#tensors).
struct CopySegment {
  const void* src;
  void* dst;
  int64_t nbytes;
  int64_t rows = 1;
  int64_t src_stride = 0;
  int64_t dst_stride = 0;

  int64_t total() const { return nbytes * rows; }
};

class CopyPlan {
 public:
  // Appends a segment; empty ones are dropped, rows that are back to back in
  // both src and dst collapse into one row, and a single row that continues
  // the previous single row in both src and dst is merged into it.
  void add(const void* src, void* dst, int64_t nbytes, int64_t rows = 1, int64_t src_stride = 0,
           int64_t dst_stride = 0);
  // Executes every segment on `device` (CPU: parallel memcpy; CUDA: one kernel
  // on the current stream). All pointers must live on that device.
  void run(const at::Device& device) const;

  const std::vector<CopySegment>& segments() const { return segments_; }
  int64_t total_bytes() const { return total_bytes_; }
  bool empty() const { return segments_.empty(); }

 private:
  std::vector<CopySegment> segments_;
  int64_t total_bytes_ = 0;
};

// Below this many bytes per segment a memcpy-per-segment plan loses to a
// strided TensorIterator copy, so callers fall back to Tensor::copy_.
constexpr int64_t kMinSegmentBytes = 128;

// True when a tensor's values are exactly its bytes, laid out contiguously, so a
// memcpy moves it; conjugate/negative views need copy_ to resolve their bit.
inline bool is_plain(const at::Tensor& t) { return t.is_contiguous() && !t.is_conj() && !t.is_neg(); }

// const_data_ptr for sources so that copy-on-write inputs are not materialized.
inline const char* src_bytes(const at::Tensor& t) { return static_cast<const char*>(t.const_data_ptr()); }
inline char* dst_bytes(const at::Tensor& t) { return static_cast<char*>(t.mutable_data_ptr()); }

// A contiguous tensor with `dtype` and `shape` on `storage` starting at element
// `offset`, built without a dispatcher round trip (views for split and unpack).
at::Tensor tensor_on_storage(const at::Storage& storage, at::ScalarType dtype, int64_t offset, at::IntArrayRef shape);

void run_copy_plan_cpu(const std::vector<CopySegment>& segments, int64_t total_bytes);

#ifdef WITH_CUDA
// Host side (copy_cuda.cpp): builds the tile table and launches the kernel.
void run_copy_plan_cuda(const std::vector<CopySegment>& segments, const at::Device& device);

#endif

}  // namespace pipeline_ext
