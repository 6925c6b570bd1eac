// The CPU convolution (groups = 1) as implicit GEMM on cpu::gemm. Pure C++ like gemm.h:
// the ops in conv_ops.cpp check arguments and lay tensors out; these kernels only compute.
//
// Tensors are NCHW-contiguous: input N x C x H x W, weight K x C x R x S (its natural
// layout, which is K x (C·R·S) row-major), output N x K x OH x OW. With P the output pixels
// (n, oh, ow) and col the im2col matrix, (C·R·S) x P:
//   forward  Y  [K, P]     = W [K, C·R·S] · col [C·R·S, P]      (+ bias per row)
//   dW       dW [K, C·R·S] = dY [K, P]    · colᵀ [P, C·R·S]
//   dX       dcol [C·R·S, P] = Wᵀ [C·R·S, K] · dY [K, P], then col2im adds dcol into dX
// W (or Wᵀ) is always GEMM's A operand, read in place and never packed; the pixel side is B.
// col is never built whole: a chunk of pixels at a time is gathered (chunk_pixels), into a
// buffer per thread, and each thread runs its own single-threaded GEMMs. Where the convolution
// runs directly (conv.cpp: convolves_directly) col is not built at all: the GEMM reads a padded
// copy of the input in place through an index, and a stride-1 dX is that convolution of dY. Small maps
// (conv.cpp: convolves_by_position) run one GEMM per output pixel and kernel tap over the whole batch,
// skipping the taps that fall in the padding. Threads split the forward (and a dX that is a convolution)
// by pixel chunks or output pixels, dW by columns of dW (rows of col), and other dX by input channels, so no
// two threads write the same element and every element gets the same arithmetic whatever the
// thread count: results are bit-identical for any number of threads.
#pragma once

#include <cstdint>

namespace ext::cpu {

struct ConvGeometry {
  int64_t batch, in_channels, height, width;          // input N, C, H, W
  int64_t out_channels, kernel_h, kernel_w;           // weight K, R, S (its C is in_channels)
  int64_t stride_h, stride_w, dilation_h, dilation_w;
  int64_t pad_top, pad_left;                          // padding before the first row / column
  int64_t out_h, out_w;                               // OH, OW (padding after follows from these)

  int64_t patch() const { return in_channels * kernel_h * kernel_w; }  // C·R·S, GEMM's depth
  int64_t out_pixels_per_image() const { return out_h * out_w; }
  int64_t in_pixels_per_image() const { return height * width; }
  // A 1x1 stride-1 unpadded kernel: col is the input itself, read in place.
  bool pointwise() const {
    return kernel_h == 1 && kernel_w == 1 && stride_h == 1 && stride_w == 1 && pad_top == 0 && pad_left == 0 &&
           out_h == height && out_w == width;
  }
};

// Pixels per chunk for a patch of `patch` values of T: the column block GEMM reads (at most
// one K block deep) stays within half of L2, which lets a GEMM of up to 128 rows read it in
// place; a multiple of `panel` pixels (the GEMM tile's columns). Depends on the shape only, never
// on the thread count (a chunk boundary changes how dW's and dX's sums are grouped).
template <typename T>
int64_t chunk_pixels(int64_t patch, int64_t panel);

// output (N x K x OH x OW) = conv(input, weight) + bias (bias: K values or nullptr).
template <typename T>
void conv2d_forward(const ConvGeometry& g, const T* input, const T* weight, const T* bias, T* output);

// grad_input (N x C x H x W) from grad_output (N x K x OH x OW) and weight.
template <typename T>
void conv2d_backward_input(const ConvGeometry& g, const T* grad_output, const T* weight, T* grad_input);

// grad_weight (K x C x R x S) from grad_output and input.
template <typename T>
void conv2d_backward_weight(const ConvGeometry& g, const T* grad_output, const T* input, T* grad_weight);

// grad_bias (K) = grad_output summed over N, OH, OW, in a fixed order.
template <typename T>
void conv2d_backward_bias(const ConvGeometry& g, const T* grad_output, T* grad_bias);

}  // namespace ext::cpu
