// The Python module of the CPU kernels (built by pc_rag/runtime/cpu_kernels.py).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("decode_attention", &pc_rag::decode_attention);
  m.def("low_rank_term", &pc_rag::low_rank_term);
  m.def("amx_available", &pc_rag::amx_available);
  m.def("amx_linear", &pc_rag::amx_linear, py::call_guard<py::gil_scoped_release>());
  m.def("dot_available", &pc_rag::dot_available);
  m.def("dot_linear", &pc_rag::dot_linear, py::call_guard<py::gil_scoped_release>());
  py::class_<pc_rag::DecodeLayers>(m, "DecodeLayers")
      .def(py::init<std::vector<pc_rag::DecodeLayers::Tensors>, std::vector<std::vector<int64_t>>,
                    std::vector<int64_t>, std::vector<double>, int64_t, int64_t, int64_t, double>())
      .def("forward", &pc_rag::DecodeLayers::forward, py::call_guard<py::gil_scoped_release>())
      .def("__len__", &pc_rag::DecodeLayers::size);
}
