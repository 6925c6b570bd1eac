// ext::conv2d (groups = 1) on the CPU: argument checks, layouts, C++ autograd and autocast.
// The schemas are declared with the others in ops.cpp; the kernels are cpu/conv.cpp.
//
// padding is [top, bottom, left, right]: padding="same" with an even kernel pads one more
// after than before (as F.conv2d does), which ext.conv2d (ext/conv.py) passes here as is.
#include "checks.h"
#include "cpu/conv.h"

#include <ATen/Dispatch.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>

namespace ext {

namespace {

using IntPair = c10::IntArrayRef;

struct ConvParams {
  int64_t stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, dilation_h, dilation_w;
};

ConvParams conv_params(const char* op, IntPair stride, c10::IntArrayRef padding, IntPair dilation) {
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
cpu::ConvGeometry geometry(const char* op, c10::IntArrayRef input_size, c10::IntArrayRef weight_size,
                           const ConvParams& p) {
  const int64_t H = input_size[2], W = input_size[3], R = weight_size[2], S = weight_size[3];
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

void check_conv_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 4, op, ": input must be 4-D (batch x channels x height x width), got shape ",
              input.sizes(), "; ext.conv2d also takes a 3-D unbatched input");
  TORCH_CHECK(weight.dim() == 4, op, ": weight must be 4-D (out_channels x in_channels x kernel_h x kernel_w), "
              "got shape ", weight.sizes());
  check_same_device_and_dtype(op, input, "input", weight, "weight");
  check_dtype(op, input, Kernels::Cpu);
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
c10::MemoryFormat output_format(const at::Tensor& input, const at::Tensor& weight) {
  const bool channels_last = input.suggest_memory_format() == c10::MemoryFormat::ChannelsLast ||
                             weight.suggest_memory_format() == c10::MemoryFormat::ChannelsLast;
  return channels_last ? c10::MemoryFormat::ChannelsLast : c10::MemoryFormat::Contiguous;
}

at::Tensor conv2d_cpu(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      IntPair stride, c10::IntArrayRef padding, IntPair dilation) {
  constexpr const char* op = "ext.conv2d";
  check_conv_args(op, input, weight, bias);
  const cpu::ConvGeometry g = geometry(op, input.sizes(), weight.sizes(), conv_params(op, stride, padding, dilation));
  auto output = at::empty({g.batch, g.out_channels, g.out_h, g.out_w}, input.options());
  if (output.numel() == 0) return output.contiguous(output_format(input, weight));
  // The kernels read NCHW: a channels_last or strided input is copied once.
  const auto x = input.contiguous(), w = weight.contiguous();
  const auto b = bias.has_value() ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), op, [&] {
    if (g.patch() == 0) {  // no input channels: the output is the bias
      output.copy_(b.defined() ? b.view({1, -1, 1, 1}).expand_as(output) : at::zeros_like(output));
      return;
    }
    cpu::conv2d_forward<scalar_t>(g, x.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(),
                                  b.defined() ? b.const_data_ptr<scalar_t>() : nullptr,
                                  output.mutable_data_ptr<scalar_t>());
  });
  return output.contiguous(output_format(input, weight));
}

// grad_output N x K x OH x OW, checked against the geometry the forward had.
void check_grad_output(const char* op, const at::Tensor& grad_output, const cpu::ConvGeometry& g) {
  TORCH_CHECK(grad_output.dim() == 4 && grad_output.size(0) == g.batch && grad_output.size(1) == g.out_channels &&
                  grad_output.size(2) == g.out_h && grad_output.size(3) == g.out_w,
              op, ": grad_output must have shape [", g.batch, ", ", g.out_channels, ", ", g.out_h, ", ", g.out_w,
              "], got ", grad_output.sizes());
}

at::Tensor conv2d_backward_input_cpu(const at::Tensor& grad_output, const at::Tensor& weight,
                                     c10::IntArrayRef input_size, IntPair stride, c10::IntArrayRef padding,
                                     IntPair dilation) {
  constexpr const char* op = "ext.conv2d_backward_input";
  TORCH_CHECK(input_size.size() == 4 && weight.dim() == 4, op, ": input_size must have 4 values and weight 4 "
              "dimensions, got ", input_size, " and ", weight.sizes());
  check_same_device_and_dtype(op, grad_output, "grad_output", weight, "weight");
  check_dtype(op, weight, Kernels::Cpu);
  const cpu::ConvGeometry g = geometry(op, input_size, weight.sizes(), conv_params(op, stride, padding, dilation));
  check_grad_output(op, grad_output, g);
  auto grad_input = at::empty(input_size, grad_output.options());
  if (grad_input.numel() == 0) return grad_input;
  if (g.out_channels == 0) return grad_input.zero_();
  const auto dy = grad_output.contiguous(), w = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES(weight.scalar_type(), op, [&] {
    cpu::conv2d_backward_input<scalar_t>(g, dy.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(),
                                         grad_input.mutable_data_ptr<scalar_t>());
  });
  return grad_input;
}

at::Tensor conv2d_backward_weight_cpu(const at::Tensor& grad_output, const at::Tensor& input,
                                      c10::IntArrayRef weight_size, IntPair stride, c10::IntArrayRef padding,
                                      IntPair dilation) {
  constexpr const char* op = "ext.conv2d_backward_weight";
  TORCH_CHECK(weight_size.size() == 4 && input.dim() == 4 && weight_size[1] == input.size(1), op,
              ": weight_size must be 4 values whose second is input's channels, got ", weight_size, " and input ",
              input.sizes());
  check_same_device_and_dtype(op, grad_output, "grad_output", input, "input");
  check_dtype(op, input, Kernels::Cpu);
  const cpu::ConvGeometry g = geometry(op, input.sizes(), weight_size, conv_params(op, stride, padding, dilation));
  check_grad_output(op, grad_output, g);
  auto grad_weight = at::empty(weight_size, grad_output.options());
  if (grad_weight.numel() == 0) return grad_weight;
  const auto dy = grad_output.contiguous(), x = input.contiguous();
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), op, [&] {
    cpu::conv2d_backward_weight<scalar_t>(g, dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                          grad_weight.mutable_data_ptr<scalar_t>());
  });
  return grad_weight;
}

