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
// dimensions before `dim` of size 1); otherwise all pieces are views into one
// fresh allocation filled by one copy pass. Values equal torch.tensor_split.
std::vector<at::Tensor> split(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim);

// Concatenates `tensors` along `dim` into `out` (allocated when absent; when
// given it must have exactly the result's shape, dtype and device and is written
// in place). Values equal torch.cat.
at::Tensor concat(at::TensorList tensors, int64_t dim, const std::optional<at::Tensor>& out);

}  // namespace pipeline_ext
