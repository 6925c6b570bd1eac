// BLIS/Goto-style GEMM: the five loops around a register-tile microkernel.
//
//   jc (NC columns of B: the packed B block stays in L3)
//    pc (KC deep: one packed B block, KC x NC)
//     ic (MC rows of A: the packed A block stays in L2)
//      jr (NR columns: one B micro-panel, KC x NR, from L2)
//       ir (MR rows: one microkernel call, an MR x NR tile of C in registers;
//           its A micro-panel, MR x KC, in L1)
//
// Threads split C into slabs of whole tiles (columns of NR, or rows of MR); each
// runs the five loops on its slab (column slabs a panel at a time, so a thread done
// early takes the panels another has not reached). No thread ever splits K, so every
// element of C sees the same operations in the same order whatever the thread count.
#include "gemm.h"

#include "microkernel.h"
#include "pack_buffer.h"

#include <ATen/Parallel.h>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <deque>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ext::cpu {

namespace {

// The caches the blocking is sized for, read from the running CPU once, at the first product:
// per core, L1d and L2 (sysfs, else sysconf; LINEAR_LAB_CPU_CACHES="l1d=32K,l2=1M" sets them, to
// run another CPU's blocking here). Each size below says which fraction of which cache it takes.
// The fractions were measured on an Intel Xeon with 48 KiB L1d and 2 MiB L2, where they give
// exactly the sizes once tuned there by hand (MC = 240 on the AVX-512 path); on the AMD EPYC
// (Zen 4: 32 KiB, 1 MiB) the project ran on before, sizes for its caches (MC = 120, what this rule
// gives there) and the Xeon's ran alike: ext's time per product (bench.linear --products, 1 thread,
// every shape) 0.92-1.13 of the Xeon's, geomean 0.996.
struct CacheSizes {
  int64_t l1d_bytes, l2_bytes;
  std::string source;  // where they were read
};

// "48K" -> 49152; "2048K", "1M", "1048576" alike; -1 if not a size.
int64_t parse_cache_size(std::string text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  if (text.empty()) return -1;
  int64_t unit = 1;
  switch (std::toupper(static_cast<unsigned char>(text.back()))) {
    case 'K': unit = 1024; break;
    case 'M': unit = 1024 * 1024; break;
    case 'G': unit = 1024 * 1024 * 1024; break;
    default: break;
  }
  if (unit != 1) text.pop_back();
  if (text.empty() || !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(text) * unit;
}

std::string read_line(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

// Kernel-reported caches of cpu0 (Linux: /sys/devices/system/cpu/cpu0/cache/index*/).
bool read_sysfs_caches(CacheSizes& sizes) {
  int64_t l1d = -1, l2 = -1;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    const std::string level = read_line(dir + "level"), type = read_line(dir + "type");
    const int64_t size = parse_cache_size(read_line(dir + "size"));
    if (level == "1" && type == "Data") l1d = size;
    if (level == "2" && type != "Instruction") l2 = size;
  }
  if (l1d <= 0 || l2 <= 0) return false;
  sizes = {l1d, l2, "sysfs"};
  return true;
}

CacheSizes detect_caches() {
  if (const char* forced = std::getenv("LINEAR_LAB_CPU_CACHES")) {
    CacheSizes sizes{-1, -1, "LINEAR_LAB_CPU_CACHES"};
    std::stringstream items(forced);
    for (std::string item; std::getline(items, item, ',');) {
      const auto eq = item.find('=');
      const std::string name = item.substr(0, eq);
      const int64_t size = eq == std::string::npos ? -1 : parse_cache_size(item.substr(eq + 1));
      if (name == "l1d") sizes.l1d_bytes = size;
      else if (name == "l2") sizes.l2_bytes = size;
      else sizes.l1d_bytes = -1;
      if (size <= 0) sizes.l1d_bytes = -1;
    }
    if (sizes.l1d_bytes < 4096 || sizes.l2_bytes < 64 * 1024)
      throw std::runtime_error(std::string("LINEAR_LAB_CPU_CACHES='") + forced + "' is not l1d=<size>,l2=<size> "
                               "(e.g. l1d=32K,l2=1M; at least 4K and 64K)");
    return sizes;
  }
  CacheSizes sizes;
  if (read_sysfs_caches(sizes)) return sizes;
  const int64_t l1d = sysconf(_SC_LEVEL1_DCACHE_SIZE), l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l1d > 0 && l2 > 0) return {l1d, l2, "sysconf"};
  return {32 * 1024, 512 * 1024, "unknown: assumed 32 KiB and 512 KiB, the smallest the project has met"};
}

const CacheSizes& caches() {
  static const CacheSizes sizes = detect_caches();
  return sizes;
}

// KC: depth of one block, 2 KiB of K per row or column (512 floats, 256 doubles).
// Deeper blocks mean fewer passes that reload and re-store C; measured here on
// 1024^3 (1 thread), KC = 128 -> 1024 floats took the forward from 147 to 174
// GFLOP/s. The ir loop is innermost, so one B micro-panel (KC x NR, 32-128
// KiB, more than L1d at 8x48) meets every A micro-panel (MR x KC, at most 16
// KiB) of the block; both stream from L2. A B micro-panel that fits L1d did not
// pay: with 8x32 tiles, KC = 256 (32 KiB) took 1024^3 from 168 to 162, KC = 384
// to 166, while KC = 1024 gave 172 (interleaved, 1 thread); the microkernel
// alone runs at the same speed from L1 as from L2 (8x32: 196-199).
template <typename T>
constexpr int64_t kKC = 2048 / sizeof(T);
static_assert(8 * kKC<float> * sizeof(float) <= 32 * 1024 / 2);  // an 8-row A micro-panel: half of a 32 KiB L1d
// Up to this depth all of K is one block, though deeper than KC: K = 784 (an
// MNIST image) in blocks of 512 + 272 stores and reloads every C tile for a
// short second block. Measured here (forward, ms, interleaved with torch, two
// runs each, 1 thread / 2 threads): 128x784->256 0.296-0.298 -> 0.291-0.295,
// 0.159-0.164 -> 0.155-0.157; 512x784->256 1.122-1.128 -> 1.096-1.113,
// 0.582-0.590 -> 0.576-0.586. Deeper single blocks were slower (K = 1000 and
// 1024 as one block: dX 128x2048->1000 and dW 1024^3 2-5% slower).
template <typename T>
constexpr int64_t kMaxSingleKBlock = 3200 / sizeof(T);

// MC: rows of one packed A block (MC x KC, KC = 2 KiB per row), per path: the share of L2 below,
// rounded down to a multiple of every MR of its path's tiles (checked when a path's tiles are
// built: pack_a fills whole MR-row panels, so any other MC would overrun the MC-row buffer).
// AVX-512: a quarter of L2 (on the Xeon, 240 rows = 480 KiB), leaving room for the B micro-panels
// streaming through. AVX2 and portable: half of L2 (Zen3, 512 KiB: 120 rows = 240 KiB, measured
// there), so the A block and the B micro-panels (KC x 16 floats = 32 KiB) share it.
int64_t a_block_budget_bytes(CpuPath path) {
  return path == CpuPath::Avx512 ? caches().l2_bytes / 4 : caches().l2_bytes / 2;
}

int64_t row_multiple(CpuPath path) {  // the least common multiple of the path's MRs (float and double)
  switch (path) {
    case CpuPath::Avx512: return 24;  // 8 and 6
    case CpuPath::Avx2Fma: return 6;
    case CpuPath::Portable: break;
  }
  return 4;
}

int64_t block_rows(CpuPath path) {
  const int64_t rows = a_block_budget_bytes(path) / (kKC<float> * static_cast<int64_t>(sizeof(float)));
  return std::max(row_multiple(path), rows / row_multiple(path) * row_multiple(path));
}

// The bytes an A block may take when all of a slab's rows fit in one: the budget MC was sized
// for. One block means B is packed per micro-panel (gemm_slab) and read once, where 256 rows of
// KC in MC-row blocks (240 + 16) re-read all of B for 16 rows. Measured (1 thread): dW
// 512x784->256 (256 rows, K = 512) 158-160 -> 174 GFLOP/s (torch 176-178), dW 512x256->256
// 161-162 -> 167-168 (torch 171-173).
int64_t single_block_bytes(CpuPath path) { return a_block_budget_bytes(path); }

// NC: columns of one packed B block (KC x NC = 6 MiB per thread), in L3; a
// multiple of every NR (48 and 64 among them). Wider than every layer here, so
// B is packed once per K block.
constexpr int64_t kNC = 3072;

// From this many rows of C on, the path's many-rows tile runs (AVX-512 float:
// 6x64 instead of 8x48, see microkernel_avx512.cpp). Measured here (1 thread,
// GFLOP/s, 8x48 -> 6x64): forward 512x784->256 175 -> 183, 1024^3 175 -> 182;
// but at 128 rows dX 128x784->256 163 -> 141 (a ragged last row panel, 128 =
// 21 x 6 + 2). At 256 rows neither wins everywhere, and the dW of the MLP layers
// (256 rows) is faster with 8x48: 784 columns leave 6x64 a one-vector panel that
// 6 rows keep only 6 FMA chains busy (8x48's has 8). Measured (1 thread, single
// calls alternating, median of the paired ratios 6x64 / 8x48): dW 128x784->256
// 1.027, 512x784->256 1.022, 128x256->256 1.005, 512x256->256 1.000; at 256 rows
// forward 256x784->256 0.997, its dX 1.039, 256x256->256 1.000 and 0.984; at 512
// rows forward 512x784->256 0.977, 512x256->256 0.970, dX 512x256->256 0.961.
constexpr int64_t kManyRowsMinRows = 512;

// Up to this many rows of C (16 row tiles of 8) a row-major B is read in place
// rather than packed. Measured here (1 thread): dX 128x784->256 320 -> 304 us,
// the 10-class head's dW 11.3 -> 8.6 us; but dX at M = 512 and dW with 256 rows
// were ~4% slower in place, and reading dW's column-major A in place ~10% slower.
constexpr int64_t kMaxRowsForBInPlace = 128;

// Both operands read in place and B's block within 5/8 of L1d (dX of a 10-class head):
// row tiles run outermost (see rows_outer in gemm_slab), and on several threads the rows
// are split (gemm). Measured on Zen 4 (32 KiB L1d; processes alternating, 10 rounds, median
// of the paired ratios, half -> 5/8): dX 128x512->10 (B 20 KiB) 1.21x faster on 2 threads,
// 64x512->10 1.24x; on 1 thread 1.00 and 1.02. With 3/4, 2 threads gained at 24 KiB too
// (128x600->10 1.14x) but 1 thread lost there (0.976); the row split alone, with column
// panels outermost, was slower (0.77).
int64_t rows_outer_max_b_bytes() { return caches().l1d_bytes * 5 / 8; }

// Up to this depth a product with both operands read in place (dX of a head with few classes)
// runs its rows in panels of shallow tiles (Microkernel::shallow_row_panel), and on several
// threads is split by rows (gemm). Measured on Zen 4 (processes alternating, 6-8 rounds, median
// of the paired ratios of the time, panels / wide tiles): dX 128x256->10 0.96 on 1 thread and
// 0.94 on 2, 128x512->10 0.88-0.90 and 0.91, 128x1000->10 0.89-0.93 and 0.82, 64x1000->10 0.92
// and 0.71, 128x784->16 0.90-0.91 and 0.85, 128x500->16 0.91; the AVX2 path (3 x 3 vectors
// against 6 x 2) 0.76-0.82 at K = 10, 0.92-0.96 at 16. Deeper, AVX-512 still gained (K = 20-32:
// 0.94-0.99) but AVX2 lost (1.00-1.06, and 1.32 at 128x512->32, whose B rows 2 KiB apart share
// L1 sets). On 2 threads in column slabs taken a panel at a time (ColumnChunks), each row panel
// was one column panel wide: 128x1000->10 1.31x slower, hence the split by rows.
constexpr int64_t kMaxShallowDepth = 16;

// Read in place, B's block is re-read from its scattered rows by every row tile, so it
// must stay in L2: half of L2 at most, and no row stride of a whole 4 KiB page, which
// maps every row to the same few cache sets (dX of 128x2048->1000 read W in place ran
// 2x slower).
template <typename T>
bool b_block_stays_in_l2(int64_t block_bytes, int64_t b_rs) {
  return block_bytes <= caches().l2_bytes / 2 && b_rs * static_cast<int64_t>(sizeof(T)) % 4096 != 0;
}

// Whether a slab of `rows` rows of C reads a row-major B in place (its K blocks `cols` columns
// wide): gemm_slab's rule, by which gemm also chooses how to split a product over threads.
template <typename T>
bool slab_reads_b_in_place(int64_t rows, int64_t K, int64_t cols, int64_t b_rs, int64_t b_cs) {
  const int64_t block_bytes = k_block_depth<T>(K) * cols * static_cast<int64_t>(sizeof(T));
  return b_cs == 1 && rows <= kMaxRowsForBInPlace && b_block_stays_in_l2<T>(block_bytes, b_rs);
}

// A row-major A is read in place, never packed: gemm_slab reads it so, and gemm splits
// threads by columns for it (each slab then packs only its own part of B).
inline bool reads_a_in_place(int64_t a_col_stride) { return a_col_stride == 1; }

CpuPath g_active_path = best_cpu_path();

// Each path's table of tile and packing functions, built on the path's first use
// (not at load: the AVX-512 file may not run on this CPU), then shared by every call.
// (Not the tall tile: it runs only products of exactly its MR rows, one A block of one panel.)
template <typename T>
Microkernels<T> checked_against_block_rows(Microkernels<T> table, CpuPath path) {
  for (const Microkernel<T>* uk : {&table.wide, &table.narrow, &table.many_rows})
    if (block_rows(path) % uk->mr != 0)
      throw std::logic_error("ext: the CPU path's MC (" + std::to_string(block_rows(path)) +
                             " rows) is not a multiple of a tile's MR (" + std::to_string(uk->mr) +
                             "); change kMC* in gemm.cpp");
  return table;
}

// The vector FMAs a core issues a cycle on a path: measured for AVX-512 (avx512_fmas_per_cycle);
// elsewhere 1, the shallow tiles as they were measured (Zen 4's AVX2 path not re-measured).
int64_t fmas_per_cycle(CpuPath path) { return path == CpuPath::Avx512 ? avx512_fmas_per_cycle() : 1; }

// Each tile's shallow row panel (Microkernel::shallow_row_panels) for the FMAs this core issues a
// cycle. With two 512-bit FMAs a cycle the 4 x 2-vector tile (8 sums) spends as many slots on its
// B loads and A broadcasts (6 per 8 FMAs) as on FMAs; 4 x 4 vectors (16 sums) load 8 per 16.
// Measured on Zen 5 (dX, processes alternating, 8 rounds, median of the paired ratios of the
// time, 4 x 4 / 4 x 2): 1 thread 128x256->10 0.95, 128x512->10 0.94, 128x784->10 0.76, 32x256->10
// 0.91, 128x784->16 0.99; 2 threads 0.95, 0.94, 0.87, 0.89, 0.97; the many-rows tile's 3 x 64 /
// 3 x 48, 512x256->10 0.99 on both. 4 x 3 was between (0.93-1.10 on 1 thread). On Zen 4 (one
// 512-bit FMA a cycle) a standalone loop put 4 x 2 at 114 GFLOP/s and 4 x 4 at 108.
template <typename T>
Microkernels<T> with_shallow_tiles_for(Microkernels<T> table, int64_t fmas) {
  const int pick = fmas >= 2 ? 1 : 0;
  for (Microkernel<T>* uk : {&table.wide, &table.narrow, &table.many_rows, &table.tall}) {
    uk->shallow_nr = uk->shallow_nrs[pick];
    uk->shallow_row_panel = uk->shallow_row_panels[pick];
  }
  return table;
}

template <typename T>
const Microkernels<T>& microkernels(CpuPath path) {
  switch (path) {
    case CpuPath::Avx512: {
      static const Microkernels<T> table =
          checked_against_block_rows(with_shallow_tiles_for(avx512_microkernels<T>(), fmas_per_cycle(path)), path);
      return table;
    }
    case CpuPath::Avx2Fma: {
      static const Microkernels<T> table = checked_against_block_rows(avx2_microkernels<T>(), path);
      return table;
    }
    case CpuPath::Portable: break;
  }
  static const Microkernels<T> table = checked_against_block_rows(portable_microkernels<T>(), path);
  return table;
}

// C = A·B with A read in place (row-major) and B a transposed view (the forward's Wᵀ) is computed
// as Cᵀ = Bᵀ·Aᵀ when K·(N − M) > 4·M·N, and C's rows fill the narrow tile: then Bᵀ = W is read
// in place and only Aᵀ (the batch, M x K) is transposed into panels, rather than B (K x N), and
// Cᵀ (M x N) is transposed back. Every element gets the same arithmetic either way (the bias is
// where each sum starts, by row for Cᵀ), so the results are bit-identical. The rule: what is
// saved, N·K values transposed, less M·K and the M·N of C, against the product's M·N·K, is
// 1/M − 1/N − c/K, and c = 4 (not 2) leaves out the shapes that were measured slower. Measured
// on Zen 4 (forward, processes alternating, 6-8 rounds, median of the paired ratios, Cᵀ / C,
// 1 thread and 2): 128x2048->1000 0.96 and 0.97, 256x2048->1000 0.96, 128x4096->4096 0.95
// and 0.94, 64x2048->1000 0.90 and 0.89, 16x2048->1000 0.72 and 0.73, 32x784->256 0.90 and
// 0.93, 64x784->256 0.96 and 0.99, 128x1024->512 0.98 and 1.00; left out by the rule,
// 128x512->1024 1.02 and 1.03, 128x784->256 1.00 and 1.04, 128x256->256 1.04 and 1.08; and
// left out by the narrow tile, 8x2048->1000 1.13 and 1.17 (C's 8 rows a 16-lane tile's half).
constexpr int64_t kTransposedCCost = 4;

template <typename T>
int64_t transposed_min_rows(CpuPath path) { return microkernels<T>(path).narrow.nr; }

template <typename T>
bool computes_transposed(int64_t M, int64_t N, int64_t K, int64_t a_cs, int64_t b_rs) {
  return a_cs == 1 && b_rs == 1 && M >= transposed_min_rows<T>(g_active_path) &&
         static_cast<double>(K) * (N - M) > static_cast<double>(kTransposedCCost) * M * N;
}

thread_local PackBuffer t_transposed_c;  // Cᵀ of gemm_transposed

// C's rows a page or more apart, in a C larger than L2: gemm_slab writes such a C row after
// row where it can (see write_c_by_rows there).
template <typename T>
bool c_rows_are_pages_apart(int64_t rows, int64_t ldc) {
  const int64_t row_bytes = ldc * static_cast<int64_t>(sizeof(T));
  return row_bytes >= 4096 && rows * row_bytes > caches().l2_bytes;
}

// The active path's tile for an M x N product of C.
template <typename T>
const Microkernel<T>& microkernel_for(int64_t M, int64_t N) {
  const Microkernels<T>& kernels = microkernels<T>(g_active_path);
  if (N <= kernels.narrow.nr) return kernels.narrow;
  if (M == kernels.tall.mr) return kernels.tall;
  return M >= kManyRowsMinRows ? kernels.many_rows : kernels.wide;
}

thread_local PackBuffer t_packed_a, t_packed_b;  // packing never allocates once warm

// Values packed since load, of A and of B, over all threads (packed_values): bench.ceiling
// reads them to show which operand a product packs. One relaxed add per packed block or panel,
// each counter on a cache line of its own, so that no add evicts a global every product reads.
alignas(64) std::atomic<int64_t> g_packed_a_values{0};
alignas(64) std::atomic<int64_t> g_packed_b_values{0};

template <typename T>
void pack_a(const Microkernel<T>& uk, const T* a, int64_t row_stride, int64_t k_stride, int64_t rows, int64_t kc,
            T* dst) {
  uk.pack_a(a, row_stride, k_stride, rows, kc, dst);
  g_packed_a_values.fetch_add(rows * kc, std::memory_order_relaxed);
}

template <typename T>
void pack_b(const Microkernel<T>& uk, const T* b, int64_t k_stride, int64_t col_stride, int64_t kc, int64_t cols,
            T* dst) {
  uk.pack_b(b, k_stride, col_stride, kc, cols, dst);
  g_packed_b_values.fetch_add(kc * cols, std::memory_order_relaxed);
}

// Buffers for the packed A that all chunks of a ColumnChunks share, kept per constructing
// thread and reused across calls, like t_packed_a. Allocated afresh for each product (up to
// 512 KiB) and freed after it, each was one more block that glibc may hand back to the
// system on free, to fault its pages in again on the next call. Counted over 20 processes
// that each ran the MLP shapes' forward, backward and fwd+bwd 900 times: ext's 512x784->256
// averaged more than 50 page faults per call in 2 processes (up to 298) with a fresh
// allocation, in 1 (66) with the pool; torch's own calls fault that way too (2-3 of 20).
// Several ColumnChunks may be alive at once (one per column slab of gemm), so each leases a
// slot and gives it back when destroyed, on the same thread.
class SharedPackPool {
 public:
  int lease() {
    const auto free_slot = std::find(leased_.begin(), leased_.end(), false);
    if (free_slot != leased_.end()) {
      *free_slot = true;
      return static_cast<int>(free_slot - leased_.begin());
    }
    buffers_.emplace_back();
    leased_.push_back(true);
    return static_cast<int>(leased_.size()) - 1;
  }
  template <typename T>
  T* get(int slot, int64_t count) { return buffers_[slot].get<T>(count); }
  void release(int slot) { leased_[slot] = false; }