at::Tensor conv2d_backward_bias_cpu(const at::Tensor& grad_output) {
  constexpr const char* op = "ext.conv2d_backward_bias";
  TORCH_CHECK(grad_output.dim() == 4, op, ": grad_output must be 4-D, got shape ", grad_output.sizes());
  check_dtype(op, grad_output, Kernels::Cpu);
  auto grad_bias = at::empty({grad_output.size(1)}, grad_output.options());
  const cpu::ConvGeometry g{grad_output.size(0), 0, 0, 0, grad_output.size(1), 1, 1, 1, 1, 1, 1, 0, 0,
                            grad_output.size(2), grad_output.size(3)};
  const auto dy = grad_output.contiguous();
  AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), op, [&] {
    cpu::conv2d_backward_bias<scalar_t>(g, dy.const_data_ptr<scalar_t>(), grad_bias.mutable_data_ptr<scalar_t>());
  });
  return grad_bias;
}

// Typed handles, looked up once, for the autograd and autocast kernels.
using ConvSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                 c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef);
using ConvGradSignature = at::Tensor(const at::Tensor&, const at::Tensor&, c10::IntArrayRef, c10::IntArrayRef,
                                     c10::IntArrayRef, c10::IntArrayRef);
using ConvBiasGradSignature = at::Tensor(const at::Tensor&);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}
const c10::TypedOperatorHandle<ConvSignature>& conv2d_op() {
  static const auto op = find_op<ConvSignature>("ext::conv2d");
  return op;
}
const c10::TypedOperatorHandle<ConvGradSignature>& backward_input_op() {
  static const auto op = find_op<ConvGradSignature>("ext::conv2d_backward_input");
  return op;
}
const c10::TypedOperatorHandle<ConvGradSignature>& backward_weight_op() {
  static const auto op = find_op<ConvGradSignature>("ext::conv2d_backward_weight");
  return op;
}
const c10::TypedOperatorHandle<ConvBiasGradSignature>& backward_bias_op() {
  static const auto op = find_op<ConvBiasGradSignature>("ext::conv2d_backward_bias");
  return op;
}

