#include "kernels/copy.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace pipeline_ext {

// Bytes one thread copies at least: below this a parallel region costs more than
// it saves. Large segments are cut into pieces of about this size so that all
// threads share one big copy.
constexpr int64_t kCpuGrainBytes = 256 * 1024;

void CopyPlan::add(const void* src, void* dst, int64_t nbytes, int64_t rows, int64_t src_stride,
                   int64_t dst_stride) {
  TORCH_CHECK(nbytes >= 0 && rows >= 0, "CopyPlan: negative segment size ", nbytes, " x ", rows);
  if (nbytes == 0 || rows == 0) return;
  if (rows > 1 && src_stride == nbytes && dst_stride == nbytes) {
    nbytes *= rows;
    rows = 1;
  }
  total_bytes_ += nbytes * rows;
  if (rows == 1 && !segments_.empty()) {
    auto& last = segments_.back();
    if (last.rows == 1 && static_cast<const char*>(last.src) + last.nbytes == src &&
        static_cast<char*>(last.dst) + last.nbytes == dst) {
      last.nbytes += nbytes;
      return;
    }
  }
  segments_.push_back({src, dst, nbytes, rows, src_stride, dst_stride});
}

void CopyPlan::run(const at::Device& device) const {
  if (segments_.empty()) return;
  if (device.is_cpu()) {
    run_copy_plan_cpu(segments_, total_bytes_);
    return;
  }
#ifdef WITH_CUDA
  if (device.is_cuda()) {
    run_copy_plan_cuda(segments_, device);
    return;
  }
#endif
  TORCH_CHECK(false, "pipeline_ext copy plan: unsupported device ", device,
              " (this build of pipeline_ext supports CPU",
#ifdef WITH_CUDA
              " and CUDA"
#endif
              ")");
}

at::Tensor tensor_on_storage(const at::Storage& storage, at::ScalarType dtype, int64_t offset,
                             at::IntArrayRef shape) {
  const auto key = c10::computeDispatchKey(dtype, at::kStrided, storage.device());
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key),
                                                    c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  t.unsafeGetTensorImpl()->set_storage_offset(offset);
  return t;
}

namespace {

// Copies bytes [begin, end) of segment `s` (counted row after row).
void copy_range(const CopySegment& s, int64_t begin, int64_t end) {
  int64_t row = begin / s.nbytes, col = begin % s.nbytes;
  const char* src = static_cast<const char*>(s.src) + row * s.src_stride;
  char* dst = static_cast<char*>(s.dst) + row * s.dst_stride;
  while (begin < end) {
    const int64_t n = std::min(s.nbytes - col, end - begin);
    std::memcpy(dst + col, src + col, n);
    begin += n;
    col = 0;
    src += s.src_stride;
    dst += s.dst_stride;
  }
}

}  // namespace

void run_copy_plan_cpu(const std::vector<CopySegment>& segments, int64_t total_bytes) {
  if (total_bytes <= kCpuGrainBytes || at::get_num_threads() == 1) {
    for (const auto& s : segments) copy_range(s, 0, s.total());
    return;
  }
  // Treat all segments as one byte range [0, total_bytes): each thread copies its
  // sub-range, which may start inside one segment (or row) and end in another.
  std::vector<int64_t> ends(segments.size());
  int64_t acc = 0;
  for (size_t i = 0; i < segments.size(); ++i) ends[i] = (acc += segments[i].total());
  at::parallel_for(0, total_bytes, kCpuGrainBytes, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    for (int64_t pos = begin; pos < end; ++i) {
      const int64_t seg_start = ends[i] - segments[i].total();
      const int64_t stop = std::min(ends[i], end);
      copy_range(segments[i], pos - seg_start, stop - seg_start);
      pos = stop;
    }
  });
}

}  // namespace pipeline_ext