 private:
  std::deque<PackBuffer> buffers_;  // a deque: a buffer stays where it is as others are added
  std::vector<bool> leased_;
};

thread_local SharedPackPool t_shared_packs;

// Asks for the next tile of C while this one computes: from the second K block on,
// the tile adds C to its sum, and C has long left L1/L2 by then (the only
// case that asks, see gemm_slab).
inline void prefetch_tile(const void* c, int64_t rows, int64_t row_bytes, int64_t ld_bytes) {
  const char* p = static_cast<const char*>(c);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(p + i * ld_bytes + byte, 1);
}

// Prefetches runs [first, last) of a B micro-panel's source into L2, for the pack that follows: the
// contiguous runs of a row-major B (its kc rows of `cols` values) or of a transposed one (its cols
// columns of kc values).
template <typename T>
void prefetch_b_runs(const T* b, int64_t b_rs, int64_t b_cs, int64_t kc, int64_t cols, int64_t first, int64_t last) {
  const bool row_runs = b_cs == 1;
  const int64_t run_stride = row_runs ? b_rs : b_cs;
  const int64_t run_bytes = (row_runs ? cols : kc) * static_cast<int64_t>(sizeof(T));
  for (int64_t run = first; run < last; ++run) {
    const char* p = reinterpret_cast<const char*>(b + run * run_stride);
    for (int64_t byte = 0; byte < run_bytes; byte += 64) __builtin_prefetch(p + byte, 0, 2);
  }
}

// The five loops on one slab of C: rows [m0, m1), columns [n0, n1). The bias is by column
// (bias, N values) or by row (row_bias, M values: a product computed as Cᵀ).
template <typename T>
void gemm_slab(const Microkernel<T>& uk, int64_t mc_at_kc, int64_t single_block_bytes, int64_t m0, int64_t m1,
               int64_t n0, int64_t n1, int64_t K,
               const T* A, int64_t a_rs, int64_t a_cs, const T* B, int64_t b_rs, int64_t b_cs,
               const T* bias, bool relu, T* C, int64_t ldc, bool accumulate_c,
               const T* shared_packed_a = nullptr, const T* prepacked_b = nullptr,
               const IndexedB<T>* indexed_b = nullptr, const T* row_bias = nullptr,
               int64_t prefetch_columns_after = 0) {
  const int64_t MR = uk.mr, NR = uk.nr, KC = k_block_depth<T>(K);
  // When all the slab's rows fit in single_block_bytes (more of them when K is
  // shallower than KC: dW, K = batch), they make one A block, which lets B be
  // packed per micro-panel (below). Measured (1 thread): dW 128x784->256 (256
  // rows, K = 128) 177 -> 181 GFLOP/s. More rows in bigger, fewer blocks were
  // slower (dW 128x2048->1000, 1000 rows in 960 + 40 instead of 240s:
  // 171 -> 156), so only a single block grows.
  const int64_t single_block_rows = single_block_bytes / (std::min(KC, K) * static_cast<int64_t>(sizeof(T)));
  // Rounded up to whole MR panels: pack_a zero-pads the last one, and packed_a
  // (below) holds MC rows.
  const int64_t MC = m1 - m0 <= single_block_rows ? std::max(mc_at_kc, (m1 - m0 + MR - 1) / MR * MR) : mc_at_kc;
  // A row-major with rows of whole MR panels is read in place: packing it would
  // cost as much as the small products it feeds. A row-major B (dX: W, dW: X) is
  // read in place when few row tiles reuse it; with more, the packed copy's
  // contiguous layout pays for itself. Only ragged last panels, whose padding
  // must be readable, are packed.
  const bool read_a_in_place = reads_a_in_place(a_cs);
  const int64_t b_block_bytes = std::min(KC, K) * (n1 - n0) * static_cast<int64_t>(sizeof(T));
  // B packed or indexed by the caller (the convolution): read as it is.
  const bool b_supplied = prepacked_b || indexed_b;
  const bool read_b_in_place = !b_supplied && slab_reads_b_in_place<T>(m1 - m0, K, n1 - n0, b_rs, b_cs);
  // C's rows a page or more apart, in a C larger than L2 (dW of a 2048-input head,
  // 1000 x 2048, from a batch of 128): down a column panel every row of a tile is
  // on another page, and C is written in 256-byte strips a thousand pages tall. If
  // B's block fits half of L2, it is packed whole and the row tiles run outermost, so
  // C is written row after row. Measured here (single calls alternating, median of
  // the paired ratios, rows / column panels): dW 128x2048->1000 0.92-0.96 over three
  // runs on 1 thread, 0.962 on 2; its fwd+bwd on 2 threads 0.971 and 1.000 in two
  // runs (its dX, on the other thread, is the longer product); dX 1024x1024->128
  // 0.955, forward 1024x128->1024 0.941. With B's block up to all of L2 instead of
  // half, dW 256x2048->1000 ran 1.39x slower.
  const bool write_c_by_rows = !read_b_in_place && c_rows_are_pages_apart<T>(m1 - m0, ldc) &&
                               b_block_bytes <= caches().l2_bytes / 2;
  // With a single A block, each B micro-panel is packed into one reused
  // KC x NR buffer right before its row tiles read it, while it is in L1/L2,
  // rather than with the whole KC x NC block first (4 MiB for N = 2048, out of
  // L2 by the time it is read).
  // Measured here (1 thread): forward 128x2048->1000 148 -> 164 GFLOP/s, its
  // dX 144 -> 157, forward 128x784->256 170 -> 173. With several A blocks
  // (more than MC rows) every block reuses the packed B block, packed first.
  const bool pack_b_per_panel = !b_supplied && m1 - m0 <= MC && !write_c_by_rows;
  // Both operands read in place and B's block small enough for L1d (dX of a
  // 10-class head, K = 10): each row tile runs across all columns, so C is written
  // row by row rather than a column panel at a time. Measured here (1 thread,
  // interleaved with torch): dX 128x256->10 8.3 -> 7.6-7.7 us, 128x512->10
  // 13.7 -> 13.0-13.3 us (torch 5.5 and 9.7-10.3); prefetching the next
  // column panel's C in this order was slower (8.1 us).
  const bool rows_outer = write_c_by_rows ||
                          (read_a_in_place && read_b_in_place && m1 - m0 <= MC && b_block_bytes <= rows_outer_max_b_bytes());
  // A shallow product read in place (dX of a 10-class head) runs its rows in panels across
  // all its columns, of tiles smaller than the wide tile (kMaxShallowDepth).
  const bool shallow = read_a_in_place && read_b_in_place && !row_bias && K <= kMaxShallowDepth;
  // A row-major B is packed by the first row tile of each of its panels, which stores B's rows as it
  // reads them for its FMAs (Microkernel::copying_b_tiles), rather than in a pass of its own: a panel at
  // a time right before its row tiles (pack_b_per_panel), or, with several A blocks, the whole block
  // during the first A block, the later blocks reading the copy. Measured on Zen 5 (processes
  // alternating, median of the paired ratios of the time): see ext/README.md, "B packed by its first
  // tile", for this and the next.
  // (The copying tiles have no bias by row and no indexed B.)
  const bool copy_b_in_tiles = !read_b_in_place && !b_supplied && !row_bias && b_cs == 1 && !rows_outer && !shallow;
  // Likewise a column-major A (dW's dYᵀ) is packed by the row tiles of each A block's first column
  // panel (Microkernel::copying_a_tiles), each storing its MR rows of A as it reads them in place; a
  // ragged last row panel is packed apart.
  const bool copy_a_in_tiles =
      !read_a_in_place && !shared_packed_a && !indexed_b && !row_bias && a_rs == 1 && !rows_outer && !shallow;
  T* packed_b = b_supplied ? const_cast<T*>(prepacked_b)
                           : t_packed_b.get<T>((read_b_in_place || pack_b_per_panel ? NR : std::min(kNC, (n1 - n0 + NR - 1) / NR * NR)) * KC);
  // A packed once for all of a ColumnChunks product (then A is one block: one ic, one pc).
  T* packed_a = shared_packed_a ? nullptr : t_packed_a.get<T>((read_a_in_place ? MR : MC) * KC);
  const T* a_panels = shared_packed_a ? shared_packed_a : packed_a;
  // The tiles this slab runs, by how A is read: with a bias by row (a product computed as Cᵀ) or not.
  const auto& unit_row_stride_tiles = row_bias ? uk.row_bias_unit_row_stride_tiles : uk.unit_row_stride_tiles;
  const auto& unit_k_stride_tiles = row_bias ? uk.row_bias_unit_k_stride_tiles : uk.unit_k_stride_tiles;
  TileArgs<T> tile{};
  tile.ldc = ldc;
  for (int64_t jc = n0; jc < n1; jc += kNC) {
    const int64_t nc = std::min(kNC, n1 - jc);
    for (int64_t pc = 0; pc < K; pc += KC) {
      const int64_t kc = std::min(KC, K - pc);
      const T* b_block = B + pc * b_rs + jc * b_cs;
      if (!read_b_in_place && !pack_b_per_panel && !b_supplied && !copy_b_in_tiles)
        pack_b(uk, b_block, b_rs, b_cs, kc, nc, packed_b);
      tile.kc = kc;
      tile.accumulate = pc > 0 || accumulate_c;
      tile.relu = relu && pc + kc == K;
      for (int64_t ic = m0; ic < m1; ic += MC) {
        const int64_t mc = std::min(MC, m1 - ic);
        const T* a_block = A + ic * a_rs + pc * a_cs;
        // A's panels copied by the first column panel's tiles: only where that panel is whole.
        const bool copy_a = copy_a_in_tiles && nc >= NR;
        if (!read_a_in_place && !shared_packed_a && !copy_a) pack_a(uk, a_block, a_rs, a_cs, mc, kc, packed_a);
        // Where B's micro-panel for columns jr is packed: one reused panel, or its place in the block.
        auto packed_b_panel = [&](int64_t jr) { return pack_b_per_panel ? packed_b : packed_b + jr * kc; };
        // Whether this A block packs B's panels (the rest read the block's copy).
        const bool packs_b = !read_b_in_place && !b_supplied && (pack_b_per_panel || ic == m0);
        // B's micro-panel for columns jr: packed, or read in place.
        // With copy_in_first_tile the panel is packed by its first row tile instead (copy_b_in_tiles).
        auto b_panel = [&](int64_t jr, int64_t cols, bool copy_in_first_tile = false) {
          tile.cols = cols;
          tile.bias = pc == 0 && bias ? bias + jc + jr : nullptr;
          if (indexed_b) {
            tile.b_offsets = indexed_b->offsets + pc;
            for (int64_t v = 0; v * uk.lanes < cols; ++v) tile.b_vectors[v] = indexed_b->vectors[(jc + jr) / uk.lanes + v];
          } else if (copy_in_first_tile) {
            tile.b = b_block + jr;
            tile.b_k_stride = b_rs;
            tile.b_copy = packed_b_panel(jr);
            g_packed_b_values.fetch_add(kc * cols, std::memory_order_relaxed);  // packed all the same
          } else if (!read_b_in_place) {
            if (pack_b_per_panel || (copy_b_in_tiles && packs_b))
              pack_b(uk, b_block + jr * b_cs, b_rs, b_cs, kc, tile.cols, packed_b_panel(jr));
            tile.b = packed_b_panel(jr);
            tile.b_k_stride = NR;
          } else if (tile.cols % uk.lanes == 0) {  // whole vectors: no padding to read
            tile.b = b_block + jr;
            tile.b_k_stride = b_rs;
          } else {
            pack_b(uk, b_block + jr, b_rs, b_cs, kc, tile.cols, packed_b);
            tile.b = packed_b;
            tile.b_k_stride = NR;
          }
        };
        // The tile of rows ir.. (up to row_end) of the block at the current B micro-panel.
        // (tile_rows: MR, or Microkernel::tall_one_vector_rows for two whole row tiles of a one-vector panel
        // with A read in place.)
        auto run_tile = [&](int64_t ir, int64_t jr, int64_t row_end, const T* next_c, int64_t next_rows,
                            int64_t tile_rows) {
          tile.rows = std::min(tile_rows, row_end - ir);
          tile.c = C + (ic + ir) * ldc + jc + jr;
          if (row_bias) tile.row_bias = pc == 0 ? row_bias + ic + ir : nullptr;
          if (next_c) prefetch_tile(next_c, next_rows, tile.cols * sizeof(T), ldc * sizeof(T));
          auto run = [&](bool unit_row_stride) {
            if (tile.rows > MR) return uk.tall_one_vector_tile(tile);
            if (tile.a_copy) return uk.copying_a_tiles[tile.b_copy ? 1 : 0](tile);
            if (tile.b_copy) return uk.copying_b_tiles[unit_row_stride ? 0 : 1](tile);
            if (indexed_b) return uk.tile_indexed_b(unit_row_stride, tile.rows, tile.cols)(tile);
            (unit_row_stride ? unit_row_stride_tiles : unit_k_stride_tiles)[uk.row_variant(tile.rows)]
                                                                          [(tile.cols - 1) / uk.lanes](tile);
          };
          if (!read_a_in_place) {
            tile.a = a_panels + ir * kc;
            tile.a_k_stride = MR;
            if (copy_a && jr == 0) {  // this row panel of A is packed now: by this tile, or apart if ragged
              if (tile.rows == MR) {
                tile.a = a_block + ir * a_rs;
                tile.a_k_stride = a_cs;
                tile.a_copy = packed_a + ir * kc;
                g_packed_a_values.fetch_add(MR * kc, std::memory_order_relaxed);  // packed all the same
              } else {
                pack_a(uk, a_block + ir * a_rs, a_rs, a_cs, tile.rows, kc, packed_a + ir * kc);
              }
            }
            run(true);
            tile.a_copy = nullptr;
          } else if (tile.rows >= MR) {
            tile.a = a_block + ir * a_rs;
            tile.a_row_stride = a_rs;
            run(false);
          } else {
            pack_a(uk, a_block + ir * a_rs, a_rs, a_cs, tile.rows, kc, packed_a);
            tile.a = packed_a;
            tile.a_k_stride = MR;
            run(true);
          }
        };
        if (rows_outer || shallow) {
          int64_t panel_rows_end = 0;  // rows [0, panel_rows_end) run in shallow row panels
          if (shallow) {
            // Row panels of uk.shallow_rows across the whole vectors of columns, one call each;
            // then the columns past the last whole vector, if any, in wide tiles over one packed
            // panel (the tiles of a part-vector go through a local copy). Rows left over, fewer
            // than a panel, run as below.
            const int64_t R = uk.shallow_rows, whole_columns = nc / uk.lanes * uk.lanes;
            panel_rows_end = mc / R * R;
            if (whole_columns > 0) {
              tile.cols = whole_columns;
              tile.a_row_stride = a_rs;
              tile.b = b_block;
              tile.b_k_stride = b_rs;
              tile.bias = pc == 0 && bias ? bias + jc : nullptr;
              for (int64_t ir = 0; ir < panel_rows_end; ir += R) {
                tile.rows = R;
                tile.a = a_block + ir * a_rs;
                tile.c = C + (ic + ir) * ldc + jc;
                uk.shallow_row_panel(tile);
              }
            }
            if (whole_columns < nc) {
              b_panel(whole_columns, nc - whole_columns);
              for (int64_t ir = 0; ir < panel_rows_end; ir += MR) run_tile(ir, whole_columns, panel_rows_end, nullptr, 0, MR);
            }
          }
          for (int64_t ir = panel_rows_end; ir < mc; ir += MR)
            for (int64_t jr = 0; jr < nc; jr += NR) {
              b_panel(jr, std::min(NR, nc - jr));
              run_tile(ir, jr, mc, nullptr, 0, MR);
            }
        } else {
          // A B packed a micro-panel at a time: each row tile also asks for its share of the next
          // panel's source, so that the pack reads it from L2 rather than memory. Measured on Zen 4
          // (processes alternating, 8 rounds, median of the paired ratios): dX 128x2048->1000 (W's
          // 8 MiB copied into panels on every call) 0.960 and 0.968 of the time on 1 thread, 1.006 on
          // 2; the MLP's products within 1%.
          const bool prefetch_next_b = pack_b_per_panel && !read_b_in_place && (b_cs == 1 || b_rs == 1);
          // copy_b_in_tiles: only whole panels whose first tile has all MR rows; the others are packed.
          const bool copy_in_first_tiles = copy_b_in_tiles && packs_b && mc >= MR;
          const int64_t row_tiles = (mc + MR - 1) / MR;
          for (int64_t jr = 0; jr < nc; jr += NR) {
            b_panel(jr, std::min(NR, nc - jr), copy_in_first_tiles && nc - jr >= NR);
            // The panel packed after this one: the next in this K block; after the last, the first of
            // the next K block; after the slab's last, the first of the columns after it
            // (prefetch_columns_after: the next chunk of a ColumnChunks). The last two, measured on
            // Zen 4 (2 threads, dX 128x2048->1000, W's 8 MiB copied into panels on every call, one
            // panel a chunk): see ext/README.md, "The next panel's source, across chunks".
            const T* next_b = b_block + (jr + NR) * b_cs;
            int64_t next_cols = std::min(NR, nc - jr - NR), next_kc = kc;
            if (next_cols <= 0 && pc + kc < K) {
              next_b = B + (pc + kc) * b_rs + jc * b_cs;
              next_cols = std::min(NR, nc);
              next_kc = std::min(KC, K - pc - kc);
            } else if (next_cols <= 0 && jc + nc == n1 && prefetch_columns_after > 0) {
              next_b = B + n1 * b_cs;
              next_cols = std::min(NR, prefetch_columns_after);
              next_kc = std::min(KC, K);
            }
            const int64_t next_runs = !prefetch_next_b || next_cols <= 0 ? 0 : b_cs == 1 ? next_kc : next_cols;
            // A one-vector panel (the last 16 columns of N = 256 or 784, or a narrow product) with A read
            // in place runs two row tiles at a time (Microkernel::tall_one_vector_tile): 2 MR sums, where
            // MR (8) keep two 512-bit FMAs a cycle of 4 cycles' latency busy only with no gap at all (alone
            // on Zen 5, bench.ceiling: 8x16 84-85% of peak, 16x16 89-91%). Measured on Zen 5 (processes
            // alternating, 6 rounds, median of the paired ratios of the time, new / old, 1 thread and 2):
            // forward 128x256->10 0.940 and 0.936, 128x512->10 0.931 and 0.930, 128x784->256 0.999 and
            // 0.991, 128x256->256 0.993 (1 thread; on 2 each thread's 128 columns have no such panel);
            // dX 128x784->256 0.992 and 0.979; after the many-rows tile (12x16), 1 thread: dX 512x784->256
            // 0.991, forward 512x256->10 0.943; the AVX2 path (forced, 1 thread) 0.997-1.015.
            const bool tall_one_vector = read_a_in_place && tile.cols <= uk.lanes && !row_bias && !indexed_b &&
                                         !tile.b_copy;
            for (int64_t ir = 0, rows; ir < mc; ir += rows) {
              rows = tall_one_vector && ir + uk.tall_one_vector_rows <= mc ? uk.tall_one_vector_rows : MR;
              if (next_runs > 0) {  // this tile's share: its row tiles' of row_tiles
                const int64_t t0 = ir / MR, t1 = std::min(row_tiles, (ir + rows + MR - 1) / MR);
                prefetch_b_runs(next_b, b_rs, b_cs, next_kc, next_cols, next_runs * t0 / row_tiles,
                                next_runs * t1 / row_tiles);
              }
              // Only tiles that load C (accumulate) prefetch the next one. A
              // first K block only stores C, and with a row stride of whole
              // 4 KiB pages the prefetched rows all fill the same L1 sets as
              // the B micro-panel. Measured (1 thread, interleaved with torch):
              // dW 128x2048->1000 (ldc 8 KiB, K = 128) 3153 -> 2944 us (torch
              // 2794-2799), 1024^3 unchanged or a little faster (dX 11768 ->
              // 11653 us), dW 128x784->256 and dX 128x784->256 unchanged.
              const T* next_c = ir + rows < mc && tile.accumulate ? C + (ic + ir + rows) * ldc + jc + jr : nullptr;
              run_tile(ir, jr, mc, next_c, std::min(rows, mc - ir - rows), rows);
              if (tile.b_copy) {  // the panel is packed now: the other row tiles read it
                tile.b = packed_b_panel(jr);
                tile.b_k_stride = NR;
                tile.b_copy = nullptr;
              }
            }
          }
        }
      }
    }
  }
}

// C = bias (or 0), then relu: what the product is when K == 0.
template <typename T>
void fill_bias(int64_t M, int64_t N, const T* bias, bool relu, T* C, int64_t ldc) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const T value = bias ? bias[n] : T(0);
      C[m * ldc + n] = relu ? std::max(value, T(0)) : value;
    }
}

}  // namespace

