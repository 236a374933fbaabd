#include "kernels/split_concat.h"

#include <ATen/MemoryOverlap.h>

#include "kernels/copy.h"

namespace pipeline_ext {
namespace {

int64_t wrap_dim(const char* op, int64_t dim, int64_t ndim) {
  TORCH_CHECK_INDEX(dim >= -ndim && dim < ndim, op, ": dim ", dim,
                    " is out of range for a tensor with ", ndim, " dimensions (expected ", -ndim,
                    " to ", ndim - 1, ")");
  return dim < 0 ? dim + ndim : dim;
}

// A contiguous tensor viewed as [outer, size(dim), inner].
struct Dims3 {
  int64_t outer = 1;
  int64_t inner = 1;
};

Dims3 around(at::IntArrayRef shape, int64_t dim) {
  Dims3 r;
  for (int64_t i = 0; i < dim; ++i) r.outer *= shape[i];
  for (int64_t i = dim + 1; i < static_cast<int64_t>(shape.size()); ++i) r.inner *= shape[i];
  return r;
}

}  // namespace

std::vector<at::Tensor> split(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim) {
  TORCH_CHECK_VALUE(input.dim() > 0, "split: cannot split a 0-d tensor (it has no dimension to split along)");
  const int64_t d = wrap_dim("split", dim, input.dim());
  TORCH_CHECK_VALUE(!sizes.empty(), "split: sizes is empty; give at least one piece size");
  int64_t sum = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK_VALUE(sizes[i] >= 0, "split: sizes[", i, "] = ", sizes[i], " is negative (sizes ", sizes, ")");
    sum += sizes[i];
  }
  TORCH_CHECK_VALUE(sum == input.size(d), "split: sizes ", sizes, " sum to ", sum, " but dimension ", d,
                    " of the tensor with shape ", input.sizes(), " has size ", input.size(d));
  c10::NoGradGuard no_grad;

  std::vector<at::Tensor> views;
  views.reserve(sizes.size());
  bool all_contiguous = true;
  int64_t start = 0;
  for (int64_t s : sizes) {
    views.push_back(input.narrow(d, start, s));
    all_contiguous = all_contiguous && views.back().is_contiguous();
    start += s;
  }
  if (all_contiguous) return views;

  // One allocation for all pieces, piece after piece, each piece contiguous.
  const Dims3 dims = around(input.sizes(), d);
  const int64_t es = input.element_size();
  at::Tensor buffer = at::empty({input.numel()}, input.options());
  std::vector<at::Tensor> pieces;
  pieces.reserve(sizes.size());
  std::vector<int64_t> shape = input.sizes().vec();
  int64_t offset = 0;
  for (int64_t s : sizes) {
    shape[d] = s;
    const int64_t n = dims.outer * s * dims.inner;
    pieces.push_back(buffer.narrow(0, offset, n).view(shape));
    offset += n;
  }
  // A segment per (outer row, piece); when rows are tiny the strided copy wins.
  const bool plan_ok = is_plain(input) &&
                       (dims.outer == 1 || dims.inner * es * input.size(d) / static_cast<int64_t>(sizes.size()) >=
                                               kMinSegmentBytes);
  if (!plan_ok) {
    for (size_t i = 0; i < sizes.size(); ++i) pieces[i].copy_(views[i]);
    return pieces;
  }
  CopyPlan plan;
  const char* src = src_bytes(input);
  const int64_t row_bytes = input.size(d) * dims.inner * es;
  for (int64_t o = 0; o < dims.outer; ++o) {
    int64_t col = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t seg = sizes[i] * dims.inner * es;
      plan.add(src + o * row_bytes + col, dst_bytes(pieces[i]) + o * seg, seg);
      col += seg;
    }
  }
  plan.run(input.device());
  return pieces;
}

at::Tensor concat(at::TensorList tensors, int64_t dim, const std::optional<at::Tensor>& out) {
  TORCH_CHECK_VALUE(!tensors.empty(), "concat: expected a non-empty list of tensors");
  const at::Tensor& ref = tensors[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].dim() > 0, "concat: tensor ", i,
                      " is 0-d; zero-dimensional tensors cannot be concatenated");
  }
  const int64_t d = wrap_dim("concat", dim, ref.dim());
  std::vector<int64_t> shape = ref.sizes().vec();
  shape[d] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), "concat: tensor ", i, " has dtype ", t.scalar_type(),
                     " but tensor 0 has dtype ", ref.scalar_type(), "; all tensors must have the same dtype");
    TORCH_CHECK_VALUE(t.device() == ref.device(), "concat: tensor ", i, " is on device ", t.device(),
                      " but tensor 0 is on device ", ref.device(), "; all tensors must be on the same device");
    bool same = t.dim() == ref.dim();
    for (int64_t k = 0; same && k < ref.dim(); ++k) same = k == d || t.size(k) == ref.size(k);
    TORCH_CHECK_VALUE(same, "concat: tensor ", i, " has shape ", t.sizes(), " but tensor 0 has shape ", ref.sizes(),
                      "; shapes must match except in dimension ", d);
    shape[d] += t.size(d);
  }
  at::Tensor result;
  if (out.has_value()) {
    result = *out;
    TORCH_CHECK_TYPE(result.scalar_type() == ref.scalar_type(), "concat: out has dtype ", result.scalar_type(),
                     " but the tensors have dtype ", ref.scalar_type());
    TORCH_CHECK_VALUE(result.device() == ref.device(), "concat: out is on device ", result.device(),
                      " but the tensors are on device ", ref.device());
    TORCH_CHECK_VALUE(result.sizes() == at::IntArrayRef(shape), "concat: out has shape ", result.sizes(),
                      " but the result has shape ", at::IntArrayRef(shape));
    for (const auto& t : tensors) at::assert_no_overlap(result, t);
  } else {
    result = at::empty(shape, ref.options());
  }
  c10::NoGradGuard no_grad;
  if (result.numel() == 0) return result;

  const Dims3 dims = around(shape, d);
  const int64_t es = ref.element_size();
  const bool out_contig = is_plain(result);
  // Inputs that can be copied as one segment per outer row join the plan; the
  // rest (non-contiguous, or rows too small to be worth a memcpy) use copy_.
  std::vector<bool> in_plan(tensors.size());
  int64_t start = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t seg = t.size(d) * dims.inner * es;
    in_plan[i] = out_contig && is_plain(t) && (dims.outer == 1 || seg >= kMinSegmentBytes);
    if (!in_plan[i] && t.numel() > 0) result.narrow(d, start, t.size(d)).copy_(t);
    start += t.size(d);
  }
  CopyPlan plan;
  char* dst = dst_bytes(result);
  for (int64_t o = 0; o < dims.outer; ++o) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const int64_t seg = tensors[i].size(d) * dims.inner * es;
      if (in_plan[i] && seg > 0) plan.add(src_bytes(tensors[i]) + o * seg, dst, seg);
      dst += seg;
    }
  }
  plan.run(ref.device());
  return result;
}

}  // namespace pipeline_ext
