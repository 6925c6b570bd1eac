// The host side of the CUDA ops: argument checks, output allocation, the empty-output
// return, dtype dispatch, operand views and the launch-size check, then one kernel launch.
// Written once for any `Device`, a policy that says how to guard a device and launch a
// kernel: linear_cuda.cu instantiates it for CUDA, and tests/cuda_emu/host_ops.cpp for the
// CPU emulation of the CUDA execution model, so the tests run this very code without a GPU.
//
// A Device provides:
//   Device::Guard                       constructed from the inputs' at::Device for the call
//   Device::launch(kernel, grid, shared_bytes, params)
//                                       runs kernel<<<grid, kThreads, shared_bytes>>>(params) on its stream
//   Device::multiprocessor_count()      the SMs of the current device (split-K's rule)
//   Device::kType, Device::kAutocastKey  the device type and autocast key the ops are under
//   Device::linear_op(relu)              the dispatcher handle of the (fused) linear op
#pragma once

#include "../checks.h"
#include "gemm_launch.cuh"
#include "sum_rows.cuh"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>

namespace ext::cuda {

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

template <typename Device>
struct LinearHost {
  // The partial sums of a split-K product live in a tensor from torch's caching allocator:
  // freed when this returns, its memory is reused only by work queued after these kernels
  // on the same stream.
  template <typename T>
  static void launch_gemm(const GemmParams<T>& params, const at::TensorOptions& options) {
    TORCH_CHECK(params.b.outer_size <= kMaxGemmN, "ext CUDA GEMM: an output with ", params.b.outer_size,
                " columns exceeds the grid limit of ", kMaxGemmN);
    using Acc = acc_t<T>;
    at::Tensor partials;
    const auto allocate = [&](int64_t elements) {
      partials = at::empty({elements}, options.dtype(std::is_same_v<Acc, double> ? at::kDouble : at::kFloat));
      return reinterpret_cast<Acc*>(partials.mutable_data_ptr());
    };
    launch_gemm_kernel<Device>(params, at::globalContext().allowTF32CuBLAS(),  // exactly as torch's matmuls
                               Device::multiprocessor_count(), allocate);
  }

  // Y (M x N) = X (M x K) · Wᵀ + bias, optionally followed by ReLU in the same store.
  static at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           bool relu) {
    check_linear_args(relu ? "ext.linear_relu" : "ext.linear", input, weight, bias, Kernels::Cuda);
    const typename Device::Guard device_guard(input.device());
    auto out = at::empty({input.size(0), weight.size(0)}, input.options());
    if (out.numel() == 0) return out;
    const auto bias_contiguous = bias.has_value() ? bias->contiguous() : at::Tensor();  // the kernel reads it densely
    dispatch_dtype(input.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* bias_ptr =
          bias_contiguous.defined() ? reinterpret_cast<const T*>(bias_contiguous.const_data_ptr()) : nullptr;
      launch_gemm(linear_params(strided<T>(input), strided<T>(weight), bias_ptr, relu, mutable_ptr<T>(out)),
                  out.options());
    });
    return out;
  }

  // dX (M x K) = dY (M x N) · W (N x K)
  static at::Tensor backward_input(const at::Tensor& grad_output, const at::Tensor& weight) {
    check_grad_args("ext.linear_backward_input", grad_output, weight, "weight", 1, 0, Kernels::Cuda);
    const typename Device::Guard device_guard(grad_output.device());
    auto grad_input = at::empty({grad_output.size(0), weight.size(1)}, grad_output.options());
    if (grad_input.numel() == 0) return grad_input;
    dispatch_dtype(grad_output.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      launch_gemm(backward_input_params(strided<T>(grad_output), strided<T>(weight), mutable_ptr<T>(grad_input)),
                  grad_input.options());
    });
    return grad_input;
  }

  // dW (N x K) = dYᵀ (N x M) · X (M x K), read through dY's strides.
  static at::Tensor backward_weight(const at::Tensor& grad_output, const at::Tensor& input) {
    check_grad_args("ext.linear_backward_weight", grad_output, input, "input", 0, 0, Kernels::Cuda);
    const typename Device::Guard device_guard(grad_output.device());
    auto grad_weight = at::empty({grad_output.size(1), input.size(1)}, grad_output.options());
    if (grad_weight.numel() == 0) return grad_weight;
    dispatch_dtype(grad_output.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      launch_gemm(backward_weight_params(strided<T>(grad_output), strided<T>(input), mutable_ptr<T>(grad_weight)),
                  grad_weight.options());
    });
    return grad_weight;
  }

  // db (N) = the sum of dY over rows, deterministic.
  static at::Tensor backward_bias(const at::Tensor& grad_output) {
    TORCH_CHECK(grad_output.dim() == 2, "ext.linear_backward_bias: grad_output must be 2-D, got shape ",
                grad_output.sizes());
    check_dtype("ext.linear_backward_bias", grad_output, Kernels::Cuda);
    const typename Device::Guard device_guard(grad_output.device());
    auto grad_bias = at::empty({grad_output.size(1)}, grad_output.options());
    if (grad_bias.numel() == 0) return grad_bias;
    dispatch_dtype(grad_output.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const SumRowsParams<T> params{strided<T>(grad_output), mutable_ptr<T>(grad_bias)};
      Device::launch(sum_rows_kernel<T>, sum_rows_grid(params), kSumRowsSharedBytes<T>, params);
    });
    return grad_bias;
  }

  // Under autocast, cast like nn.Linear (F.linear is on autocast's lower-precision list):
  // floating arguments other than float64 go to the autocast dtype, then the op runs with
  // autocast off.
  template <bool kRelu>
  static at::Tensor linear_autocast(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(Device::kAutocastKey);
    const auto dtype = at::autocast::get_autocast_dtype(Device::kType);
    return Device::linear_op(kRelu).call(at::autocast::cached_cast(dtype, input, Device::kType),
                                         at::autocast::cached_cast(dtype, weight, Device::kType),
                                         at::autocast::cached_cast(dtype, bias, Device::kType));
  }
};

}  // namespace ext::cuda