bool cpu_supports(CpuPath path) {
  __builtin_cpu_init();  // we may run from a static initializer, before libgcc's own
  switch (path) {
    case CpuPath::Avx512: return __builtin_cpu_supports("avx512f");
    case CpuPath::Avx2Fma: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuPath::Portable: return true;
  }
  return false;
}

CpuPath best_cpu_path() {
  for (CpuPath path : {CpuPath::Avx512, CpuPath::Avx2Fma})
    if (cpu_supports(path)) return path;
  return CpuPath::Portable;
}

CpuPath active_cpu_path() { return g_active_path; }

void set_cpu_path(CpuPath path) {
  if (!cpu_supports(path))
    throw std::runtime_error(std::string("this CPU cannot run the ") + cpu_path_name(path) + " path");
  g_active_path = path;
}

const char* cpu_path_name(CpuPath path) {
  switch (path) {
    case CpuPath::Avx512: return "avx512";
    case CpuPath::Avx2Fma: return "avx2+fma";
    case CpuPath::Portable: break;
  }
  return "portable";
}

std::optional<CpuPath> cpu_path_from_name(std::string_view name) {
  for (CpuPath path : {CpuPath::Portable, CpuPath::Avx2Fma, CpuPath::Avx512})
    if (name == cpu_path_name(path)) return path;
  return std::nullopt;
}

