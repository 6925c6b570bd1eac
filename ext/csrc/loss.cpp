// ext::cross_entropy: F.cross_entropy(input, target, ignore_index=ignore_index) for class-index
// targets and the mean over the rows, the trainer's loss, in one kernel each way.
//
// Why: a training step's loss is tiny (batch x classes, 128 x 10 for the MLP), and torch's takes
// four kernels and two autograd nodes for it (log_softmax, nll_loss and their backwards), each
// slow on rows of 10 (log_softmax alone 8 µs on 2 threads, 14 on 1; Zen 5). Here the forward
// is one pass over the rows that keeps each row's exps and 1/sum, and the backward one pass that
// forms the softmax from them less the targets' one-hot: forward and backward at 128x10 30 -> 17 µs
// (python -m bench.loss), the MLP's epoch about 2% faster (epochs alternating in one process, median
// of seven runs' paired ratios 0.981, bench/README.md).
//
// The plain CPU case (float32/float64, input N x C with contiguous rows, int64 target of N) runs
// here; anything else (CUDA, other dtypes, fake tensors, dispatch modes) runs
// at::cross_entropy_loss, torch's own, so the op is a drop-in wherever it is called.
#include "checks.h"
#include "op_handles.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/one_hot.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace ext {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kMeanReduction = 1;  // at::Reduction::Mean

// The case the kernels below take; the rest goes to torch's cross_entropy_loss.
bool plain_cpu_case(const at::Tensor& input, const at::Tensor& target) {
  const auto dtype = input.scalar_type();
  return plain_cpu(input, target) &&
         (dtype == at::kFloat || dtype == at::kDouble) && input.dim() == 2 && input.size(1) > 0 &&
         (input.size(1) == 1 || input.stride(1) == 1) && target.dim() == 1 && target.scalar_type() == at::kLong &&
         target.size(0) == input.size(0);
}

at::Tensor torch_cross_entropy(const at::Tensor& input, const at::Tensor& target, int64_t ignore_index) {
  return at::cross_entropy_loss(input, target, /*weight=*/{}, kMeanReduction, ignore_index, /*label_smoothing=*/0.0);
}

// exp(x) in place for x <= 0 (a logit less its row's max), within 2 ulp of std::exp (Cephes' expf:
// x = n ln2 + r, a degree-6 polynomial in r, times 2^n); 0 below -87, where expf's result is a
// denormal that adds nothing to a sum of at least 1; NaN stays NaN. Written so that the compiler
// vectorizes it, and compiled for AVX-512, AVX2 and the baseline, one picked at load time from the
// CPU (target_clones), with no multiply-add contracted into an FMA (GCC contracts in C++ by default,
// and only the AVX2 and AVX-512 copies have FMAs: their results differed from the baseline's in 1% of
// values), so that every CPU gets the same bits: std::exp one value at a time took 4 of the op's 5.6 µs
// at 128x10 (Zen 5).
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), optimize("fp-contract=off")))
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

// A row's max and sum in 16 interleaved lanes, which the compiler vectorizes: one chain of float adds
// may not be reordered (no -ffast-math here) and runs one add per 4 cycles, which made a row of 1,000
// classes cost more than all the rest of the row's work.
constexpr int64_t kLanes = 16;

template <typename T>
T row_max(const T* x, int64_t n) {
  T max = x[0];
  int64_t c = 0;
  if (n >= kLanes) {
    T lanes[kLanes];
    std::copy(x, x + kLanes, lanes);
    for (c = kLanes; c + kLanes <= n; c += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], x[c + j]);
    max = *std::max_element(lanes, lanes + kLanes);
  }
  for (; c < n; ++c) max = std::max(max, x[c]);
  return max;
}

