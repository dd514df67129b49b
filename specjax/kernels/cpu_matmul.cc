// y[M, N] = x[M, K] @ w[K, N] (SpecjaxMatmul) and y = x @ w[N, K]^T
// (SpecjaxMatmulT, a tied output head) for the few rows of a decode step on
// CPU, as XLA FFI targets (specjax/kernels/cpu_matmul.py builds, loads and
// dispatches them). x, w and y are each float32 or bfloat16; sums are float32
// and a bfloat16 y is rounded once, at the end.
//
// Row independence. Greedy verification compares the rows of one product of
// gamma + 1 tokens with rows computed alone, so y[m, n] must come out bit for
// bit the same whatever M, the other rows, the register tile row m lands in or
// the threads. The rule: the float operations that produce y[m, n] depend only
// on x[m, :], w's column n, K, N and the variant compiled in.
//  - [K, N]: y[m, n] is one chain of fused multiply-adds over k ascending from
//    0 (vector and scalar FMAs round alike, so the register tile, the k-blocks
//    that park the partial sum in memory and the scalar tail columns, chosen
//    from N alone, never change a bit). With AVX512-BF16 and bfloat16 x and w
//    every column goes through vdpbf16ps on the pairs (k, k + 1) in ascending
//    order (the last columns with masked loads, an odd K's last pair with a
//    zero partner), so no column depends on where a chunk ends.
//  - [N, K]: per-lane partial sums over contiguous k (one vector's lanes), a
//    fixed reduction tree, then a scalar FMA tail over the last K % width.
// Chunks of columns start at multiples of every tile width, and contraction
// is never left to the compiler (-ffp-contract=off is fine): every product is
// an explicit FMA intrinsic, vdpbf16ps or __builtin_fmaf.
//
// Memory. A decode step is bound by reading the weights, so w is read once for
// all rows. Up to one register tile of rows: kKb rows of w are streamed side by
// side straight into the tile, sweeping the thread's whole chunk. Up to
// kStreamMaxRows rows (float32 w): the same streams feed the first row group's
// tiles, which also store the vectors they load into a small packed block that
// the other row groups then sweep from L1, so reading w overlaps computing and
// the hardware prefetcher sees long runs (a separate packing pass, below,
// measured 1.2-1.4x slower at 8-16 rows). More rows (compute-bound) or
// bfloat16 w: each block of kPackRows x kBlockCols of w is first packed into a small
// contiguous buffer (float32, or vdpbf16ps's interleaved pairs), which every
// row group then sweeps from L1. Packing makes the conversion or interleave
// happen once per block rather than once per row group, and it keeps the
// block's rows out of each other's way: w's rows are often a multiple of 4 KiB
// apart and would all fall into the same few L1 sets.
//
// Variants, chosen from the -march the build passes: avx512_bf16 (AVX-512 with
// vdpbf16ps), avx512 (32 zmm), avx2 (16 ymm, FMA), generic (portable C++:
// __builtin_fmaf over small arrays that the compiler vectorizes). Register
// tiles of MT rows x NV vectors are sized to the register file: MT x NV
// accumulators + NV weight vectors + 1 broadcast must fit (16 ymm for avx2,
// 32 zmm for avx512), else the tile spills and the kernel runs at a fraction
// of the memory bandwidth. The tables below were measured on a 2-core Zen 4
// (a shared VM: differences under ~20% did not reproduce, so they are left
// at the plain choices that fit).
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

float ToF32(float v) { return v; }
float ToF32(uint16_t v) {
  const uint32_t b = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
uint16_t ToBf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffff) > 0x7f800000) return uint16_t((b >> 16) | 0x40);
  b += 0x7fff + ((b >> 16) & 1);
  return uint16_t(b >> 16);
}

