// The CUDA device policy of the ops' host code (linear_host.h, conv_host.h): the guard, the
// launch on the current stream with its error check, the SM count, and the dispatcher handles
// autocast calls. Included by the .cu files only; the emulation tests have their own policy.
#pragma once

#include "../op_handles.h"
#include "kernel_common.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace ext::cuda {

struct CudaDevice {
  using Guard = c10::cuda::CUDAGuard;
  static constexpr c10::DeviceType kType = c10::DeviceType::CUDA;
  static constexpr c10::DispatchKey kAutocastKey = c10::DispatchKey::AutocastCUDA;

  template <typename Params>
  static void launch(void (*kernel)(Params), dim3 grid, size_t shared_bytes, const Params& params) {
    kernel<<<grid, kThreads, shared_bytes, c10::cuda::getCurrentCUDAStream()>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  static int multiprocessor_count() {  // cudaDeviceGetAttribute is a cheap query, unlike cudaGetDeviceProperties
    int count = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
    return count;
  }

  static const c10::TypedOperatorHandle<handles::LinearSignature>& linear_op(bool relu) {
    return handles::linear(relu);
  }

  static const c10::TypedOperatorHandle<handles::ConvSignature>& conv2d_op() { return handles::conv2d(); }
};

}  // namespace ext::cuda
