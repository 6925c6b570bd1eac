// Runs the real CUDA kernels (ext/csrc/cuda/*.cuh) on the CPU through cuda_emu.h.
// Driven by tests/test_cuda_emulation.py, which writes the operands as raw files,
// runs this program, and compares its output file with PyTorch.
//
//   driver OP DTYPE OUT_FILE OPERAND...     (DTYPE tf32: float32 with TF32 allowed)
//   OPERAND = FILE,OFFSET,ROWS,COLS,ROW_STRIDE,COL_STRIDE   (elements; the matrix
//             starts OFFSET elements into FILE, so OFFSET 1 gives a misaligned pointer)
//
//   OP (operands)                          output
//   linear X W [BIAS]   linear_relu ...    Y  = X·Wᵀ + b   (M x N)
//   backward_input DY W                    dX = dY·W       (M x K)
//   backward_weight DY X                   dW = dYᵀ·X      (N x K)
//   backward_bias DY                       db = rows of dY summed (N)
//   to_dtype SRC                           SRC (float32) rounded to DTYPE (float16 or bfloat16)
//   to_float SRC                           SRC (DTYPE) widened to float32
//   conv_forward SHAPE X W [BIAS]          Y  = conv2d(X, W) + b            (N x K x OH x OW)
//   conv_backward_input SHAPE DY W         dX                               (N x C x H x W)
//   conv_backward_weight SHAPE DY X        dW                               (K x C x R x S)
//   conv_backward_bias SHAPE DY            db                               (K)
//     SHAPE = N,C,H,W,K,R,S,STRIDE_H,STRIDE_W,DILATION_H,DILATION_W,PAD_TOP,PAD_LEFT,OH,OW, and the
//     tensors are raw contiguous files (exactly their size: AddressSanitizer sees any overrun)
//   constants                              prints the kernels' tile sizes as NAME=VALUE lines
//                                          (DTYPE and OUT_FILE are ignored), so tests never copy them
//
// The emulated warp-level instructions, one warp each (warp_kernels.h says what goes in and out):
//   warp_mma A B C                         D = A·B + C of one m16n8k16 tile (DTYPE float16/bfloat16)
//   warp_ldmatrix M, warp_ldmatrix_trans M the 4 x 32 registers ldmatrix.x4 (.trans) gives
//   warp_cp_async SRC                      shared memory seen at three moments of three copy groups
//   warp_shuffle                           the lanes' results of four shuffles
//   warp_diverge, warp_skip                warp instructions misused: the harness must say so
// Their inputs are raw files, not operand specs.
//
// BIAS is an N x 1 operand. GEMM ops print which operands took the wide-load path.
#include "cuda_emu.h"

#include "conv.cuh"
#include "gemm_launch.cuh"
#include "sum_rows.cuh"
#include "warp_kernels.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string_view>

namespace {

using ext::cuda::StridedMatrix;

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "driver: %s\n", message.c_str());
  std::exit(2);
}

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) fail("cannot read " + path);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

template <typename T>
void write_elements(const std::string& path, const std::vector<T>& data) {
  std::ofstream file(path, std::ios::binary);
  file.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size() * sizeof(T)));
  if (!file) fail("cannot write " + path);
}

// An operand's storage, sized exactly to its file so AddressSanitizer sees any read past the end.
template <typename T>
struct Operand {
  std::vector<T> storage;
  StridedMatrix<T> view;
};

template <typename T>
Operand<T> parse_operand(const std::string& spec) {
  std::istringstream fields(spec);
  std::string path;
  std::getline(fields, path, ',');
  int64_t numbers[5];
  for (int64_t& number : numbers) {
    std::string field;
    if (!std::getline(fields, field, ',')) fail("operand needs FILE,OFFSET,ROWS,COLS,ROW_STRIDE,COL_STRIDE: " + spec);
    number = std::stoll(field);
  }
  const std::vector<char> bytes = read_bytes(path);
  Operand<T> operand;
  operand.storage.resize(bytes.size() / sizeof(T));
  std::memcpy(operand.storage.data(), bytes.data(), operand.storage.size() * sizeof(T));
  operand.view = {operand.storage.data() + numbers[0], numbers[1], numbers[2], numbers[3], numbers[4]};
  return operand;
}

// An empty output launches nothing, as the host code (linear_host.h) returns before any launch:
// CUDA refuses a grid with a zero dimension, and so does the emulation.
struct EmulatedDevice {
  template <typename Params>
  static void launch(void (*kernel)(Params), dim3 grid, size_t shared_bytes, const Params& params) {
    emu::launch(grid, dim3(ext::cuda::kThreads), shared_bytes, kernel, params);
  }
};