// The vector of each variant: VW float32 lanes; Load widens bfloat16 exactly.
#if defined(__AVX512F__)
#define SPECJAX_AVX512 1
#if defined(__AVX512BF16__)
#define SPECJAX_DPBF16 1
constexpr char kIsa[] = "avx512_bf16";
#else
constexpr char kIsa[] = "avx512";
#endif
constexpr int VW = 16;
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Load(const uint16_t* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
inline Vec Broadcast(float f) { return _mm512_set1_ps(f); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// Branch-free (a branch here makes GCC 12 keep a tile's accumulators in memory).
inline Vec LoadOrZero(const float* p, bool zero) {
  return _mm512_maskz_loadu_ps(zero ? 0 : 0xffff, p);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr char kIsa[] = "avx2";
constexpr int VW = 8;
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Load(const uint16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline Vec Broadcast(float f) { return _mm256_set1_ps(f); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec LoadOrZero(const float* p, bool zero) {
  return _mm256_maskload_ps(p, _mm256_set1_epi32(zero ? 0 : -1));
}
#else
constexpr char kIsa[] = "generic";
constexpr int VW = 8;
struct Vec {
  float f[VW];
};
inline Vec Zero() { return Vec{}; }
template <typename T>
inline Vec Load(const T* p) {
  Vec v;
  for (int i = 0; i < VW; ++i) v.f[i] = ToF32(p[i]);
  return v;
}
inline Vec Broadcast(float f) {
  Vec v;
  for (int i = 0; i < VW; ++i) v.f[i] = f;
  return v;
}
inline Vec Fma(Vec a, Vec b, Vec c) {
  Vec v;
  for (int i = 0; i < VW; ++i) v.f[i] = __builtin_fmaf(a.f[i], b.f[i], c.f[i]);
  return v;
}
inline void Store(float* p, Vec v) { std::memcpy(p, v.f, sizeof(v.f)); }
inline Vec LoadOrZero(const float* p, bool zero) { return zero ? Zero() : Load(p); }
#endif

// Register tiles by rows: kColNv[MT - 1] vectors of columns for a tile of MT
// rows ([K, N] layout), kDotNr[MT - 1] rows of w for the [N, K] layout, and
// (AVX512-BF16) kPairNg[MT - 1] groups of 32 columns, each two accumulators.
// The table's length is the tallest tile; more rows take several row groups.
#if defined(SPECJAX_AVX512)
// Up to 8 x 3 = 24 accumulators + 3 weights + 1 broadcast of 32 zmm; 1-2 rows
// take 8 vectors (a 512-byte run of each row of w per tile).
constexpr int kColNv[] = {8, 8, 6, 4, 4, 4, 3, 3};
constexpr int kDotNr[] = {4, 4, 4, 4, 3, 3, 2, 2};
#elif defined(__AVX2__) && defined(__FMA__)
// At most 16 ymm: 2 x 4 + 4 + 1, 3 x 3 + 3 + 1, 6 x 2 + 2 + 1 (4 x 3 spilled).
constexpr int kColNv[] = {4, 4, 3, 2, 2, 2};
constexpr int kDotNr[] = {4, 4, 3, 2};
#else
constexpr int kColNv[] = {4, 2, 2, 2};
constexpr int kDotNr[] = {4, 2, 2, 2};
#endif
#if defined(SPECJAX_DPBF16)
// Each group: 2 accumulators, 2 vectors of pairs (+ 2 rows loaded before the
// interleave): up to 12 x 2 or 6 x 4 accumulators.
constexpr int kPairNg[] = {4, 4, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1};
#endif

// Rows of w per block: kKb streams read side by side (8 and 32 measured no better).
// Up to one register tile of rows the sums of the chunk's whole width go to L2
// and back once per block; sweeping instead panels of columns whose sums fit in
// L1 (16 KiB: 768 columns at 5 rows) through every block measured 1.4x slower
// at 5 rows and 1.2x at one (2-core Xeon, AMX; 2026-12-06): the shorter runs
// along w's rows cost more than the sums' traffic saves.
constexpr int64_t kKb = 16;
// One row (a decode step at batch 1) streams fewer rows of w at a time: on the
// Zen 4, a 2048 x 11264 float32 product took 2.7-4.0 ms with 4 streams against
// 3.6-4.8 with 16 (XLA's GEMV: 3.2-3.6) and the 1B layer's other float32
// shapes 1.1-1.3x less. Not for bfloat16 w (rows half as long): with the
// prefetch below, the avx2 and avx512 builds' six 1B layers at one row took
// 26 ms with 4 streams against 22-23 with 16 (2-core Xeon, 2026-12-06). The
// k-blocks only park float32 sums in memory, so no bit changes.
constexpr int64_t kKbOneRow = 4;
// Reading w straight from memory into the register tiles, the hardware
// prefetchers fall behind once a tile computes more per byte than one float32
// row: each row's lines kAheadBytes on are prefetched by hand. On the 2-core
// Xeon (AMX; 2026-12-06), the benchmark's six 1B-shaped layers, before ->
// after: float32 5 rows 56 -> 46 ms, 8 rows 67 -> 55, 16 rows 92 -> 81-85;
// bfloat16 (vdpbf16ps) 1 row 27 -> 22, 5 rows 41 -> 32; the avx2 and avx512
// builds alike. A float32 row alone measured 3% slower with it (its
// prefetchers keep up), so not there. Farther ahead measured slower (bfloat16,
// 5 rows: 32 ms at 256 bytes, 36 at 512, 44 at 1024, and no better into L2
// only). No bit changes.
constexpr int kAheadBytes = 256;
template <int MT, typename W>
constexpr bool kAhead = MT > 1 || sizeof(W) == 2;
// The packed block of w shared by several row groups (48 KiB in float32;
// multiples of 32 columns, vdpbf16ps's groups). Against 32 x 128 (2-core Xeon,
// 2026-12-06; 2048 x 11264 unless named): float32 47 rows (a prompt's
// prefill) 14.3 -> 12.0 ms on the avx512_bf16 build, 20.5 -> 15.9 on avx2,
// 5632 x 2048 7.4 -> 6.9; 64 rows 18.7 -> 15.1; bfloat16 16 rows 5.5 -> 5.0
// (avx512), 7.1 -> 6.8 (avx2): fewer passes over the float32 sums per byte of
// w. 128 x 96 was faster still at 64 float32 rows but slower at 16 bfloat16.
constexpr int64_t kPackRows = 64, kBlockCols = 192;
// Up to kStreamMaxRows rows (more than one register tile): the first row
// group streams w's kKb rows straight from memory, a panel of kStreamPanel
// floats of sums (kept in L2) at a time, kStreamVecs vectors of columns per
// step, leaving a packed copy there that the other row groups sweep from L1.
constexpr int64_t kStreamMaxRows = 32, kStreamVecs = 12, kStreamPanel = 64 * 1024;
// The chunk's packing buffer, in floats.
constexpr int64_t kPackFloats = std::max<int64_t>(kPackRows * kBlockCols, kKb * kStreamVecs * VW);
// Rows of w per block in the [N, K] layout, shared by the row groups.
constexpr int64_t kDotRows = 8;
// Chunks of columns start at multiples of this: the widest tile (8 zmm) and
// vdpbf16ps's groups of 32 columns divide it.
constexpr int64_t kAlign = 128;

// ---- [K, N]: one FMA chain per element ----

// y[0:MT, 0:NV VW] (row stride ys) = (first ? 0 : y) + x[0:MT, k0:k1] @ w[k0:k1, 0:NV VW].
// kStore: w's vectors are also stored (as float32) to pk[(k - k0) * pks + ...].
// kMem: w is read from memory (not a packed block in L1), so each row's lines
// kAheadBytes on are prefetched where that pays (kAhead).
template <int MT, int NV, bool kStore, bool kMem, typename W>
inline void ColumnTile(const float* x, int64_t K, const W* w, int64_t N, float* y, int64_t ys,
                       int64_t k0, int64_t k1, bool first, float* pk, int64_t pks) {
  Vec acc[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = LoadOrZero(y + m * ys + j * VW, first);
  int64_t k = k0;  // k1 > k0: a do-while keeps the accumulators in registers (GCC 12)
  do {
    const W* row = w + k * N;
    Vec wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = Load(row + j * VW);
    if constexpr (kMem && kAhead<MT, W>)
      for (int b = 0; b < NV * VW * int(sizeof(W)); b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row) + kAheadBytes + b);
    if constexpr (kStore)
      for (int j = 0; j < NV; ++j) Store(pk + (k - k0) * pks + j * VW, wv[j]);
    for (int m = 0; m < MT; ++m) {
      const Vec xb = Broadcast(x[m * K + k]);
      for (int j = 0; j < NV; ++j) acc[m][j] = Fma(xb, wv[j], acc[m][j]);
    }
  } while (++k < k1);
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NV; ++j) Store(y + m * ys + j * VW, acc[m][j]);
}

// The last r < NV vectors of a strip, as one tile of r vectors.
template <int MT, int NV, bool kStore, bool kMem, typename W>
inline void ColumnRest(const float* x, int64_t K, const W* w, int64_t N, float* y, int64_t ys,
                       int64_t k0, int64_t k1, int64_t r, bool first, float* pk, int64_t pks) {
  if constexpr (NV >= 1) {
    if (r == NV) ColumnTile<MT, NV, kStore, kMem>(x, K, w, N, y, ys, k0, k1, first, pk, pks);
    else ColumnRest<MT, NV - 1, kStore, kMem>(x, K, w, N, y, ys, k0, k1, r, first, pk, pks);
  }
}

template <int MT, bool kStore, bool kMem, typename W>
inline void ColumnStripS(const float* x, int64_t K, const W* w, int64_t N, float* y, int64_t ys,
                         int64_t k0, int64_t k1, int64_t nvec, bool first, float* pk,
                         int64_t pks) {
  constexpr int NV = kColNv[MT - 1];
  int64_t v = 0;
  for (; v + NV <= nvec; v += NV)
    ColumnTile<MT, NV, kStore, kMem>(x, K, w + v * VW, N, y + v * VW, ys, k0, k1, first,
                                     kStore ? pk + v * VW : nullptr, pks);
  ColumnRest<MT, NV - 1, kStore, kMem>(x, K, w + v * VW, N, y + v * VW, ys, k0, k1, nvec - v,
                                       first, kStore ? pk + v * VW : nullptr, pks);
}

// One row group of MT rows over `nvec` vectors of columns, for rows k0:k1 of w;
// with `pk`, w's rows k0:k1 are also packed there (pks floats apart).
template <int MT, bool kMem, typename W>
void ColumnStrip(const float* x, int64_t K, const W* w, int64_t N, float* y, int64_t ys,
                 int64_t k0, int64_t k1, int64_t nvec, bool first, float* pk, int64_t pks) {
  if (pk) ColumnStripS<MT, true, kMem>(x, K, w, N, y, ys, k0, k1, nvec, first, pk, pks);
  else ColumnStripS<MT, false, kMem>(x, K, w, N, y, ys, k0, k1, nvec, first, pk, pks);
}

template <typename W>
using ColumnFn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int64_t,
                          int64_t, int64_t, bool, float*, int64_t);
template <typename W, bool kMem, int... I>
constexpr std::array<ColumnFn<W>, sizeof...(I)> ColumnTable(std::integer_sequence<int, I...>) {
  return {{&ColumnStrip<I + 1, kMem, W>...}};
}
constexpr int kColMt = sizeof(kColNv) / sizeof(int);

// Everything a chunk of columns needs; `acc` holds the float32 sums (row
// stride ys): y itself for a float32 y in the [N, K] layout, else scratch.
struct Job {
  int64_t M, K, N;
  const float* xf;        // x in float32, [M, K], rows xs apart
  const uint16_t* xh;     // x as bfloat16 (vdpbf16ps, [N, K] layout only), [M, K]
  const uint32_t* xp;     // x's bfloat16 pairs (k, k + 1) as 32 bits, [M, (K + 1) / 2], xs apart
  int64_t xs;
  const void* w;
  bool w16, dp, transposed;
  float* acc;
  int64_t ys;
  void* y;
  bool y16, direct;
};

// Packing reads w from memory in short runs and the row groups then compute
// without touching memory, so the hardware prefetchers fall behind: each row's
// next block (`count` elements from p, past the chunk's end: harmless) is
// fetched by hand while the row groups work on this one. Reading w and
// computing still take turns: at 47 float32 rows, packing alone took 4.3 ms of
// a 2048 x 11264 product, the FMAs alone 6.8 and both 12-14. Spreading these
// prefetches over the FMA loops (a few lines per step) measured slower, not
// overlapped: six 1B layers 141 -> 161 ms into L2, 185 into L1 (2-core Xeon,
// 2026-12-06).
template <typename W>
inline void Prefetch(const W* p, int64_t count) {
  for (int64_t i = 0; i < count; i += 64 / sizeof(W)) __builtin_prefetch(p + i);
}

// `pack`: kPackFloats floats of this chunk's own.
template <typename W>
void ColumnChunk(const Job& j, const W* w, int64_t n0, int64_t n1, float* pack) {
  static constexpr auto table = ColumnTable<W, true>(std::make_integer_sequence<int, kColMt>());
  static constexpr auto packed =
      ColumnTable<float, false>(std::make_integer_sequence<int, kColMt>());
  const int64_t M = j.M, K = j.K, N = j.N, ys = j.ys;
  const int64_t nv = N / VW * VW;  // columns past nv: the scalar tail, decided by N alone
  const int64_t vend = std::min(n1, nv);
  if (M <= kColMt) {
    const int64_t kb = M == 1 && sizeof(W) == 4 ? kKbOneRow : kKb;
    for (int64_t k0 = 0; k0 < K && vend > n0; k0 += kb) {
      // The next block's rows start where this block's prefetches never reach:
      // for a narrow chunk (the 68M draft's 768 columns: 384 per thread) that
      // start is a large share of each row. Measured on the 2-core Xeon
      // (2026-12-06), 14 of the draft's layers in bfloat16: one row 11.0 ->
      // 10.5 ms (AVX-512 build), 11.1 -> 10.5 (AVX2), five rows 15.8 -> 15.1;
      // the 1B layers' one-row chains unchanged.
      for (int64_t k = k0 + kb; k < std::min(k0 + 2 * kb, K); ++k)
        Prefetch(w + k * N + n0, kAheadBytes / int64_t(sizeof(W)));
      table[M - 1](j.xf, j.xs, w + n0, N, j.acc + n0, ys, k0, std::min(k0 + kb, K),
                   (vend - n0) / VW, k0 == 0, nullptr, 0);
    }
  } else if (sizeof(W) == 4 && M <= kStreamMaxRows) {
    const int64_t panel = std::max<int64_t>(kAlign, kStreamPanel / M / kAlign * kAlign);
    for (int64_t p0 = n0; p0 < vend; p0 += panel) {
      const int64_t p1 = std::min(p0 + panel, vend);
      for (int64_t k0 = 0; k0 < K; k0 += kKb) {
        const int64_t k1 = std::min(k0 + kKb, K);
        for (int64_t n = p0; n < p1; n += kStreamVecs * VW) {
          const int64_t vecs = std::min(kStreamVecs * VW, p1 - n) / VW;
          // The first row group reads w and leaves a packed copy for the others.
          table[kColMt - 1](j.xf, j.xs, w + n, N, j.acc + n, ys, k0, k1, vecs, k0 == 0, pack,
                            vecs * VW);
          for (int64_t m0 = kColMt, mt; m0 < M; m0 += mt) {
            mt = std::min<int64_t>(kColMt, M - m0);
            packed[mt - 1](j.xf + m0 * j.xs + k0, j.xs, pack, vecs * VW, j.acc + m0 * ys + n, ys,
                           0, k1 - k0, vecs, k0 == 0, nullptr, 0);
          }
        }
      }
    }
  } else {
    for (int64_t k0 = 0; k0 < K && vend > n0; k0 += kPackRows) {
      const int64_t kb = std::min(kPackRows, K - k0);
      for (int64_t n = n0; n < vend; n += kBlockCols) {
        const int64_t cols = std::min(kBlockCols, vend - n);
        for (int64_t k = 0; k < kb; ++k) {
          const W* row = w + (k0 + k) * N + n;
          for (int64_t c = 0; c < cols; c += VW) Store(pack + k * cols + c, Load(row + c));
          Prefetch(row + kBlockCols, kBlockCols);
        }
        for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
          mt = std::min<int64_t>(kColMt, M - m0);
          packed[mt - 1](j.xf + m0 * j.xs + k0, j.xs, pack, cols, j.acc + m0 * ys + n, ys, 0, kb,
                         cols / VW, k0 == 0, nullptr, 0);
        }
      }
    }
  }
  for (int64_t n = std::max(n0, nv); n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k)
        s = __builtin_fmaf(j.xf[m * j.xs + k], ToF32(w[k * N + n]), s);
      j.acc[m * ys + n] = s;
    }
}

// ---- [K, N], bfloat16 x and w with vdpbf16ps ----
#if defined(SPECJAX_DPBF16)
// vdpbf16ps multiplies pairs within 32-bit lanes, so rows k and k + 1 of w are
// interleaved with unpacklo/hi_epi16. Those work within 128-bit lanes: a
// group of 32 columns comes out as `lo` = columns {0-3, 8-11, 16-19, 24-27}
// and `hi` = {4-7, 12-15, ...}. The sums keep that order (scratch rows padded
// to whole groups) and PairPos puts them back on output.
inline int64_t PairPos(int64_t c) { return (c & 4 ? 16 : 0) + ((c >> 3) << 2) + (c & 3); }

// Rows r[0:32] and r[N:N + 32] (a zero row unless `second`) as two vectors of
// pairs: out[0] = `lo`, out[1] = `hi`. Columns outside `mask` read as zero.
inline void Interleave(const uint16_t* r, int64_t N, bool second, __mmask32 mask, __m512i* out) {
  const __m512i a = _mm512_maskz_loadu_epi16(mask, r);
  const __m512i b = second ? _mm512_maskz_loadu_epi16(mask, r + N) : _mm512_setzero_si512();
  out[0] = _mm512_unpacklo_epi16(a, b);
  out[1] = _mm512_unpackhi_epi16(a, b);
}

// Pairs p0:p1 of rows of w for MT rows x NG groups of 32 columns; pair `odd`
// (K odd) has row K - 1 and a zero row. kMasked: one group, columns by `mask`.
// kPacked: w holds the pairs interleaved already (PairChunk), pair rows N apart.
enum Mode { kDirect, kMasked, kPacked };
template <int MT, int NG, Mode kMode>
inline void PairTile(const uint32_t* xp, int64_t K2, const uint16_t* w, int64_t N, float* y,
                     int64_t ys, int64_t p0, int64_t p1, int64_t odd, __mmask32 mask,
                     bool first) {
  __m512 acc[MT][2 * NG];
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < 2 * NG; ++g)
      acc[m][g] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * ys + 16 * g);
  auto step = [&](int64_t p, auto has_second) {
    __m512i pairs[2 * NG];
    if (kMode == kPacked) {
      for (int g = 0; g < 2 * NG; ++g) pairs[g] = _mm512_loadu_si512(w + p * N + 32 * g);
    } else {
      for (int g = 0; g < NG; ++g)
        Interleave(w + 2 * p * N + 32 * g, N, has_second, kMode == kMasked ? mask : ~0u,
                   pairs + 2 * g);
      if constexpr (kMode == kDirect)  // bfloat16 w: always kAhead
        for (int g = 0; g < NG; ++g)
          for (const uint16_t* r : {w + 2 * p * N, w + (2 * p + 1) * N})
            __builtin_prefetch(reinterpret_cast<const char*>(r + 32 * g) + kAheadBytes);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[m * K2 + p]);
      for (int g = 0; g < 2 * NG; ++g)
        acc[m][g] = _mm512_dpbf16_ps(acc[m][g], (__m512bh)pairs[g], xb);
    }
  };
  const int64_t full = std::min(p1, odd);
  for (int64_t p = p0; p < full; ++p) step(p, std::true_type());
  if (p1 > odd) step(odd, std::false_type());
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < 2 * NG; ++g) _mm512_storeu_ps(y + m * ys + 16 * g, acc[m][g]);
}

