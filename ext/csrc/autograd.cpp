// Autograd for ext::linear and ext::linear_relu, in C++.
//
// Registered for the Autograd dispatch key, so the forward and the backward run
// without entering Python: at batch 128 a Python autograd.Function added about
// 10 µs per layer per step (measured: the 128x256->10 head took 22.7 µs against
// F.linear's 13.5), as much as the GEMM itself on small layers.
// The backward computes only the gradients autograd asks for and saves only the
// operands they need (dX needs W, dW needs X). With create_graph it builds the
// gradients from differentiable ops (ext::linear itself), so double backward works.
#include "cpu/gemm.h"
#include "op_handles.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/threshold_backward.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace ext {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
enum Input { kInput, kWeight, kBias };

// dX = dY·W and dW = dYᵀ·X cost the same; on a 2-thread CPU they run side by side, one
// per thread, rather than one after the other with each split over both threads: no
// fork-join per product, and each thread keeps its operands in its own caches.
// Measured here (2 threads, backward of ext.linear, ms, one after the other -> side by
// side): 128x784->256 0.377 -> 0.354, 128x256->256 0.140 -> 0.135, 512x256->256
// 0.502 -> 0.458, 1024^3 12.57 -> 12.52. With more threads each product spreads over all of them.
// Only for plain CPU tensors: fake tensors and Python dispatch modes (torch.compile's
// tracing, TorchDispatchMode) stay on the thread that set them up. Products too small
// to split over threads (cpu::kParallelMinFlops each) run one after the other: waking
// the second thread costs more than it saves. Measured here (bench.linear, backward,
// 2 threads, us, side by side -> one after the other): 8x8->8 27 -> 23, 64x64->10
// 28 -> 25, 128x128->10 31 -> 29 (1 thread: 22-23, 24-25, 28-29).
bool side_by_side(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight) {
  static const c10::DispatchKeySet plain_cpu_keys =
      c10::DispatchKeySet({c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU,
                           c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCPU});
  auto plain_cpu = [](const at::Tensor& t) { return plain_cpu_keys.isSupersetOf(t.key_set()); };
  if (!plain_cpu(grad_output) || !plain_cpu(input) || !plain_cpu(weight)) return false;  // sizes may be symbolic
  const double flops_per_product = 2.0 * grad_output.size(0) * weight.size(0) * weight.size(1);
  return flops_per_product >= cpu::kParallelMinFlops && c10::impl::TorchDispatchModeTLS::stack_len() == 0 &&
         at::get_num_threads() == 2 && !at::in_parallel_region();
}

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, bool relu) {
    at::Tensor output;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      output = handles::linear(relu).call(input, weight, bias);
    }
    // Undefined slots save nothing: dX needs only W, dW only X, and ReLU's mask is the output.
    // (needs_input_grad is not usable here: with no input requiring grad the node has no edges.)
    ctx->save_for_backward({weight.requires_grad() ? input : at::Tensor(),
                            input.requires_grad() ? weight : at::Tensor(),
                            relu ? output : at::Tensor()});
    ctx->saved_data["relu"] = relu;
    // A missing bias has no gradient slot (needs_input_grad(kBias) would be out of range).
    ctx->saved_data["has_bias"] = bias.has_value();
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    at::Tensor grad_output = grad_outputs[0];
    // ReLU's gradient, torch's own: 0 where the output is <= 0 (NaN passes through).
    if (ctx->saved_data["relu"].toBool()) grad_output = at::threshold_backward(grad_output, saved[2], 0);

    at::Tensor grad_input, grad_weight, grad_bias;
    const bool needs_grad_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(kBias);
    if (at::GradMode::is_enabled()) {
      // create_graph: the same products through ext::linear, which records its own backward.
      if (ctx->needs_input_grad(kInput)) grad_input = handles::linear(false).call(grad_output, weight.t(), {});
      if (ctx->needs_input_grad(kWeight)) grad_weight = handles::linear(false).call(grad_output.t(), input.t(), {});
      if (needs_grad_bias) grad_bias = grad_output.sum(0);
    } else {
      const bool needs_input = ctx->needs_input_grad(kInput), needs_weight = ctx->needs_input_grad(kWeight);
      // db goes with dX: side by side, dW was the slower of the two on every MLP shape
      // (1 thread, us, dX / dW: 128x784->256 279 / 305, 512x256->256 356 / 400).
      auto operand_grads = [&](int64_t which) {
        if (which == 0 && needs_input) grad_input = handles::backward_input().call(grad_output, weight);
        if (which == 0 && needs_grad_bias) grad_bias = handles::backward_bias().call(grad_output);
        if (which == 1 && needs_weight) grad_weight = handles::backward_weight().call(grad_output, input);
      };
      if (needs_input && needs_weight && side_by_side(grad_output, input, weight)) {
        // Each task runs with this thread's dispatcher state (autograd off, modes, profiler).
        const at::ThreadLocalState state;
        at::parallel_for(0, 2, 1, [&](int64_t first, int64_t last) {
          const at::ThreadLocalStateGuard same_state(state);
          for (int64_t which = first; which < last; ++which) operand_grads(which);
        });
      } else {
        operand_grads(0);
        operand_grads(1);
      }
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor()};  // nothing for the relu flag
  }
};

at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  return LinearFunction::apply(input, weight, bias, false);
}

at::Tensor linear_relu_autograd(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias) {
  return LinearFunction::apply(input, weight, bias, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(ext, Autograd, m) {
  m.impl("linear", &linear_autograd);
  m.impl("linear_relu", &linear_relu_autograd);
}

}  // namespace ext
