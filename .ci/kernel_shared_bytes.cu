// Prints each CUDA kernel's dynamic shared memory per block, as the host code launches it, for
// .ci/check_cuda.sh's occupancy figures (ptxas reports static shared memory only). Host code:
// compiled by nvcc and run here, no GPU needed. A kernel missing from this list fails the check.
#include "../ext/csrc/cuda/conv.cuh"
#include "../ext/csrc/cuda/gemm_launch.cuh"
#include "../ext/csrc/cuda/sum_rows.cuh"

#include <cstdio>

using namespace ext::cuda;

int main() {
  std::printf("ext::cuda::gemm_kernel<float> %zu\n", kFmaSharedBytes<float>);
  std::printf("ext::cuda::gemm_kernel<double> %zu\n", kFmaSharedBytes<double>);
  std::printf("ext::cuda::tc::gemm_kernel<float> %zu\n", kTensorCoreSharedBytes<float>);
  std::printf("ext::cuda::tc::gemm_kernel<__half> %zu\n", kTensorCoreSharedBytes<__half>);
  std::printf("ext::cuda::tc::gemm_kernel<__nv_bfloat16> %zu\n", kTensorCoreSharedBytes<__nv_bfloat16>);
  std::printf("ext::cuda::sum_rows_kernel<float> %zu\n", kSumRowsSharedBytes<float>);
  std::printf("ext::cuda::sum_rows_kernel<double> %zu\n", kSumRowsSharedBytes<double>);
  std::printf("ext::cuda::sum_rows_kernel<__half> %zu\n", kSumRowsSharedBytes<__half>);
  std::printf("ext::cuda::sum_rows_kernel<__nv_bfloat16> %zu\n", kSumRowsSharedBytes<__nv_bfloat16>);
  for (const char* type : {"float", "double", "__half", "__nv_bfloat16"}) {
    std::printf("ext::cuda::split_k_reduce_kernel<%s> 0\n", type);  // no shared memory
  }
  // conv_kernel's products share their type's shared memory (check_cuda.sh drops the product).
  std::printf("ext::cuda::conv_kernel<float> %zu\n", kConvSharedBytes<float>);
  std::printf("ext::cuda::conv_kernel<double> %zu\n", kConvSharedBytes<double>);
  std::printf("ext::cuda::conv_kernel<__half> %zu\n", kConvSharedBytes<__half>);
  std::printf("ext::cuda::conv_kernel<__nv_bfloat16> %zu\n", kConvSharedBytes<__nv_bfloat16>);
  std::printf("ext::cuda::sum_channels_kernel<float> %zu\n", kSumChannelsSharedBytes<float>);
  std::printf("ext::cuda::sum_channels_kernel<double> %zu\n", kSumChannelsSharedBytes<double>);
  std::printf("ext::cuda::sum_channels_kernel<__half> %zu\n", kSumChannelsSharedBytes<__half>);
  std::printf("ext::cuda::sum_channels_kernel<__nv_bfloat16> %zu\n", kSumChannelsSharedBytes<__nv_bfloat16>);
  return 0;
}