// kPackedW: w packed by PairChunk, a group's two vectors of pairs side by side.
template <int MT, bool kPackedW>
void PairStrip(const uint32_t* xp, int64_t K2, const uint16_t* w, int64_t N, float* y,
               int64_t ys, int64_t p0, int64_t p1, int64_t odd, int64_t groups,
               __mmask32 tail, bool first) {
  constexpr int NG = kPairNg[MT - 1];
  constexpr Mode mode = kPackedW ? kPacked : kDirect;
  constexpr int step = kPackedW ? 64 : 32;
  int64_t g = 0;
  for (; g + NG <= groups; g += NG)
    PairTile<MT, NG, mode>(xp, K2, w + step * g, N, y + 32 * g, ys, p0, p1, odd, 0, first);
  for (; g < groups; ++g)
    PairTile<MT, 1, mode>(xp, K2, w + step * g, N, y + 32 * g, ys, p0, p1, odd, 0, first);
  if (tail)
    PairTile<MT, 1, kMasked>(xp, K2, w + step * g, N, y + 32 * g, ys, p0, p1, odd, tail, first);
}

using PairFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, float*, int64_t,
                        int64_t, int64_t, int64_t, int64_t, __mmask32, bool);
template <bool kPackedW, int... I>
constexpr std::array<PairFn, sizeof...(I)> PairTable(std::integer_sequence<int, I...>) {
  return {{&PairStrip<I + 1, kPackedW>...}};
}
constexpr int kPairMt = sizeof(kPairNg) / sizeof(int);

