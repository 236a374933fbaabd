// The kernels as torch custom operators, namespace pipeline_ext (PyTorch's
// extension-cpp layout): ops.cpp holds the schemas (TORCH_LIBRARY), the CPU
// kernels and the composite unpack; ops_cuda.cpp registers the same kernels for
// CUDA. Their fake (meta) kernels and autograd formulas are registered from
// Python, in pipeline_ext/runtime/ops.py, with torch.library.register_fake and
// torch.library.register_autograd.
//
// Every kernel is device-generic: its byte moving is a CopyPlan, which runs as
// a parallel memcpy on CPU and as one kernel launch on CUDA, so both dispatch
// keys register the same functions.
#pragma once

#include <torch/library.h>

#include <optional>
#include <utility>
#include <vector>

#include "kernels/pack.h"

namespace pipeline_ext {

// m.impl(...) of every op that has a backend kernel, for the key of `m`.
void register_device_kernels(torch::Library& m);

// Eager entry points (bound by bindings.cpp, used by pipeline_ext.runtime.ops outside
// torch.compile). Calling torch.ops.pipeline_ext.* from Python costs a few
// microseconds of argument parsing, and the Python kernel that
// torch.library.register_autograd installs at the Autograd key runs on every
// call, graph or not: about as long as the kernels themselves on small
// tensors. These call the same ops through the dispatcher (so autograd, fake
// tensors, dispatch modes and the profiler still see them), below autograd
// when no input requires grad. torch.compile cannot trace pybind11 functions,
// so traced calls use torch.ops.pipeline_ext.* instead.
std::vector<at::Tensor> call_split(const at::Tensor& input, at::IntArrayRef sizes, int64_t dim);
at::Tensor call_concat(at::TensorList tensors, int64_t dim, const std::optional<at::Tensor>& out);
std::pair<at::Tensor, PackLayout> call_pack(at::TensorList tensors, const std::optional<at::Tensor>& out);

}  // namespace pipeline_ext
