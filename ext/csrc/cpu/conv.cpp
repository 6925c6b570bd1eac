// Convolution as implicit GEMM: im2col one chunk of output pixels at a time, straight into
// the operand a single-threaded cpu::gemm reads (see conv.h for the three products).
#include "conv.h"

#include "gemm.h"
#include "pack_buffer.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace ext::cpu {

namespace {

// Most pixels in one chunk: more only grows the buffers (a 3-channel stem's patch of 27
// values would otherwise ask for 9000-pixel chunks), not the GEMM's speed.
constexpr int64_t kMaxChunkPixels = 1024;
// dW's threads split its columns in pieces of at least this many (a vector of floats).
constexpr int64_t kWeightColumnsGrain = 16;

// A run of output pixels q0 .. q0 + count - 1, numbered q = n·OH·OW + oh·OW + ow.
struct Chunk {
  int64_t q0, count;
};

// How a call walks the output pixels. When an image holds at least half a chunk, chunks stay
// within one image, so an image's output and dY (K x OH·OW, row stride OH·OW) are GEMM
// operands as they lie. Smaller images (the 4x4 and 8x8 maps of a CIFAR ResNet's last
// stages) share chunks: the forward computes each into a buffer and copies it out, the
// backward stages dY as one K x (N·OH·OW) matrix.
struct ChunkPlan {
  bool per_image;
  std::vector<Chunk> chunks;
  // The forward's threads take parts: chunks part_starts[i] .. part_starts[i + 1] - 1.
  std::vector<size_t> part_starts;
};

// With `threads`, shared chunks are cut from `threads` equal parts of the pixels, each in whole
// column panels of the GEMM's tile but its last chunk, so that the forward's threads get the same
// work (8192 pixels of 8x8 images in 480s would give one thread 9 chunks, the other 8 and 32
// pixels). The forward's sums do not cross chunks, so this changes no result; dX and dW, whose sums
// do, keep the plan of one thread.
template <typename T>
ChunkPlan plan_chunks(const ConvGeometry& g, int64_t threads = 1, int64_t panel = 0) {
  if (panel == 0) panel = block_sizes<T>(active_cpu_path()).wide_nr;
  const int64_t hw = g.out_pixels_per_image(), total = g.batch * hw;
  // An image up to a quarter larger than a chunk is one chunk: 16x16 images in chunks of 240
  // pixels (a 3x3 kernel over 128 channels) left every image a 16-pixel chunk, a GEMM of one
  // narrow panel, and the direct gather (gathers_padded).
  const int64_t limit = chunk_pixels<T>(g.patch(), panel);
  const int64_t chunk = hw > limit && hw <= limit + limit / 4 ? hw : limit;
  ChunkPlan plan{2 * hw >= chunk, {}, {}};
  if (plan.per_image) {
    for (int64_t n = 0; n < g.batch; ++n)
      for (int64_t p0 = 0; p0 < hw; p0 += chunk) {
        plan.part_starts.push_back(plan.chunks.size());
        plan.chunks.push_back({n * hw + p0, std::min(chunk, hw - p0)});
      }
  } else {
    const int64_t parts = std::max<int64_t>(1, std::min(threads, total / panel));
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t begin = total * part / parts / panel * panel;
      const int64_t end = part + 1 == parts ? total : total * (part + 1) / parts / panel * panel;
      // Chunks of about equal size in whole panels, rather than full ones and a short last one
      // (1024 pixels as 384 + 384 + 256, not 480 + 480 + 64).
      plan.part_starts.push_back(plan.chunks.size());
      if (end == begin) continue;  // no pixels (a batch of 0)
      const int64_t count = (end - begin + chunk - 1) / chunk;
      const int64_t size = ((end - begin + count - 1) / count + panel - 1) / panel * panel;
      for (int64_t q = begin; q < end; q += size) plan.chunks.push_back({q, std::min(size, end - q)});
    }
  }
  plan.part_starts.push_back(plan.chunks.size());
  return plan;
}

thread_local PackBuffer t_columns, t_outputs;  // im2col (or dcol) and output buffers, per thread

// Row strides of whole 4 KiB pages put every row of a GEMM tile in the same few L1 sets (the
// rows of a 32x32 image's channels are 4 KiB apart). Buffers the kernels lay out themselves
// get rows 64 bytes longer instead.
template <typename T>
bool page_multiple(int64_t row_stride) {
  return row_stride * static_cast<int64_t>(sizeof(T)) % 4096 == 0;
}

template <typename T>
int64_t padded_stride(int64_t count) {
  const int64_t lanes = 64 / static_cast<int64_t>(sizeof(T));
  const int64_t rounded = (count + lanes - 1) / lanes * lanes;
  return page_multiple<T>(rounded) ? rounded + lanes : rounded;
}

template <typename T>
std::unique_ptr<T[]> uninitialized(int64_t count) {
  return std::unique_ptr<T[]>(new T[static_cast<size_t>(count)]);
}

// ceil(a / b) for b > 0 and any a.
inline int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }

// A run of a chunk's pixels along one output row: pixels (n, oh, ow0 .. ow1 - 1), the j-th ..
// of the chunk. A chunk's runs are listed once, then walked for each patch element.
struct RowRun {
  int64_t n, oh, ow0, ow1, j;
};

// Runs also end at every multiple of panel_width pixels (0: no limit), so that none crosses a
// packed panel of GEMM's B.
void list_row_runs(const ConvGeometry& g, Chunk chunk, std::vector<RowRun>& runs, int64_t panel_width = 0) {
  runs.clear();
  const int64_t hw = g.out_pixels_per_image(), end = chunk.q0 + chunk.count;
  for (int64_t q = chunk.q0; q < end;) {
    const int64_t n = q / hw, p = q % hw, oh = p / g.out_w, ow0 = p % g.out_w, j = q - chunk.q0;
    const int64_t run_end = panel_width ? std::min(end, chunk.q0 + (j / panel_width + 1) * panel_width) : end;
    const int64_t ow1 = std::min(g.out_w, ow0 + (run_end - q));
    runs.push_back({n, oh, ow0, ow1, j});
    q += ow1 - ow0;
  }
}

thread_local std::vector<RowRun> t_runs;

// Where patch element kk = (c, r, s) reads: input row ih = oh·stride_h + row_offset, column
// iw = ow·stride_w + column_offset, inside the input for output columns [ow_lo, ow_hi) and rows
// [oh_lo, oh_hi).
struct PatchElement {
  int64_t c, row_offset, column_offset, ow_lo, ow_hi, oh_lo, oh_hi;
  bool inside(int64_t oh, int64_t ow) const { return oh >= oh_lo && oh < oh_hi && ow >= ow_lo && ow < ow_hi; }
  int64_t outputs_inside() const { return (oh_hi - oh_lo) * (ow_hi - ow_lo); }
  // The input pixel (ih·W + iw) the element reads for output (oh, ow), which must be inside.
  int64_t input_pixel(const ConvGeometry& g, int64_t oh, int64_t ow) const {
    return (oh * g.stride_h + row_offset) * g.width + ow * g.stride_w + column_offset;
  }
};

inline PatchElement patch_element(const ConvGeometry& g, int64_t kk) {
  const int64_t rs = g.kernel_h * g.kernel_w;
  const int64_t c = kk / rs, r = kk % rs / g.kernel_w, s = kk % g.kernel_w;
  const int64_t row_offset = r * g.dilation_h - g.pad_top, column_offset = s * g.dilation_w - g.pad_left;
  const int64_t ow_lo = std::clamp<int64_t>(ceil_div(-column_offset, g.stride_w), 0, g.out_w);
  const int64_t ow_hi = std::clamp<int64_t>(ceil_div(g.width - column_offset, g.stride_w), ow_lo, g.out_w);
  const int64_t oh_lo = std::clamp<int64_t>(ceil_div(-row_offset, g.stride_h), 0, g.out_h);
  const int64_t oh_hi = std::clamp<int64_t>(ceil_div(g.height - row_offset, g.stride_h), oh_lo, g.out_h);
  return {c, row_offset, column_offset, ow_lo, ow_hi, oh_lo, oh_hi};
}