// `pack`: kPackRows x kBlockCols bfloat16 of this chunk's own.
void PairChunk(const Job& j, const uint16_t* w, int64_t n0, int64_t n1, uint16_t* pack) {
  static constexpr auto table = PairTable<false>(std::make_integer_sequence<int, kPairMt>());
  static constexpr auto packed = PairTable<true>(std::make_integer_sequence<int, kPairMt>());
  const int64_t M = j.M, N = j.N, ys = j.ys, K2 = (j.K + 1) / 2, odd = j.K / 2;
  const int64_t full = std::min(n1, N / 32 * 32);
  // The last, partial group of 32 columns (only the chunk ending at N has one).
  const __mmask32 tail = n1 == N && N % 32 ? __mmask32((1u << (N % 32)) - 1) : 0;
  const int64_t end = tail ? full + 32 : full;
  if (M <= kPairMt) {
    for (int64_t p0 = 0; p0 < K2; p0 += kKb / 2)
      table[M - 1](j.xp, j.xs, w + n0, N, j.acc + n0, ys, p0, std::min(p0 + kKb / 2, K2), odd,
                   (full - n0) / 32, tail, p0 == 0);
    return;
  }
  for (int64_t p0 = 0; p0 < K2; p0 += kPackRows / 2) {
    const int64_t pb = std::min(kPackRows / 2, K2 - p0);
    for (int64_t n = n0; n < end; n += kBlockCols) {
      const int64_t groups = (std::min(n + kBlockCols, end) - n) / 32;
      // Pair rows of 2 x 32 x groups elements; the partial group and an odd
      // K's zero partner are filled in here, so every tile below is whole.
      for (int64_t p = 0; p < pb; ++p) {
        const uint16_t* rows = w + 2 * (p0 + p) * N + n;
        for (int64_t g = 0; g < groups; ++g) {
          __m512i v[2];
          Interleave(rows + 32 * g, N, p0 + p < odd, n + 32 * g < full ? ~0u : tail, v);
          _mm512_storeu_si512(pack + p * 64 * groups + 64 * g, v[0]);
          _mm512_storeu_si512(pack + p * 64 * groups + 64 * g + 32, v[1]);
        }
        Prefetch(rows + kBlockCols, kBlockCols);
        if (p0 + p < odd) Prefetch(rows + N + kBlockCols, kBlockCols);
      }
      for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
        mt = std::min<int64_t>(kPairMt, M - m0);
        packed[mt - 1](j.xp + m0 * j.xs + p0, j.xs, pack, 64 * groups, j.acc + m0 * ys + n, ys, 0,
                       pb, pb, groups, 0, p0 == 0);
      }
    }
  }
}
#endif

