// The op schemas (declared once, here) and their CPU kernels.
// CUDA kernels attach to the same schemas in cuda/linear_cuda.cu.
#include "checks.h"
#include "cpu/gemm.h"
#include "op_handles.h"

#include <ATen/Dispatch.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace ext {

double shared_min_flops();  // autograd.cpp: from this size the backward shares dX and dW's chunks

namespace {

// Y = X·Wᵀ + b, optionally followed by ReLU in the same store.
at::Tensor linear_cpu_impl(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, bool relu) {
  const char* op = relu ? "ext.linear_relu" : "ext.linear";
  check_linear_args(op, input, weight, bias, Kernels::Cpu);
  const int64_t M = input.size(0), K = input.size(1), N = weight.size(0);
  auto out = at::empty({M, N}, input.options());
  if (M == 0 || N == 0) return out;
  const auto bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "ext.linear", [&] {
    // B = Wᵀ: B[k, n] = W[n, k], so B's row stride is W's column stride.
    cpu::gemm<scalar_t>(M, N, K, input.const_data_ptr<scalar_t>(), input.stride(0), input.stride(1),
                        weight.const_data_ptr<scalar_t>(), weight.stride(1), weight.stride(0),
                        bias_c.defined() ? bias_c.const_data_ptr<scalar_t>() : nullptr, relu,
                        out.mutable_data_ptr<scalar_t>(), N);
  });
  return out;
}

at::Tensor linear_cpu(const at::Tensor& input, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  return linear_cpu_impl(input, weight, bias, /*relu=*/false);
}

at::Tensor linear_relu_cpu(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  return linear_cpu_impl(input, weight, bias, /*relu=*/true);
}

// dX (M x K) = dY (M x N) · W (N x K)
at::Tensor linear_backward_input_cpu(const at::Tensor& grad_output, const at::Tensor& weight) {
  check_grad_args("ext.linear_backward_input", grad_output, weight, "weight", 1, 0, Kernels::Cpu);
  const int64_t M = grad_output.size(0), N = grad_output.size(1), K = weight.size(1);
  auto grad_input = at::empty({M, K}, grad_output.options());
  if (M == 0 || K == 0) return grad_input;
  AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), "ext.linear_backward_input", [&] {
    cpu::gemm<scalar_t>(M, K, N, grad_output.const_data_ptr<scalar_t>(), grad_output.stride(0),
                        grad_output.stride(1), weight.const_data_ptr<scalar_t>(), weight.stride(0),
                        weight.stride(1), nullptr, false, grad_input.mutable_data_ptr<scalar_t>(), K);
  });
  return grad_input;
}

// dW (N x K) = dYᵀ (N x M) · X (M x K), packed straight from dY's strides.
at::Tensor linear_backward_weight_cpu(const at::Tensor& grad_output, const at::Tensor& input) {
  check_grad_args("ext.linear_backward_weight", grad_output, input, "input", 0, 0, Kernels::Cpu);
  const int64_t M = grad_output.size(0), N = grad_output.size(1), K = input.size(1);
  auto grad_weight = at::empty({N, K}, grad_output.options());
  if (N == 0 || K == 0) return grad_weight;
  AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), "ext.linear_backward_weight", [&] {
    cpu::gemm<scalar_t>(N, K, M, grad_output.const_data_ptr<scalar_t>(), grad_output.stride(1),
                        grad_output.stride(0), input.const_data_ptr<scalar_t>(), input.stride(0),
                        input.stride(1), nullptr, false, grad_weight.mutable_data_ptr<scalar_t>(), K);
  });
  return grad_weight;
}

// db (N) = sum of dY over rows.
at::Tensor linear_backward_bias_cpu(const at::Tensor& grad_output) {
  TORCH_CHECK(grad_output.dim() == 2, "ext.linear_backward_bias: grad_output must be 2-D, got shape ",
              grad_output.sizes());
  check_dtype("ext.linear_backward_bias", grad_output, Kernels::Cpu);
  const int64_t M = grad_output.size(0), N = grad_output.size(1);
  auto grad_bias = at::empty({N}, grad_output.options());
  if (N == 0) return grad_bias;
  AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), "ext.linear_backward_bias", [&] {
    cpu::sum_rows<scalar_t>(M, N, grad_output.const_data_ptr<scalar_t>(), grad_output.stride(0),
                            grad_output.stride(1), grad_bias.mutable_data_ptr<scalar_t>());
  });
  return grad_bias;
}

std::string cpu_path() { return cpu::cpu_path_name(cpu::active_cpu_path()); }

void set_cpu_path(const std::string& name) {
  const auto path = cpu::cpu_path_from_name(name);
  TORCH_CHECK(path.has_value(), "ext.set_cpu_path: unknown path '", name,
              "'; use 'portable', 'avx2+fma' or 'avx512'");
  TORCH_CHECK(cpu::cpu_supports(*path), "ext.set_cpu_path: this CPU cannot run the ", name, " path");
  cpu::set_cpu_path(*path);
}

