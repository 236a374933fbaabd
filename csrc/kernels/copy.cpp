#include "kernels/copy.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace pipeline_ext {

// Bytes one thread copies at least: below this a parallel region costs more than
// it saves. Large segments are cut into pieces of about this size so that all
// threads share one big copy.
constexpr int64_t kCpuGrainBytes = 256 * 1024;

void CopyPlan::add(const void* src, void* dst, int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "CopyPlan: negative segment size ", nbytes);
  if (nbytes == 0) return;
  if (!segments_.empty()) {
    auto& last = segments_.back();
    if (static_cast<const char*>(last.src) + last.nbytes == src &&
        static_cast<char*>(last.dst) + last.nbytes == dst) {
      last.nbytes += nbytes;
      total_bytes_ += nbytes;
      return;
    }
  }
  segments_.push_back({src, dst, nbytes});
  total_bytes_ += nbytes;
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

void run_copy_plan_cpu(const std::vector<CopySegment>& segments, int64_t total_bytes) {
  if (total_bytes <= kCpuGrainBytes || at::get_num_threads() == 1) {
    for (const auto& s : segments) std::memcpy(s.dst, s.src, s.nbytes);
    return;
  }
  // Treat all segments as one byte range [0, total_bytes): each thread copies its
  // sub-range, which may start inside one segment and end inside another.
  std::vector<int64_t> ends(segments.size());
  int64_t acc = 0;
  for (size_t i = 0; i < segments.size(); ++i) ends[i] = (acc += segments[i].nbytes);
  at::parallel_for(0, total_bytes, kCpuGrainBytes, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    int64_t pos = begin;
    while (pos < end) {
      const auto& s = segments[i];
      const int64_t seg_start = ends[i] - s.nbytes;
      const int64_t off = pos - seg_start;
      const int64_t n = std::min(ends[i], end) - pos;
      std::memcpy(static_cast<char*>(s.dst) + off, static_cast<const char*>(s.src) + off, n);
      pos += n;
      ++i;
    }
  });
}

}  // namespace pipeline_ext
