// The convolution's argument checks and geometry, shared by the CPU ops (conv_ops.cpp) and the
// CUDA ones (cuda/conv_host.h): one clear message per way the arguments cannot make a convolution.
//
// padding is [top, bottom, left, right]: padding="same" with an even kernel pads one more
// after than before (as F.conv2d does), which ext.conv2d (ext/conv.py) passes here as is.
#pragma once

#include "checks.h"
#include "cpu/conv.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace ext {

using IntPair = c10::IntArrayRef;

struct ConvParams {
  int64_t stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, dilation_h, dilation_w;
};

inline ConvParams conv_params(const char* op, IntPair stride, c10::IntArrayRef padding, IntPair dilation) {
  TORCH_CHECK(stride.size() == 2 && padding.size() == 4 && dilation.size() == 2, op,
              ": stride and dilation take 2 values and padding 4 (top, bottom, left, right), got ", stride, ", ",
              padding, " and ", dilation);
  TORCH_CHECK(stride[0] > 0 && stride[1] > 0, op, ": stride must be positive, got ", stride);
  TORCH_CHECK(dilation[0] > 0 && dilation[1] > 0, op, ": dilation must be positive, got ", dilation);
  for (int64_t p : padding) TORCH_CHECK(p >= 0, op, ": padding must not be negative, got ", padding);
  return {stride[0], stride[1], padding[0], padding[1], padding[2], padding[3], dilation[0], dilation[1]};
}

// The geometry of a convolution of an N x C x H x W input with a K x C x R x S kernel,
// with one clear message for each way the sizes cannot make one.
inline cpu::ConvGeometry geometry(const char* op, c10::IntArrayRef input_size, c10::IntArrayRef weight_size,
                           const ConvParams& p) {
  const int64_t H = input_size[2], W = input_size[3], R = weight_size[2], S = weight_size[3];
  TORCH_CHECK(R >= 1 && S >= 1, op, ": the kernel must be at least 1x1, got ", R, "x", S, " (weight shape ",
              weight_size, ")");
  const int64_t reach_h = p.dilation_h * (R - 1) + 1, reach_w = p.dilation_w * (S - 1) + 1;
  const int64_t padded_h = H + p.pad_top + p.pad_bottom, padded_w = W + p.pad_left + p.pad_right;
  TORCH_CHECK(padded_h >= reach_h && padded_w >= reach_w, op, ": the input, ", H, "x", W, " (", padded_h, "x",
              padded_w, " padded), is smaller than the kernel's reach, ", reach_h, "x", reach_w,
              " (kernel ", R, "x", S, ", dilation ", p.dilation_h, "x", p.dilation_w, "); pad the input or use a "
              "smaller kernel");
  return {input_size[0], input_size[1], H, W, weight_size[0], R, S, p.stride_h, p.stride_w, p.dilation_h,
          p.dilation_w, p.pad_top, p.pad_left, (padded_h - reach_h) / p.stride_h + 1,
          (padded_w - reach_w) / p.stride_w + 1};
}

inline void check_conv_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, Kernels kernels) {
  TORCH_CHECK(input.dim() == 4, op, ": input must be 4-D (batch x channels x height x width), got shape ",
              input.sizes(), "; ext.conv2d also takes a 3-D unbatched input");
  TORCH_CHECK(weight.dim() == 4, op, ": weight must be 4-D (out_channels x in_channels x kernel_h x kernel_w), "
              "got shape ", weight.sizes());
  check_same_device_and_dtype(op, input, "input", weight, "weight");
  check_dtype(op, input, kernels);
  TORCH_CHECK(input.size(1) == weight.size(1), op, ": input has ", input.size(1), " channels but weight expects ",
              weight.size(1), " (input shape ", input.sizes(), ", weight shape ", weight.sizes(),
              "); grouped convolutions are not supported: use conv=torch for them");
  if (bias.has_value()) {
    check_same_device_and_dtype(op, *bias, "bias", weight, "weight");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": bias must have shape [",
                weight.size(0), "] to match weight, got ", bias->sizes());
  }
}