// A path's block sizes and thresholds by name (cpu::BlockSizes), with the work sizes below which
// a product stays on one thread, is split in whole slabs, and the backward's dX and dW stop
// sharing column chunks.
c10::Dict<std::string, int64_t> cpu_block_sizes(const std::string& path_name, const std::string& dtype) {
  const auto path = cpu::cpu_path_from_name(path_name);
  TORCH_CHECK(path.has_value(), "ext.cpu_block_sizes: unknown path '", path_name,
              "'; use 'portable', 'avx2+fma' or 'avx512'");
  TORCH_CHECK(dtype == "float32" || dtype == "float64", "ext.cpu_block_sizes: dtype must be 'float32' or 'float64'");
  const cpu::BlockSizes b = dtype == "float32" ? cpu::block_sizes<float>(*path) : cpu::block_sizes<double>(*path);
  c10::Dict<std::string, int64_t> sizes;
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"wide_mr", b.wide_mr}, {"wide_nr", b.wide_nr},
                                    {"narrow_mr", b.narrow_mr}, {"narrow_nr", b.narrow_nr},
                                    {"many_rows_mr", b.many_rows_mr}, {"many_rows_nr", b.many_rows_nr},
                                    {"tall_mr", b.tall_mr}, {"tall_nr", b.tall_nr},
                                    {"one_vector_mr", b.one_vector_mr},
                                    {"narrow_one_vector_mr", b.narrow_one_vector_mr},
                                    {"lanes", b.lanes}, {"kc", b.kc}, {"max_single_k_block", b.max_single_k_block},
                                    {"mc", b.mc}, {"nc", b.nc}, {"single_block_bytes", b.single_block_bytes},
                                    {"many_rows_min_rows", b.many_rows_min_rows},
                                    {"b_in_place_max_rows", b.b_in_place_max_rows},
                                    {"rows_outer_max_b_bytes", b.rows_outer_max_b_bytes},
                                    {"transposed_min_rows", b.transposed_min_rows},
                                    {"transposed_c_cost", b.transposed_c_cost},
                                    {"max_shallow_depth", b.max_shallow_depth}, {"shallow_mr", b.shallow_mr},
                                    {"shallow_nr", b.shallow_nr}, {"fmas_per_cycle", b.fmas_per_cycle},
                                    {"l2_bytes", b.l2_bytes},
                                    {"l1d_bytes", b.l1d_bytes},
                                    {"parallel_min_flops", static_cast<int64_t>(cpu::kParallelMinFlops)},
                                    {"whole_slabs_max_flops", static_cast<int64_t>(cpu::kWholeSlabsMaxFlops)},
                                    {"shared_min_flops", static_cast<int64_t>(shared_min_flops())}}) {
    sizes.insert(name, value);
  }
  return sizes;
}

double tile_gflops(const std::string& tile, int64_t vectors, int64_t kc, int64_t num_threads) {
  try {
    return cpu::measure_tile_gflops(tile, vectors, kc, num_threads);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK(false, "ext.tile_gflops: ", error.what(), " (got tile '", tile, "', vectors ", vectors, ", kc ", kc,
                ", num_threads ", num_threads, ")");
  }
}

std::vector<int64_t> cpu_packed_values() {
  const cpu::PackedValues packed = cpu::packed_values();
  return {packed.a, packed.b};
}

// Under CPU autocast (bfloat16) the ops run in float32, as autocast runs PyTorch's own fp32-only ops:
// the CPU kernels implement float32 and float64, and a ResNet's autocast convolutions hand the final
// Linear a bfloat16 input. Lower-precision inputs are cast up; then the op runs with autocast off.
template <bool kRelu>
at::Tensor linear_autocast_cpu(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const auto& op = handles::linear(kRelu);
  return op.call(at::autocast::cached_cast(at::kFloat, input, c10::DeviceType::CPU),
                 at::autocast::cached_cast(at::kFloat, weight, c10::DeviceType::CPU),
                 at::autocast::cached_cast(at::kFloat, bias, c10::DeviceType::CPU));
}

// Sparse, quantized and MKL-DNN tensors reach the ops under their own dispatch keys; rather than
// the dispatcher's 40-line "could not run with the SparseCPU backend", one line names the operand
// and how to make it a dense one. (F.linear takes sparse and MKL-DNN inputs; our kernels are dense
// GEMMs, and densifying silently could exhaust memory on a large sparse input.)
void dense_only(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const auto values = torch::jit::last(*stack, arguments.size());
  std::string name = op.schema().name();
  name.replace(name.find("::"), 2, ".");
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (!values[i].isTensor()) continue;
    const at::Tensor& t = values[i].toTensor();
    const std::string& arg = arguments[i].name();
    TORCH_CHECK(!t.is_quantized(), name, ": ", arg, " is a quantized tensor (", t.scalar_type(),
                "); its kernels take float tensors: pass ", arg, ".dequantize()");
    TORCH_CHECK(t.layout() == at::kStrided, name, ": ", arg, "'s layout is ", t.layout(), ", not Strided; its kernels take "
                "dense (strided) tensors: pass ", arg, ".to_dense()");
  }
  TORCH_CHECK(false, name, ": its kernels take dense (strided) tensors only");
}