// ---- [N, K]: lanes of partial sums, a fixed reduction, a scalar tail ----

inline float Reduce(const float* lanes, int n) {  // a fixed tree over n (a power of 2) lanes
  float l[32];
  std::memcpy(l, lanes, n * sizeof(float));
  for (int h = n / 2; h > 0; h /= 2)
    for (int i = 0; i < h; ++i) l[i] = l[i] + l[i + h];
  return l[0];
}

// y[0:MT, 0:NR] = x[0:MT, :] @ w[0:NR, :]^T, w's rows contiguous in k.
template <int MT, int NR, typename W>
inline void DotTile(const float* x, [[maybe_unused]] const uint16_t* xh, int64_t K, const W* w,
                    float* y, int64_t ys) {
  float lanes[MT][NR][32];
  int64_t k = 0;
  int width = VW;
#if defined(SPECJAX_DPBF16)
  if constexpr (sizeof(W) == 2) {
    if (xh != nullptr) {  // 32 products per instruction, on pairs (k, k + 1)
      __m512 acc[MT][NR];
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
      for (; k + 32 <= K; k += 32) {
        __m512bh wv[NR];
        for (int r = 0; r < NR; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
        for (int m = 0; m < MT; ++m) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(xh + m * K + k);
          for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
        }
      }
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < NR; ++r) _mm512_storeu_ps(lanes[m][r], acc[m][r]);
      width = 16;
    }
  }
  if (xh == nullptr || sizeof(W) != 2)