// The short runs of im2col and col2im (an 8x8 image's rows are 8 values) in whole vectors of
// fixed size, which compile to single vector instructions, where a memcpy or memset call or a loop
// of unknown length spent more on its setup than on the work (the gather took 30% of the forward's
// time beside the GEMM's 60% at 256 channels of 8x8). op(dst, src) is applied to n elements.
template <typename T, typename Op>
inline void for_run(T* __restrict dst, const T* __restrict src, int64_t n, Op op) {
  constexpr int64_t kVector = 64 / sizeof(T);
  for (; n >= kVector; n -= kVector, src += kVector, dst += kVector)
    for (int64_t i = 0; i < kVector; ++i) op(dst[i], src[i]);
  if (n >= kVector / 2) {
    for (int64_t i = 0; i < kVector / 2; ++i) op(dst[i], src[i]);
    n -= kVector / 2, src += kVector / 2, dst += kVector / 2;
  }
  for (int64_t i = 0; i < n; ++i) op(dst[i], src[i]);
}

template <typename T>
inline void copy_run(const T* src, T* dst, int64_t n) {
  for_run(dst, src, n, [](T& d, T s) { d = s; });
}

template <typename T>
inline void add_run(const T* src, T* dst, int64_t n) {
  for_run(dst, src, n, [](T& d, T s) { d += s; });
}

template <typename T>
inline void zero_run(T* dst, int64_t n) {
  static constexpr T kZeros[64 / sizeof(T)] = {};
  while (n > 0) {  // runs of padding are a few values: one or two steps
    const int64_t step = std::min<int64_t>(n, 64 / sizeof(T));
    for_run(dst, kZeros, step, [](T& d, T s) { d = s; });
    dst += step, n -= step;
  }
}

// Strided runs (a stride-2 1x1 downsample reads every other row, and every other value of it) left the
// hardware prefetcher behind: the gather asks for the input row of the run this many ahead while it
// copies the current one. Measured (64->128 1x1 stride 2 at 32x32, batch 128, ms, without -> with):
// forward 4.9-5.0 -> 3.3-3.8 on 2 threads, 9.4-9.7 -> 5.9-6.7 on 1; dW 6.6-6.7 -> 4.1-5.1 on 2. Runs
// read in order (stride 1) were slower with it: 1024->256 1x1 at 8x8, forward 12.8-12.9 -> 15.8-16.9.
// (Written out in the loop: moved into a helper function of its own, the prefetches were gone from
// the compiled code, GCC 12 at -O3.)
constexpr size_t kPrefetchRuns = 8;

// Rows kk0 .. kk1 - 1 of the chunk's im2col: the input under patch element kk at the chunk's
// j-th pixel (zero in the padding). Laid out as rows, col[(kk - kk0) · ldcol + j], or with
// panel_width as gemm's packed B (gemm.h: packed_b_panel_width), whose panels the runs must
// not cross (list_row_runs).
template <typename T>
void gather_columns(const ConvGeometry& g, const T* input, const std::vector<RowRun>& runs, int64_t kk0,
                    int64_t kk1, T* col, int64_t ldcol, int64_t panel_width = 0) {
  const int64_t depth = kk1 - kk0;
  const int64_t input_size = g.batch * g.in_channels * g.in_pixels_per_image();
  for (int64_t kk = kk0; kk < kk1; ++kk) {
    const PatchElement e = patch_element(g, kk);
    T* row = col + (kk - kk0) * (panel_width ? panel_width : ldcol);
    for (size_t i = 0; i < runs.size(); ++i) {
      const RowRun& run = runs[i];
      if (g.stride_w > 1) {
        const RowRun& ahead = runs[std::min(runs.size() - 1, i + kPrefetchRuns)];
        const int64_t ih = ahead.oh * g.stride_h + e.row_offset;
        if (ih >= 0 && ih < g.height) {
          const T* input_row = input + ((ahead.n * g.in_channels + e.c) * g.height + ih) * g.width;
          for (int64_t byte = 0; byte < g.width * static_cast<int64_t>(sizeof(T)); byte += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(input_row) + byte);
        }
      }
      const int64_t at = panel_width ? run.j / panel_width * depth * panel_width + run.j % panel_width : run.j;
      T* out = row + at - run.ow0;  // out[ow] for ow in [ow0, ow1)
      const int64_t ih = run.oh * g.stride_h + e.row_offset;
      if (ih < 0 || ih >= g.height) {
        zero_run(out + run.ow0, run.ow1 - run.ow0);
        continue;
      }
      const int64_t lo = std::clamp(e.ow_lo, run.ow0, run.ow1), hi = std::clamp(e.ow_hi, lo, run.ow1);
      const int64_t offset = ((run.n * g.in_channels + e.c) * g.height + ih) * g.width + e.column_offset;
      const T* in = input + offset;
      if (g.stride_w == 1 && lo < hi && offset + run.ow0 >= 0 && offset + run.ow1 <= input_size) {
        // The whole run in one copy, of whole vectors where a copy of [lo, hi) would end in scalar
        // steps; what it took from beyond the row's ends (the padding) is zeroed after.
        copy_run(in + run.ow0, out + run.ow0, run.ow1 - run.ow0);
        zero_run(out + run.ow0, lo - run.ow0);
        zero_run(out + hi, run.ow1 - hi);
        continue;
      }
      zero_run(out + run.ow0, lo - run.ow0);
      if (g.stride_w == 1) {
        copy_run(in + lo, out + lo, hi - lo);
      } else if (g.stride_w == 2) {  // ResNet's downsampling: a constant stride the compiler vectorizes
        for (int64_t ow = lo; ow < hi; ++ow) out[ow] = in[2 * ow];
      } else {
        for (int64_t ow = lo; ow < hi; ++ow) out[ow] = in[ow * g.stride_w];
      }
      zero_run(out + hi, run.ow1 - hi);
    }
  }
}

// The padded gather: the input rows a chunk reads (a K block's channels at a time) are first copied
// with their padding written out as zeros, and im2col is gathered from that copy one output row at
// a time, with no bounds to check: each patch element's run is a few whole vectors (one at 16x16).
// The direct gather (gather_columns) spent more on the bounds and the padding of each short run
// than on its copy: at 128 channels of 16x16 it took a fifth of the forward (perf, 1 thread,
// Zen 5). Used where the copy is no larger than the im2col it feeds (a dilated kernel over a tiny
// output would copy far more than it gathers) and the kernel reads each input more than once (a
// 1x1 kernel's gather is a copy already).
struct PaddedWindow {
  int64_t n0, n1;     // images
  int64_t row0, rows;  // padded rows row0 .. row0 + rows - 1 of each plane (padded row ph: input row ph - pad_top)
  int64_t width;      // padded columns (padded column pw: input column pw - pad_left)
  int64_t plane() const { return rows * width; }
};

inline int64_t padded_extent(int64_t out, int64_t stride, int64_t kernel, int64_t dilation) {
  return (out - 1) * stride + (kernel - 1) * dilation + 1;  // the input rows (columns) the output reads
}

// The padded rows a chunk reads: within one image, those under its output rows; across images, all.
PaddedWindow padded_window(const ConvGeometry& g, Chunk chunk) {
  const int64_t hw = g.out_pixels_per_image(), last = chunk.q0 + chunk.count - 1;
  const int64_t n0 = chunk.q0 / hw, n1 = last / hw + 1;
  const int64_t oh0 = n1 - n0 == 1 ? chunk.q0 % hw / g.out_w : 0;
  const int64_t oh1 = n1 - n0 == 1 ? last % hw / g.out_w + 1 : g.out_h;
  return {n0, n1, oh0 * g.stride_h, padded_extent(oh1 - oh0, g.stride_h, g.kernel_h, g.dilation_h),
          padded_extent(g.out_w, g.stride_w, g.kernel_w, g.dilation_w)};
}

