// The CPU GEMM behind every linear op. Pure C++: no torch headers here, so the
// kernels compile fast and can be tested on their own.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

namespace ext::cpu {

// Below this many flops (2·M·N·K) one thread finishes a product before a second
// one wakes up (a few microseconds), so it stays on the calling thread; the
// backward also runs dX and dW one after the other below it (autograd.cpp).
// Measured here (2 threads, bench.linear): 4e6 kept the 10-class heads (0.66 and
// 1.3 Mflop per product) on one thread; at 5e5 their forward takes 13 -> 10-11
// us (128x256->10) and 21 -> 16 us (128x512->10), torch 11 and 16.
constexpr double kParallelMinFlops = 5e5;

// Under this many flops a product split over threads by columns with A packed (dW) is cut once into
// whole slabs, one per thread, which take no panels from each other: the panels a thread takes cost a
// shared counter each, whose cache line then moves between the cores, and for these products there is
// little to balance. (A forward, A read in place, still shares one-panel chunks.) One whose operands
// are both read in place is split by rows (gemm.cpp). Measured
// on Zen 4 (2 threads, 14 process pairs alternating, medians, µs, old -> new): dX 128x256->10
// 8.27 -> 7.66, dW 7.37 -> 7.13, dW 128x512->10 11.16 -> 10.58, 64x64->64 dX 6.02 -> 5.93 and
// dW 6.56 -> 6.35, the other products of 64x64->64, 128x256->32 and 64x256->64 within 1.3%.
// At moments this machine's fork and join takes 1.4 µs instead of 0.65 (the other vCPU slower
// to answer); then: dX 128x256->10 13.6 -> 10.2, its dW 12.7 -> 8.9, dW 128x512->10 17.1 ->
// 13.2, dW 128x256->32 20.0 -> 17.3 and 64x256->64 21.0 -> 17.9. Cut into whole column slabs
// instead of rows, dX of 128x256->10 and 128x512->10 were 13% and 44% slower.
constexpr double kWholeSlabsMaxFlops = 4e6;

// C (M x N, row-major, leading dimension ldc) = A (M x K) · B (K x N) + bias.
// A and B are strided views: A[m, k] = A[m * a_row_stride + k * a col_stride],
// so a transposed operand costs nothing (dW = dYᵀ·X packs straight from dY).
// bias has N elements or is nullptr. C is overwritten, never read, unless accumulate
// is set: then C += A·B (bias must be nullptr; the convolutions sum K in chunks so).
// A product whose B is a transposed view much larger than A (the forward of a wide layer)
// is computed as Cᵀ = Bᵀ·Aᵀ and transposed into C, with the same arithmetic (gemm.cpp).
// With relu set, C = max(C, 0) is applied in the same store (fused epilogue).
// Results are bit-identical from run to run and for any thread count: work is
// split over output tiles only, never over K.
template <typename T>
void gemm(int64_t M, int64_t N, int64_t K,
          const T* A, int64_t a_row_stride, int64_t a_col_stride,
          const T* B, int64_t b_row_stride, int64_t b_col_stride,
          const T* bias, bool relu,
          T* C, int64_t ldc, bool accumulate = false);

// B as gemm packs it for an M x N product: ceil(N / width) panels of `width` columns, panel p
// holding B[k][p·width + j] at p·width·K + k·width + j, zero past column N. A caller that builds
// B itself (the convolution's im2col) writes it so, and gemm_packed_b reads it without a copy.
template <typename T>
int64_t packed_b_panel_width(int64_t M, int64_t N);

// The depth of one K block of gemm for a product of depth K: all of K up to
// BlockSizes::max_single_k_block, else kc. A caller that builds B a block at a time (the
// convolution's im2col) cuts K where gemm does; k_is_one_block says whether all of K is one block.
template <typename T>
int64_t k_block_depth(int64_t K);
template <typename T>
bool k_is_one_block(int64_t K);

// C (+)= A · B, as gemm with accumulate and no bias, B packed as packed_b_panel_width(M, N) says.
// One thread, K at most one K block (BlockSizes::max_single_k_block or kc) and N at most nc.
template <typename T>
void gemm_packed_b(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_row_stride, int64_t a_col_stride,
                   const T* packed_b, T* C, int64_t ldc, bool accumulate);

// B read in place through an index rather than packed (the direct convolution's shifted
// planes, conv.cpp): B[k][j .. j + lanes - 1] is the `lanes` values at vectors[j / lanes] +
// offsets[k], for j a multiple of the vector lanes (BlockSizes::lanes).
template <typename T>
struct IndexedB {
  const int64_t* offsets;  // K values
  const T* const* vectors;  // N / lanes pointers
};

// C (+)= A · B, as gemm_packed_b, B indexed; N a multiple of the vector lanes.
template <typename T>
void gemm_indexed_b(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_row_stride, int64_t a_col_stride,
                    const IndexedB<T>& b, T* C, int64_t ldc, bool accumulate);

// One product C = A·B + bias (relu as in gemm) whose columns are computed in chunks of
// panels_per_chunk column panels of its tile (0: one chunk), taken by any threads in any
// order through run(). An A read in place costs the chunks nothing while its rows make one
// block of gemm_slab or take under half of L2 (each chunk re-reads it from there); an A that
// is packed is packed once, by the first thread that needs it, for all chunks, when it makes
// one packed block (depth up to one K block, rows within single_block_bytes); otherwise, and
// when C is written row after row (rows a page apart, larger than L2), the product is one chunk.
// Every element of C gets the same arithmetic as from gemm, whichever thread computes it.
// gemm's column slabs, and the backward's dX and dW side by side (autograd.cpp), are shared
// between threads this way.
template <typename T>
class ColumnChunks {
 public:
  ColumnChunks(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_row_stride, int64_t a_col_stride,
               const T* B, int64_t b_row_stride, int64_t b_col_stride, const T* bias, bool relu, T* C, int64_t ldc,
               int64_t panels_per_chunk, bool accumulate = false);
  ~ColumnChunks();
  ColumnChunks(const ColumnChunks&) = delete;
  ColumnChunks& operator=(const ColumnChunks&) = delete;
  // Computes chunks, on the calling thread, until none is left to take.
  void run();
  // No chunk is left to take (some may still be computing).
  bool all_taken() const { return next_chunk_.load(std::memory_order_relaxed) >= chunks_; }

