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

// `nbytes` contiguous bytes per row of the plan: in row r they are copied from
// src + r * src_stride to dst + r * dst_stride. One segment describes e.g. one
// input of a concat across all outer indices, so plans stay O(#tensors).
struct CopySegment {
  const void* src;
  void* dst;
  int64_t nbytes;
  int64_t src_stride = 0;
  int64_t dst_stride = 0;
};

class CopyPlan {
 public:
  // Row r copies every segment's row r, in order: for concat that writes the
  // output front to back (and split reads its input front to back), which
  // streams far better than one strided pass per tensor.
  explicit CopyPlan(int64_t rows = 1) : rows_(rows) {}
  // Appends a segment; empty ones are dropped and one that continues the
  // previous one in both src and dst (same strides) is merged into it.
  void add(const void* src, void* dst, int64_t nbytes, int64_t src_stride = 0, int64_t dst_stride = 0);
  // Executes every segment on `device` (CPU: parallel memcpy; CUDA: one kernel
  // on the current stream). All pointers must live on that device.
  void run(const at::Device& device) const;

  const std::vector<CopySegment>& segments() const { return segments_; }
  int64_t rows() const { return rows_; }
  int64_t total_bytes() const { return row_bytes_ * rows_; }
  bool empty() const { return segments_.empty() || rows_ == 0; }

 private:
  std::vector<CopySegment> segments_;
  int64_t rows_;
  int64_t row_bytes_ = 0;
};

// Below this many bytes per segment a memcpy-per-segment plan loses to a
// strided TensorIterator copy, so callers fall back to Tensor::copy_.
constexpr int64_t kMinSegmentBytes = 128;

// True when a tensor's values are exactly its bytes, laid out contiguously, so a
// memcpy moves it; conjugate/negative views need copy_ to resolve their bit.
inline bool is_plain(const at::Tensor& t) { return t.is_contiguous() && !t.is_conj() && !t.is_neg(); }

// Why the core may not read `t`'s bytes itself (data pointer and strides), or
// nullptr when it may: a dense strided CPU/CUDA tensor with no wrapper around it.
// Every path that reads or writes a tensor's memory directly (pack, the kernels,
// every channel's send) checks its tensors with it: a tensor subclass that
// dispatches in Python (DTensor, FakeTensor, a __torch_dispatch__ wrapper, a
// jagged NestedTensor) has no memory of its own there (its data pointer may be
// null), and sparse, nested, quantized and meta tensors are not laid out as
// their shape says. Reading them would crash the process. A few flag tests: no
// measurable cost per message.
const char* unreadable_reason(const at::Tensor& t);

// True for a tensor seen through a wrapper or functional layer (a Python
// subclass's dispatch, functionalization, vmap, grad transforms): its metadata
// is the wrapper's, its bytes (if any) are not at its data pointer.
bool is_wrapped(const at::Tensor& t);

// TypeError naming the tensor ("pack: tensor 1", or `op` alone for index -1),
// the reason and what to do, unless the core may read `t` directly (see
// unreadable_reason).
void check_readable(const at::Tensor& t, const char* op, int64_t index);

// const_data_ptr for sources so that copy-on-write inputs are not materialized.
inline const char* src_bytes(const at::Tensor& t) { return static_cast<const char*>(t.const_data_ptr()); }
inline char* dst_bytes(const at::Tensor& t) { return static_cast<char*>(t.mutable_data_ptr()); }

// A contiguous tensor with `dtype` and `shape` on `storage` starting at element
// `offset`, built without a dispatcher round trip (views for split and unpack).
at::Tensor tensor_on_storage(const at::Storage& storage, at::ScalarType dtype, int64_t offset, at::IntArrayRef shape);

void run_copy_plan_cpu(const std::vector<CopySegment>& segments, int64_t rows);

#ifdef WITH_CUDA
// Host side (copy_cuda.cpp): builds the tile table and launches the kernel.
void run_copy_plan_cuda(const std::vector<CopySegment>& segments, int64_t rows, const at::Device& device);

#endif

}  // namespace pipeline_ext