bool g_allow_tf32 = false;  // DTYPE tf32: float32 data, TF32 allowed

template <typename T>
void run_gemm(const ext::cuda::GemmParams<T>& params) {
  if (params.a.outer_size == 0 || params.b.outer_size == 0) return;
  if (ext::cuda::on_tensor_cores<T>(g_allow_tf32)) {
    std::printf("tensor_cores chunk_loads a=%d b=%d\n", int(params.a.chunk_loads), int(params.b.chunk_loads));
  } else {
    std::printf("wide_loads a=%d b=%d\n", int(params.a.wide_loads), int(params.b.wide_loads));
  }
  std::vector<ext::cuda::acc_t<T>> partials;
  const auto allocate = [&](int64_t elements) {
    partials.resize(size_t(elements));  // exactly sized: AddressSanitizer sees an overrun
    return partials.data();
  };
  const ext::cuda::SplitK split = ext::cuda::choose_gemm_split(params, g_allow_tf32, emu::sm_count());
  std::printf("split_k splits=%d k_split=%lld\n", split.splits, static_cast<long long>(split.k_split));
  ext::cuda::launch_gemm_kernel<EmulatedDevice>(params, g_allow_tf32, emu::sm_count(), allocate);
}

template <typename T>
void run_op(std::string_view op, const std::string& out_path, const std::vector<std::string>& specs) {
  std::vector<Operand<T>> operands;
  for (const std::string& spec : specs) operands.push_back(parse_operand<T>(spec));
  const auto expect_operands = [&](size_t low, size_t high) {
    if (operands.size() < low || operands.size() > high) fail("wrong number of operands for " + std::string(op));
  };
  std::vector<T> out;
  if (op == "linear" || op == "linear_relu") {
    expect_operands(2, 3);
    const StridedMatrix<T>& x = operands[0].view;
    const StridedMatrix<T>& w = operands[1].view;
    const T* bias = operands.size() == 3 ? operands[2].view.ptr : nullptr;
    out.resize(size_t(x.rows * w.rows));
    run_gemm(ext::cuda::linear_params(x, w, bias, op == "linear_relu", out.data()));
  } else if (op == "backward_input") {
    expect_operands(2, 2);
    out.resize(size_t(operands[0].view.rows * operands[1].view.cols));
    run_gemm(ext::cuda::backward_input_params(operands[0].view, operands[1].view, out.data()));
  } else if (op == "backward_weight") {
    expect_operands(2, 2);
    out.resize(size_t(operands[0].view.cols * operands[1].view.cols));
    run_gemm(ext::cuda::backward_weight_params(operands[0].view, operands[1].view, out.data()));
  } else if (op == "backward_bias") {
    expect_operands(1, 1);
    out.resize(size_t(operands[0].view.cols));
    const ext::cuda::SumRowsParams<T> params{operands[0].view, out.data()};
    if (!out.empty()) EmulatedDevice::launch(ext::cuda::sum_rows_kernel<T>, ext::cuda::sum_rows_grid(params),
                                             ext::cuda::kSumRowsSharedBytes<T>, params);
  } else {
    fail("unknown op " + std::string(op));
  }
  write_elements(out_path, out);
}