// F.conv2d's output is channels_last when its input or its weight is.
inline c10::MemoryFormat output_format(const at::Tensor& input, const at::Tensor& weight) {
  const bool channels_last = input.suggest_memory_format() == c10::MemoryFormat::ChannelsLast ||
                             weight.suggest_memory_format() == c10::MemoryFormat::ChannelsLast;
  return channels_last ? c10::MemoryFormat::ChannelsLast : c10::MemoryFormat::Contiguous;
}

// grad_output N x K x OH x OW, checked against the geometry the forward had.
inline void check_grad_output(const char* op, const at::Tensor& grad_output, const cpu::ConvGeometry& g) {
  TORCH_CHECK(grad_output.dim() == 4 && grad_output.size(0) == g.batch && grad_output.size(1) == g.out_channels &&
                  grad_output.size(2) == g.out_h && grad_output.size(3) == g.out_w,
              op, ": grad_output must have shape [", g.batch, ", ", g.out_channels, ", ", g.out_h, ", ", g.out_w,
              "], got ", grad_output.sizes());
}

// Each op's arguments checked, and its geometry: the forward's, dX's and dW's, for either kernel family.
inline cpu::ConvGeometry checked_forward_geometry(const char* op, const at::Tensor& input, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias, IntPair stride,
                                                  c10::IntArrayRef padding, IntPair dilation, Kernels kernels) {
  check_conv_args(op, input, weight, bias, kernels);
  return geometry(op, input.sizes(), weight.sizes(), conv_params(op, stride, padding, dilation));
}

inline cpu::ConvGeometry checked_backward_input_geometry(const char* op, const at::Tensor& grad_output,
                                                         const at::Tensor& weight, c10::IntArrayRef input_size,
                                                         IntPair stride, c10::IntArrayRef padding, IntPair dilation,
                                                         Kernels kernels) {
  TORCH_CHECK(input_size.size() == 4 && weight.dim() == 4, op, ": input_size must have 4 values and weight 4 "
              "dimensions, got ", input_size, " and ", weight.sizes());
  for (int64_t size : input_size) TORCH_CHECK(size >= 0, op, ": input_size must not be negative, got ", input_size);
  TORCH_CHECK(input_size[1] == weight.size(1), op, ": input_size has ", input_size[1], " channels but weight has ",
              weight.size(1), " (input_size ", input_size, ", weight shape ", weight.sizes(), ")");
  check_same_device_and_dtype(op, grad_output, "grad_output", weight, "weight");
  check_dtype(op, weight, kernels);
  const cpu::ConvGeometry g = geometry(op, input_size, weight.sizes(), conv_params(op, stride, padding, dilation));
  check_grad_output(op, grad_output, g);
  return g;
}

inline cpu::ConvGeometry checked_backward_weight_geometry(const char* op, const at::Tensor& grad_output,
                                                          const at::Tensor& input, c10::IntArrayRef weight_size,
                                                          IntPair stride, c10::IntArrayRef padding, IntPair dilation,
                                                          Kernels kernels) {
  TORCH_CHECK(weight_size.size() == 4 && input.dim() == 4 && weight_size[1] == input.size(1), op,
              ": weight_size must be 4 values whose second is input's channels, got ", weight_size, " and input ",
              input.sizes());
  for (int64_t size : weight_size) TORCH_CHECK(size >= 0, op, ": weight_size must not be negative, got ", weight_size);
  check_same_device_and_dtype(op, grad_output, "grad_output", input, "input");
  check_dtype(op, input, kernels);
  const cpu::ConvGeometry g = geometry(op, input.sizes(), weight_size, conv_params(op, stride, padding, dilation));
  check_grad_output(op, grad_output, g);
  return g;
}

// db's geometry: only the sizes of grad_output (N x K x OH x OW) matter.
inline cpu::ConvGeometry checked_backward_bias_geometry(const char* op, const at::Tensor& grad_output,
                                                        Kernels kernels) {
  TORCH_CHECK(grad_output.dim() == 4, op, ": grad_output must be 4-D, got shape ", grad_output.sizes());
  check_dtype(op, grad_output, kernels);
  return {grad_output.size(0), 0, 0, 0, grad_output.size(1), 1, 1, 1, 1, 1, 1, 0, 0, grad_output.size(2),
          grad_output.size(3)};
}

}  // namespace ext