#endif
  {
    Vec acc[MT][NR];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = Zero();
    for (; k + VW <= K; k += VW) {
      Vec wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = Load(w + r * K + k);
      for (int m = 0; m < MT; ++m) {
        const Vec xv = Load(x + m * K + k);
        for (int r = 0; r < NR; ++r) acc[m][r] = Fma(xv, wv[r], acc[m][r]);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < NR; ++r) Store(lanes[m][r], acc[m][r]);
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < NR; ++r) {
      float s = Reduce(lanes[m][r], width);
      for (int64_t kk = k; kk < K; ++kk) s = __builtin_fmaf(x[m * K + kk], ToF32(w[r * K + kk]), s);
      y[m * ys + r] = s;
    }
}

template <int MT, typename W>
void DotStrip(const float* x, const uint16_t* xh, int64_t K, const W* w, float* y, int64_t ys,
              int64_t rows) {
  constexpr int NR = kDotNr[MT - 1];
  int64_t r = 0;
  for (; r + NR <= rows; r += NR) DotTile<MT, NR>(x, xh, K, w + r * K, y + r, ys);
  for (; r < rows; ++r) DotTile<MT, 1>(x, xh, K, w + r * K, y + r, ys);
}

template <typename W>
using DotFn = void (*)(const float*, const uint16_t*, int64_t, const W*, float*, int64_t, int64_t);
template <typename W, int... I>
constexpr std::array<DotFn<W>, sizeof...(I)> DotTable(std::integer_sequence<int, I...>) {
  return {{&DotStrip<I + 1, W>...}};
}
constexpr int kDotMt = sizeof(kDotNr) / sizeof(int);