bool gathers_padded(const ConvGeometry& g, Chunk chunk) {
  const int64_t rs = g.kernel_h * g.kernel_w;
  const PaddedWindow w = padded_window(g, chunk);
  return rs > 1 && (w.n1 - w.n0) * w.plane() <= rs * chunk.count;
}

// One row of a copy with its padding written out: out[lo .. hi) = from[0], from[stride], ..., the rest
// of its `width` values zero (all of them where from is null: a padding row). In whole vectors (copy_run,
// zero_run): rows of 16 values, each a memcpy and two memset calls, spent 1.4% of a ResNet-18 step in
// the calls.
template <typename T>
void copy_padded_row(const T* from, int64_t stride, int64_t lo, int64_t hi, int64_t width, T* out) {
  if (!from) return zero_run(out, width);
  zero_run(out, lo);
  if (stride == 1) {
    copy_run(from, out + lo, hi - lo);
  } else {
    for (int64_t j = lo; j < hi; ++j) out[j] = from[(j - lo) * stride];
  }
  zero_run(out + hi, width - hi);
}

// Channels c0 .. c1 - 1 of the window's images, each plane's window at
// out + ((n - n0)·(c1 - c0) + c - c0)·plane.
template <typename T>
void pad_planes(const ConvGeometry& g, const T* input, const PaddedWindow& w, int64_t c0, int64_t c1, T* out) {
  // Columns lo .. hi - 1 of a padded row hold input columns from lo - pad_left on.
  const int64_t lo = std::min(g.pad_left, w.width), hi = std::clamp(g.pad_left + g.width, lo, w.width);
  for (int64_t n = w.n0; n < w.n1; ++n)
    for (int64_t c = c0; c < c1; ++c) {
      const T* plane = input + (n * g.in_channels + c) * g.height * g.width;
      for (int64_t ph = w.row0; ph < w.row0 + w.rows; ++ph, out += w.width) {
        const int64_t ih = ph - g.pad_top;
        const bool inside = ih >= 0 && ih < g.height;
        copy_padded_row(inside ? plane + ih * g.width + lo - g.pad_left : nullptr, 1, lo, hi, w.width, out);
      }
    }
}

// One output row's run of a padded gather: read from src + (the patch element's offset), written
// to dst, `length` pixels.
struct PaddedRun {
  int64_t src, dst, length;
};

thread_local std::vector<PaddedRun> t_padded_runs;

// Every run kBytes long: fixed-size copies, each one or two vector moves.
template <typename T, int64_t kBytes>
void copy_padded_runs(const T* base, T* row, const std::vector<PaddedRun>& runs) {
  for (const PaddedRun& run : runs) std::memcpy(row + run.dst, base + run.src, kBytes);
}

// Calls f(std::integral_constant<int64_t, bytes>) where runs of `bytes` have a fixed-size
// loop (copy_padded_runs, add_padded_runs) and returns true; false for any other length.
template <typename F>
bool with_fixed_size(int64_t bytes, F&& f) {
  switch (bytes) {
    case 16: f(std::integral_constant<int64_t, 16>{}); return true;
    case 32: f(std::integral_constant<int64_t, 32>{}); return true;
    case 64: f(std::integral_constant<int64_t, 64>{}); return true;
    case 128: f(std::integral_constant<int64_t, 128>{}); return true;
    default: return false;
  }
}

// The chunk's runs as offsets into pad_planes' copy of channels c0 .. c1 - 1 (src, before the patch
// element's own offset) and into im2col's rows (dst, in the layout gather_columns says). Returns the
// runs' length in bytes if they all have it and are contiguous (stride 1), else 0.
template <typename T>
int64_t padded_runs(const ConvGeometry& g, const PaddedWindow& w, int64_t c0, int64_t c1,
                    const std::vector<RowRun>& runs, int64_t depth, int64_t panel_width,
                    std::vector<PaddedRun>& out_runs) {
  out_runs.clear();
  int64_t uniform = runs.empty() ? 0 : runs.front().ow1 - runs.front().ow0;
  for (const RowRun& run : runs) {
    const int64_t length = run.ow1 - run.ow0;
    const int64_t src = ((run.n - w.n0) * (c1 - c0) * w.rows + run.oh * g.stride_h - w.row0) * w.width +
                        run.ow0 * g.stride_w;
    const int64_t dst = panel_width ? run.j / panel_width * depth * panel_width + run.j % panel_width : run.j;
    out_runs.push_back({src, dst, length});
    if (length != uniform) uniform = 0;
  }
  return g.stride_w == 1 ? uniform * static_cast<int64_t>(sizeof(T)) : 0;
}

// Where patch element kk's runs start in pad_planes' copy of channels from c0 on.
inline int64_t padded_offset(const ConvGeometry& g, const PaddedWindow& w, int64_t c0, int64_t kk) {
  const int64_t rs = g.kernel_h * g.kernel_w, c = kk / rs, r = kk % rs / g.kernel_w, s = kk % g.kernel_w;
  return (c - c0) * w.plane() + r * g.dilation_h * w.width + s * g.dilation_w;
}

// gather_columns' result, from pad_planes' copy of channels c0 .. c1 - 1 in window w.
template <typename T>
void gather_padded(const ConvGeometry& g, const T* padded, const PaddedWindow& w, int64_t c0, int64_t c1,
                   const std::vector<RowRun>& runs, int64_t kk0, int64_t kk1, T* col, int64_t ldcol,
                   int64_t panel_width) {
  std::vector<PaddedRun>& out_runs = t_padded_runs;
  const int64_t uniform_bytes = padded_runs<T>(g, w, c0, c1, runs, kk1 - kk0, panel_width, out_runs);
  for (int64_t kk = kk0; kk < kk1; ++kk) {
    const T* base = padded + padded_offset(g, w, c0, kk);
    T* row = col + (kk - kk0) * (panel_width ? panel_width : ldcol);
    if (with_fixed_size(uniform_bytes, [&](auto bytes) { copy_padded_runs<T, bytes.value>(base, row, out_runs); }))
      continue;
    for (const PaddedRun& run : out_runs) {
      const T* in = base + run.src;
      T* out = row + run.dst;
      if (g.stride_w == 1) {
        copy_run(in, out, run.length);
      } else if (g.stride_w == 2) {  // a constant stride the compiler vectorizes
        for (int64_t i = 0; i < run.length; ++i) out[i] = in[2 * i];
      } else {
        for (int64_t i = 0; i < run.length; ++i) out[i] = in[i * g.stride_w];
      }
    }
  }
}

// Every run kBytes long: fixed-size adds, which compile to whole-vector steps.
template <typename T, int64_t kBytes>
void add_padded_runs(const T* row, T* base, const std::vector<PaddedRun>& runs) {
  // As one vector value (GCC's vector extension): added in place, GCC could not rule out that the
  // two runs overlap and added a value at a time; through arrays, it spilled them to the stack.
  typedef T Run __attribute__((vector_size(kBytes)));
  for (const PaddedRun& run : runs) {
    Run sum, in;
    std::memcpy(&sum, base + run.src, sizeof sum);
    std::memcpy(&in, row + run.dst, sizeof in);
    sum += in;
    std::memcpy(base + run.src, &sum, sizeof sum);
  }
}

// col2im into a zeroed padded copy (scatter_columns' sums for channels c0 .. c1 - 1 of window w,
// without its bounds), from dcol laid out as rows.
template <typename T>
void scatter_padded(const ConvGeometry& g, const T* dcol, int64_t lddcol, const PaddedWindow& w, int64_t c0,
                    int64_t c1, const std::vector<RowRun>& runs, int64_t kk0, int64_t kk1, T* padded) {
  std::vector<PaddedRun>& out_runs = t_padded_runs;
  const int64_t uniform_bytes = padded_runs<T>(g, w, c0, c1, runs, kk1 - kk0, 0, out_runs);
  for (int64_t kk = kk0; kk < kk1; ++kk) {
    T* base = padded + padded_offset(g, w, c0, kk);
    const T* row = dcol + (kk - kk0) * lddcol;
    if (with_fixed_size(uniform_bytes, [&](auto bytes) { add_padded_runs<T, bytes.value>(row, base, out_runs); }))
      continue;
    for (const PaddedRun& run : out_runs)
      for (int64_t i = 0; i < run.length; ++i) base[run.src + i * g.stride_w] += row[run.dst + i];
  }
}