// The ops that take tensors; the path and peak ops take none.
constexpr const char* kTensorOps[] = {"linear", "linear_relu", "linear_backward_input", "linear_backward_weight",
                                      "linear_backward_bias"};
// The convolution's (conv_ops.cpp, cuda/conv_cuda.cu).
constexpr const char* kConvOps[] = {"conv2d", "conv2d_backward_input", "conv2d_backward_weight",
                                    "conv2d_backward_bias"};

void refuse_non_dense(torch::Library& m) {
  for (const char* name : kTensorOps) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&dense_only>());
  for (const char* name : kConvOps) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&dense_only>());
}

#ifndef LINEAR_LAB_WITH_CUDA
// A CPU-only build still answers CUDA tensors, with how to get CUDA kernels
// instead of the dispatcher's generic "could not run with the CUDA backend".
void cuda_not_built(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  TORCH_CHECK(false, op.schema().name(), ": this build of linear-lab's extension has no CUDA "
              "kernels (torch saw no GPU when it was built, or LINEAR_LAB_CUDA=0). Rebuild with CUDA: "
              "LINEAR_LAB_CUDA=1 python -m ext");
}
#endif

}  // namespace

TORCH_LIBRARY(ext, m) {
  m.def("linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_relu(Tensor input, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_backward_input(Tensor grad_output, Tensor weight) -> Tensor");
  m.def("linear_backward_weight(Tensor grad_output, Tensor input) -> Tensor");
  m.def("linear_backward_bias(Tensor grad_output) -> Tensor");
  // padding is [top, bottom, left, right] (conv_ops.cpp); ext.conv2d takes F.conv2d's forms.
  m.def("conv2d(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[4] padding, int[2] dilation) -> Tensor");
  m.def("conv2d_backward_input(Tensor grad_output, Tensor weight, int[4] input_size, int[2] stride, int[4] padding, "
        "int[2] dilation) -> Tensor");
  m.def("conv2d_backward_weight(Tensor grad_output, Tensor input, int[4] weight_size, int[2] stride, "
        "int[4] padding, int[2] dilation) -> Tensor");
  m.def("conv2d_backward_bias(Tensor grad_output) -> Tensor");
  // CPU code-path selection, for `python -m ext` and the path-agreement tests.
  m.def("cpu_path() -> str", &cpu_path);
  m.def("set_cpu_path(str name) -> ()", &set_cpu_path);
  m.def("fma_peak_gflops(int num_threads) -> float", &cpu::measure_fma_peak_gflops);
  m.def("cpu_block_sizes(str path, str dtype) -> Dict(str, int)", &cpu_block_sizes);
  // For bench.ceiling: the register tile alone, and the values gemm has packed (A's, B's).
  m.def("tile_gflops(str tile, int vectors, int kc, int num_threads) -> float", &tile_gflops);
  m.def("cpu_packed_values() -> int[]", &cpu_packed_values);
}

TORCH_LIBRARY_IMPL(ext, CPU, m) {
  m.impl("linear", &linear_cpu);
  m.impl("linear_relu", &linear_relu_cpu);
  m.impl("linear_backward_input", &linear_backward_input_cpu);
  m.impl("linear_backward_weight", &linear_backward_weight_cpu);
  m.impl("linear_backward_bias", &linear_backward_bias_cpu);
}

TORCH_LIBRARY_IMPL(ext, SparseCPU, m) { refuse_non_dense(m); }
TORCH_LIBRARY_IMPL(ext, SparseCsrCPU, m) { refuse_non_dense(m); }
TORCH_LIBRARY_IMPL(ext, QuantizedCPU, m) { refuse_non_dense(m); }
TORCH_LIBRARY_IMPL(ext, MkldnnCPU, m) { refuse_non_dense(m); }
TORCH_LIBRARY_IMPL(ext, SparseCUDA, m) { refuse_non_dense(m); }
TORCH_LIBRARY_IMPL(ext, SparseCsrCUDA, m) { refuse_non_dense(m); }
TORCH_LIBRARY_IMPL(ext, QuantizedCUDA, m) { refuse_non_dense(m); }

TORCH_LIBRARY_IMPL(ext, AutocastCPU, m) {
  m.impl("linear", &linear_autocast_cpu<false>);
  m.impl("linear_relu", &linear_autocast_cpu<true>);
}

#ifndef LINEAR_LAB_WITH_CUDA
TORCH_LIBRARY_IMPL(ext, CUDA, m) {
  for (const char* name : kTensorOps) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  for (const char* name : kConvOps) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
}
#endif

}  // namespace ext