template <typename W>
void DotChunk(const Job& j, const W* w, int64_t n0, int64_t n1) {
  static constexpr auto table = DotTable<W>(std::make_integer_sequence<int, kDotMt>());
  const int64_t M = j.M, K = j.K, ys = j.ys;
  for (int64_t n = n0; n < n1; n += kDotRows) {
    const int64_t rows = std::min(kDotRows, n1 - n);
    for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
      mt = std::min<int64_t>(kDotMt, M - m0);
      table[mt - 1](j.xf + m0 * K, j.xh ? j.xh + m0 * K : nullptr, K, w + n * K,
                    j.acc + m0 * ys + n, ys, rows);
    }
  }
}

// ---- chunks, threads, the FFI handlers ----

// Columns n0:n1 of y (rows n0:n1 of w when transposed): the sums, then y.
// `pack`: the chunk's kPackFloats floats for packing w.
void RunChunk(const Job& j, int64_t n0, int64_t n1, float* pack) {
  const auto* w16 = static_cast<const uint16_t*>(j.w);
  const auto* w32 = static_cast<const float*>(j.w);
  if (j.transposed) {
    if (j.w16) DotChunk(j, w16, n0, n1);
    else DotChunk(j, w32, n0, n1);
  } else if (j.dp) {
#if defined(SPECJAX_DPBF16)
    PairChunk(j, w16, n0, n1, reinterpret_cast<uint16_t*>(pack));
#endif
  } else if (j.w16) {
    ColumnChunk(j, w16, n0, n1, pack);
  } else {
    ColumnChunk(j, w32, n0, n1, pack);
  }
  if (j.direct) return;
#if defined(SPECJAX_DPBF16)
  const bool permuted = j.dp && !j.transposed;
#endif
  for (int64_t m = 0; m < j.M; ++m) {
    const float* a = j.acc + m * j.ys;
    for (int64_t n = n0; n < n1; ++n) {
#if defined(SPECJAX_DPBF16)
      const float v = permuted ? a[(n & ~int64_t(31)) + PairPos(n & 31)] : a[n];
#else
      const float v = a[n];
#endif
      if (j.y16) static_cast<uint16_t*>(j.y)[m * j.N + n] = ToBf16(v);
      else static_cast<float*>(j.y)[m * j.N + n] = v;
    }
  }
}

