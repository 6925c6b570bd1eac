// The CUDA kernels of the five tensor ops (schemas in ../ops.cpp), and their
// autocast rule. The kernels themselves live in gemm.cuh and sum_rows.cuh.
#include "../checks.h"
#include "../op_handles.h"
#include "gemm.cuh"
#include "sum_rows.cuh"

#include <ATen/autocast_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

namespace ext {

namespace {

using cuda::StridedMatrix;

// Calls fn(T{}) with T the kernel's element type for the tensor's dtype
// (c10::Half and c10::BFloat16 share __half's and __nv_bfloat16's bits).
template <typename Fn>
void dispatch_dtype(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: return fn(float{});
    case at::kDouble: return fn(double{});
    case at::kHalf: return fn(__half{});
    case at::kBFloat16: return fn(__nv_bfloat16{});
    default: TORCH_CHECK(false, "ext CUDA kernels: unsupported dtype ", dtype);
  }
}

template <typename T>
StridedMatrix<T> strided(const at::Tensor& t) {
  return {reinterpret_cast<const T*>(t.const_data_ptr()), t.size(0), t.size(1), t.stride(0), t.stride(1)};
}

template <typename T>
T* mutable_ptr(at::Tensor& t) {
  return reinterpret_cast<T*>(t.mutable_data_ptr());
}

template <typename T>
void launch_gemm(const cuda::GemmParams<T>& params) {
  TORCH_CHECK(params.b.outer_size <= cuda::kMaxGemmN, "ext CUDA GEMM: an output with ", params.b.outer_size,
              " columns exceeds the grid limit of ", cuda::kMaxGemmN);
  cuda::gemm_kernel<T><<<cuda::gemm_grid(params), cuda::kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor linear_cuda_impl(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, bool relu) {
  check_linear_args(relu ? "ext.linear_relu" : "ext.linear", input, weight, bias);
  const c10::cuda::CUDAGuard device_guard(input.device());
  auto out = at::empty({input.size(0), weight.size(0)}, input.options());
  if (out.numel() == 0) return out;
  const auto bias_contiguous = bias.has_value() ? bias->contiguous() : at::Tensor();
  dispatch_dtype(input.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* bias_ptr =
        bias_contiguous.defined() ? reinterpret_cast<const T*>(bias_contiguous.const_data_ptr()) : nullptr;
    launch_gemm(cuda::linear_params(strided<T>(input), strided<T>(weight), bias_ptr, relu, mutable_ptr<T>(out)));
  });
  return out;
}

at::Tensor linear_cuda(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_cuda_impl(input, weight, bias, /*relu=*/false);
}

at::Tensor linear_relu_cuda(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  return linear_cuda_impl(input, weight, bias, /*relu=*/true);
}

// dX (M x K) = dY (M x N) · W (N x K)
at::Tensor linear_backward_input_cuda(const at::Tensor& grad_output, const at::Tensor& weight) {
  check_grad_args("ext.linear_backward_input", grad_output, weight, "weight", 1, 0);
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  auto grad_input = at::empty({grad_output.size(0), weight.size(1)}, grad_output.options());
  if (grad_input.numel() == 0) return grad_input;
  dispatch_dtype(grad_output.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    launch_gemm(cuda::backward_input_params(strided<T>(grad_output), strided<T>(weight), mutable_ptr<T>(grad_input)));
  });
  return grad_input;
}

// dW (N x K) = dYᵀ (N x M) · X (M x K), read through dY's strides.
at::Tensor linear_backward_weight_cuda(const at::Tensor& grad_output, const at::Tensor& input) {
  check_grad_args("ext.linear_backward_weight", grad_output, input, "input", 0, 0);
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  auto grad_weight = at::empty({grad_output.size(1), input.size(1)}, grad_output.options());
  if (grad_weight.numel() == 0) return grad_weight;
  dispatch_dtype(grad_output.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    launch_gemm(cuda::backward_weight_params(strided<T>(grad_output), strided<T>(input), mutable_ptr<T>(grad_weight)));
  });
  return grad_weight;
}

// db (N) = the sum of dY over rows, deterministic.
at::Tensor linear_backward_bias_cuda(const at::Tensor& grad_output) {
  TORCH_CHECK(grad_output.dim() == 2, "ext.linear_backward_bias: grad_output must be 2-D, got shape ",
              grad_output.sizes());
  check_dtype_for_device("ext.linear_backward_bias", grad_output);
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  auto grad_bias = at::empty({grad_output.size(1)}, grad_output.options());
  if (grad_bias.numel() == 0) return grad_bias;
  dispatch_dtype(grad_output.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const cuda::SumRowsParams<T> params{strided<T>(grad_output), mutable_ptr<T>(grad_bias)};
    cuda::sum_rows_kernel<T><<<cuda::sum_rows_grid(params), cuda::kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_bias;
}

// Under autocast, cast like nn.Linear (F.linear is on autocast's lower-precision list):
// floating CUDA arguments other than float64 go to the autocast dtype, then the op runs
// with autocast off.
template <bool kRelu>
at::Tensor linear_autocast(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  const auto& op = handles::linear(kRelu);
  const auto dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  return op.call(at::autocast::cached_cast(dtype, input, c10::DeviceType::CUDA),
                 at::autocast::cached_cast(dtype, weight, c10::DeviceType::CUDA),
                 at::autocast::cached_cast(dtype, bias, c10::DeviceType::CUDA));
}

}  // namespace

TORCH_LIBRARY_IMPL(ext, CUDA, m) {
  m.impl("linear", &linear_cuda);
  m.impl("linear_relu", &linear_relu_cuda);
  m.impl("linear_backward_input", &linear_backward_input_cuda);
  m.impl("linear_backward_weight", &linear_backward_weight_cuda);
  m.impl("linear_backward_bias", &linear_backward_bias_cuda);
}

TORCH_LIBRARY_IMPL(ext, AutocastCUDA, m) {
  m.impl("linear", &linear_autocast<false>);
  m.impl("linear_relu", &linear_autocast<true>);
}

}  // namespace ext
