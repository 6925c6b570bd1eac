// Python's direct calls into the linear ops: the library is also a Python module (ext._calls, imported by
// ext/_build.py), whose functions call the ops through the dispatcher from C++. Autograd, autocast, dispatch
// modes and FakeTensor apply as they do through torch.ops.ext.
//
// Why: torch.ops.ext.linear.default matches its arguments to the schema in torch's generic Python path, which
// costs more than the kernel of a small layer. Measured on Zen 4, 1 thread, an 8x8 product a call (µs):
// linear 3.5 -> 2.1 and linear_backward_input 2.3 -> 1.2, against torch.mm's 1.5. ext.linear calls them in
// eager mode; under torch.compile it keeps the OpOverload, which dynamo puts in its graph.
#include <torch/extension.h>

#include "op_handles.h"

namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

bool is_tensor(py::handle object) { return THPVariable_Check(object.ptr()); }

// linear or linear_relu on ext.linear's common case, 2-D tensors and a bias of [out_features] or None; None for
// any other call, which ext.linear then adapts to the op in Python (leading dimensions, 1-D operands, nested
// tensors, a bias to broadcast, arguments that are not tensors: each gets F.linear's meaning or a clear error).
// The check is here, not in Python, because there it cost 0.45 µs a call.
template <bool relu>
py::object linear_if_2d(py::handle input_object, py::handle weight_object, py::handle bias_object) {
  const bool has_bias = !bias_object.is_none();
  if (!is_tensor(input_object) || !is_tensor(weight_object) || (has_bias && !is_tensor(bias_object))) {
    return py::none();
  }
  const Tensor& input = THPVariable_Unpack(input_object.ptr());
  const Tensor& weight = THPVariable_Unpack(weight_object.ptr());
  OptionalTensor bias;
  if (has_bias) bias = THPVariable_Unpack(bias_object.ptr());
  if (input.dim() != 2 || weight.dim() != 2 || input.is_nested() ||
      (has_bias && (bias->dim() != 1 || bias->size(0) != weight.size(0)))) {
    return py::none();
  }
  Tensor output;
  {
    py::gil_scoped_release without_gil;
    output = ext::handles::linear(relu).call(input, weight, bias);
  }
  return py::cast(std::move(output));
}

Tensor linear_backward_input(const Tensor& grad_output, const Tensor& weight) {
  return ext::handles::backward_input().call(grad_output, weight);
}

Tensor linear_backward_weight(const Tensor& grad_output, const Tensor& input) {
  return ext::handles::backward_weight().call(grad_output, input);
}

Tensor linear_backward_bias(const Tensor& grad_output) { return ext::handles::backward_bias().call(grad_output); }

}  // namespace

// The module's name is ext/_build.py's PYTHON_MODULE ("ext._calls"), whose last part names PyInit__calls.
PYBIND11_MODULE(_calls, m) {
  m.doc() = "ext's linear ops, called from Python without torch.ops' argument parsing (see python_calls.cpp)";
  // The GIL is released while the op runs, as torch's own bindings do: other Python threads go on meanwhile.
  const auto without_gil = py::call_guard<py::gil_scoped_release>();
  m.def("linear", &linear_if_2d<false>, "torch.ops.ext.linear on 2-D tensors, else None", py::arg("input"),
        py::arg("weight"), py::arg("bias"));
  m.def("linear_relu", &linear_if_2d<true>, "torch.ops.ext.linear_relu on 2-D tensors, else None",
        py::arg("input"), py::arg("weight"), py::arg("bias"));
  m.def("linear_backward_input", &linear_backward_input, "torch.ops.ext.linear_backward_input",
        py::arg("grad_output"), py::arg("weight"), without_gil);
  m.def("linear_backward_weight", &linear_backward_weight, "torch.ops.ext.linear_backward_weight",
        py::arg("grad_output"), py::arg("input"), without_gil);
  m.def("linear_backward_bias", &linear_backward_bias, "torch.ops.ext.linear_backward_bias",
        py::arg("grad_output"), without_gil);
}