// C = A·B computed as Cᵀ = Bᵀ·Aᵀ: Bᵀ's rows read in place, Aᵀ packed (transposed), Cᵀ written
// into a buffer and transposed into C (see computes_transposed). Threads take rows of Cᵀ.
template <typename T>
void gemm_transposed(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_rs, const T* B, int64_t b_cs,
                     const T* bias, bool relu, T* C, int64_t ldc, int64_t threads) {
  const Microkernel<T>& uk = microkernel_for<T>(N, M);
  T* c_transposed = t_transposed_c.get<T>(N * M);
  const int64_t MC = block_rows(g_active_path), single_bytes = single_block_bytes(g_active_path);
  const int64_t panels = (N + uk.mr - 1) / uk.mr, slabs = std::min(threads, panels);
  at::parallel_for(0, slabs, 1, [&](int64_t first, int64_t last) {
    for (int64_t slab = first; slab < last; ++slab) {
      const int64_t n0 = panels * slab / slabs * uk.mr, n1 = std::min(N, panels * (slab + 1) / slabs * uk.mr);
      gemm_slab<T>(uk, MC, single_bytes, n0, n1, 0, M, K, B, b_cs, 1, A, 1, a_rs, nullptr, relu, c_transposed, M,
                   false, nullptr, nullptr, nullptr, bias);
      microkernels<T>(g_active_path).transpose(c_transposed + n0 * M, M, n1 - n0, M, C + n0, ldc);
    }
  });
}

