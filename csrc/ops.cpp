// Schemas and CPU kernels of the pipeline_ext custom ops (see ops.h).
//
// Aliasing: custom ops that return views of their inputs cannot be
// functionalized (torch.compile, export), so
// - split_copy always returns fresh tensors; the zero-copy split (pieces that
//   are contiguous as views) stays outside the op, as torch.split_with_sizes;
// - concat_out and pack_out write their `out` argument (declared `Tensor(a!)`)
//   and return nothing;
// - unpack is CompositeImplicitAutograd: its outputs are declared views of the
//   buffer (`Tensor(a)`) and, under tracing, it decomposes into narrow/view ops.
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "kernels/split_concat.h"

namespace pipeline_ext {
namespace {

at::Tensor concat_kernel(at::TensorList tensors, int64_t dim) { return concat(tensors, dim, std::nullopt); }

void concat_out_kernel(at::TensorList tensors, int64_t dim, at::Tensor& out) { concat(tensors, dim, out); }

at::Tensor pack_kernel(at::TensorList tensors) { return pack(tensors).first; }

void pack_out_kernel(at::TensorList tensors, at::Tensor& out) { pack(tensors, out); }

std::vector<at::Tensor> unpack_composite(const at::Tensor& buffer, at::IntArrayRef layout) {
  return unpack(buffer, PackLayout::decode(layout.vec()));
}

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Below autograd unless an input requires grad (what register_autograd's own
// kernel does, without its Python round trip).
class BelowAutogradUnlessGrad {
 public:
  explicit BelowAutogradUnlessGrad(at::TensorList tensors) {
    if (!at::GradMode::is_enabled()) {
      guard_.emplace();
      return;
    }
    for (const auto& t : tensors) {
      if (t.requires_grad()) return;
    }
    guard_.emplace();
  }

 private:
  std::optional<at::AutoDispatchBelowAutograd> guard_;
};

}  // namespace

std::vector<at::Tensor> call_split(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim) {
  BelowAutogradUnlessGrad guard(input);
  if (split_gives_views(input, sizes, dim)) return at::split_with_sizes(input, sizes, dim);  // aten views
  static const auto op =
      find_op<std::vector<at::Tensor>(const at::Tensor&, c10::SymIntArrayRef, int64_t)>("pipeline_ext::split_copy");
  return op.call(input, c10::fromIntArrayRefSlow(sizes), dim);
}

at::Tensor call_concat(at::TensorList tensors, int64_t dim, const std::optional<at::Tensor>& out) {
  // With no tensor the dispatcher could not pick a kernel to report this.
  TORCH_CHECK_VALUE(!tensors.empty(), "concat: expected a non-empty list of tensors");
  BelowAutogradUnlessGrad guard(tensors);
  if (out.has_value()) {
    static const auto op = find_op<void(at::TensorList, int64_t, at::Tensor&)>("pipeline_ext::concat_out");
    at::Tensor result = *out;
    op.call(tensors, dim, result);
    return result;
  }
  static const auto op = find_op<at::Tensor(at::TensorList, int64_t)>("pipeline_ext::concat");
  return op.call(tensors, dim);
}

std::pair<at::Tensor, PackLayout> call_pack(at::TensorList tensors, const std::optional<at::Tensor>& out) {
  PackLayout layout = layout_of(tensors);
  BelowAutogradUnlessGrad guard(tensors);
  if (out.has_value()) {
    static const auto op = find_op<void(at::TensorList, at::Tensor&)>("pipeline_ext::pack_out");
    at::Tensor buffer = *out;
    op.call(tensors, buffer);
    return {buffer, std::move(layout)};
  }
  if (tensors.empty()) return {at::empty({0}, at::kByte), std::move(layout)};  // nothing to dispatch on
  static const auto op = find_op<at::Tensor(at::TensorList)>("pipeline_ext::pack");
  return {op.call(tensors), std::move(layout)};
}

void register_device_kernels(torch::Library& m) {
  m.impl("split_copy", &split_copy);
  m.impl("concat", &concat_kernel);
  m.impl("concat_out", &concat_out_kernel);
  m.impl("pack", &pack_kernel);
  m.impl("pack_out", &pack_out_kernel);
}

// The fake kernels live in this Python module: C++ callers tracing an op (e.g.
// under torch.export) make torch import it.
TORCH_LIBRARY(pipeline_ext, m) {
  m.set_python_module("pipeline_ext.runtime.ops");
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};
  // No default argument values: the dispatcher drops arguments equal to their
  // default before register_autograd's Python kernel sees them, and torch 2.13's
  // Tensor[] autograd wrapper then mismatches the backward's gradient structure.
  m.def("split_copy(Tensor self, SymInt[] sizes, int dim) -> Tensor[]", pt2);
  m.def("concat(Tensor[] tensors, int dim) -> Tensor", pt2);
  m.def("concat_out(Tensor[] tensors, int dim, Tensor(a!) out) -> ()", pt2);
  m.def("pack(Tensor[] tensors) -> Tensor", pt2);
  m.def("pack_out(Tensor[] tensors, Tensor(a!) out) -> ()", pt2);
  // layout: PackLayout.encode() words.
  m.def("unpack(Tensor(a) buffer, int[] layout) -> Tensor(a)[]", pt2);
}

TORCH_LIBRARY_IMPL(pipeline_ext, CPU, m) { register_device_kernels(m); }

TORCH_LIBRARY_IMPL(pipeline_ext, CompositeImplicitAutograd, m) { m.impl("unpack", &unpack_composite); }

}  // namespace pipeline_ext
