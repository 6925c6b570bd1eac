// ext::cross_entropy: F.cross_entropy(input, target, ignore_index=ignore_index) for class-index
// targets and the mean over the rows, the trainer's loss, in one kernel each way.
//
// Why: a training step's loss is tiny (batch x classes, 128 x 10 for the MLP), and torch's takes
// four kernels and two autograd nodes for it (log_softmax, nll_loss and their backwards), each
// slow on rows of 10 (log_softmax alone 8 µs on 2 threads, 14 on 1; Zen 5). Here the forward
// is one pass over the rows that also keeps the softmax, and the backward one pass that
// subtracts the targets' one-hot from it: the MLP's epoch 3.4% faster (epochs alternating in one
// process, median of the paired ratios, bench/README.md).
//
// The plain CPU case (float32/float64, input N x C with contiguous rows, int64 target of N) runs
// here; anything else (CUDA, other dtypes, fake tensors, dispatch modes) runs
// at::cross_entropy_loss, torch's own, so the op is a drop-in wherever it is called.
#include "op_handles.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/one_hot.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/record_function.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

namespace ext {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kMeanReduction = 1;  // at::Reduction::Mean

// The case the kernels below take; the rest goes to torch's cross_entropy_loss.
bool plain_cpu_case(const at::Tensor& input, const at::Tensor& target) {
  static const c10::DispatchKeySet plain_cpu_keys =
      c10::DispatchKeySet({c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU,
                           c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCPU});
  const auto dtype = input.scalar_type();
  return plain_cpu_keys.isSupersetOf(input.key_set()) && plain_cpu_keys.isSupersetOf(target.key_set()) &&
         c10::impl::TorchDispatchModeTLS::stack_len() == 0 && (dtype == at::kFloat || dtype == at::kDouble) &&
         input.dim() == 2 && input.size(1) > 0 && (input.size(1) == 1 || input.stride(1) == 1) &&
         target.dim() == 1 && target.scalar_type() == at::kLong && target.size(0) == input.size(0);
}

at::Tensor torch_cross_entropy(const at::Tensor& input, const at::Tensor& target, int64_t ignore_index) {
  return at::cross_entropy_loss(input, target, /*weight=*/{}, kMeanReduction, ignore_index, /*label_smoothing=*/0.0);
}

// exp(x) in place for x <= 0 (a logit less its row's max), within 2 ulp of std::exp (Cephes' expf:
// x = n ln2 + r, a degree-6 polynomial in r, times 2^n); 0 below -87, where expf's result is a
// denormal that adds nothing to a sum of at least 1; NaN stays NaN. Written so that the compiler
// vectorizes it, and compiled for AVX-512, AVX2 and the baseline, one picked at load time from the
// CPU (target_clones; no FMA contraction under -std=c++20, so all three give the same results):
// std::exp one value at a time took 4 of the op's 5.6 µs at 128x10 (Zen 5).
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void exp_nonpositive(float* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float x = values[i];
    float n = std::nearbyint(x * 1.44269504088896341f);
    n = n >= -127.0f ? n : -127.0f;  // also for NaN: the conversion below stays defined
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln 2 in two parts
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const float two_to_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
    values[i] = x < -87.0f ? 0.0f : p * two_to_n;
  }
}

void exp_nonpositive(double* values, int64_t count) {  // float64 is the exact path: the library's exp
  for (int64_t i = 0; i < count; ++i) values[i] = std::exp(values[i]);
}

// The mean over the rows whose target is not ignore_index of -log softmax(row)[target], as
// log_softmax computes it: (x[t] - max) - log(sum(exp(x - max))). probs (rows x classes) receives
// each row's softmax, exp(x - max) / sum, where scale_probs is set, and is scratch otherwise.
// *counted gets the number of rows counted. An empty mean is 0/0, NaN, as torch's.
template <typename T>
T cross_entropy_rows(int64_t rows, int64_t classes, const T* input, int64_t row_stride, const int64_t* target,
                     int64_t ignore_index, T* probs, bool scale_probs, int64_t* counted) {
  std::vector<T> maxima(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const T* x = input + i * row_stride;
    T* p = probs + i * classes;
    T max = x[0];
    for (int64_t c = 1; c < classes; ++c) max = std::max(max, x[c]);
    for (int64_t c = 0; c < classes; ++c) p[c] = x[c] - max;
    maxima[i] = max;
  }
  exp_nonpositive(probs, rows * classes);  // all rows in one call: vectors run across rows of 10
  double total = 0;  // summed in double: the rows' order then hardly matters
  int64_t count = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = target[i];
    TORCH_CHECK(t == ignore_index || (0 <= t && t < classes), "ext.cross_entropy: target ", t, " (row ", i,
                ") is not a class index: with ", classes, " classes, targets are 0..", classes - 1,
                " (or ignore_index=", ignore_index, " to leave a row out)");
    T* p = probs + i * classes;
    T sum = 0;
    for (int64_t c = 0; c < classes; ++c) sum += p[c];
    if (scale_probs) {
      const T inverse = T(1) / sum;
      for (int64_t c = 0; c < classes; ++c) p[c] *= inverse;
    }
    if (t == ignore_index) continue;
    total -= (input[i * row_stride + t] - maxima[i]) - std::log(sum);
    ++count;
  }
  *counted = count;
  return static_cast<T>(total / static_cast<double>(count));
}

