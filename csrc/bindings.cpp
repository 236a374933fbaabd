// The only file that includes pybind11: it exposes the C++ core as pipeline_ext._C.
// Each section binds one header; the code it binds lives beside that header.
#include <torch/extension.h>

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipeline_ext compiled core: kernels, streams/events, send/recv channels";
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