enum Input { kInput, kWeight, kBias };

class Conv2dFunction : public torch::autograd::Function<Conv2dFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation) {
    at::Tensor output;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      output = conv2d_op().call(input, weight, bias, stride, padding, dilation);
    }
    // dX needs W and X's shape, dW needs X: both are saved (X for its shape too), as torch's
    // own convolution saves them.
    ctx->save_for_backward({input, weight});
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["has_bias"] = bias.has_value();
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "ext.conv2d: its backward cannot be differentiated again "
                "(create_graph=True, double backward); run this layer with torch's convolution (conv=torch)");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &grad_output = grad_outputs[0];
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(kInput))
      grad_input = backward_input_op().call(grad_output, weight, input.sizes(), stride, padding, dilation);
    if (ctx->needs_input_grad(kWeight))
      grad_weight = backward_weight_op().call(grad_output, input, weight.sizes(), stride, padding, dilation);
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(kBias))
      grad_bias = backward_bias_op().call(grad_output);
    // Gradients in the memory format of what they belong to, as torch's convolution gives them.
    if (grad_input.defined()) grad_input = grad_input.contiguous(input.suggest_memory_format());
    if (grad_weight.defined()) grad_weight = grad_weight.contiguous(weight.suggest_memory_format());
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor conv2d_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation) {
  return Conv2dFunction::apply(input, weight, bias, stride, padding, dilation);
}

// Under CPU autocast the convolution runs in float32, as ext.linear does (ops.cpp): the CPU
// kernels implement float32 and float64.
at::Tensor conv2d_autocast_cpu(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                               c10::IntArrayRef padding, c10::IntArrayRef dilation) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  return conv2d_op().call(at::autocast::cached_cast(at::kFloat, input, c10::DeviceType::CPU),
                          at::autocast::cached_cast(at::kFloat, weight, c10::DeviceType::CPU),
                          at::autocast::cached_cast(at::kFloat, bias, c10::DeviceType::CPU), stride, padding,
                          dilation);
}

// No CUDA kernel yet: one line saying what to use instead of the dispatcher's generic error.
void no_cuda_kernel(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  std::string name = op.schema().name();
  name.replace(name.find("::"), 2, ".");
  TORCH_CHECK(false, name, ": the custom convolution runs on the CPU only so far; on a GPU use torch's "
              "convolution (conv=torch; ext.replace_convs leaves CUDA models alone)");
}

constexpr const char* kConvOps[] = {"conv2d", "conv2d_backward_input", "conv2d_backward_weight",
                                    "conv2d_backward_bias"};

}  // namespace

TORCH_LIBRARY_IMPL(ext, CPU, m) {
  m.impl("conv2d", &conv2d_cpu);
  m.impl("conv2d_backward_input", &conv2d_backward_input_cpu);
  m.impl("conv2d_backward_weight", &conv2d_backward_weight_cpu);
  m.impl("conv2d_backward_bias", &conv2d_backward_bias_cpu);
}

TORCH_LIBRARY_IMPL(ext, Autograd, m) { m.impl("conv2d", &conv2d_autograd); }

TORCH_LIBRARY_IMPL(ext, AutocastCPU, m) { m.impl("conv2d", &conv2d_autocast_cpu); }

TORCH_LIBRARY_IMPL(ext, CUDA, m) {
  for (const char* name : kConvOps) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&no_cuda_kernel>());
}

}  // namespace ext