template <typename T>
std::vector<T> read_tensor(const std::string& path) {
  const std::vector<char> bytes = read_bytes(path);
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

ext::cuda::ConvShape parse_conv_shape(const std::string& spec) {
  std::istringstream fields(spec);
  int values[15];
  for (int& value : values) {
    std::string field;
    if (!std::getline(fields, field, ',')) fail("SHAPE needs 15 numbers (driver.cpp): " + spec);
    value = std::stoi(field);
  }
  return {values[0], values[1], values[2], values[3], values[4], values[5], values[6], values[7],
          values[8], values[9], values[10], values[11], values[12], values[13], values[14]};
}

// The convolution's four ops through conv.cuh's launches, as conv_host.h makes them (but for
// its argument checks and the empty-output return, which tests/test_cuda_host.py covers).
template <typename T>
void run_conv(std::string_view op, const std::string& out_path, const std::vector<std::string>& args) {
  if (args.size() < 2) fail(std::string(op) + " takes SHAPE and its tensors' files");
  const ext::cuda::ConvShape s = parse_conv_shape(args[0]);
  std::vector<std::vector<T>> tensors;
  for (size_t i = 1; i < args.size(); ++i) tensors.push_back(read_tensor<T>(args[i]));
  const int64_t out_pixels = int64_t(s.batch) * s.out_h * s.out_w;
  std::vector<T> out;
  if (op == "conv_forward") {
    out.resize(size_t(out_pixels * s.out_channels));
    const T* bias = tensors.size() > 2 ? tensors[2].data() : nullptr;
    if (!out.empty()) ext::cuda::launch_conv_forward<EmulatedDevice>(s, tensors[0].data(), tensors[1].data(), bias,
                                                                      out.data());
  } else if (op == "conv_backward_input") {
    // W (K x C x R x S) permuted to C x R x S x K, as the host code does with at::Tensor::permute.
    const int64_t K = s.out_channels, C = s.in_channels, taps = int64_t(s.kernel_h) * s.kernel_w;
    std::vector<T> permuted(tensors[1].size());
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t t = 0; t < taps; ++t) permuted[(c * taps + t) * K + k] = tensors[1][(k * C + c) * taps + t];
    out.resize(size_t(int64_t(s.batch) * C * s.height * s.width));
    if (!out.empty()) ext::cuda::launch_conv_backward_input<EmulatedDevice>(s, tensors[0].data(), permuted.data(),
                                                                             out.data());
  } else if (op == "conv_backward_weight") {
    out.resize(size_t(int64_t(s.out_channels) * s.in_channels * s.kernel_h * s.kernel_w));
    std::vector<ext::cuda::acc_t<T>> partials;
    const auto allocate = [&](int64_t elements) {
      partials.resize(size_t(elements));
      return partials.data();
    };
    if (!out.empty()) ext::cuda::launch_conv_backward_weight<EmulatedDevice>(s, tensors[0].data(), tensors[1].data(),
                                                                              out.data(), emu::sm_count(), allocate);
    std::printf("conv_backward_weight splits=%zu\n", partials.empty() ? 1 : partials.size() / out.size());
  } else if (op == "conv_backward_bias") {
    out.resize(size_t(s.out_channels));
    if (!out.empty()) ext::cuda::launch_conv_backward_bias<EmulatedDevice>(s, tensors[0].data(), out.data());
  } else {
    fail("unknown op " + std::string(op));
  }
  write_elements(out_path, out);
}

template <typename T>
void run_any_op(std::string_view op, const std::string& out_path, const std::vector<std::string>& specs) {
  if (op.starts_with("conv_")) return run_conv<T>(op, out_path, specs);
  run_op<T>(op, out_path, specs);
}

// The emulated 16-bit conversions, checked against PyTorch's by the tests.
template <typename T, typename Narrow, typename Widen>
void run_conversion(std::string_view op, const std::string& out_path, const std::string& in_path,
                    Narrow narrow, Widen widen) {
  const std::vector<char> bytes = read_bytes(in_path);
  if (op == "to_dtype") {
    std::vector<float> values(bytes.size() / sizeof(float));
    std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
    std::vector<T> out;
    for (float value : values) out.push_back(narrow(value));
    write_elements(out_path, out);
  } else {
    std::vector<T> values(bytes.size() / sizeof(T));
    std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
    std::vector<float> out;
    for (T value : values) out.push_back(widen(value));
    write_elements(out_path, out);
  }
}