// grad_input += the input part of a padded copy (scatter_padded's sums), channels c0 .. c1 - 1.
template <typename T>
void add_unpadded(const ConvGeometry& g, const T* padded, const PaddedWindow& w, int64_t c0, int64_t c1,
                  T* grad_input) {
  const int64_t lo = std::min(g.pad_left, w.width), hi = std::clamp(g.pad_left + g.width, lo, w.width);
  for (int64_t n = w.n0; n < w.n1; ++n)
    for (int64_t c = c0; c < c1; ++c) {
      T* plane = grad_input + (n * g.in_channels + c) * g.height * g.width;
      for (int64_t ph = w.row0; ph < w.row0 + w.rows; ++ph, padded += w.width) {
        const int64_t ih = ph - g.pad_top;
        if (ih >= 0 && ih < g.height) add_run(padded + lo, plane + ih * g.width + lo - g.pad_left, hi - lo);
      }
    }
}

thread_local PackBuffer t_padded;  // the padded copies of gather_chunk and of the dX scatter, per thread

// Rows kk0 .. kk1 - 1 of a chunk's im2col, laid out as gather_columns says, by the gather that
// suits the shape.
template <typename T>
void gather_chunk(const ConvGeometry& g, const T* input, Chunk chunk, int64_t kk0, int64_t kk1, T* col,
                  int64_t ldcol, int64_t panel_width = 0) {
  list_row_runs(g, chunk, t_runs, panel_width);
  if (!gathers_padded(g, chunk)) {
    gather_columns(g, input, t_runs, kk0, kk1, col, ldcol, panel_width);
    return;
  }
  const int64_t rs = g.kernel_h * g.kernel_w, c0 = kk0 / rs, c1 = (kk1 - 1) / rs + 1;
  const PaddedWindow w = padded_window(g, chunk);
  T* padded = t_padded.get<T>((w.n1 - w.n0) * (c1 - c0) * w.plane());
  pad_planes(g, input, w, c0, c1, padded);
  gather_padded(g, padded, w, c0, c1, t_runs, kk0, kk1, col, ldcol, panel_width);
}

// The direct convolution: no im2col at all. With stride 1 down the rows, output pixels p .. p + 15
// of an image (numbered oh·OW + ow) read, under patch element (c, r, s), 16 consecutive values of a
// "shifted plane" X_s[c][ph][ow] = the padded input at row ph, column ow·stride_w + s·dilation_w,
// rows of exactly OW values: those at X_s + p + r·dilation_h·OW, whatever OW is. So a chunk copies
// its input S times (once per kernel column, the padding written out), and the GEMM reads B from
// those copies in place, through a per-k offset (gemm_indexed_b): im2col copied each value R·S
// times and the GEMM read it back. Where OW is whole vectors, no vector crosses an output row and
// one padded copy serves every s (convolve_directly). Measured (2 threads, Zen 5, batch 128, against
// the gather): forward 64 channels of 32x32 262 -> 292-309 GFLOP/s, 128 of 16x16 420 -> 449-469;
// dX (below: the convolution of dY) 238-251 -> 290-302 and 395 -> 454-468. Not taken where OW is less
// than a vector: at 4x4 (loads across cache lines) forward and dX ran 2-5% slower, at 8x8 the same.
// Needs every vector of pixels within one image: OH·OW a multiple of the vector lanes.
template <typename T>
bool convolves_directly(const ConvGeometry& g) {
  const int64_t lanes = block_sizes<T>(active_cpu_path()).lanes;
  return g.stride_h == 1 && g.kernel_h * g.kernel_w > 1 && g.out_pixels_per_image() % lanes == 0 && g.out_w >= lanes;
}

// ... and a chunk whose copy is no larger than the im2col it replaces (a chunk spanning images copies
// them whole, which for a dilated kernel over tiny outputs can be more).
bool chunk_convolves_directly(const ConvGeometry& g, Chunk chunk) {
  const PaddedWindow w = padded_window(g, chunk);
  return (w.n1 - w.n0) * w.rows * g.out_w <= g.kernel_h * chunk.count;
}

// Channels c0 .. c1 - 1 of the window as shifted planes, X_s of channel c and image n at
// out + ((s·(c1 - c0) + c - c0)·(n1 - n0) + n - n0)·rows·OW.
template <typename T>
void shift_planes(const ConvGeometry& g, const T* input, const PaddedWindow& w, int64_t c0, int64_t c1, T* out) {
  for (int64_t s = 0; s < g.kernel_w; ++s) {
    const PatchElement e = patch_element(g, s);  // column offset and valid columns of kernel column s
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t n = w.n0; n < w.n1; ++n) {
        const T* plane = input + (n * g.in_channels + c) * g.height * g.width;
        for (int64_t ph = w.row0; ph < w.row0 + w.rows; ++ph, out += g.out_w) {
          const int64_t ih = ph - g.pad_top;
          const bool inside = ih >= 0 && ih < g.height;
          copy_padded_row(inside ? plane + ih * g.width + e.column_offset + e.ow_lo * g.stride_w : nullptr,
                          g.stride_w, e.ow_lo, e.ow_hi, g.out_w, out);
        }
      }
  }
}

thread_local std::vector<int64_t> t_offsets;
template <typename T>
thread_local std::vector<const T*> t_vectors;

// Y (+)= W[:, kk0 .. kk1) · col[kk0 .. kk1), whole channels c0 .. c1 - 1, col read in place from
// a copy of the chunk's input. Where every vector of pixels lies within one output row (OW a
// multiple of the lanes, stride 1 along the rows), that copy is pad_planes' (one copy, S times
// less than the shifted planes): vector (oh, ow0 ..) under (c, r, s) starts at padded row oh +
// r·dilation_h, column ow0 + s·dilation_w. Otherwise it is the shifted planes.
template <typename T>
void convolve_directly(const ConvGeometry& g, const T* input, const T* weight, Chunk chunk, int64_t c0,
                       int64_t c1, T* y, int64_t ldy, bool accumulate) {
  const PaddedWindow w = padded_window(g, chunk);
  const int64_t images = w.n1 - w.n0, channels = c1 - c0, rs = g.kernel_h * g.kernel_w;
  const int64_t lanes = block_sizes<T>(active_cpu_path()).lanes, hw = g.out_pixels_per_image();
  const bool padded_rows = g.stride_w == 1 && g.out_w % lanes == 0;
  // Where patch element (c, r, s) and the vector of pixels (n, oh, ow0 ..) start in the copy.
  int64_t channel_stride, row_stride, column_stride, image_stride, shift_stride;
  T* copy;
  if (padded_rows) {
    copy = t_padded.get<T>(images * channels * w.plane());
    pad_planes(g, input, w, c0, c1, copy);
    channel_stride = w.plane(), row_stride = w.width, column_stride = 1;
    image_stride = channels * w.plane(), shift_stride = 0;
  } else {
    const int64_t plane = w.rows * g.out_w;
    copy = t_padded.get<T>(g.kernel_w * channels * images * plane);
    shift_planes(g, input, w, c0, c1, copy);
    channel_stride = images * plane, row_stride = g.out_w, column_stride = 0;
    image_stride = plane, shift_stride = channels * images * plane;
  }
  t_offsets.resize(channels * rs);
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t r = 0; r < g.kernel_h; ++r)
      for (int64_t s = 0; s < g.kernel_w; ++s)
        t_offsets[(c * g.kernel_h + r) * g.kernel_w + s] = c * channel_stride + r * g.dilation_h * row_stride +
                                                           s * (g.dilation_w * column_stride + shift_stride);
  std::vector<const T*>& vectors = t_vectors<T>;
  vectors.clear();
  for (int64_t q = chunk.q0; q < chunk.q0 + chunk.count; q += lanes) {
    const int64_t oh = q % hw / g.out_w - w.row0, ow = q % g.out_w;  // the window's rows (stride_h is 1)
    vectors.push_back(copy + (q / hw - w.n0) * image_stride + oh * row_stride + ow);
  }
  gemm_indexed_b<T>(g.out_channels, chunk.count, channels * rs, weight + c0 * rs, g.patch(), 1,
                    IndexedB<T>{t_offsets.data(), vectors.data()}, y, ldy, accumulate);
}

