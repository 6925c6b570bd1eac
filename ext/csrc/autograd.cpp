// Autograd for ext::linear and ext::linear_relu, in C++ (and for the backward ops, near the end).
//
// Registered for the Autograd dispatch key, so the forward and the backward run
// without entering Python: at batch 128 a Python autograd.Function added about
// 10 µs per layer per step (measured: the 128x256->10 head took 22.7 µs against
// F.linear's 13.5), as much as the GEMM itself on small layers.
// The backward computes only the gradients autograd asks for and saves only the
// operands they need (dX needs W, dW needs X). With create_graph it builds the
// gradients from differentiable ops (ext::linear itself), so double backward works.
#include "checks.h"
#include "cpu/gemm.h"
#include "op_handles.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/threshold_backward.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>

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
// Products too small to split over threads (cpu::kParallelMinFlops each) run one after
// the other: waking the second thread costs more than it saves. Measured here
// (bench.linear, backward, 2 threads, us, side by side -> one after the other): 8x8->8
// 27 -> 23, 64x64->10 28 -> 25, 128x128->10 31 -> 29 (1 thread: 22-23, 24-25, 28-29).
bool side_by_side(int64_t batch, int64_t out_features, int64_t in_features) {
  const double flops_per_product = 2.0 * batch * out_features * in_features;
  return flops_per_product >= cpu::kParallelMinFlops && at::get_num_threads() == 2 && !at::in_parallel_region();
}

// Side by side, dX and dW are each cut into chunks of one column panel where cpu::ColumnChunks
// allows it, and a thread done with its own product takes the other's chunks still left, so
// neither waits while the other works. A product stays one chunk when its rows make several
// blocks, its packed A is deeper than one K block, or its C is written row after row: dW of
// 128x2048->1000 (C's rows 8 KiB apart) and dW of a batch of 512 with 1000 outputs (dYᵀ
// several blocks) stay whole, and then only dX is shared. Which product is longer depends on
// the shape (one thread: dX 3.1 ms and dW 2.8 for 128x2048->1000, 0.35 and 0.40 for
// 512x256->256), and on a shared machine either core may run slow for a while. dW's chunks
// share one packed copy of dYᵀ (cpu::ColumnChunks), so cutting it repacks nothing. Each
// element gets the same arithmetic whichever thread computes it, so results stay
// bit-identical. Only from kSharedMinFlops per product, where a chunk's own setup is lost in
// it. Measured (2 threads, single calls alternating with the previous scheme, where only dX
// was cut, in 192-column chunks, and only from 64 Mflop; median of the paired ratios, while
// one vCPU ran slow): fwd+bwd 128x784->256 0.957, 128x256->256 0.974, 512x784->256 0.988,
// 512x256->256 1.001, 128x256->10 1.000 (with the forward's column slabs shared too, see
// cpu::gemm); backward alone 128x784->256 0.957, 128x256->256 0.948 (sharing from 4 rather
// than 64 Mflop), 512x784->256 0.892 (one-panel chunks), 128x2048->1000 1.001 (only dX cut),
// 1024^3 0.999. With both vCPUs at full speed it is a wash: fwd+bwd 128x784->256 1.006,
// 128x256->256 1.015, 512x784->256 0.996, 512x256->256 1.020 (its backward alone 1.080, 1.015
// and 0.991 in three runs). On one thread, running a backward in chunks rather than whole cost
// 0-1.4%.
constexpr int64_t kSharedChunkPanels = 1;
constexpr double kSharedMinFlops = 8e6;

struct Grads {
  at::Tensor input, weight, bias;
};