template <typename T>
std::vector<T> read_elements(const std::string& path, size_t count) {
  const std::vector<char> bytes = read_bytes(path);
  if (bytes.size() != count * sizeof(T)) fail(path + " must hold " + std::to_string(count) + " elements");
  std::vector<T> values(count);
  std::memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

template <typename T>
void run_warp_mma(const std::string& out_path, const std::vector<std::string>& files) {
  constexpr size_t K = std::is_same_v<T, float> ? 8 : 16;
  if (files.size() != 3) fail("warp_mma takes the files A (16 x K), B (K x 8) and C (16 x 8, float32)");
  const auto a = read_elements<T>(files[0], 16 * K);
  const auto b = read_elements<T>(files[1], K * 8);
  const auto c = read_elements<float>(files[2], 16 * 8);
  std::vector<float> d(16 * 8);
  emu::launch(dim3(1), dim3(32), 0, warp_tests::mma_tile<T>, a.data(), b.data(), c.data(), d.data());
  write_elements(out_path, d);
}

void run_warp_test(std::string_view op, std::string_view dtype, const std::string& out_path,
                   const std::vector<std::string>& files) {
  if (op == "warp_mma") {
    if (dtype == "float16") return run_warp_mma<__half>(out_path, files);
    if (dtype == "bfloat16") return run_warp_mma<__nv_bfloat16>(out_path, files);
    if (dtype == "tf32") return run_warp_mma<float>(out_path, files);
    fail("warp_mma is for float16, bfloat16 and tf32");
  }
  if (op == "warp_ldmatrix" || op == "warp_ldmatrix_trans") {
    if (files.size() != 1) fail(std::string(op) + " takes one file: 4 x 8 x 8 16-bit values");
    const auto matrices = read_elements<uint16_t>(files[0], 256);
    std::vector<uint32_t> out(32 * 4);
    const size_t shared_bytes = 32 * 24 * sizeof(uint16_t);
    if (op == "warp_ldmatrix") {
      emu::launch(dim3(1), dim3(32), shared_bytes, warp_tests::ldmatrix_rows<false>, matrices.data(), out.data());
    } else {
      emu::launch(dim3(1), dim3(32), shared_bytes, warp_tests::ldmatrix_rows<true>, matrices.data(), out.data());
    }
    return write_elements(out_path, out);
  }
  if (op == "warp_cp_async") {
    if (files.size() != 1) fail("warp_cp_async takes one file: 3 x 32 x 16 source bytes");
    std::vector<unsigned char> src = read_elements<unsigned char>(files[0], 3 * 32 * 16);
    std::vector<unsigned char> out(3 * 32 * 3 * 16);
    emu::launch(dim3(1), dim3(32), 32 * 3 * 16, warp_tests::cp_async_groups, src.data(), out.data());
    return write_elements(out_path, out);
  }
  if (op == "warp_diverge" || op == "warp_skip") {
    std::vector<int> out(32);
    if (op == "warp_diverge") {
      emu::launch(dim3(1), dim3(32), 16, warp_tests::misused_warp<warp_tests::Misuse::kDiverge>, out.data());
    } else {
      emu::launch(dim3(1), dim3(32), 0, warp_tests::misused_warp<warp_tests::Misuse::kSkip>, out.data());
    }
    return write_elements(out_path, out);
  }
  if (op == "warp_shuffle") {
    std::vector<int> out(32 * 4);
    emu::launch(dim3(1), dim3(32), 0, warp_tests::shuffles, out.data());
    return write_elements(out_path, out);
  }
  fail("unknown op " + std::string(op));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) fail("usage: driver OP DTYPE OUT_FILE OPERAND... (see driver.cpp)");
  const std::string_view op = argv[1];
  const std::string_view dtype = argv[2];
  const std::string out_path = argv[3];
  const std::vector<std::string> specs(argv + 4, argv + argc);
  if (op == "constants") {
    namespace k = ext::cuda;
    std::printf("threads=%d\nblock_m=%d\nblock_n=%d\nblock_k=%d\nrun=%d\nsum_cols=%d\nsum_row_lanes=%d\n",
                k::kThreads, k::kBlockM, k::kBlockN, k::kBlockK, k::kRun, k::kSumCols, k::kSumRowLanes);
    std::printf("tc_block_m=%d\ntc_block_n=%d\ntc_block_k=%d\ntc_block_k_tf32=%d\ntc_stages=%d\ntc_warp_m=%d\n"
                "tc_warp_n=%d\n",
                k::tc::kBlockM, k::tc::kBlockN, k::tc::kBlockK<__half>, k::tc::kBlockK<float>, k::tc::kStages,
                k::tc::kWarpM, k::tc::kWarpN);
    return 0;
  }
  if (op.starts_with("warp_")) {
    run_warp_test(op, dtype, out_path, specs);
    return 0;
  }
  if (op == "to_dtype" || op == "to_float") {
    if (specs.size() != 1) fail("conversions take one input file");
    if (dtype == "float16") {
      run_conversion<__half>(op, out_path, specs[0], __float2half_rn, __half2float);
    } else if (dtype == "bfloat16") {
      run_conversion<__nv_bfloat16>(op, out_path, specs[0], __float2bfloat16_rn, __bfloat162float);
    } else {
      fail("conversions are for float16 and bfloat16");
    }
    return 0;
  }
  if (dtype == "float32" || dtype == "tf32") {
    g_allow_tf32 = dtype == "tf32";
    run_any_op<float>(op, out_path, specs);
  } else if (dtype == "float64") {
    run_any_op<double>(op, out_path, specs);
  } else if (dtype == "float16") {
    run_any_op<__half>(op, out_path, specs);
  } else if (dtype == "bfloat16") {
    run_any_op<__nv_bfloat16>(op, out_path, specs);
  } else {
    fail("unknown dtype " + std::string(dtype));
  }
  return 0;
}
