// Typed dispatcher handles to the ext ops, for C++ that calls them through the
// dispatcher (autograd, autocast): each schema is looked up once, here.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace ext::handles {

using LinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using BackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&);
using BackwardBiasSignature = at::Tensor(const at::Tensor&);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// ext::linear, or ext::linear_relu with relu.
inline const c10::TypedOperatorHandle<LinearSignature>& linear(bool relu) {
  static const auto plain = find<LinearSignature>("ext::linear");
  static const auto fused = find<LinearSignature>("ext::linear_relu");
  return relu ? fused : plain;
}

inline const c10::TypedOperatorHandle<BackwardSignature>& backward_input() {
  static const auto op = find<BackwardSignature>("ext::linear_backward_input");
  return op;
}

inline const c10::TypedOperatorHandle<BackwardSignature>& backward_weight() {
  static const auto op = find<BackwardSignature>("ext::linear_backward_weight");
  return op;
}

inline const c10::TypedOperatorHandle<BackwardBiasSignature>& backward_bias() {
  static const auto op = find<BackwardBiasSignature>("ext::linear_backward_bias");
  return op;
}

}  // namespace ext::handles