// The convolution by output position, for small maps (the 8x8 and 4x4 of a CIFAR ResNet's last
// stages): one GEMM per output pixel and kernel tap, over the whole batch, Y[oh, ow] (K x N) +=
// W[:, :, r, s] (K x C) · X[ih, iw] (C x N), for only the taps that land inside the input. im2col
// multiplies the padding's zeros too, 31% of a 3x3 kernel's products at 4x4 and 16% at 8x8; here
// they are skipped, and nothing is gathered: the input is laid out once, pixel by pixel, as the
// GEMM's packed B (position_layout), and W once tap by tap, so that both are read in place.
// Measured (Zen 5, batch 128, ms, im2col -> by position), 2 threads: 512 channels of 4x4 forward
// 22.0-23.2 -> 16.7-18.0, dX 23.2-25.3 -> 17.4-18.0; 256 of 8x8 forward 21.9-22.6 -> 19.7-20.3, dX
// 23.2-24.0 -> 19.7-20.0; 256->512 3x3 stride 2 at 8x8 forward 12.2-12.6 -> 11.6-11.8; 1 thread:
// 4x4 forward 46.4-48.8 -> 33.8-34.1, 8x8 45.2-45.7 -> 39.3-41.9 (dW: weight_gradient_by_position). Not
// taken: at 16x16 (forward 21.6 -> 23.1, where the direct convolution skips no products but reads its
// copy as well) and from 32x32 on; for inputs over 64 pixels (the layout copies the whole input: 128->256
// stride 2 from 16x16 to 8x8, dW 13.2 -> 14.0 on 2 threads, forward level); below a batch of 64 (each GEMM
// reads all of a tap's W for too few images: at 4x4 and a batch of 16 the forward took 2.98 -> 4.31).
constexpr int64_t kPositionMaxPixels = 64, kPositionMinBatch = 64;

template <typename T>
bool convolves_by_position(const ConvGeometry& g) {
  return g.kernel_h * g.kernel_w > 1 && g.out_pixels_per_image() <= kPositionMaxPixels &&
         g.in_pixels_per_image() <= kPositionMaxPixels && g.batch >= kPositionMinBatch &&
         g.batch <= block_sizes<T>(active_cpu_path()).nc;
}

// How convolve_by_position lays X out: for input pixel i and channel block cb (channels c0 ..
// c0 + count - 1), gemm's packed B of that block's channels x the batch, padded to `panels` panels
// of `width` images (the last one's extra columns zero). Pixels are pixel_stride apart, not a whole
// number of pages (padded_stride): the copies in and out walk the pixels.
struct PositionLayout {
  int64_t width, panels, block_channels, channels, pixel_stride;
  int64_t batch_padded() const { return width * panels; }
  // Where channel c of pixel i starts (image n at + (n / width)·count·width + n % width).
  int64_t offset(int64_t i, int64_t c) const {
    const int64_t c0 = c / block_channels * block_channels;
    return i * pixel_stride + c0 * batch_padded() + (c - c0) * width;
  }
  int64_t block_count(int64_t c0) const { return std::min(block_channels, channels - c0); }
};

// out[offset(i, c) + (n / width)·count·width + n % width] = input[n][c][i], zero past the batch:
// an image's plane read in order, written to a line per pixel that the next images fill up.
template <typename T>
void position_layout(const ConvGeometry& g, const T* input, const PositionLayout& l, T* out) {
  const int64_t hw = g.in_pixels_per_image(), N = g.batch, C = g.in_channels;
  at::parallel_for(0, C, 1, [&](int64_t c_begin, int64_t c_end) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t count = l.block_count(c / l.block_channels * l.block_channels);
      T* channel = out + l.offset(0, c);
      for (int64_t n = 0; n < l.batch_padded(); ++n) {
        T* column = channel + n / l.width * count * l.width + n % l.width;
        const T* plane = input + (n * C + c) * hw;
        if (n < N)
          for (int64_t i = 0; i < hw; ++i) column[i * l.pixel_stride] = plane[i];
        else
          for (int64_t i = 0; i < hw; ++i) column[i * l.pixel_stride] = T(0);
      }
    }
  });
}

// output = the convolution, weight_taps laid out K x (R·S) x C (tap by tap, W[k][c][r][s] at
// [k][r·S + s][c]).
template <typename T>
void convolve_by_position(const ConvGeometry& g, const T* input, const T* weight_taps, const T* bias, T* output) {
  const int64_t N = g.batch, C = g.in_channels, K = g.out_channels, rs = g.kernel_h * g.kernel_w;
  const int64_t ohw = g.out_pixels_per_image();
  const int64_t width = packed_b_panel_width<T>(K, N), panels = (N + width - 1) / width, npad = panels * width;
  const int64_t block_channels = k_block_depth<T>(C);  // channels per GEMM: one K block
  const PositionLayout l{width, panels, block_channels, C, padded_stride<T>(C * npad)};
  const auto x = uninitialized<T>(g.in_pixels_per_image() * l.pixel_stride);
  position_layout(g, input, l, x.get());
  const int64_t y_stride = padded_stride<T>(K * npad);  // Y[o][k][n] at o·y_stride + k·npad + n
  const auto y = uninitialized<T>(ohw * y_stride);
  at::parallel_for(0, ohw, 1, [&](int64_t o_begin, int64_t o_end) {
    for (int64_t o = o_begin; o < o_end; ++o) {
      const int64_t oh = o / g.out_w, ow = o % g.out_w;
      T* yo = y.get() + o * y_stride;
      bool first = true;
      for (int64_t tap = 0; tap < rs; ++tap) {
        const PatchElement e = patch_element(g, tap);
        if (!e.inside(oh, ow)) continue;
        const int64_t i = e.input_pixel(g, oh, ow);
        for (int64_t c0 = 0; c0 < C; c0 += l.block_channels) {
          gemm_packed_b<T>(K, N, l.block_count(c0), weight_taps + tap * C + c0, rs * C, 1, x.get() + l.offset(i, c0),
                           yo, npad, /*accumulate=*/!first);
          first = false;
        }
      }
      if (first) std::fill_n(yo, K * npad, T(0));  // every tap in the padding
    }
  });
  // output[n][k][o] = Y[o][k][n] + bias[k], 8 channels at a time: their Y lines stay in L1 while
  // each image's rows are written in order.
  constexpr int64_t kChannels = 8;
  at::parallel_for(0, (K + kChannels - 1) / kChannels, 1, [&](int64_t kb0, int64_t kb1) {
    const int64_t k0 = kb0 * kChannels, k1 = std::min(K, kb1 * kChannels);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = k0; k < k1; ++k) {
        const T b = bias ? bias[k] : T(0);
        T* out = output + (n * K + k) * ohw;
        for (int64_t o = 0; o < ohw; ++o) out[o] = y[o * y_stride + k * npad + n] + b;
      }
  });
}