// The gradients asked for, from the CPU kernels called directly (plain_cpu): the ops'
// checks hold already (the forward checked shapes and dtypes, autograd gives dY the
// output's), and skipping three dispatcher calls saves about 1 µs per layer and step,
// more on some shapes. Measured here (fwd+bwd, us, interleaved in one process, ops ->
// direct): 2 threads 128x256->10 45.9 -> 45.6, 128x784->256 554 -> 546, 512x784->256
// 2019 -> 1892 (2033 -> 1909 in a second run); 1 thread 8x8->8 29.4 -> 28.7,
// 512x256->256 1258 -> 1244.
// db goes with dX: side by side, dW was the slower of the two on every MLP shape (1
// thread, us, dX / dW: 128x784->256 279 / 305, 512x256->256 356 / 400). Each product
// is recorded for the profiler under its op's name.
//
// With relu_output (linear_relu; dY and the output with contiguous rows), dY is first masked
// by ReLU's gradient and db is summed in that same pass (cpu::relu_backward_sum_rows), rather
// than threshold_backward's pass and then db's own: the MLP's epoch 1% faster (Zen 5,
// 2 threads, epochs alternating in one process; medians of the paired ratios 0.989, 0.988
// and 0.998 in three runs).
Grads backward_cpu(const at::Tensor& grad_output_in, const at::Tensor& relu_output, const at::Tensor& input,
                   const at::Tensor& weight, bool needs_input, bool needs_weight, bool needs_bias) {
  const int64_t M = grad_output_in.size(0), N = grad_output_in.size(1);
  const int64_t K = needs_input ? weight.size(1) : needs_weight ? input.size(1) : 0;
  const auto options = grad_output_in.options();
  Grads grads;
  if (needs_input) grads.input = at::empty({M, K}, options);
  if (needs_weight) grads.weight = at::empty({N, K}, options);
  if (needs_bias) grads.bias = at::empty({N}, options);
  at::Tensor grad_output = grad_output_in;
  if (relu_output.defined()) {
    grad_output = at::empty({M, N}, options);
    AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), "ext.linear_relu backward", [&] {
      RECORD_FUNCTION("ext::linear_relu_backward_mask", std::vector<c10::IValue>());
      cpu::relu_backward_sum_rows<scalar_t>(M, N, grad_output_in.const_data_ptr<scalar_t>(), grad_output_in.stride(0),
                                            relu_output.const_data_ptr<scalar_t>(), relu_output.stride(0),
                                            grad_output.mutable_data_ptr<scalar_t>(),
                                            needs_bias ? grads.bias.mutable_data_ptr<scalar_t>() : nullptr);
    });
    needs_bias = false;  // summed already
  }
  const int64_t dy_rs = grad_output.stride(0), dy_cs = grad_output.stride(1);
  AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), "ext.linear backward", [&] {
    const scalar_t* dy = grad_output.const_data_ptr<scalar_t>();
    const bool side = needs_input && needs_weight && side_by_side(M, N, K);
    const bool share = side && 2.0 * M * N * K >= kSharedMinFlops;
    const int64_t panels_per_chunk = share ? kSharedChunkPanels : 0;  // else one chunk
    // dX (M x K) = dY (M x N) · W (N x K)
    std::optional<cpu::ColumnChunks<scalar_t>> input_grad, weight_grad;
    if (needs_input)
      input_grad.emplace(M, K, N, dy, dy_rs, dy_cs, weight.const_data_ptr<scalar_t>(), weight.stride(0),
                         weight.stride(1), nullptr, false, grads.input.mutable_data_ptr<scalar_t>(), K,
                         panels_per_chunk);
    // dW (N x K) = dYᵀ (N x M) · X (M x K), packed straight from dY's strides
    if (needs_weight)
      weight_grad.emplace(N, K, M, dy, dy_cs, dy_rs, input.const_data_ptr<scalar_t>(), input.stride(0),
                          input.stride(1), nullptr, false, grads.weight.mutable_data_ptr<scalar_t>(), K,
                          panels_per_chunk);
    auto input_and_bias_grads = [&] {
      if (needs_input) {
        RECORD_FUNCTION("ext::linear_backward_input", std::vector<c10::IValue>());
        input_grad->run();
      }
      if (needs_bias) {  // db (N) = the sum of dY's rows
        RECORD_FUNCTION("ext::linear_backward_bias", std::vector<c10::IValue>());
        cpu::sum_rows<scalar_t>(M, N, dy, dy_rs, dy_cs, grads.bias.mutable_data_ptr<scalar_t>());
      }
    };
    auto weight_grad_all = [&] {
      if (!needs_weight) return;
      RECORD_FUNCTION("ext::linear_backward_weight", std::vector<c10::IValue>());
      weight_grad->run();
    };
    if (side) {
      const at::ThreadLocalState state;  // the caller's (profiler, grad mode), for the other thread
      at::parallel_for(0, 2, 1, [&](int64_t first, int64_t last) {
        const at::ThreadLocalStateGuard same_state(state);
        for (int64_t which = first; which < last; ++which) {
          if (which == 0) {
            input_and_bias_grads();
            if (share && !weight_grad->all_taken()) {  // dW chunks still left: take them
              RECORD_FUNCTION("ext::linear_backward_weight (shared)", std::vector<c10::IValue>());
              weight_grad->run();
            }
          } else {
            weight_grad_all();
            if (share && !input_grad->all_taken()) {  // dX chunks still left: take them
              RECORD_FUNCTION("ext::linear_backward_input (shared)", std::vector<c10::IValue>());
              input_grad->run();
            }
          }
        }
      });
    } else {
      input_and_bias_grads();
      weight_grad_all();
    }
  });
  return grads;
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
    const at::Tensor& relu_output = saved[2];  // undefined without the ReLU

    at::Tensor grad_input, grad_weight, grad_bias;
    const bool needs_grad_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(kBias);
    // ReLU's gradient: 0 where the output is <= 0 (NaN passes through), threshold_backward's
    // rule, which backward_cpu applies itself in its one pass where it can.
    const bool direct = !at::GradMode::is_enabled() && plain_cpu(grad_output, input, weight);
    const bool mask_in_backward_cpu =
        direct && relu_output.defined() && grad_output.stride(1) == 1 && relu_output.stride(1) == 1;
    if (relu_output.defined() && !mask_in_backward_cpu)
      grad_output = at::threshold_backward(grad_output, relu_output, 0);
    if (at::GradMode::is_enabled()) {
      // create_graph: the same products through ext::linear, which records its own backward.
      if (ctx->needs_input_grad(kInput)) grad_input = handles::linear(false).call(grad_output, weight.t(), {});
      if (ctx->needs_input_grad(kWeight)) grad_weight = handles::linear(false).call(grad_output.t(), input.t(), {});
      if (needs_grad_bias) grad_bias = grad_output.sum(0);
    } else {
      const bool needs_input = ctx->needs_input_grad(kInput), needs_weight = ctx->needs_input_grad(kWeight);
      if (direct) {
        Grads grads = backward_cpu(grad_output, mask_in_backward_cpu ? relu_output : at::Tensor(), input, weight,
                                   needs_input, needs_weight, needs_grad_bias);
        grad_input = std::move(grads.input);
        grad_weight = std::move(grads.weight);
        grad_bias = std::move(grads.bias);
      } else {
        if (needs_input) grad_input = handles::backward_input().call(grad_output, weight);
        if (needs_weight) grad_weight = handles::backward_weight().call(grad_output, input);
        if (needs_grad_bias) grad_bias = handles::backward_bias().call(grad_output);
      }
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor()};  // nothing for the relu flag
  }
};

