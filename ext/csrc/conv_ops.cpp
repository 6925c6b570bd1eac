// ext::conv2d (groups = 1) on the CPU: argument checks, layouts, C++ autograd and autocast.
// The schemas are declared with the others in ops.cpp; the kernels are cpu/conv.cpp, the checks
// conv_checks.h. The autograd kernel serves the CUDA ops too (cuda/conv_cuda.cu).
#include "conv_checks.h"
#include "op_handles.h"

#include <ATen/Dispatch.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace ext {

namespace {

at::Tensor conv2d_cpu(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      IntPair stride, c10::IntArrayRef padding, IntPair dilation) {
  constexpr const char* op = "ext.conv2d";
  const cpu::ConvGeometry g =
      checked_forward_geometry(op, input, weight, bias, stride, padding, dilation, Kernels::Cpu);
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

at::Tensor conv2d_backward_input_cpu(const at::Tensor& grad_output, const at::Tensor& weight,
                                     c10::IntArrayRef input_size, IntPair stride, c10::IntArrayRef padding,
                                     IntPair dilation) {
  constexpr const char* op = "ext.conv2d_backward_input";
  const cpu::ConvGeometry g = checked_backward_input_geometry(op, grad_output, weight, input_size, stride, padding,
                                                               dilation, Kernels::Cpu);
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
  const cpu::ConvGeometry g = checked_backward_weight_geometry(op, grad_output, input, weight_size, stride, padding,
                                                                dilation, Kernels::Cpu);
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
  const cpu::ConvGeometry g = checked_backward_bias_geometry(op, grad_output, Kernels::Cpu);
  auto grad_bias = at::empty({grad_output.size(1)}, grad_output.options());
  const auto dy = grad_output.contiguous();
  AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), op, [&] {
    cpu::conv2d_backward_bias<scalar_t>(g, dy.const_data_ptr<scalar_t>(), grad_bias.mutable_data_ptr<scalar_t>());
  });
  return grad_bias;
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
      output = handles::conv2d().call(input, weight, bias, stride, padding, dilation);
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
                "(create_graph=True, double backward); take higher derivatives with torch.func (grad of grad, hessian), "
                "which ext.conv2d serves, or run this layer with torch's convolution (conv=torch)");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &grad_output = grad_outputs[0];
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(kInput))
      grad_input =
          handles::conv2d_backward_input().call(grad_output, weight, input.sizes(), stride, padding, dilation);
    if (ctx->needs_input_grad(kWeight))
      grad_weight =
          handles::conv2d_backward_weight().call(grad_output, input, weight.sizes(), stride, padding, dilation);
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(kBias))
      grad_bias = handles::conv2d_backward_bias().call(grad_output);
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
  return handles::conv2d().call(at::autocast::cached_cast(at::kFloat, input, c10::DeviceType::CPU),
                                at::autocast::cached_cast(at::kFloat, weight, c10::DeviceType::CPU),
                                at::autocast::cached_cast(at::kFloat, bias, c10::DeviceType::CPU), stride, padding,
                                dilation);
}

}  // namespace

TORCH_LIBRARY_IMPL(ext, CPU, m) {
  m.impl("conv2d", &conv2d_cpu);
  m.impl("conv2d_backward_input", &conv2d_backward_input_cpu);
  m.impl("conv2d_backward_weight", &conv2d_backward_weight_cpu);
  m.impl("conv2d_backward_bias", &conv2d_backward_bias_cpu);
}

TORCH_LIBRARY_IMPL(ext, Autograd, m) { m.impl("conv2d", &conv2d_autograd); }

TORCH_LIBRARY_IMPL(ext, AutocastCPU, m) { m.impl("conv2d", &conv2d_autocast_cpu); }

}  // namespace ext