// gemm, whose slab, where it is one, may prefetch B's `prefetch_columns_after` columns after N
// (ColumnChunks: its next chunk's).
template <typename T>
void gemm_prefetching(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_rs, int64_t a_cs, const T* B,
                      int64_t b_rs, int64_t b_cs, const T* bias, bool relu, T* C, int64_t ldc, bool accumulate,
                      int64_t prefetch_columns_after) {
  if (M == 0 || N == 0) return;
  if (accumulate && bias) throw std::logic_error("ext::cpu::gemm: accumulate takes no bias");
  if (K == 0) return accumulate ? void() : fill_bias(M, N, bias, relu, C, ldc);
  const Microkernel<T>& uk = microkernel_for<T>(M, N);
  const int64_t MC = block_rows(g_active_path), single_bytes = single_block_bytes(g_active_path);
  const int64_t m_panels = (M + uk.mr - 1) / uk.mr, n_panels = (N + uk.nr - 1) / uk.nr;
  // Threads are torch's intra-op threads: at::parallel_for is OpenMP here (the build
  // passes -fopenmp), the pool and thread count (torch.set_num_threads) of torch's own
  // kernels. Small products, and calls from inside another parallel region (no nested
  // oversubscription), stay on the calling thread.
  const bool small = 2.0 * M * N * K < kParallelMinFlops;
  const int64_t threads = small || at::in_parallel_region() ? 1 : at::get_num_threads();
  if (!accumulate && computes_transposed<T>(M, N, K, a_cs, b_rs))
    return gemm_transposed(M, N, K, A, a_rs, B, b_cs, bias, relu, C, ldc, threads);
  // Split the wider side: each slab re-packs the other operand's part, so split
  // where that part is smaller (A is M x K, B is K x N) while every slab has a panel.
  // An A read in place is never packed, so then the columns are split whatever the
  // shape: in row slabs each thread would pack all of B. Measured
  // here (2 threads, forward, single calls alternating with the row split, median of
  // the paired ratios): 512x784->256 0.973 (fwd+bwd 0.986), 256x784->128 0.973,
  // 1024x784->256 0.977, 2048x512->512 0.985, 512x256->256 0.998.
  const bool read_a_in_place = reads_a_in_place(a_cs);
  // A small product (under kWholeSlabsMaxFlops) whose A and B are both read in place, and whose B
  // is small enough for its row tiles to run outermost (dX of a 10-class head, K = 10), is split
  // by rows: nothing is packed either way, and each thread writes rows of C of its own. So is a
  // shallow one whose rows per thread read B in place: its row panels span all the columns
  // (kMaxShallowDepth). Where B is packed (dX 128x2048->10: W's rows 8 KiB apart), each row
  // slab would pack all of it: 1.2x slower on 2 threads than column slabs.
  const bool whole_slabs = 2.0 * M * N * K < kWholeSlabsMaxFlops;
  const int64_t b_bytes = K * N * static_cast<int64_t>(sizeof(T));
  const bool shallow_rows =
      K <= kMaxShallowDepth && slab_reads_b_in_place<T>((M + threads - 1) / threads, K, N, b_rs, b_cs);
  const bool rows_unpacked = read_a_in_place && b_cs == 1 && m_panels >= threads &&
                             ((whole_slabs && b_bytes <= rows_outer_max_b_bytes()) || shallow_rows);
  // A packed (dW's dYᵀ) and a B that row slabs read in place (at most kMaxRowsForBInPlace rows each,
  // B's block within half of L2) are split by rows: each row slab packs only its own rows of A and
  // nothing of B, where each column slab packed all of A (and, its rows several blocks, shared no
  // panels). Measured on Zen 5 (2 threads, processes alternating, 5 rounds, medians new / old, best
  // rounds in brackets): dW 128x256->256 0.91 (0.92), 128x784->256 0.86 (0.985), 512x256->256 0.94 (0.97).
  const bool rows_pack_less = !read_a_in_place && m_panels >= threads &&
                              slab_reads_b_in_place<T>((m_panels + threads - 1) / threads * uk.mr, K, N, b_rs, b_cs);
  const bool split_columns = !rows_unpacked && !rows_pack_less && n_panels >= threads &&
                             (M <= N || m_panels < threads || read_a_in_place);
  const int64_t slabs = std::min(threads, split_columns ? n_panels : m_panels);
  if (slabs == 1)
    return gemm_slab<T>(uk, MC, single_bytes, 0, M, 0, N, K, A, a_rs, a_cs, B, b_rs, b_cs, bias, relu, C, ldc,
                        accumulate, nullptr, nullptr, nullptr, nullptr, prefetch_columns_after);
  if (!split_columns) {
    at::parallel_for(0, slabs, 1, [&](int64_t first, int64_t last) {
      for (int64_t slab = first; slab < last; ++slab)
        gemm_slab(uk, MC, single_bytes, m_panels * slab / slabs * uk.mr,
                  std::min(M, m_panels * (slab + 1) / slabs * uk.mr), 0, N, K, A, a_rs, a_cs, B, b_rs, b_cs, bias,
                  relu, C, ldc, accumulate);
    });
    return;
  }
  // Column slabs are cut at whole vectors rather than whole NR panels: a slab's
  // ragged last panel runs only the vectors it has, and with NR = 48 or 64,
  // whole panels split unevenly (N = 1000 in 48s: 480 + 520 columns; in
  // vectors of 16, 496 + 504). Each thread computes its slab a column panel at a
  // time, then takes the panels still left in the others: on a shared machine one
  // core may run slower for a while, and the other then finishes its slab rather
  // than wait (where ColumnChunks cuts a slab: not when its rows make several blocks, unless A
  // is read in place and takes under half of L2).
  // Measured (2 threads, forward, single calls alternating with whole slabs, median of
  // the paired ratios, while one vCPU ran slow): 128x256->256 0.880, 128x2048->1000
  // 0.964, 128x784->256 0.995, 512x256->256 1.004; with the machine quiet,
  // 128x256->256 1.003, 512x256->256 1.001.
  const int64_t vectors = (N + uk.lanes - 1) / uk.lanes;
  auto slab_first_column = [&](int64_t slab) { return std::min(N, vectors * slab / slabs * uk.lanes); };
  if (whole_slabs && !read_a_in_place) {  // whole slabs, no panels to take (kWholeSlabsMaxFlops): dW of a head
    at::parallel_for(0, slabs, 1, [&](int64_t first, int64_t last) {
      for (int64_t slab = first; slab < last; ++slab) {
        const int64_t n0 = slab_first_column(slab), n1 = slab_first_column(slab + 1);
        gemm<T>(M, n1 - n0, K, A, a_rs, a_cs, B + n0 * b_cs, b_rs, b_cs, bias ? bias + n0 : nullptr, relu, C + n0, ldc,
                accumulate);
      }
    });
    return;
  }
  std::deque<ColumnChunks<T>> slab_panels;  // a deque: ColumnChunks cannot move
  for (int64_t slab = 0; slab < slabs; ++slab) {
    const int64_t n0 = slab_first_column(slab), n1 = slab_first_column(slab + 1);
    slab_panels.emplace_back(M, n1 - n0, K, A, a_rs, a_cs, B + n0 * b_cs, b_rs, b_cs, bias ? bias + n0 : nullptr, relu,
                             C + n0, ldc, 1, accumulate);
  }
  at::parallel_for(0, slabs, 1, [&](int64_t first, int64_t last) {
    for (int64_t slab = first; slab < last; ++slab)
      for (int64_t i = 0; i < slabs; ++i) slab_panels[(slab + i) % slabs].run();
  });
}