// dW by output position: dW[:, :, r, s] (K x C) = the sum over output pixels o whose tap (r, s) lands
// inside the input, in order, of dY[o] (K x N) · X[i]ᵀ (N x C), i the input pixel under it. dY is laid
// out pixel by pixel (K x N each, read in place as A), X as gemm's packed B of N x C per pixel (panels of
// channels). Needs the batch within one K block. Measured (Zen 5, batch 128, ms, im2col -> by position):
// 2 threads, 512 channels of 4x4 23.3 -> 16.2-16.4, 256 of 8x8 23.2-23.7 -> 19.8-20.4, 256->512 stride 2
// at 8x8 12.6-12.8 -> 10.1-11.0; 1 thread 44.9-45.0 -> 31.0, 45.4-46.4 -> 37.9-40.2, 23.8-23.9 -> 20.0-20.2.
template <typename T>
void weight_gradient_by_position(const ConvGeometry& g, const T* grad_output, const T* input, T* grad_weight) {
  const int64_t N = g.batch, C = g.in_channels, K = g.out_channels, rs = g.kernel_h * g.kernel_w;
  const int64_t ohw = g.out_pixels_per_image(), hw = g.in_pixels_per_image();
  const int64_t width = packed_b_panel_width<T>(K, C), panels = (C + width - 1) / width;
  // dY[n][k][o] -> dy[o][k][n]
  const int64_t dy_stride = padded_stride<T>(K * N);
  const auto dy = uninitialized<T>(ohw * dy_stride);
  at::parallel_for(0, K, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t n = 0; n < N; ++n) {
        const T* row = grad_output + (n * K + k) * ohw;
        for (int64_t o = 0; o < ohw; ++o) dy[o * dy_stride + k * N + n] = row[o];
      }
  });
  // X[n][c][i] -> x[i][panel][n][c - panel·width], zero past C: per pixel, each panel's N x columns as gemm
  // packs them for that product (a narrow last panel in the narrow tile's panels).
  std::vector<int64_t> panel_offset(panels + 1, 0), panel_width(panels);
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t columns = std::min(C - p * width, width);
    panel_width[p] = packed_b_panel_width<T>(K, columns);
    panel_offset[p + 1] = panel_offset[p] + (columns + panel_width[p] - 1) / panel_width[p] * panel_width[p] * N;
  }
  const int64_t x_stride = padded_stride<T>(panel_offset[panels]);
  const auto x = uninitialized<T>(hw * x_stride);
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t w = panel_width[p], columns = (panel_offset[p + 1] - panel_offset[p]) / N;
        for (int64_t j = 0; j < columns; ++j) {
          const int64_t c = p * width + j;
          T* column = x.get() + panel_offset[p] + (j / w * N + n) * w + j % w;
          if (c >= C) {
            for (int64_t i = 0; i < hw; ++i) column[i * x_stride] = T(0);
            continue;
          }
          const T* plane = input + (n * C + c) * hw;
          for (int64_t i = 0; i < hw; ++i) column[i * x_stride] = plane[i];
        }
      }
  });
  const auto taps = uninitialized<T>(rs * K * C);  // dW[k][c][r][s] at [r·S + s][k][c]
  // Threads take runs of (panel, tap) pairs of about equal work (columns x positions under the tap): by
  // panels alone, 128 channels (panels of 48, 48 and 32) left one thread a third of the work, and by
  // equal numbers of pairs 256 channels' ragged last panel of 16 left the other waiting 7% of the time.
  std::vector<int64_t> done(panels * rs + 1, 0);  // work of the pairs before each
  for (int64_t item = 0; item < panels * rs; ++item)
    done[item + 1] = done[item] + std::min(C - item / rs * width, width) * patch_element(g, item % rs).outputs_inside();
  const int64_t parts = at::in_parallel_region() ? 1 : at::get_num_threads();
  at::parallel_for(0, parts, 1, [&](int64_t part0, int64_t part1) {
    const auto first_item = [&](int64_t part) -> int64_t {
      if (part == parts) return panels * rs;  // past pairs of no work too
      return std::lower_bound(done.begin(), done.end() - 1, done.back() * part / parts) - done.begin();
    };
    for (int64_t item = first_item(part0); item < first_item(part1); ++item) {
      const int64_t panel = item / rs, c0 = panel * width, columns = std::min(C - c0, width);
      const PatchElement e = patch_element(g, item % rs);
      T* tap = taps.get() + item % rs * K * C + c0;
      bool first = true;
      for (int64_t o = 0; o < ohw; ++o) {
        const int64_t oh = o / g.out_w, ow = o % g.out_w;
        if (!e.inside(oh, ow)) continue;
        const int64_t i = e.input_pixel(g, oh, ow);
        gemm_packed_b<T>(K, columns, N, dy.get() + o * dy_stride, N, 1, x.get() + i * x_stride + panel_offset[panel],
                         tap, C, /*accumulate=*/!first);
        first = false;
      }
      if (first)  // every position's tap in the padding
        for (int64_t k = 0; k < K; ++k) std::fill_n(tap + k * C, columns, T(0));
    }
  });
  at::parallel_for(0, K, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t t = 0; t < rs; ++t) grad_weight[(k * C + c) * rs + t] = taps[(t * K + k) * C + c];
  });
}

// col2im: grad_input += dcol scattered back, for patch rows [kk0, kk1) (whole channels, so
// the threads, which own disjoint channels, never write the same element).
template <typename T>
void scatter_columns(const ConvGeometry& g, const T* dcol, int64_t lddcol, const std::vector<RowRun>& runs,
                     int64_t kk0, int64_t kk1, T* grad_input) {
  for (int64_t kk = kk0; kk < kk1; ++kk) {
    const PatchElement e = patch_element(g, kk);
    const T* row = dcol + (kk - kk0) * lddcol;
    for (const RowRun& run : runs) {
      const int64_t ih = run.oh * g.stride_h + e.row_offset;
      if (ih < 0 || ih >= g.height) continue;
      const int64_t lo = std::clamp(e.ow_lo, run.ow0, run.ow1), hi = std::clamp(e.ow_hi, lo, run.ow1);
      const T* in = row + run.j - run.ow0;
      T* out = grad_input + ((run.n * g.in_channels + e.c) * g.height + ih) * g.width + e.column_offset;
      if (g.stride_w == 1) {
        add_run(in + lo, out + lo, hi - lo);
      } else {
        for (int64_t ow = lo; ow < hi; ++ow) out[ow * g.stride_w] += in[ow];
      }
    }
  }
}

// An image-side operand of a chunk: rows of K (or C) channels, `count` pixels each.
template <typename T>
struct Operand {
  T* data;
  int64_t row_stride;
};

// The chunk's slice of an N x rows x OH·OW tensor (per-image chunks), or of the same staged
// as rows x N·OH·OW.
template <typename T>
Operand<T> chunk_slice(const ConvGeometry& g, const ChunkPlan& plan, Chunk chunk, T* per_image, int64_t rows,
                       T* staged) {
  const int64_t hw = g.out_pixels_per_image();
  if (!plan.per_image) return {staged + chunk.q0, g.batch * hw};
  const int64_t n = chunk.q0 / hw, p = chunk.q0 % hw;
  return {per_image + n * rows * hw + p, hw};
}

// dY (N x K x HW) staged as one K x N·HW matrix, for chunks that span images.
template <typename T>
std::unique_ptr<T[]> staged_grad_output(const ConvGeometry& g, const T* grad_output) {
  const int64_t K = g.out_channels, hw = g.out_pixels_per_image();
  auto staged = uninitialized<T>(K * g.batch * hw);
  at::parallel_for(0, g.batch * K, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      std::copy_n(grad_output + i * hw, hw, staged.get() + (i % K * g.batch + i / K) * hw);
  });
  return staged;
}

// dst (cols x rows, row stride ldd) = srcᵀ (src: rows x cols, row stride lds), in square tiles
// whose reads and writes each stay in a few cache lines: element by element, writes a whole row
// apart (Wᵀ for dX) took 8% of the backward at 512 channels of 4x4 (perf, Zen 5).
template <typename T>
void transpose_into(const T* src, int64_t rows, int64_t cols, int64_t lds, T* dst, int64_t ldd) {
  constexpr int64_t kTile = 16;
  for (int64_t c0 = 0; c0 < cols; c0 += kTile)
    for (int64_t r0 = 0; r0 < rows; r0 += kTile)
      for (int64_t c = c0; c < std::min(cols, c0 + kTile); ++c)
        for (int64_t r = r0; r < std::min(rows, r0 + kTile); ++r) dst[c * ldd + r] = src[r * lds + c];
}

}  // namespace

