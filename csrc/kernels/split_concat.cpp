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

// What split needs to know about valid arguments.
struct SplitPlan {
  int64_t dim;
  int64_t nonempty;  // pieces with at least one row
  Dims3 dims;
};

SplitPlan check_split(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim) {
  TORCH_CHECK_VALUE(input.dim() > 0, "split: cannot split a 0-d tensor (it has no dimension to split along)");
  const int64_t d = wrap_dim("split", dim, input.dim());
  TORCH_CHECK_VALUE(!sizes.empty(), "split: sizes is empty; give at least one piece size");
  int64_t sum = 0, nonempty = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK_VALUE(sizes[i] >= 0, "split: sizes[", i, "] = ", sizes[i], " is negative (sizes ", sizes, ")");
    sum += sizes[i];
    nonempty += sizes[i] > 0;
  }
  TORCH_CHECK_VALUE(sum == input.size(d), "split: sizes ", sizes, " sum to ", sum, " but dimension ", d,
                    " of the tensor with shape ", input.sizes(), " has size ", input.size(d));
  return {d, nonempty, around(input.sizes(), d)};
}

// Fresh contiguous pieces, filled by one copy pass. Each piece has its own
// allocation: torch custom ops may not return outputs that alias each other.
std::vector<at::Tensor> copy_pieces(const at::Tensor& input, at::IntArrayRef sizes, const SplitPlan& p) {
  c10::NoGradGuard no_grad;
  const int64_t d = p.dim;
  const int64_t es = input.element_size();
  std::vector<at::Tensor> pieces;
  pieces.reserve(sizes.size());
  std::vector<int64_t> shape = input.sizes().vec();
  for (int64_t s : sizes) {
    shape[d] = s;
    pieces.push_back(at::empty(shape, input.options().memory_format(at::MemoryFormat::Contiguous)));
  }
  // One strided segment per piece; when rows are tiny the strided copy_ wins.
  const int64_t row_bytes = input.size(d) * p.dims.inner * es;
  const bool plan_ok = is_plain(input) && row_bytes / std::max<int64_t>(p.nonempty, 1) >= kMinSegmentBytes;
  int64_t start = 0;
  CopyPlan plan(p.dims.outer);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t seg = sizes[i] * p.dims.inner * es;
    if (!plan_ok) {
      if (sizes[i] > 0) pieces[i].copy_(input.narrow(d, start, sizes[i]));
    } else {
      plan.add(src_bytes(input) + start * p.dims.inner * es, dst_bytes(pieces[i]), seg, row_bytes, seg);
    }
    start += sizes[i];
  }
  plan.run(input.device());
  return pieces;
}

}  // namespace

bool split_gives_views(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim) {
  const int64_t ndim = input.dim();
  if (ndim == 0 || sizes.empty() || dim < -ndim || dim >= ndim || !input.is_contiguous()) return false;
  const int64_t d = dim < 0 ? dim + ndim : dim;
  int64_t sum = 0, nonempty = 0;
  for (int64_t s : sizes) {
    if (s < 0) return false;
    sum += s;
    nonempty += s > 0;
  }
  return sum == input.size(d) && (around(input.sizes(), d).outer == 1 || nonempty <= 1 || input.numel() == 0);
}

std::vector<at::Tensor> split(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim) {
  if (split_gives_views(input, sizes, dim)) {
    c10::NoGradGuard no_grad;
    return at::split_with_sizes(input, sizes, dim);  // one dispatch for all views
  }
  return split_copy(input, sizes, dim);
}

std::vector<at::Tensor> split_copy(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim) {
  check_readable(input, "split", -1);  // its bytes are read directly
  return copy_pieces(input, sizes, check_split(input, sizes, dim));
}

at::Tensor concat(at::TensorList tensors, int64_t dim, const std::optional<at::Tensor>& out) {
  TORCH_CHECK_VALUE(!tensors.empty(), "concat: expected a non-empty list of tensors");
  const at::Tensor& ref = tensors[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_readable(tensors[i], "concat", static_cast<int64_t>(i));  // their bytes are read directly
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
    check_readable(result, "concat: out", -1);
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
  const int64_t row_bytes = shape[d] * dims.inner * es;
  // Each input is one strided segment (a row per outer index) of the plan,
  // unless it is non-contiguous or its rows are too small to be worth a
  // memcpy: those use copy_.
  CopyPlan plan(dims.outer);
  int64_t start = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t seg = t.size(d) * dims.inner * es;
    if (seg == 0) continue;
    if (out_contig && is_plain(t) && (dims.outer == 1 || seg >= kMinSegmentBytes)) {
      plan.add(src_bytes(t), dst_bytes(result) + start * dims.inner * es, seg, seg, row_bytes);
    } else {
      result.narrow(d, start, t.size(d)).copy_(t);
    }
    start += t.size(d);
  }
  plan.run(ref.device());
  return result;
}

}  // namespace pipeline_ext