at::Tensor cross_entropy_cpu_impl(const at::Tensor& input, const at::Tensor& target, int64_t ignore_index,
                                  at::Tensor* probs, int64_t* counted) {
  const auto target_c = target.contiguous();
  auto loss = at::empty({}, input.options());
  const auto buffer = at::empty(input.sizes(), input.options());  // the softmax, or scratch
  if (probs) *probs = buffer;
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "ext.cross_entropy", [&] {
    *loss.mutable_data_ptr<scalar_t>() = cross_entropy_rows<scalar_t>(
        input.size(0), input.size(1), input.const_data_ptr<scalar_t>(), input.stride(0),
        target_c.const_data_ptr<int64_t>(), ignore_index, buffer.mutable_data_ptr<scalar_t>(), probs != nullptr,
        counted);
  });
  return loss;
}

// The CPU kernel (below autograd: no gradient to keep).
at::Tensor cross_entropy_cpu(const at::Tensor& input, const at::Tensor& target, int64_t ignore_index) {
  if (!plain_cpu_case(input, target)) return torch_cross_entropy(input, target, ignore_index);
  int64_t counted = 0;
  return cross_entropy_cpu_impl(input, target, ignore_index, nullptr, &counted);
}

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& target,
                            int64_t ignore_index) {
    at::Tensor probs;
    int64_t counted = 0;
    at::Tensor loss = cross_entropy_cpu_impl(input, target, ignore_index, &probs, &counted);
    ctx->save_for_backward({input, target, probs});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["counted"] = counted;
    return loss;
  }

  // d loss / d input[i, c] = (softmax[i, c] - [c == target[i]]) · grad / counted, 0 on ignored rows.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &target = saved[1], &probs = saved[2];
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const auto counted = static_cast<double>(ctx->saved_data["counted"].toInt());
    const at::Tensor& grad = grad_outputs[0];
    if (at::GradMode::is_enabled() || !plain_cpu_case(input, target) || grad.device() != input.device()) {
      // create_graph (or anything unusual): the same formula from differentiable ops
      const auto counted_rows = target.ne(ignore_index).unsqueeze(1);
      const auto one_hot = at::one_hot(at::where(counted_rows.squeeze(1), target, 0), input.size(1));
      const auto grad_input = at::softmax(input, 1).sub(one_hot.to(input.scalar_type())).mul(grad.div(counted));
      return {at::where(counted_rows, grad_input, at::zeros_like(grad_input)), at::Tensor(), at::Tensor()};
    }
    RECORD_FUNCTION("ext::cross_entropy_backward", std::vector<c10::IValue>());
    const int64_t rows = probs.size(0), classes = probs.size(1);
    auto grad_input = at::empty({rows, classes}, probs.options());
    const auto target_c = target.contiguous();
    AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "ext.cross_entropy backward", [&] {
      const auto scale = static_cast<scalar_t>(grad.item<double>() / counted);
      const scalar_t* p = probs.const_data_ptr<scalar_t>();
      const int64_t* t = target_c.const_data_ptr<int64_t>();
      scalar_t* g = grad_input.mutable_data_ptr<scalar_t>();
      for (int64_t i = 0; i < rows; ++i) {
        scalar_t* g_row = g + i * classes;
        const scalar_t* p_row = p + i * classes;
        if (t[i] == ignore_index) {
          std::fill(g_row, g_row + classes, scalar_t(0));
          continue;
        }
        for (int64_t c = 0; c < classes; ++c) g_row[c] = p_row[c] * scale;
        g_row[t[i]] -= scale;
      }
    });
    return {grad_input, at::Tensor(), at::Tensor()};
  }
};

at::Tensor cross_entropy_autograd(const at::Tensor& input, const at::Tensor& target, int64_t ignore_index) {
  if (!plain_cpu_case(input, target)) return torch_cross_entropy(input, target, ignore_index);
  if (!at::GradMode::is_enabled() || !input.requires_grad()) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return cross_entropy_cpu(input, target, ignore_index);
  }
  return CrossEntropyFunction::apply(input, target, ignore_index);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ext, m) {
  m.def("cross_entropy(Tensor input, Tensor target, int ignore_index=-100) -> Tensor");
}

TORCH_LIBRARY_IMPL(ext, Autograd, m) { m.impl("cross_entropy", &cross_entropy_autograd); }
TORCH_LIBRARY_IMPL(ext, CPU, m) { m.impl("cross_entropy", &cross_entropy_cpu); }
// Every other backend (CUDA, sparse, ...) below autograd, as under torch.inference_mode: torch's.
TORCH_LIBRARY_IMPL(ext, CompositeExplicitAutograd, m) { m.impl("cross_entropy", &torch_cross_entropy); }

}  // namespace ext
