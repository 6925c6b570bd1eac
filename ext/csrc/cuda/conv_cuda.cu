// The CUDA kernels of the four convolution ops (schemas in ../ops.cpp) and their autocast rule:
// conv_host.h's host code on the CUDA device; the kernels live in conv.cuh. Autograd is the
// device-agnostic kernel of ../conv_ops.cpp.
#include "conv_host.h"
#include "cuda_device.h"

#include <torch/library.h>

namespace ext {

namespace {

using Host = cuda::ConvHost<cuda::CudaDevice>;

}  // namespace

TORCH_LIBRARY_IMPL(ext, CUDA, m) {
  m.impl("conv2d", &Host::conv2d);
  m.impl("conv2d_backward_input", &Host::backward_input);
  m.impl("conv2d_backward_weight", &Host::backward_weight);
  m.impl("conv2d_backward_bias", &Host::backward_bias);
}

TORCH_LIBRARY_IMPL(ext, AutocastCUDA, m) { m.impl("conv2d", &Host::conv2d_autocast); }

}  // namespace ext
