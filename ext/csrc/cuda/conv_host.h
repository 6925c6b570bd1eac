// The host side of the CUDA convolution ops: the checks the CPU ops make (conv_checks.h), the
// 32-bit index limits of the kernels, layouts (NCHW-contiguous in, F.conv2d's memory format out),
// dtype dispatch and conv.cuh's launches. Written once for any `Device` (linear_host.h says what
// one provides, plus Device::conv2d_op() for autocast), so the emulation tests run this very code.
#pragma once

#include "../conv_checks.h"
#include "conv.cuh"
#include "linear_host.h"

#include <ATen/ops/empty.h>

#include <limits>

namespace ext::cuda {

template <typename T>
const T* const_ptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}

// The kernels' ConvShape: every index space must fit 32 bits and every extent stay below
// kMaxConvExtent (conv.cuh), else one line says what to do.
inline ConvShape conv_shape(const char* op, const cpu::ConvGeometry& g) {
  constexpr int64_t kMaxIndex = std::numeric_limits<int32_t>::max();
  const int64_t index_spaces[] = {g.batch * g.out_h * g.out_w, g.batch * g.height * g.width, g.patch(),
                                  g.kernel_h * g.kernel_w * g.out_channels};
  for (const int64_t space : index_spaces)
    TORCH_CHECK(space <= kMaxIndex, op, ": this convolution has ", space, " pixels or patch elements, more than "
                "the CUDA kernels' 32-bit indices reach; split the batch, or use conv=torch for this layer");
  const int64_t reach_h = g.dilation_h * (g.kernel_h - 1) + 1, reach_w = g.dilation_w * (g.kernel_w - 1) + 1;
  const int64_t extents[] = {g.height, g.width, g.pad_top, g.pad_left, g.stride_h, g.stride_w, reach_h, reach_w};
  for (const int64_t extent : extents)
    TORCH_CHECK(extent < kMaxConvExtent, op, ": a height, width, padding, stride or kernel reach of ", extent,
                " is beyond the CUDA kernels' limit of ", kMaxConvExtent, "; use conv=torch for this layer");
  const auto i = [](int64_t v) { return int(v); };
  return {i(g.batch),      i(g.in_channels), i(g.height),     i(g.width),      i(g.out_channels),
          i(g.kernel_h),   i(g.kernel_w),    i(g.stride_h),   i(g.stride_w),   i(g.dilation_h),
          i(g.dilation_w), i(g.pad_top),     i(g.pad_left),   i(g.out_h),      i(g.out_w)};
}

template <typename Device>
struct ConvHost {
  static at::Tensor conv2d(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation) {
    constexpr const char* op = "ext.conv2d";
    const cpu::ConvGeometry g =
        checked_forward_geometry(op, input, weight, bias, stride, padding, dilation, Kernels::Cuda);
    const ConvShape s = conv_shape(op, g);
    const typename Device::Guard device_guard(input.device());
    auto output = at::empty({g.batch, g.out_channels, g.out_h, g.out_w}, input.options());
    if (output.numel() == 0) return output.contiguous(output_format(input, weight));
    // The kernels read NCHW: a channels_last or strided input is copied once.
    const auto x = input.contiguous(), w = weight.contiguous();
    const auto b = bias.has_value() ? bias->contiguous() : at::Tensor();
    dispatch_dtype(input.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      launch_conv_forward<Device>(s, const_ptr<T>(x), const_ptr<T>(w), b.defined() ? const_ptr<T>(b) : nullptr,
                                  mutable_ptr<T>(output));
    });
    return output.contiguous(output_format(input, weight));
  }

  static at::Tensor backward_input(const at::Tensor& grad_output, const at::Tensor& weight,
                                   c10::IntArrayRef input_size, c10::IntArrayRef stride, c10::IntArrayRef padding,
                                   c10::IntArrayRef dilation) {
    constexpr const char* op = "ext.conv2d_backward_input";
    const cpu::ConvGeometry g = checked_backward_input_geometry(op, grad_output, weight, input_size, stride, padding,
                                                                 dilation, Kernels::Cuda);
    const ConvShape s = conv_shape(op, g);
    const typename Device::Guard device_guard(grad_output.device());
    auto grad_input = at::empty(input_size, grad_output.options());
    if (grad_input.numel() == 0) return grad_input;
    // A = W as C x (R·S·K): one copy of the (small) weight, so the kernel reads it as a plain matrix.
    const auto dy = grad_output.contiguous(), permuted_weight = weight.permute({1, 2, 3, 0}).contiguous();
    dispatch_dtype(weight.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      launch_conv_backward_input<Device>(s, const_ptr<T>(dy), const_ptr<T>(permuted_weight),
                                         mutable_ptr<T>(grad_input));
    });
    return grad_input;
  }

  static at::Tensor backward_weight(const at::Tensor& grad_output, const at::Tensor& input,
                                    c10::IntArrayRef weight_size, c10::IntArrayRef stride, c10::IntArrayRef padding,
                                    c10::IntArrayRef dilation) {
    constexpr const char* op = "ext.conv2d_backward_weight";
    const cpu::ConvGeometry g = checked_backward_weight_geometry(op, grad_output, input, weight_size, stride, padding,
                                                                  dilation, Kernels::Cuda);
    const ConvShape s = conv_shape(op, g);
    const typename Device::Guard device_guard(grad_output.device());
    auto grad_weight = at::empty(weight_size, grad_output.options());
    if (grad_weight.numel() == 0) return grad_weight;
    const auto dy = grad_output.contiguous(), x = input.contiguous();
    dispatch_dtype(input.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      using Acc = acc_t<T>;
      at::Tensor partials;  // split-K's, from torch's caching allocator (as LinearHost::launch_gemm)
      const auto allocate = [&](int64_t elements) {
        partials = at::empty({elements}, dy.options().dtype(std::is_same_v<Acc, double> ? at::kDouble : at::kFloat));
        return reinterpret_cast<Acc*>(partials.mutable_data_ptr());
      };
      launch_conv_backward_weight<Device>(s, const_ptr<T>(dy), const_ptr<T>(x), mutable_ptr<T>(grad_weight),
                                          Device::multiprocessor_count(), allocate);
    });
    return grad_weight;
  }

  static at::Tensor backward_bias(const at::Tensor& grad_output) {
    constexpr const char* op = "ext.conv2d_backward_bias";
    const cpu::ConvGeometry g = checked_backward_bias_geometry(op, grad_output, Kernels::Cuda);
    const ConvShape s = conv_shape(op, g);
    const typename Device::Guard device_guard(grad_output.device());
    auto grad_bias = at::empty({grad_output.size(1)}, grad_output.options());
    if (grad_bias.numel() == 0) return grad_bias;
    const auto dy = grad_output.contiguous();
    dispatch_dtype(grad_output.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      launch_conv_backward_bias<Device>(s, const_ptr<T>(dy), mutable_ptr<T>(grad_bias));
    });
    return grad_bias;
  }

  // Under autocast, cast like nn.Conv2d (conv2d is on autocast's lower-precision list), as
  // LinearHost::linear_autocast does.
  static at::Tensor conv2d_autocast(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(Device::kAutocastKey);
    const auto dtype = at::autocast::get_autocast_dtype(Device::kType);
    return Device::conv2d_op().call(at::autocast::cached_cast(dtype, input, Device::kType),
                                    at::autocast::cached_cast(dtype, weight, Device::kType),
                                    at::autocast::cached_cast(dtype, bias, Device::kType), stride, padding, dilation);
  }
};

}  // namespace ext::cuda