// Whether a call must be recorded for autograd: grad mode on and an operand that requires grad, or one
// carrying a forward-mode tangent (the C++ Function then raises that it has no jvp, rather than the
// tangent being dropped). Otherwise the op runs below autograd, as torch's own kernels do: no graph
// node, saved tensors or context, which cost more than a small product's kernel. Measured (Zen 5,
// 1 thread, processes alternating, 6 rounds, µs a call, node -> below): ext.linear 1x1->1 2.18 -> 1.31
// (torch's F.linear 1.8), 128x256->10 8.10 -> 7.26, 128x512->10 13.6 -> 12.7.
bool records_graph(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& c = std::nullopt) {
  const auto recorded = [](const at::Tensor& t) {
    return t.defined() && ((at::GradMode::is_enabled() && t.requires_grad()) || t._fw_grad(/*level=*/0).defined());
  };
  return recorded(a) || recorded(b) || (c.has_value() && recorded(*c));
}

template <bool kRelu>
at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  if (records_graph(input, weight, bias)) return LinearFunction::apply(input, weight, bias, kRelu);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return handles::linear(kRelu).call(input, weight, bias);
}

// The backward products as ops of their own are differentiable too: dX = dY·W is linear(dY, Wᵀ), and
// dW = dYᵀ·X is linear(dYᵀ, Xᵀ), each recorded by ext::linear's autograd; db is dY's column sums. Not
// recorded, they run below autograd. Without a kernel here torch's boxed autograd fallback ran instead:
// it gave the operands zero gradients with only a warning, and boxing cost 0.06 µs a call (1x1->1
// dX 0.96 -> 0.89 µs, dW 0.97 -> 0.91). The op's checks run first either way, so a mistake is named
// after the op called.
Kernels kernels_for(const at::Tensor& t) { return t.is_cuda() ? Kernels::Cuda : Kernels::Cpu; }

at::Tensor linear_backward_input_autograd(const at::Tensor& grad_output, const at::Tensor& weight) {
  if (records_graph(grad_output, weight)) {
    check_grad_args("ext.linear_backward_input", grad_output, weight, "weight", 1, 0, kernels_for(weight));
    return handles::linear(false).call(grad_output, weight.t(), {});
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return handles::backward_input().call(grad_output, weight);
}

at::Tensor linear_backward_weight_autograd(const at::Tensor& grad_output, const at::Tensor& input) {
  if (records_graph(grad_output, input)) {
    check_grad_args("ext.linear_backward_weight", grad_output, input, "input", 0, 0, kernels_for(input));
    return handles::linear(false).call(grad_output.t(), input.t(), {});
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return handles::backward_weight().call(grad_output, input);
}

at::Tensor linear_backward_bias_autograd(const at::Tensor& grad_output) {
  if (records_graph(grad_output, at::Tensor())) {
    TORCH_CHECK(grad_output.dim() == 2, "ext.linear_backward_bias: grad_output must be 2-D, got shape ",
                grad_output.sizes());
    return grad_output.sum(0);
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return handles::backward_bias().call(grad_output);
}

}  // namespace

double shared_min_flops() { return kSharedMinFlops; }  // reported by ext.cpu_block_sizes

TORCH_LIBRARY_IMPL(ext, Autograd, m) {
  m.impl("linear", &linear_autograd<false>);
  m.impl("linear_relu", &linear_autograd<true>);
  m.impl("linear_backward_input", &linear_backward_input_autograd);
  m.impl("linear_backward_weight", &linear_backward_weight_autograd);
  m.impl("linear_backward_bias", &linear_backward_bias_autograd);
}

}  // namespace ext