// Rows of im2col gathered at a time: one K block of cpu::gemm (all of the patch up to its
// largest single block). A chunk's block, block rows x chunk pixels, stays within half of L2
// from its gather to the GEMM that reads it.
template <typename T>
int64_t patch_block_rows(int64_t patch) {
  return k_block_depth<T>(patch);
}

template <typename T>
int64_t chunk_pixels(int64_t patch, int64_t panel) {
  const BlockSizes b = block_sizes<T>(active_cpu_path());
  const int64_t fit = b.l2_bytes / 2 / (patch_block_rows<T>(patch) * static_cast<int64_t>(sizeof(T)));
  // Whole column panels of the GEMM's tile: a ragged last panel runs a narrower, slower tile.
  return std::clamp<int64_t>(fit / panel * panel, panel, kMaxChunkPixels / panel * panel);
}

template <typename T>
void conv2d_forward(const ConvGeometry& g, const T* input, const T* weight, const T* bias, T* output) {
  if (convolves_by_position<T>(g)) {
    // W[k][c][r][s] -> [k][r][s][c]
    const int64_t rs = g.kernel_h * g.kernel_w, C = g.in_channels;
    const auto taps = uninitialized<T>(g.out_channels * g.patch());
    at::parallel_for(0, g.out_channels, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t c = 0; c < C; ++c)
          for (int64_t i = 0; i < rs; ++i) taps[(k * rs + i) * C + c] = weight[(k * C + c) * rs + i];
    });
    return convolve_by_position<T>(g, input, taps.get(), bias, output);
  }
  // Chunks in whole panels of the tile the forward's GEMM runs (6x64 rather than 8x48 from 512 output
  // channels on): 480-pixel chunks left 512->512 a 32-column panel in every chunk.
  const int64_t panel = packed_b_panel_width<T>(g.out_channels, kMaxChunkPixels);
  const ChunkPlan plan = plan_chunks<T>(g, at::in_parallel_region() ? 1 : at::get_num_threads(), panel);
  const int64_t K = g.out_channels, patch = g.patch(), hw = g.out_pixels_per_image();
  const int64_t block = patch_block_rows<T>(patch);
  const int64_t parts = static_cast<int64_t>(plan.part_starts.size()) - 1;
  // The direct convolution takes K blocks of whole channels.
  const bool direct = convolves_directly<T>(g);
  const int64_t block_channels = std::max<int64_t>(1, block / (g.kernel_h * g.kernel_w));
  at::parallel_for(0, parts, 1, [&](int64_t first_part, int64_t last_part) {
    for (size_t i = plan.part_starts[first_part]; i < plan.part_starts[last_part]; ++i) {
      const Chunk chunk = plan.chunks[i];
      // Shared chunks, and output rows a page apart (a 32x32 image's channels), are computed into a
      // buffer whose rows are not (padded_stride), then copied out while it is in L2.
      const Operand<T> out = plan.per_image ? chunk_slice<T>(g, plan, chunk, output, K, nullptr) : Operand<T>{};
      const bool buffered = !plan.per_image || page_multiple<T>(out.row_stride);
      const Operand<T> y = buffered ? Operand<T>{t_outputs.get<T>(K * padded_stride<T>(chunk.count)),
                                                 padded_stride<T>(chunk.count)}
                                    : out;
      // The bias is per row of this product (gemm's is per column): C starts as it, and the
      // products are added.
      if (bias)
        for (int64_t k = 0; k < K; ++k) std::fill_n(y.data + k * y.row_stride, chunk.count, bias[k]);
      if (direct && chunk_convolves_directly(g, chunk)) {
        for (int64_t c0 = 0; c0 < g.in_channels; c0 += block_channels)
          convolve_directly(g, input, weight, chunk, c0, std::min(g.in_channels, c0 + block_channels), y.data,
                            y.row_stride, /*accumulate=*/c0 > 0 || bias != nullptr);
      } else if (g.pointwise() && plan.per_image) {  // im2col is the input itself
        const Operand<T> x = chunk_slice<T>(g, plan, chunk, const_cast<T*>(input), g.in_channels, nullptr);
        gemm<T>(K, chunk.count, patch, weight, patch, 1, x.data, x.row_stride, 1, nullptr, false, y.data,
                y.row_stride, /*accumulate=*/bias != nullptr);
      } else {
        // im2col a block of rows at a time, straight into the panels gemm reads B from (no packing
        // copy), each read while it is in L2.
        const int64_t width = packed_b_panel_width<T>(K, chunk.count);
        const int64_t panels = (chunk.count + width - 1) / width, ragged = chunk.count % width;
        T* col = t_columns.get<T>(block * panels * width);
        for (int64_t kk = 0; kk < patch; kk += block) {
          const int64_t rows = std::min(block, patch - kk);
          gather_chunk(g, input, chunk, kk, kk + rows, col, 0, width);
          if (ragged)  // the last panel's columns past the chunk are zero, as gemm's own packing leaves them
            for (int64_t k = 0; k < rows; ++k)
              std::fill_n(col + ((panels - 1) * rows + k) * width + ragged, width - ragged, T(0));
          gemm_packed_b<T>(K, chunk.count, rows, weight + kk, patch, 1, col, y.data, y.row_stride,
                           /*accumulate=*/kk > 0 || bias != nullptr);
        }
      }
      if (!buffered) continue;
      // Out, image by image: the chunk's pixels j0 .. of image n are its pixels p0 .. p1 - 1.
      for (int64_t q = chunk.q0, end = chunk.q0 + chunk.count; q < end;) {
        const int64_t n = q / hw, p0 = q % hw, p1 = std::min(hw, p0 + (end - q)), j0 = q - chunk.q0;
        for (int64_t k = 0; k < K; ++k)
          std::copy_n(y.data + k * y.row_stride + j0, p1 - p0, output + (n * K + k) * hw + p0);
        q += p1 - p0;
      }
    }
  });
}

template <typename T>
void conv2d_backward_weight(const ConvGeometry& g, const T* grad_output, const T* input, T* grad_weight) {
  const ChunkPlan plan = plan_chunks<T>(g);
  const int64_t K = g.out_channels, patch = g.patch(), hw = g.out_pixels_per_image();
  const int64_t block = patch_block_rows<T>(patch);
  if (g.batch * hw == 0) {
    std::fill_n(grad_weight, K * patch, T(0));
    return;
  }
  if (convolves_by_position<T>(g) && k_is_one_block<T>(g.batch))
    return weight_gradient_by_position(g, grad_output, input, grad_weight);
  const auto staged = plan.per_image ? nullptr : staged_grad_output(g, grad_output);
  // Threads own columns of dW (rows of im2col), a block of them at a time: each gathers only
  // those rows of every chunk, and sums its columns over the chunks in order.
  at::parallel_for(0, patch, kWeightColumnsGrain, [&](int64_t begin, int64_t end) {
    for (int64_t kk0 = begin; kk0 < end; kk0 += block) {
      const int64_t kk1 = std::min(end, kk0 + block);
      bool first_chunk = true;
      for (const Chunk chunk : plan.chunks) {
        const Operand<T> dy = chunk_slice<T>(g, plan, chunk, const_cast<T*>(grad_output), K, staged.get());
        // B (count x columns) = the chunk's im2col rows kk0 .. kk1 - 1, transposed.
        Operand<const T> col{};
        if (g.pointwise() && plan.per_image) {
          const Operand<T> x = chunk_slice<T>(g, plan, chunk, const_cast<T*>(input), g.in_channels, nullptr);
          col = {x.data + kk0 * x.row_stride, x.row_stride};
        } else {
          T* buffer = t_columns.get<T>((kk1 - kk0) * chunk.count);
          gather_chunk(g, input, chunk, kk0, kk1, buffer, chunk.count);
          col = {buffer, chunk.count};
        }
        gemm<T>(K, kk1 - kk0, chunk.count, dy.data, dy.row_stride, 1, col.data, 1, col.row_stride, nullptr, false,
                grad_weight + kk0, patch, /*accumulate=*/!first_chunk);
        first_chunk = false;
      }
    }
  });
}

