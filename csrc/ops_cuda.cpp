// CUDA kernels of the pipeline_ext custom ops: the same device-generic kernels
// as on CPU (ops.cpp); their CopyPlan launches one copy kernel on the current
// stream of the tensors' device.
#include "ops.h"

namespace pipeline_ext {

TORCH_LIBRARY_IMPL(pipeline_ext, CUDA, m) { register_device_kernels(m); }

}  // namespace pipeline_ext
