// The CUDA kernels of the five tensor ops (schemas in ../ops.cpp), and their autocast
// rule: linear_host.h's host code on the CUDA device. The kernels live in gemm.cuh and
// sum_rows.cuh.
#include "../op_handles.h"
#include "linear_host.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

namespace ext {

namespace {

struct CudaDevice {
  using Guard = c10::cuda::CUDAGuard;
  static constexpr c10::DeviceType kType = c10::DeviceType::CUDA;
  static constexpr c10::DispatchKey kAutocastKey = c10::DispatchKey::AutocastCUDA;

  template <typename Params>
  static void launch(void (*kernel)(Params), dim3 grid, size_t shared_bytes, const Params& params) {
    kernel<<<grid, cuda::kThreads, shared_bytes, c10::cuda::getCurrentCUDAStream()>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  static int multiprocessor_count() {  // cudaDeviceGetAttribute is a cheap query, unlike cudaGetDeviceProperties
    int count = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
    return count;
  }

  static const c10::TypedOperatorHandle<handles::LinearSignature>& linear_op(bool relu) {
    return handles::linear(relu);
  }
};

using Host = cuda::LinearHost<CudaDevice>;

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