 private:
  const T* packed_a();
  int64_t M_, N_, K_;
  const T* A_;
  int64_t a_rs_, a_cs_;
  const T* B_;
  int64_t b_rs_, b_cs_;
  const T* bias_;
  bool relu_;
  T* C_;
  bool accumulate_;
  int64_t ldc_, chunk_columns_, chunks_;
  bool share_packed_a_;
  std::atomic<int64_t> next_chunk_{0};
  enum PackState : int { kUnpacked, kPacking, kPacked };
  std::atomic<int> pack_state_{kUnpacked};
  // A's panels when shared: a buffer leased at construction from the constructing thread's
  // pool (gemm.cpp), filled once, and given back by the destructor, which must run on that
  // thread (gemm and the backward construct and destroy theirs in one call).
  T* packed_a_ = nullptr;
  int shared_pack_slot_ = -1;
};

// out[n] = sum over m of A[m, n], for an M x N strided view. Deterministic.
template <typename T>
void sum_rows(int64_t M, int64_t N,
              const T* A, int64_t a_row_stride, int64_t a_col_stride,
              T* out);

// ReLU's backward and db in one pass: masked (M x N, contiguous) = dY where the layer's
// output is > 0, else 0 (threshold_backward's rule), and, unless sums is null, sums[n] =
// the sum of masked's column n, the same to the bit as sum_rows of masked. dY and the
// output must have contiguous rows (unit column stride).
template <typename T>
void relu_backward_sum_rows(int64_t M, int64_t N, const T* dy, int64_t dy_row_stride, const T* output,
                            int64_t output_row_stride, T* masked, T* sums);

// Which microkernel family runs. The best one this CPU supports is chosen at
// load; tests switch paths to check that they agree.
enum class CpuPath { Portable, Avx2Fma, Avx512 };
CpuPath best_cpu_path();             // what this CPU supports
CpuPath active_cpu_path();           // what runs now
bool cpu_supports(CpuPath path);     // can this CPU run the path?
void set_cpu_path(CpuPath path);     // raises std::runtime_error if the CPU lacks it
const char* cpu_path_name(CpuPath path);                   // "portable" | "avx2+fma" | "avx512"
std::optional<CpuPath> cpu_path_from_name(std::string_view name);  // inverse of cpu_path_name

// The sizes a path blocks a product by and the thresholds that pick its code paths,
// exactly as the kernels use them: tests derive their edge cases from these and
// `python -m ext` reports them, so no copy of a constant lives outside gemm.cpp.
struct BlockSizes {
  int64_t wide_mr, wide_nr;            // the usual register tile of C
  int64_t narrow_mr, narrow_nr;        // the tile for N <= narrow_nr
  int64_t many_rows_mr, many_rows_nr;  // the tile from many_rows_min_rows rows of C
  int64_t tall_mr, tall_nr;            // the tile for C of exactly tall_mr rows
  int64_t one_vector_mr;               // rows of the tile for a one-vector column panel, A read in place
  int64_t narrow_one_vector_mr;        // the same for the narrow tile (tall_one_vector_tile)
  int64_t lanes;                       // values per vector
  int64_t kc;                          // depth of a K block
  int64_t max_single_k_block;          // up to this K, all of K is one block
  int64_t mc;                          // rows of a packed A block
  int64_t nc;                          // columns of a packed B block
  int64_t single_block_bytes;          // an A block may hold all of a slab's rows within this
  int64_t many_rows_min_rows;
  int64_t b_in_place_max_rows;         // up to this many rows of C a row-major B is read unpacked
  int64_t rows_outer_max_b_bytes;      // both operands in place and B's block this small: row tiles outermost
  int64_t transposed_min_rows;         // C = A·Bᵀ-view computed as Cᵀ from this many rows of C, when
  int64_t transposed_c_cost;           // K·(N − M) > transposed_c_cost·M·N (gemm.cpp: computes_transposed)
  int64_t max_shallow_depth;           // up to this K, both operands in place: row panels of shallow tiles
  int64_t shallow_mr, shallow_nr;      // the wide tile's shallow tile (Microkernel::shallow_row_panel)
  int64_t fmas_per_cycle;              // the vector FMAs a cycle the shallow tiles were picked for
  int64_t l2_bytes;                    // L2 per core as detected (gemm.cpp: caches); MC and the rest follow
  int64_t l1d_bytes;                   // L1d per core as detected
};
template <typename T>
BlockSizes block_sizes(CpuPath path);

// This machine's measured peak of fused multiply-adds, in GFLOP/s (2 flops per
// lane per FMA), running independent chains of the widest vector FMA the CPU
// has (AVX-512 if present, else AVX2) on num_threads threads.
// The benchmark reports each kernel as a % of it.
double measure_fma_peak_gflops(int64_t num_threads);

// 512-bit FMAs a core issues a cycle: 1 (Zen 4, which runs them on 256-bit units) or 2 (Zen 5),
// measured once, on first call, as the rate of 12 independent FMA chains over that of 4
// (latency-bound: one a cycle anywhere); 0 without AVX-512. The shallow tiles follow it (gemm.cpp).
int avx512_fmas_per_cycle();

// Runs work(i) for i in [0, count) on `count` threads at once, for the measurements here, which time
// every core working together. All threads started are joined before it returns, also when starting
// one fails (the error is then rethrown), so no failure ends the process.
void run_on_threads(int64_t count, const std::function<void(int64_t)>& work);

// The register tile alone, float32 on the active path: GFLOP/s of `tile` ("wide", "narrow" or
// "many_rows": BlockSizes' three tiles) computing `vectors` vectors of its columns at depth kc,
// its operands where gemm puts them for a batch of 128 (A's rows read in place, one packed B
// micro-panel re-read by all the row tiles, six panels in turn), and nothing else: no packing,
// no ragged tiles, no call. Each of num_threads threads runs its own copy at once; the best of
// several trials, as measure_fma_peak_gflops. Throws std::invalid_argument for a bad argument.
double measure_tile_gflops(std::string_view tile, int64_t vectors, int64_t kc, int64_t num_threads);

// Values gemm has packed since the library loaded, of A and of B, on every thread: read
// before and after a product, they show which operand it packs (bench.ceiling).
struct PackedValues {
  int64_t a, b;
};
PackedValues packed_values();

}  // namespace ext::cpu