template <typename T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_rs, int64_t a_cs, const T* B, int64_t b_rs,
          int64_t b_cs, const T* bias, bool relu, T* C, int64_t ldc, bool accumulate) {
  gemm_prefetching(M, N, K, A, a_rs, a_cs, B, b_rs, b_cs, bias, relu, C, ldc, accumulate, 0);
}

template <typename T>
int64_t k_block_depth(int64_t K) {
  return K <= kMaxSingleKBlock<T> ? K : kKC<T>;
}

template <typename T>
bool k_is_one_block(int64_t K) {
  return k_block_depth<T>(K) >= K;
}

template <typename T>
int64_t packed_b_panel_width(int64_t M, int64_t N) {
  return microkernel_for<T>(M, N).nr;
}

template <typename T>
void gemm_packed_b(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_rs, int64_t a_cs, const T* packed_b, T* C,
                   int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0 || (K == 0 && accumulate)) return;
  if (K == 0) return fill_bias<T>(M, N, nullptr, false, C, ldc);
  if (!k_is_one_block<T>(K) || N > kNC)
    throw std::logic_error("ext::cpu::gemm_packed_b: B must be one packed block (K <= one K block, N <= NC)");
  gemm_slab<T>(microkernel_for<T>(M, N), block_rows(g_active_path), single_block_bytes(g_active_path), 0, M, 0, N, K,
               A, a_rs, a_cs, nullptr, 0, 0, nullptr, false, C, ldc, accumulate, nullptr, packed_b);
}

