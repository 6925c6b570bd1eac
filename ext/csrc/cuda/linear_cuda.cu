// The CUDA kernels of the five tensor ops (schemas in ../ops.cpp), and their autocast
// rule: linear_host.h's host code on the CUDA device. The kernels live in gemm.cuh and
// sum_rows.cuh.
#include "cuda_device.h"
#include "linear_host.h"

#include <torch/library.h>

namespace ext {

namespace {

using Host = cuda::LinearHost<cuda::CudaDevice>;

at::Tensor linear_cuda(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return Host::linear(input, weight, bias, /*relu=*/false);
}

at::Tensor linear_relu_cuda(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  return Host::linear(input, weight, bias, /*relu=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(ext, CUDA, m) {
  m.impl("linear", &linear_cuda);
  m.impl("linear_relu", &linear_relu_cuda);
  m.impl("linear_backward_input", &Host::backward_input);
  m.impl("linear_backward_weight", &Host::backward_weight);
  m.impl("linear_backward_bias", &Host::backward_bias);
}

TORCH_LIBRARY_IMPL(ext, AutocastCUDA, m) {
  m.impl("linear", &Host::linear_autocast<false>);
  m.impl("linear_relu", &Host::linear_autocast<true>);
}

}  // namespace ext