template <typename T>
T row_sum(const T* x, int64_t n) {
  if (n < kLanes) return std::accumulate(x, x + n, T(0));
  T lanes[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += x[c + j];
  for (int64_t j = 0; c < n; ++c, ++j) lanes[j] += x[c];
  T sum = 0;
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

// Rows in blocks of at least kBlockValues values, a block per task: a batch of 128 with 10 classes is one
// block and runs on the calling thread; a large one (a big batch, many classes) runs on all of torch's
// threads, as torch's own loss does. The blocks depend only on the shape, and their sums are added in
// block order, so the loss is the same for any thread count.
constexpr int64_t kBlockValues = 32768;

int64_t rows_per_block(int64_t classes) { return std::max<int64_t>(1, kBlockValues / std::max<int64_t>(classes, 1)); }

struct BlockSum {
  double total = 0;  // summed in double: the rows' order then hardly matters
  int64_t counted = 0;
};

// Rows [r0, r1): -log softmax(row)[target] as log_softmax computes it, (x[t] - max) - log(sum(exp(x -
// max))), summed over the rows whose target is not ignore_index. exps (rows x classes) receives each
// row's exp(x - max) and, where given, inverse_sums (rows) each row's 1 / sum(exp(x - max)): the softmax
// is their product, which the backward forms in its one pass rather than in a pass here (the forward of
// 256x1000 78 -> 63 µs on 2 threads). (Cut into chunks of 2,048 values to stay in L1, the block's three
// passes were no faster: 4096x1000's forward 1,200 µs against 980.)
template <typename T>
BlockSum cross_entropy_block(int64_t r0, int64_t r1, int64_t classes, const T* input, int64_t row_stride,
                             const int64_t* target, int64_t ignore_index, T* exps, T* inverse_sums) {
  std::vector<T> maxima(r1 - r0);
  for (int64_t i = r0; i < r1; ++i) {
    const T* x = input + i * row_stride;
    T* e = exps + i * classes;
    const T max = row_max(x, classes);
    for (int64_t c = 0; c < classes; ++c) e[c] = x[c] - max;
    maxima[i - r0] = max;
  }
  exp_nonpositive(exps + r0 * classes, (r1 - r0) * classes);  // the block at once: vectors run across rows
  BlockSum sum;
  for (int64_t i = r0; i < r1; ++i) {
    const int64_t t = target[i];
    const T row_exp_sum = row_sum(exps + i * classes, classes);
    if (inverse_sums) inverse_sums[i] = T(1) / row_exp_sum;
    if (t == ignore_index) continue;
    sum.total -= (input[i * row_stride + t] - maxima[i - r0]) - std::log(row_exp_sum);
    ++sum.counted;
  }
  return sum;
}

// The mean over the rows counted (an empty mean is 0/0, NaN, as torch's); *counted gets their number.
template <typename T>
T cross_entropy_rows(int64_t rows, int64_t classes, const T* input, int64_t row_stride, const int64_t* target,
                     int64_t ignore_index, T* exps, T* inverse_sums, int64_t* counted) {
  const int64_t block_rows = rows_per_block(classes), blocks = (rows + block_rows - 1) / block_rows;
  BlockSum all;
  if (blocks <= 1) {  // the common case, a training step's batch: no task to hand out
    all = cross_entropy_block(0, rows, classes, input, row_stride, target, ignore_index, exps, inverse_sums);
  } else {
    std::vector<BlockSum> sums(blocks);
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b)
        sums[b] = cross_entropy_block(b * block_rows, std::min(rows, (b + 1) * block_rows), classes, input,
                                      row_stride, target, ignore_index, exps, inverse_sums);
    });
    for (const BlockSum& sum : sums) {
      all.total += sum.total;
      all.counted += sum.counted;
    }
  }
  *counted = all.counted;
  return static_cast<T>(all.total / static_cast<double>(all.counted));
}

// Every target a class index or ignore_index, checked before any kernel reads one, on the calling
// thread (so that of several bad targets the first is named), and again by the backward: a target
// changed in place after the forward must not index out of its row. torch raises IndexError here too.
void check_targets(const int64_t* target, int64_t rows, int64_t classes, int64_t ignore_index) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = target[i];
    TORCH_CHECK_INDEX(t == ignore_index || (0 <= t && t < classes), "ext.cross_entropy: target ", t, " (row ", i,
                      ") is not a class index: with ", classes, " classes, targets are 0..", classes - 1,
                      " (or ignore_index=", ignore_index, " to leave a row out)");
  }
}

// The loss; where exps and inverse_sums are given, they receive what the backward needs (see
// cross_entropy_block), else a scratch buffer takes the exps.
at::Tensor cross_entropy_cpu_impl(const at::Tensor& input, const at::Tensor& target, int64_t ignore_index,
                                  at::Tensor* exps, at::Tensor* inverse_sums, int64_t* counted) {
  const auto target_c = target.contiguous();
  check_targets(target_c.const_data_ptr<int64_t>(), input.size(0), input.size(1), ignore_index);
  auto loss = at::empty({}, input.options());
  const auto buffer = at::empty(input.sizes(), input.options());
  if (exps) {
    *exps = buffer;
    *inverse_sums = at::empty({input.size(0)}, input.options());
  }
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "ext.cross_entropy", [&] {
    *loss.mutable_data_ptr<scalar_t>() = cross_entropy_rows<scalar_t>(
        input.size(0), input.size(1), input.const_data_ptr<scalar_t>(), input.stride(0),
        target_c.const_data_ptr<int64_t>(), ignore_index, buffer.mutable_data_ptr<scalar_t>(),
        exps ? inverse_sums->mutable_data_ptr<scalar_t>() : nullptr, counted);
  });
  return loss;
}