// With stride 1, dX is itself a convolution: of dY, padded by (R - 1)·dilation_h - pad_top rows
// (and so on) on each side, with W flipped in both kernel directions and its channel axes
// swapped. Where that convolution runs directly (convolves_directly) it replaces the GEMM and
// col2im of dX; std::nullopt where it cannot (strides, or padding beyond the kernel's reach).
std::optional<ConvGeometry> transposed_geometry(const ConvGeometry& g) {
  const int64_t reach_h = (g.kernel_h - 1) * g.dilation_h, reach_w = (g.kernel_w - 1) * g.dilation_w;
  const int64_t pad_bottom = g.out_h - 1 + reach_h + 1 - g.height - g.pad_top;
  const int64_t pad_right = g.out_w - 1 + reach_w + 1 - g.width - g.pad_left;
  if (g.stride_h != 1 || g.stride_w != 1 || std::max(g.pad_top, pad_bottom) > reach_h ||
      std::max(g.pad_left, pad_right) > reach_w)
    return std::nullopt;
  return ConvGeometry{g.batch, g.out_channels, g.out_h, g.out_w, g.in_channels, g.kernel_h, g.kernel_w, 1, 1,
                      g.dilation_h, g.dilation_w, reach_h - g.pad_top, reach_w - g.pad_left, g.height, g.width};
}

template <typename T>
void conv2d_backward_input(const ConvGeometry& g, const T* grad_output, const T* weight, T* grad_input) {
  const int64_t rs = g.kernel_h * g.kernel_w, C = g.in_channels, K = g.out_channels;
  // The transposed convolution's weight, W'[c][k][r][s] = W[k][c][R - 1 - r][S - 1 - s], at index(c, k, r·S + s).
  const auto transposed_weight = [&](auto index) {
    auto out = uninitialized<T>(K * g.patch());
    at::parallel_for(0, C, 16, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t k = 0; k < K; ++k)
          for (int64_t i = 0; i < rs; ++i) out[index(c, k, i)] = weight[(k * C + c) * rs + rs - 1 - i];
    });
    return out;
  };
  if (const auto t = transposed_geometry(g); t && convolves_by_position<T>(*t)) {
    const auto taps = transposed_weight([&](int64_t c, int64_t k, int64_t i) { return (c * rs + i) * K + k; });
    return convolve_by_position<T>(*t, grad_output, taps.get(), nullptr, grad_input);
  } else if (t && convolves_directly<T>(*t)) {
    const auto flipped = transposed_weight([&](int64_t c, int64_t k, int64_t i) { return (c * K + k) * rs + i; });
    return conv2d_forward<T>(*t, grad_output, flipped.get(), nullptr, grad_input);
  }
  const ChunkPlan plan = plan_chunks<T>(g);
  const int64_t patch = g.patch();
  const int64_t hw = g.out_pixels_per_image(), in_hw = g.in_pixels_per_image();
  // dcol is computed a block of whole channels at a time and scattered while it is in L2.
  const int64_t block_channels = std::max<int64_t>(1, patch_block_rows<T>(patch) / rs);
  const auto staged = plan.per_image ? nullptr : staged_grad_output(g, grad_output);
  // A = Wᵀ (patch x K), transposed once so that it is read in place like W in the forward.
  const auto weight_t = uninitialized<T>(patch * K);
  at::parallel_for(0, patch, 64, [&](int64_t begin, int64_t end) {
    transpose_into(weight + begin, K, end - begin, patch, weight_t.get() + begin * K, K);
  });
  const bool direct = g.pointwise() && plan.per_image;  // dcol is dX itself: nothing to scatter
  // Threads own input channels: the rows of dcol they compute and the part of dX they add into.
  at::parallel_for(0, g.in_channels, 1, [&](int64_t c_begin, int64_t c_end) {
    if (!direct)
      for (int64_t n = 0; n < g.batch; ++n)
        std::fill_n(grad_input + (n * g.in_channels + c_begin) * in_hw, (c_end - c_begin) * in_hw, T(0));
    for (const Chunk chunk : plan.chunks) {
      const Operand<T> dy = chunk_slice<T>(g, plan, chunk, const_cast<T*>(grad_output), K, staged.get());
      if (direct) {
        const Operand<T> dx = chunk_slice<T>(g, plan, chunk, grad_input, g.in_channels, nullptr);
        gemm<T>((c_end - c_begin) * rs, chunk.count, K, weight_t.get() + c_begin * rs * K, K, 1, dy.data,
                dy.row_stride, 1, nullptr, false, dx.data + c_begin * dx.row_stride, dx.row_stride);
        continue;
      }
      list_row_runs(g, chunk, t_runs);
      for (int64_t c0 = c_begin; c0 < c_end; c0 += block_channels) {
        const int64_t kk0 = c0 * rs, kk1 = std::min(c_end, c0 + block_channels) * rs;
        T* dcol = t_columns.get<T>((kk1 - kk0) * chunk.count);
        gemm<T>(kk1 - kk0, chunk.count, K, weight_t.get() + kk0 * K, K, 1, dy.data, dy.row_stride, 1, nullptr,
                false, dcol, chunk.count);
        if (!gathers_padded(g, chunk)) {
          scatter_columns(g, dcol, chunk.count, t_runs, kk0, kk1, grad_input);
          continue;
        }
        // As the gather, through a padded copy: col2im into it without bounds, then its input part
        // into dX (at 128 channels of 16x16 the direct scatter took 7% of the backward).
        const int64_t c1 = std::min(c_end, c0 + block_channels);
        const PaddedWindow w = padded_window(g, chunk);
        T* padded = t_padded.get<T>((w.n1 - w.n0) * (c1 - c0) * w.plane());
        std::fill_n(padded, (w.n1 - w.n0) * (c1 - c0) * w.plane(), T(0));
        scatter_padded(g, dcol, chunk.count, w, c0, c1, t_runs, kk0, kk1, padded);
        add_unpadded(g, padded, w, c0, c1, grad_input);
      }
    }
  });
}

template <typename T>
void conv2d_backward_bias(const ConvGeometry& g, const T* grad_output, T* grad_bias) {
  constexpr int kLanes = 16;  // independent partial sums: vectorizable, in a fixed order
  const int64_t K = g.out_channels, hw = g.out_pixels_per_image();
  at::parallel_for(0, K, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      T lanes[kLanes] = {};
      T tail = 0;
      for (int64_t n = 0; n < g.batch; ++n) {
        const T* row = grad_output + (n * K + k) * hw;
        int64_t p = 0;
        for (; p + kLanes <= hw; p += kLanes)
          for (int l = 0; l < kLanes; ++l) lanes[l] += row[p + l];
        for (; p < hw; ++p) tail += row[p];
      }
      T sum = tail;
      for (int l = 0; l < kLanes; ++l) sum += lanes[l];
      grad_bias[k] = sum;
    }
  });
}

#define EXT_INSTANTIATE_CONV(T)                                                                         \
  template int64_t chunk_pixels<T>(int64_t, int64_t);                                                   \
  template void conv2d_forward<T>(const ConvGeometry&, const T*, const T*, const T*, T*);               \
  template void conv2d_backward_input<T>(const ConvGeometry&, const T*, const T*, T*);                  \
  template void conv2d_backward_weight<T>(const ConvGeometry&, const T*, const T*, T*);                 \
  template void conv2d_backward_bias<T>(const ConvGeometry&, const T*, T*);
EXT_INSTANTIATE_CONV(float)
EXT_INSTANTIATE_CONV(double)
#undef EXT_INSTANTIATE_CONV

}  // namespace ext::cpu
