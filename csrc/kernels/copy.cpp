#include "kernels/copy.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace pipeline_ext {

// Bytes one thread copies at least: below this a parallel region costs more than
// it saves. Large segments are cut into pieces of about this size so that all
// threads share one big copy.
constexpr int64_t kCpuGrainBytes = 256 * 1024;

void CopyPlan::add(const void* src, void* dst, int64_t nbytes, int64_t src_stride, int64_t dst_stride) {
  TORCH_CHECK(nbytes >= 0, "CopyPlan: negative segment size ", nbytes);
  if (nbytes == 0) return;
  row_bytes_ += nbytes;
  if (!segments_.empty()) {
    auto& last = segments_.back();
    if (static_cast<const char*>(last.src) + last.nbytes == src && static_cast<char*>(last.dst) + last.nbytes == dst &&
        last.src_stride == src_stride && last.dst_stride == dst_stride) {
      last.nbytes += nbytes;
      return;
    }
  }
  segments_.push_back({src, dst, nbytes, src_stride, dst_stride});
}

void CopyPlan::run(const at::Device& device) const {
  if (empty()) return;
  if (device.is_cpu()) {
    run_copy_plan_cpu(segments_, rows_);
    return;
  }
#ifdef WITH_CUDA
  if (device.is_cuda()) {
    run_copy_plan_cuda(segments_, rows_, device);
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

bool is_wrapped(const at::Tensor& t) {
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                            c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper});
  return t.key_set().has_any(wrapped);
}

const char* unreadable_reason(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  if (t.is_nested()) return "a nested tensor";
  if (is_wrapped(t)) return "a tensor subclass or wrapper (DTensor, FakeTensor, a __torch_dispatch__ subclass)";
  if (t.layout() != at::kStrided) return "not a dense (strided) tensor (sparse or another layout)";
  if (t.is_quantized()) return "a quantized tensor";
  if (!(t.is_cpu() || t.is_cuda())) return "not on a CPU or CUDA device (a meta tensor has no data)";
  if (!t.has_storage()) return "a tensor without storage";
  return nullptr;
}

void check_readable(const at::Tensor& t, const char* op, int64_t index) {
  const char* why = unreadable_reason(t);
  if (why == nullptr) return;
  TORCH_CHECK_TYPE(false, op, index >= 0 ? ": tensor " + std::to_string(index) : std::string(), " is ", why,
                   ", whose memory pipeline_ext's core cannot read; pass plain dense CPU/CUDA tensors (a DTensor: "
                   ".to_local() or .full_tensor(); sparse: .to_dense(); quantized: .dequantize(); nested: "
                   ".to_padded_tensor(0))");
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

void run_copy_plan_cpu(const std::vector<CopySegment>& segments, int64_t rows) {
  // Byte q of row r of the plan is byte q - (start of its segment) of that
  // segment's row r; ends[i] is where segment i stops within a row.
  std::vector<int64_t> ends(segments.size());
  int64_t row_bytes = 0;
  for (size_t i = 0; i < segments.size(); ++i) ends[i] = (row_bytes += segments[i].nbytes);
  // Copies plan bytes [begin, end), which may start and stop inside a segment.
  auto copy = [&](int64_t begin, int64_t end) {
    int64_t r = begin / row_bytes, q = begin % row_bytes;
    size_t i = std::upper_bound(ends.begin(), ends.end(), q) - ends.begin();
    while (begin < end) {
      const CopySegment& s = segments[i];
      const int64_t off = q - (ends[i] - s.nbytes);
      const int64_t n = std::min(s.nbytes - off, end - begin);
      std::memcpy(static_cast<char*>(s.dst) + r * s.dst_stride + off,
                  static_cast<const char*>(s.src) + r * s.src_stride + off, n);
      begin += n;
      q += n;
      if (++i == segments.size()) i = 0, q = 0, ++r;
    }
  };
  const int64_t total = rows * row_bytes;
  if (total <= kCpuGrainBytes || at::get_num_threads() == 1) {
    copy(0, total);
  } else {
    at::parallel_for(0, total, kCpuGrainBytes, copy);
  }
}

}  // namespace pipeline_ext
