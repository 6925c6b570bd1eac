// Argument checks shared by the CPU and CUDA kernels: one clear message per
// mistake, raised before any kernel touches memory.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>

#include <optional>

namespace ext {

// Plain CPU tensors (an undefined one counts) and no Python dispatch mode: a backward may call the
// CPU kernels directly. Fake tensors (torch.compile's tracing, whose sizes may be symbolic),
// TorchDispatchModes, CUDA and other tensors go through the ops and the dispatcher.
template <typename... Tensors>
bool plain_cpu(const Tensors&... tensors) {
  static const c10::DispatchKeySet plain_cpu_keys =
      c10::DispatchKeySet({c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU,
                           c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCPU});
  return ((!tensors.defined() || plain_cpu_keys.isSupersetOf(tensors.key_set())) && ...) &&
         c10::impl::TorchDispatchModeTLS::stack_len() == 0;
}

inline void check_same_device_and_dtype(const char* op, const at::Tensor& a, const char* a_name,
                                        const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", a_name, " is on ", a.device(), " but ", b_name,
              " is on ", b.device(), "; move both to the same device");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", a_name, " is ", a.scalar_type(),
              " but ", b_name, " is ", b.scalar_type(), "; cast both to the same dtype");
}

// Which kernels a call runs: each family implements its own dtypes. Named by the caller rather
// than read from the tensors' device, so the CUDA host code runs unchanged in the emulation tests
// (tests/cuda_emu), where its tensors live on the CPU.
enum class Kernels { Cpu, Cuda };

inline void check_dtype(const char* op, const at::Tensor& t, Kernels kernels) {
  const auto dtype = t.scalar_type();
  if (kernels == Kernels::Cpu) {
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, op, ": dtype ", dtype,
                " is not supported on the CPU; use float32 or float64");
  } else {
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                    dtype == at::kBFloat16,
                op, ": dtype ", dtype, " is not supported; use float32, float64, float16 or bfloat16");
  }
}

// input (M x K), weight (N x K), bias (N) or none.
inline void check_linear_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, Kernels kernels) {
  TORCH_CHECK(input.dim() == 2, op, ": input must be 2-D (batch x in_features), got shape ",
              input.sizes(), "; ext.linear accepts any number of leading dimensions");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D (out_features x in_features), got shape ",
              weight.sizes());
  check_same_device_and_dtype(op, input, "input", weight, "weight");
  check_dtype(op, input, kernels);
  TORCH_CHECK(input.size(1) == weight.size(1), op, ": input has ", input.size(1),
              " features but weight expects ", weight.size(1), " (input shape ", input.sizes(),
              ", weight shape ", weight.sizes(), ")");
  if (bias.has_value()) {
    check_same_device_and_dtype(op, *bias, "bias", weight, "weight");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), op,
                ": bias must have shape [", weight.size(0), "] to match weight, got ", bias->sizes());
  }
}

// grad_output (M x N) against a second operand whose rows (dim 0) must be M or N.
inline void check_grad_args(const char* op, const at::Tensor& grad_output, const at::Tensor& other,
                            const char* other_name, int64_t grad_dim, int64_t other_dim, Kernels kernels) {
  TORCH_CHECK(grad_output.dim() == 2 && other.dim() == 2, op, ": grad_output and ", other_name,
              " must be 2-D, got shapes ", grad_output.sizes(), " and ", other.sizes());
  check_same_device_and_dtype(op, grad_output, "grad_output", other, other_name);
  check_dtype(op, other, kernels);
  TORCH_CHECK(grad_output.size(grad_dim) == other.size(other_dim), op, ": grad_output shape ",
              grad_output.sizes(), " does not match ", other_name, " shape ", other.sizes());
}

}  // namespace ext
