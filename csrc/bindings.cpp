// The only file that includes pybind11: it exposes the C++ core as pipeline_ext._C.
// Each section binds one header; the code it binds lives beside that header.
#include <torch/extension.h>

#include "kernels/pack.h"
#include "kernels/split_concat.h"

namespace py = pybind11;

namespace {

// ---- kernels/split_concat.h, kernels/pack.h --------------------------------
void bind_kernels(py::module_& m) {
  using pipeline_ext::PackLayout;
  // The copy work runs without the GIL so other Python threads (one per
  // pipeline rank) keep going; no Python object is touched inside.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("split", &pipeline_ext::split, py::arg("tensor"), py::arg("sizes"), py::arg("dim") = 0, release(),
        "Split along dim into contiguous pieces of the given sizes (views when possible, else one copy pass).");
  // std::vector, not at::TensorList: pybind11 converts Python lists to the former.
  using Tensors = std::vector<at::Tensor>;
  m.def(
      "concat",
      [](const Tensors& tensors, int64_t dim, const std::optional<at::Tensor>& out) {
        return pipeline_ext::concat(tensors, dim, out);
      }, py::arg("tensors"), py::arg("dim") = 0, py::arg("out") = py::none(),
        release(), "Concatenate along dim in one copy pass into out (allocated when None).");
  m.def(
      "pack", [](const Tensors& tensors) { return pipeline_ext::pack(tensors); }, py::arg("tensors"), release(),
        "Copy tensors into one 64-byte-aligned uint8 buffer; returns (buffer, PackLayout).");
  m.def("unpack", &pipeline_ext::unpack, py::arg("buffer"), py::arg("layout"), release(),
        "Views of buffer described by layout (no copy).");
  m.attr("PACK_ALIGNMENT") = pipeline_ext::kPackAlignment;

  py::class_<PackLayout>(m, "PackLayout", "Where each packed tensor lives in a pack() buffer.")
      .def(py::init<>())
      .def_readonly("nbytes", &PackLayout::nbytes)
      .def_property_readonly("dtypes",
                             [](const PackLayout& l) {
                               std::vector<at::ScalarType> r;
                               for (const auto& e : l.entries) r.push_back(e.dtype);
                               return r;
                             })
      .def_property_readonly("shapes",
                             [](const PackLayout& l) {
                               py::list r;
                               for (const auto& e : l.entries) r.append(py::tuple(py::cast(e.shape)));
                               return r;
                             })
      .def_property_readonly("offsets",
                             [](const PackLayout& l) {
                               std::vector<int64_t> r;
                               for (const auto& e : l.entries) r.push_back(e.offset);
                               return r;
                             })
      .def("__len__", [](const PackLayout& l) { return l.entries.size(); })
      .def("encode", &PackLayout::encode)
      .def_static("decode", &PackLayout::decode, py::arg("words"))
      .def("to_tensor", &PackLayout::to_tensor)
      .def_static("from_tensor", &PackLayout::from_tensor, py::arg("tensor"))
      .def("__eq__", [](const PackLayout& a, const PackLayout& b) { return a == b; }, py::is_operator())
      .def("__eq__", [](const PackLayout&, const py::object&) { return false; })
      .def("__repr__", &PackLayout::repr)
      .def(py::pickle([](const PackLayout& l) { return py::tuple(py::cast(l.encode())); },
                      [](const py::tuple& t) { return PackLayout::decode(t.cast<std::vector<int64_t>>()); }));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipeline_ext compiled core: kernels, streams/events, send/recv channels";
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  bind_kernels(m);
}