template <typename T>
void gemm_indexed_b(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_rs, int64_t a_cs, const IndexedB<T>& b,
                    T* C, int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0 || (K == 0 && accumulate)) return;
  if (K == 0) return fill_bias<T>(M, N, nullptr, false, C, ldc);
  const Microkernel<T>& uk = microkernel_for<T>(M, N);
  if (!k_is_one_block<T>(K) || N > kNC || N % uk.lanes != 0)
    throw std::logic_error("ext::cpu::gemm_indexed_b: K must be one K block, N at most NC and whole vectors");
  gemm_slab<T>(uk, block_rows(g_active_path), single_block_bytes(g_active_path), 0, M, 0, N, K, A, a_rs, a_cs,
               nullptr, 0, 0, nullptr, false, C, ldc, accumulate, nullptr, nullptr, &b);
}

template <typename T>
ColumnChunks<T>::ColumnChunks(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_row_stride,
                              int64_t a_col_stride, const T* B, int64_t b_row_stride, int64_t b_col_stride,
                              const T* bias, bool relu, T* C, int64_t ldc, int64_t panels_per_chunk,
                              bool accumulate)
    : M_(M), N_(N), K_(K), A_(A), a_rs_(a_row_stride), a_cs_(a_col_stride), B_(B), b_rs_(b_row_stride),
      b_cs_(b_col_stride), bias_(bias), relu_(relu), C_(C), accumulate_(accumulate), ldc_(ldc) {
  // One chunk when A's rows make more than one block of gemm_slab (each chunk would run the
  // row blocks again, and re-read or re-pack all of A), when a packed A is deeper than one K
  // block (each chunk would pack it again), and when gemm_slab writes C row after row (chunks
  // would cut the rows into strips again). An A read in place that takes under half of L2 is
  // cut all the same: each chunk re-reads it from L2, which costs nothing a panel of B does not
  // already pay. Measured on Zen 5 (2 threads, processes alternating, 6 rounds, new / old time):
  // forward 128x784->256 (A 392 KiB, 120 + 8 rows) 0.97-1.00, its 12% of samples in libgomp's
  // waits with each thread's 128 columns one chunk; 200x600->300 0.99-1.00; at half of L2
  // (512x256->256, forward and dX) 1.00-1.01 slower, hence under half.
  const bool packs_a = !reads_a_in_place(a_col_stride);
  const int64_t KC = k_block_depth<T>(K);
  const bool rows_are_one_block = M <= block_rows(g_active_path) ||
                                  M * KC * static_cast<int64_t>(sizeof(T)) <= single_block_bytes(g_active_path);
  const bool a_is_one_block = rows_are_one_block && K > 0 && k_is_one_block<T>(K);
  const bool a_in_place_within_l2 = !packs_a && M * K * static_cast<int64_t>(sizeof(T)) < caches().l2_bytes / 2;
  const bool one_chunk = panels_per_chunk <= 0 || (!rows_are_one_block && !a_in_place_within_l2) ||
                         (packs_a && !a_is_one_block) || c_rows_are_pages_apart<T>(M, ldc);
  chunk_columns_ = one_chunk ? std::max<int64_t>(N, 1) : panels_per_chunk * microkernel_for<T>(M, N).nr;
  chunks_ = M > 0 && N > 0 ? (N + chunk_columns_ - 1) / chunk_columns_ : 0;
  share_packed_a_ = packs_a && chunks_ > 1;
  if (share_packed_a_) {  // sized here, on the calling thread, so that no chunk waits on a failed allocation
    const int64_t mr = microkernel_for<T>(M, N).mr;
    shared_pack_slot_ = t_shared_packs.lease();
    try {
      packed_a_ = t_shared_packs.get<T>(shared_pack_slot_, (M + mr - 1) / mr * mr * K);
    } catch (...) {
      t_shared_packs.release(shared_pack_slot_);
      throw;
    }
  }
}

template <typename T>
void ColumnChunks<T>::run() {
  for (int64_t chunk; (chunk = next_chunk_.fetch_add(1)) < chunks_;) {
    const int64_t n0 = chunk * chunk_columns_, n1 = std::min(N_, n0 + chunk_columns_);
    const int64_t next_chunk_columns = std::min(chunk_columns_, N_ - n1);  // most likely this thread's next
    if (share_packed_a_) {
      // The tile of the whole product, so that A's panels are those packed for it.
      gemm_slab<T>(microkernel_for<T>(M_, N_), block_rows(g_active_path), single_block_bytes(g_active_path), 0, M_,
                   n0, n1, K_, A_, a_rs_, a_cs_, B_, b_rs_, b_cs_, bias_, relu_, C_, ldc_, accumulate_, packed_a(),
                   nullptr, nullptr, nullptr, next_chunk_columns);
    } else {
      gemm_prefetching<T>(M_, n1 - n0, K_, A_, a_rs_, a_cs_, B_ + n0 * b_cs_, b_rs_, b_cs_,
                          bias_ ? bias_ + n0 : nullptr, relu_, C_ + n0, ldc_, accumulate_, next_chunk_columns);
    }
  }
}

template <typename T>
ColumnChunks<T>::~ColumnChunks() {
  if (shared_pack_slot_ >= 0) t_shared_packs.release(shared_pack_slot_);
}

// A's panels, packed by the first thread that asks; others wait the few microseconds it takes.
// pack_a only copies into the buffer sized by the constructor and cannot throw, so a
// claimed pack always reaches kPacked and no waiter spins forever.
template <typename T>
const T* ColumnChunks<T>::packed_a() {
  int state = kUnpacked;
  if (pack_state_.compare_exchange_strong(state, kPacking, std::memory_order_acquire)) {
    pack_a(microkernel_for<T>(M_, N_), A_, a_rs_, a_cs_, M_, K_, packed_a_);
    pack_state_.store(kPacked, std::memory_order_release);
  }
  while (pack_state_.load(std::memory_order_acquire) != kPacked) std::this_thread::yield();
  return packed_a_;
}

template class ColumnChunks<float>;
template class ColumnChunks<double>;