// Chunks handed out one at a time to the calling thread and the pool's tasks:
// a pool thread that wakes late (or never, while the pool is busy: XLA may run
// this on a pool thread) leaves its chunk to the caller instead of the caller
// waiting for it. Tasks hold a shared_ptr, so one that starts after the
// handler returned finds nothing left to do and touches nothing else.
struct Chunks {
  std::function<void(int64_t)> work;
  int64_t count = 0;
  std::atomic<int64_t> next{0}, done{0};
  void Drain() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
      work(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

std::string Shape(int64_t a, int64_t b) {
  return "[" + std::to_string(a) + ", " + std::to_string(b) + "]";
}

ffi::Error Product(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                   ffi::Result<ffi::AnyBuffer> y, bool transposed) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const char* layout = transposed ? "w [N, K]" : "w [K, N]";
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument(std::string("specjax_cpu_matmul: x [M, K], ") + layout +
                                       " and y [M, N] must have rank 2");
  const int64_t M = xd[0], K = xd[1], N = wd[transposed ? 0 : 1];
  if (wd[transposed ? 1 : 0] != K)
    return ffi::Error::InvalidArgument("specjax_cpu_matmul: x " + Shape(M, K) + " and " + layout +
                                       " = " + Shape(wd[0], wd[1]) + " disagree on K");
  if (yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("specjax_cpu_matmul: y is " + Shape(yd[0], yd[1]) +
                                       ", expected " + Shape(M, N));
  for (ffi::DataType t : {x.element_type(), w.element_type(), y->element_type()})
    if (t != ffi::F32 && t != ffi::BF16)
      return ffi::Error::InvalidArgument("specjax_cpu_matmul: float32 or bfloat16 only");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const bool x16 = x.element_type() == ffi::BF16, w16 = w.element_type() == ffi::BF16;
  const bool y16 = y->element_type() == ffi::BF16;
  if (K == 0) {  // an empty sum; bfloat16 and float32 zeros are both all-zero bits
    std::memset(y->untyped_data(), 0, M * N * (y16 ? 2 : 4));
    return ffi::Error::Success();
  }

  Job j{};
  j.M = M, j.K = K, j.N = N, j.w = w.untyped_data(), j.w16 = w16, j.transposed = transposed;
  j.y = y->untyped_data(), j.y16 = y16;
#if defined(SPECJAX_DPBF16)
  j.dp = x16 && w16;
#endif
  // [K, N]: the rows of x and of the sums are padded by 64 bytes. K and N are
  // often multiples of 1024, and rows a multiple of 4 KiB apart would all
  // share the same few L1 sets (several row groups measured 1.6x slower).
  const int64_t pad = transposed ? 0 : 16;
  j.xs = K + pad;
  const auto* x16p = static_cast<const uint16_t*>(x.untyped_data());
  const auto* x32p = static_cast<const float*>(x.untyped_data());
  std::vector<float> xf(x16 || pad ? M * j.xs : 0);
  for (int64_t m = 0; m < M && !xf.empty(); ++m)
    for (int64_t k = 0; k < K; ++k)
      xf[m * j.xs + k] = x16 ? ToF32(x16p[m * K + k]) : x32p[m * K + k];
  j.xf = xf.empty() ? x32p : xf.data();
  std::vector<uint32_t> xp;
  if (j.dp && transposed) j.xh = x16p;
  if (j.dp && !transposed) {
    const int64_t K2 = (K + 1) / 2;
    xp.resize(M * j.xs);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t p = 0; p < K2; ++p) {
        const uint32_t hi = 2 * p + 1 < K ? x16p[m * K + 2 * p + 1] : 0;
        xp[m * j.xs + p] = x16p[m * K + 2 * p] | (hi << 16);
      }
    j.xp = xp.data();
  }
  // vdpbf16ps's sums are in pair order, padded to whole groups of 32 columns.
  const bool permuted = j.dp && !transposed;
  j.ys = (permuted ? (N + 31) / 32 * 32 : N) + pad;
  j.direct = !y16 && transposed;
  std::vector<float> scratch(j.direct ? 0 : M * j.ys);
  j.acc = j.direct ? static_cast<float*>(j.y) : scratch.data();

  // Small products stay on the calling thread: a task hand-off costs more.
  // One chunk per thread: more, smaller chunks measured slower (shorter runs
  // along each row of w).
  int64_t threads = K * N >= (1 << 16) ? pool.num_threads() : 1;
  threads = std::max<int64_t>(threads, 1);
  const int64_t align = transposed ? kDotRows : kAlign;
  const int64_t per = ((N + threads - 1) / threads + align - 1) / align * align;
  auto shared = std::make_shared<Chunks>();
  shared->count = (N + per - 1) / per;
  std::vector<float> packs(transposed ? 0 : shared->count * kPackFloats);
  shared->work = [&j, &packs, per, N](int64_t chunk) {
    RunChunk(j, chunk * per, std::min(chunk * per + per, N),
             packs.empty() ? nullptr : packs.data() + chunk * kPackFloats);
  };
  const int64_t helpers = std::min(threads, shared->count) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    try {
      pool.Schedule([shared] { shared->Drain(); });
    } catch (...) {  // no task: the caller drains its chunk
      break;
    }
  }
  shared->Drain();
  // Only finished chunks are waited for: a task that starts later finds none left.
  while (shared->done.load(std::memory_order_acquire) < shared->count) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return ffi::Error::Success();
}

// No C++ exception may cross the FFI boundary.
ffi::Error Guarded(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                   ffi::Result<ffi::AnyBuffer> y, bool transposed) {
  try {
    return Product(pool, x, w, y, transposed);
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "specjax_cpu_matmul: out of memory for scratch buffers");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("specjax_cpu_matmul: ") + e.what());
  } catch (...) {
    return ffi::Error::Internal("specjax_cpu_matmul: unknown C++ exception");
  }
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> y) {
  return Guarded(pool, x, w, y, false);
}

ffi::Error MatmulT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                   ffi::Result<ffi::AnyBuffer> y) {
  return Guarded(pool, x, w, y, true);
}

}  // namespace

extern "C" const char* SpecjaxKernelIsa(void) { return kIsa; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmulT, MatmulT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