// The CPU kernel (below autograd: no gradient to keep).
at::Tensor cross_entropy_cpu(const at::Tensor& input, const at::Tensor& target, int64_t ignore_index) {
  if (!plain_cpu_case(input, target)) return torch_cross_entropy(input, target, ignore_index);
  int64_t counted = 0;
  return cross_entropy_cpu_impl(input, target, ignore_index, nullptr, nullptr, &counted);
}

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& target,
                            int64_t ignore_index) {
    at::Tensor exps, inverse_sums;
    int64_t counted = 0;
    at::Tensor loss = cross_entropy_cpu_impl(input, target, ignore_index, &exps, &inverse_sums, &counted);
    ctx->save_for_backward({input, target, exps, inverse_sums});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["counted"] = counted;
    return loss;
  }

  // d loss / d input[i, c] = (softmax[i, c] - [c == target[i]]) · grad / counted, 0 on ignored rows;
  // softmax[i, c] = exps[i, c] · inverse_sums[i].
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &target = saved[1], &exps = saved[2], &inverse_sums = saved[3];
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const auto counted = static_cast<double>(ctx->saved_data["counted"].toInt());
    const at::Tensor& grad = grad_outputs[0];
    if (at::GradMode::is_enabled() || !plain_cpu_case(input, target) || !plain_cpu(grad) ||
        grad.device() != input.device()) {
      // create_graph, or anything unusual (a batched grad under is_grads_batched): the same formula
      // from differentiable ops
      const auto counted_rows = target.ne(ignore_index).unsqueeze(1);
      const auto one_hot = at::one_hot(at::where(counted_rows.squeeze(1), target, 0), input.size(1));
      // (a mean of no rows has no gradient: divided by 1 rather than 0, so that the mask's backward
      // multiplies 0 by a finite factor, as torch's double backward gives 0 there). Ignored rows are
      // multiplied by 0, not replaced by it: NaN where their logits make the softmax NaN, as torch's.
      const auto grad_input =
          at::softmax(input, 1).sub(one_hot.to(input.scalar_type())).mul(grad.div(std::max(counted, 1.0)));
      return {grad_input.mul(counted_rows.to(input.scalar_type())), at::Tensor(), at::Tensor()};
    }
    RECORD_FUNCTION("ext::cross_entropy_backward", std::vector<c10::IValue>());
    const int64_t rows = exps.size(0), classes = exps.size(1);
    auto grad_input = at::empty({rows, classes}, exps.options());
    const auto target_c = target.contiguous();
    AT_DISPATCH_FLOATING_TYPES(exps.scalar_type(), "ext.cross_entropy backward", [&] {
      const auto scale = static_cast<scalar_t>(grad.item<double>() / counted);
      const scalar_t* e = exps.const_data_ptr<scalar_t>();
      const scalar_t* inverse = inverse_sums.const_data_ptr<scalar_t>();
      const int64_t* t = target_c.const_data_ptr<int64_t>();
      scalar_t* g = grad_input.mutable_data_ptr<scalar_t>();
      check_targets(t, rows, classes, ignore_index);
      auto rows_grad = [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; ++i) {
          scalar_t* g_row = g + i * classes;
          const scalar_t* e_row = e + i * classes;
          const bool ignored = t[i] == ignore_index;
          // an ignored row's gradient is softmax · 0, as torch's: 0, or NaN where its logits make the
          // softmax NaN (a NaN, or a row all -inf)
          const scalar_t row_scale = inverse[i] * (ignored ? scalar_t(0) : scale);
          for (int64_t c = 0; c < classes; ++c) g_row[c] = e_row[c] * row_scale;
          if (!ignored) g_row[t[i]] -= scale;
        }
      };
      const int64_t block_rows = rows_per_block(classes);
      if (rows <= block_rows) return rows_grad(0, rows);
      at::parallel_for(0, rows, block_rows, rows_grad);
    });
    return {grad_input, at::Tensor(), at::Tensor()};
  }
};

// Under CPU autocast the loss runs in float32, autocast's rule for torch's cross_entropy: a bfloat16
// input is cast up, then the op runs (our kernel) with autocast off.
at::Tensor cross_entropy_autocast_cpu(const at::Tensor& input, const at::Tensor& target, int64_t ignore_index) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
  static const auto op = handles::find<Signature>("ext::cross_entropy");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  return op.call(at::autocast::cached_cast(at::kFloat, input, c10::DeviceType::CPU), target, ignore_index);
}

at::Tensor cross_entropy_autograd(const at::Tensor& input, const at::Tensor& target, int64_t ignore_index) {
  if (!plain_cpu_case(input, target)) return torch_cross_entropy(input, target, ignore_index);
  if (!at::GradMode::is_enabled() || !input.requires_grad()) {
    int64_t counted = 0;
    return cross_entropy_cpu_impl(input, target, ignore_index, nullptr, nullptr, &counted);
  }
  return CrossEntropyFunction::apply(input, target, ignore_index);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ext, m) {
  m.def("cross_entropy(Tensor input, Tensor target, int ignore_index=-100) -> Tensor");
}

TORCH_LIBRARY_IMPL(ext, Autograd, m) { m.impl("cross_entropy", &cross_entropy_autograd); }
TORCH_LIBRARY_IMPL(ext, CPU, m) { m.impl("cross_entropy", &cross_entropy_cpu); }
TORCH_LIBRARY_IMPL(ext, AutocastCPU, m) { m.impl("cross_entropy", &cross_entropy_autocast_cpu); }
// Every other backend (CUDA, sparse, ...) below autograd, as under torch.inference_mode: torch's.
TORCH_LIBRARY_IMPL(ext, CompositeExplicitAutograd, m) { m.impl("cross_entropy", &torch_cross_entropy); }

}  // namespace ext