// Column sums (sum_rows, relu_backward_sum_rows) split over threads by columns, so each
// column's sum keeps its order; under 64k values they stay on one thread.
static int64_t column_sum_grain(int64_t M, int64_t N) {
  constexpr int64_t kColumnsPerTask = 1024;
  return M * N < 65536 ? N : kColumnsPerTask;
}

// Adds the rows of A into out. Along contiguous rows the path's vector kernel
// sums blocks of columns held in registers; otherwise each column is a
// contiguous run summed in place. Either way each out[n] adds its M values in
// row order, independent of threads.
template <typename T>
void sum_rows(int64_t M, int64_t N, const T* A, int64_t a_rs, int64_t a_cs, T* out) {
  at::parallel_for(0, N, column_sum_grain(M, N), [&](int64_t n0, int64_t n1) {
    if (a_cs == 1) {
      microkernels<T>(g_active_path).sum_rows(A + n0, a_rs, M, n1 - n0, out + n0);
    } else {
      for (int64_t n = n0; n < n1; ++n) {
        T sum = 0;
        for (int64_t m = 0; m < M; ++m) sum += A[m * a_rs + n * a_cs];
        out[n] = sum;
      }
    }
  });
}

template <typename T>
void relu_backward_sum_rows(int64_t M, int64_t N, const T* dy, int64_t dy_rs, const T* output, int64_t output_rs,
                            T* masked, T* sums) {
  at::parallel_for(0, N, column_sum_grain(M, N), [&](int64_t n0, int64_t n1) {
    microkernels<T>(g_active_path)
        .relu_backward_sum_rows(dy + n0, dy_rs, output + n0, output_rs, M, n1 - n0, masked + n0, N,
                                sums ? sums + n0 : nullptr);
  });
}

template <typename T>
BlockSizes block_sizes(CpuPath path) {
  const Microkernels<T>& k = microkernels<T>(path);
  return {k.wide.mr,     k.wide.nr,          k.narrow.mr,     k.narrow.nr,
          k.many_rows.mr, k.many_rows.nr,    k.tall.mr,       k.tall.nr,
          k.wide.tall_one_vector_rows, k.narrow.tall_one_vector_rows,           k.wide.lanes,    kKC<T>,
          kMaxSingleKBlock<T>, block_rows(path), kNC,          single_block_bytes(path),
          kManyRowsMinRows, kMaxRowsForBInPlace, rows_outer_max_b_bytes(), transposed_min_rows<T>(path),
          kTransposedCCost, kMaxShallowDepth, k.wide.shallow_rows, k.wide.shallow_nr, fmas_per_cycle(path),
          caches().l2_bytes,  caches().l1d_bytes};
}
template BlockSizes block_sizes<float>(CpuPath);

PackedValues packed_values() {
  return {g_packed_a_values.load(std::memory_order_relaxed), g_packed_b_values.load(std::memory_order_relaxed)};
}

double measure_tile_gflops(std::string_view tile_name, int64_t vectors, int64_t kc, int64_t num_threads) {
  const Microkernels<float>& kernels = microkernels<float>(g_active_path);
  // "one_vector": the wide tile's two row tiles at a time on a one-vector panel (tall_one_vector_tile).
  const bool one_vector = tile_name == "one_vector";
  const Microkernel<float>* uk = tile_name == "wide" || one_vector ? &kernels.wide
                                 : tile_name == "narrow"           ? &kernels.narrow
                                 : tile_name == "many_rows"        ? &kernels.many_rows
                                 : tile_name == "tall"             ? &kernels.tall
                                                                   : nullptr;
  if (!uk) throw std::invalid_argument("tile must be 'wide', 'narrow', 'many_rows', 'tall' or 'one_vector'");
  const int64_t max_vectors = one_vector ? 1 : uk->nr / uk->lanes;
  if (vectors < 1 || vectors > max_vectors)
    throw std::invalid_argument("vectors must be 1 to " + std::to_string(max_vectors) + " for this tile");
  if (kc < 1 || kc > 4096) throw std::invalid_argument("kc must be 1 to 4096");
  if (num_threads < 1 || num_threads > 256) throw std::invalid_argument("num_threads must be 1 to 256");
  constexpr int64_t kRows = 128, kPanels = 6, kTrials = 7;
  const int64_t tile_rows = one_vector ? uk->tall_one_vector_rows : uk->mr;
  const int64_t row_tiles = kRows / tile_rows, rows = row_tiles * tile_rows, ldc = kPanels * uk->nr;
  // 64-byte aligned, as torch's tensors and gemm's packed panels are: C's rows start a cache line
  // (a std::vector's 147 KiB C started 16 bytes into one, and the tile read 3% slower at kc = 10).
  struct Operands {
    PackBuffer a_buffer, b_buffer, c_buffer;
    float *a, *b, *c;
  };
  std::deque<Operands> operands(num_threads);  // a deque: PackBuffer does not move
  for (Operands& o : operands) {  // values that neither vanish to denormals nor overflow over kc terms
    const int64_t a_count = rows * kc, b_count = kPanels * kc * uk->nr, c_count = rows * ldc;
    o.a = o.a_buffer.get<float>(a_count);
    o.b = o.b_buffer.get<float>(b_count);
    o.c = o.c_buffer.get<float>(c_count);
    std::fill_n(o.a, a_count, 1e-3f);
    std::fill_n(o.b, b_count, 1e-3f);
    std::fill_n(o.c, c_count, 0.0f);
  }
  const auto tile = one_vector ? uk->tall_one_vector_tile : uk->tile_unit_k_stride(uk->mr, vectors * uk->lanes);
  auto passes = [&](Operands& o, int64_t count) {  // gemm_slab's loop over one K block of a forward
    TileArgs<float> t{};
    t.kc = kc;
    t.a_row_stride = kc;
    t.a_k_stride = 1;
    t.b_k_stride = uk->nr;
    t.ldc = ldc;
    t.rows = tile_rows;
    t.cols = vectors * uk->lanes;
    for (int64_t pass = 0; pass < count; ++pass)
      for (int64_t panel = 0; panel < kPanels; ++panel) {
        t.b = o.b + panel * kc * uk->nr;
        for (int64_t row_tile = 0; row_tile < row_tiles; ++row_tile) {
          t.a = o.a + row_tile * tile_rows * kc;
          t.c = o.c + row_tile * tile_rows * ldc + panel * uk->nr;
          tile(t);
        }
      }
  };
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  passes(operands[0], 1);  // warm-up, and a pass's time: each trial takes about 20 ms
  const double pass_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const int64_t count = std::max<int64_t>(1, static_cast<int64_t>(0.02 / std::max(pass_seconds, 1e-9)));
  const double flops = 2.0 * rows * vectors * uk->lanes * kc * kPanels * count * num_threads;
  double best_gflops = 0.0;
  for (int64_t trial = 0; trial < kTrials; ++trial) {
    const auto trial_start = Clock::now();
    run_on_threads(num_threads, [&](int64_t i) { passes(operands[i], count); });
    const double seconds = std::chrono::duration<double>(Clock::now() - trial_start).count();
    best_gflops = std::max(best_gflops, flops / seconds / 1e9);
  }
  return best_gflops;
}
template BlockSizes block_sizes<double>(CpuPath);

template void gemm<float>(int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                          const float*, int64_t, int64_t, const float*, bool, float*, int64_t, bool);
template void gemm<double>(int64_t, int64_t, int64_t, const double*, int64_t, int64_t,
                           const double*, int64_t, int64_t, const double*, bool, double*, int64_t, bool);
template int64_t packed_b_panel_width<float>(int64_t, int64_t);
template int64_t packed_b_panel_width<double>(int64_t, int64_t);
template int64_t k_block_depth<float>(int64_t);
template int64_t k_block_depth<double>(int64_t);
template bool k_is_one_block<float>(int64_t);
template bool k_is_one_block<double>(int64_t);
template void gemm_packed_b<float>(int64_t, int64_t, int64_t, const float*, int64_t, int64_t, const float*, float*,
                                   int64_t, bool);
template void gemm_packed_b<double>(int64_t, int64_t, int64_t, const double*, int64_t, int64_t, const double*,
                                    double*, int64_t, bool);
template void gemm_indexed_b<float>(int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                                    const IndexedB<float>&, float*, int64_t, bool);
template void gemm_indexed_b<double>(int64_t, int64_t, int64_t, const double*, int64_t, int64_t,
                                     const IndexedB<double>&, double*, int64_t, bool);
template void sum_rows<float>(int64_t, int64_t, const float*, int64_t, int64_t, float*);
template void sum_rows<double>(int64_t, int64_t, const double*, int64_t, int64_t, double*);
template void relu_backward_sum_rows<float>(int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*,
                                            float*);
template void relu_backward_sum_rows<double>(int64_t, int64_t, const double*, int64_t, const double*, int64_t,
                                             double*, double*);

}  // namespace ext::cpu
