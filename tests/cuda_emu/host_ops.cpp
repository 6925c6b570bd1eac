// The CUDA ops' host code (ext/csrc/cuda/linear_host.h and conv_host.h, the very code linear_cuda.cu
// and conv_cuda.cu run)
// on the CPU: its kernels launched through cuda_emu.h, registered as the ops of a library of
// their own, ext_cuda_emu, for CPU tensors. tests/test_cuda_host.py (and test_conv.py) build this file as a torch
// extension and calls the ops: dtype dispatch, checks, the empty-output return, the bias made
// contiguous, the launch-size check and the autocast rule, all without a GPU.
//
// What stays CUDA-only (and is compiled, not run, by the CPU tests): the CUDAGuard, the stream
// and the <<<>>> launch in cuda_device.h's CudaDevice.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "cuda_emu.h"  // before the kernel headers
#include "conv_host.h"
#include "linear_host.h"

#include <string>

namespace {

std::string g_last_guarded_device;  // what the last call guarded, so a test can see the guard's device

struct EmulatedDevice {
  struct Guard {
    explicit Guard(at::Device device) { g_last_guarded_device = device.str(); }
  };
  static constexpr c10::DeviceType kType = c10::DeviceType::CPU;
  static constexpr c10::DispatchKey kAutocastKey = c10::DispatchKey::AutocastCPU;

  template <typename Params>
  static void launch(void (*kernel)(Params), dim3 grid, size_t shared_bytes, const Params& params) {
    emu::launch(grid, dim3(ext::cuda::kThreads), shared_bytes, kernel, params);
  }

  static int multiprocessor_count() { return emu::sm_count(); }

  using LinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
  static const c10::TypedOperatorHandle<LinearSignature>& linear_op(bool relu) {
    static const auto plain =
        c10::Dispatcher::singleton().findSchemaOrThrow("ext_cuda_emu::linear", "").typed<LinearSignature>();
    static const auto fused =
        c10::Dispatcher::singleton().findSchemaOrThrow("ext_cuda_emu::linear_relu", "").typed<LinearSignature>();
    return relu ? fused : plain;
  }

  using ConvSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef);
  static const c10::TypedOperatorHandle<ConvSignature>& conv2d_op() {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("ext_cuda_emu::conv2d", "").typed<ConvSignature>();
    return op;
  }
};

using Host = ext::cuda::LinearHost<EmulatedDevice>;
using ConvHost = ext::cuda::ConvHost<EmulatedDevice>;

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return Host::linear(input, weight, bias, /*relu=*/false);
}

at::Tensor linear_relu(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return Host::linear(input, weight, bias, /*relu=*/true);
}

std::string last_guarded_device() { return g_last_guarded_device; }

}  // namespace

// The schemas of ext/csrc/ops.cpp, in a library of their own so the real ext ops are untouched.
TORCH_LIBRARY(ext_cuda_emu, m) {
  m.def("linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_relu(Tensor input, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_backward_input(Tensor grad_output, Tensor weight) -> Tensor");
  m.def("linear_backward_weight(Tensor grad_output, Tensor input) -> Tensor");
  m.def("linear_backward_bias(Tensor grad_output) -> Tensor");
  m.def("conv2d(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[4] padding, int[2] dilation) -> Tensor");
  m.def("conv2d_backward_input(Tensor grad_output, Tensor weight, int[4] input_size, int[2] stride, int[4] padding, "
        "int[2] dilation) -> Tensor");
  m.def("conv2d_backward_weight(Tensor grad_output, Tensor input, int[4] weight_size, int[2] stride, "
        "int[4] padding, int[2] dilation) -> Tensor");
  m.def("conv2d_backward_bias(Tensor grad_output) -> Tensor");
  m.def("last_guarded_device() -> str", &last_guarded_device);
}

TORCH_LIBRARY_IMPL(ext_cuda_emu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_relu", &linear_relu);
  m.impl("linear_backward_input", &Host::backward_input);
  m.impl("linear_backward_weight", &Host::backward_weight);
  m.impl("linear_backward_bias", &Host::backward_bias);
  m.impl("conv2d", &ConvHost::conv2d);
  m.impl("conv2d_backward_input", &ConvHost::backward_input);
  m.impl("conv2d_backward_weight", &ConvHost::backward_weight);
  m.impl("conv2d_backward_bias", &ConvHost::backward_bias);
}

TORCH_LIBRARY_IMPL(ext_cuda_emu, AutocastCPU, m) {
  m.impl("linear", &Host::linear_autocast<false>);
  m.impl("linear_relu", &Host::linear_autocast<true>);
  m.impl("conv2d", &ConvHost::conv2d_autocast);
}
