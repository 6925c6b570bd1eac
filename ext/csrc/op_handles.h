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

using ConvSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                 c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef);
using ConvGradSignature = at::Tensor(const at::Tensor&, const at::Tensor&, c10::IntArrayRef, c10::IntArrayRef,
                                     c10::IntArrayRef, c10::IntArrayRef);

inline const c10::TypedOperatorHandle<ConvSignature>& conv2d() {
  static const auto op = find<ConvSignature>("ext::conv2d");
  return op;
}

inline const c10::TypedOperatorHandle<ConvGradSignature>& conv2d_backward_input() {
  static const auto op = find<ConvGradSignature>("ext::conv2d_backward_input");
  return op;
}

inline const c10::TypedOperatorHandle<ConvGradSignature>& conv2d_backward_weight() {
  static const auto op = find<ConvGradSignature>("ext::conv2d_backward_weight");
  return op;
}

inline const c10::TypedOperatorHandle<BackwardBiasSignature>& conv2d_backward_bias() {
  static const auto op = find<BackwardBiasSignature>("ext::conv2d_backward_bias");
  return op;
}

}  // namespace ext::handles
