// Microbatch split and merge: the two copies every pipeline step pays on its
// inputs and outputs. Both cost at most one pass over the bytes (a CopyPlan);
// split costs nothing when the pieces can be views.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace pipeline_ext {

// Splits `input` along `dim` into pieces of `sizes` (which must sum to the size
// of that dimension). Every piece is contiguous. Pieces are views of `input`
// when narrow() already gives contiguous tensors (contiguous input, all
// dimensions before `dim` of size 1); otherwise they are fresh tensors filled
// by one copy pass. Values equal torch.tensor_split.
std::vector<at::Tensor> split(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim);

// Whether split() gives views: valid arguments, and narrow() already gives
// contiguous pieces (contiguous input, all dimensions before `dim` of size 1, or
// at most one non-empty piece). pipeline_ext.runtime.ops._views_suffice mirrors it for
// traced calls.
bool split_gives_views(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim);

// split that always copies: the pieces are fresh tensors (one copy pass fills
// them all), never views of `input` or of each other. This is the
// torch custom op pipeline_ext::split_copy; the zero-copy case stays outside
// the op (pipeline_ext.runtime.ops.split uses torch.split_with_sizes there).
std::vector<at::Tensor> split_copy(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim);

// Concatenates `tensors` along `dim` into `out` (allocated when absent; when
// given it must have exactly the result's shape, dtype and device and is written
// in place). Values equal torch.cat.
at::Tensor concat(at::TensorList tensors, int64_t dim, const std::optional<at::Tensor>& out);

}  // namespace pipeline_ext
