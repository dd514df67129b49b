// y[M, N] = x[M, K] @ w[K, N] for the few rows of a decode step on CPU, as an XLA
// FFI target (specjax/kernels/cpu_matmul.py builds, loads and dispatches it).
//
// A decode step multiplies a handful of rows by every weight matrix, so it is
// bound by how fast the weights stream from memory. This kernel reads each
// weight once for all M <= 8 rows (M > 8: once per 8 rows), splits the columns
// between the threads of XLA's intra-op pool, and accumulates in float32 in a
// fixed order per output element: row m's result does not depend on M or on
// the other rows, so one token and a block of gamma + 1 tokens give the same
// numbers (what exact greedy verification needs).
//
// dtypes: x and w float32 or bfloat16 (any mix), y float32 or bfloat16. With
// AVX512-BF16, bfloat16 x and w use vdpbf16ps on pairs of rows of w.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline v16 load_w(const float* p) { v16 v; std::memcpy(&v, p, 64); return v; }
static inline v16 load_w(const uint16_t* p) {
  u16x16 h; std::memcpy(&h, p, 32);
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 v; std::memcpy(&v, &w, 64); return v;
}
static inline float to_f32(float v) { return v; }
static inline float to_f32(uint16_t v) { uint32_t b = uint32_t(v) << 16; float f; std::memcpy(&f, &b, 4); return f; }
static inline uint16_t to_bf16(float f) {
  uint32_t b; std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffff) > 0x7f800000) return uint16_t((b >> 16) | 0x40);  // NaN stays NaN
  b += 0x7fff + ((b >> 16) & 1);
  return uint16_t(b >> 16);
}

// Rows of w per block: KB concurrent sequential streams (16 measured faster than 4 or 64).
constexpr int64_t KB = 16;

// y[:, n0:n1] (float, row stride N) += x[:, k-block] @ w[k-block, n0:n1] for MT rows.
template <int MT, int NV, typename W>
static void tile_rows(const float* x, const W* w, float* y, int64_t K, int64_t N,
                      int64_t n0, int64_t n1) {
  constexpr int64_t TW = NV * 16;
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = k0 + KB < K ? k0 + KB : K;
    int64_t n = n0;
    for (; n + TW <= n1; n += TW) {
      v16 acc[MT][NV];
      for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NV; ++j) std::memcpy(&acc[m][j], y + m * N + n + 16 * j, 64);
      for (int64_t k = k0; k < k1; ++k) {
        const W* row = w + k * N + n;
        v16 wv[NV];
        for (int j = 0; j < NV; ++j) wv[j] = load_w(row + 16 * j);
        for (int m = 0; m < MT; ++m) {
          const float xm = x[m * K + k];
          for (int j = 0; j < NV; ++j) acc[m][j] += xm * wv[j];
        }
      }
      for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NV; ++j) std::memcpy(y + m * N + n + 16 * j, &acc[m][j], 64);
    }
    for (; n < n1; ++n)  // the ragged end, same order of sums
      for (int m = 0; m < MT; ++m) {
        float s = y[m * N + n];
        for (int64_t k = k0; k < k1; ++k) s = __builtin_fmaf(x[m * K + k], to_f32(w[k * N + n]), s);
        y[m * N + n] = s;
      }
  }
}

template <typename W>
static void columns(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N,
                    int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M * N; m += N) std::memset(y + m + n0, 0, (n1 - n0) * 4);
  for (int64_t m = 0; m < M; m += 8) {
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (M - m < 8 ? M - m : 8) {
      case 1: tile_rows<1, 8>(xm, w, ym, K, N, n0, n1); break;
      case 2: tile_rows<2, 8>(xm, w, ym, K, N, n0, n1); break;
      case 3: tile_rows<3, 4>(xm, w, ym, K, N, n0, n1); break;
      case 4: tile_rows<4, 4>(xm, w, ym, K, N, n0, n1); break;
      case 5: tile_rows<5, 2>(xm, w, ym, K, N, n0, n1); break;
      case 6: tile_rows<6, 2>(xm, w, ym, K, N, n0, n1); break;
      case 7: tile_rows<7, 2>(xm, w, ym, K, N, n0, n1); break;
      case 8: tile_rows<8, 2>(xm, w, ym, K, N, n0, n1); break;
    }
  }
}


#if defined(__AVX512BF16__)
#include <immintrin.h>
// bfloat16 weights and activations: vdpbf16ps takes rows k and k+1 interleaved
// (x[m,k] w[k,n] + x[m,k+1] w[k+1,n] per lane), half the instructions of
// converting to float32. unpacklo/hi interleave within 128-bit lanes, so a
// 32-column tile's accumulators hold columns in the order `lo` = {0-3, 8-11,
// 16-19, 24-27}, `hi` = {4-7, ...}: y keeps that order and `unpermute` fixes it.
constexpr bool kHaveDpbf16 = true;
template <int MT, int NV>
static void tile_rows_bf16(const uint32_t* xp, const uint16_t* w, float* y, int64_t K,
                           int64_t N, int64_t n0, int64_t n1) {
  // xp[m * K2 + k2]: rows m's bf16 pair (x[m, 2 k2], x[m, 2 k2 + 1]) as 32 bits.
  const int64_t K2 = (K + 1) / 2;
  constexpr int64_t TW = NV * 32;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t k0 = 0; k0 < K2; k0 += KB / 2) {
    const int64_t k1 = k0 + KB / 2 < K2 ? k0 + KB / 2 : K2;
    for (int64_t n = n0; n + TW <= n1; n += TW) {
      __m512 acc[MT][2 * NV];
      for (int m = 0; m < MT; ++m)
        for (int j = 0; j < 2 * NV; ++j) acc[m][j] = _mm512_loadu_ps(y + m * N + n + 16 * j);
      for (int64_t k2 = k0; k2 < k1; ++k2) {
        const uint16_t* r0 = w + 2 * k2 * N + n;
        const bool odd = 2 * k2 + 1 >= K;
        __m512i pairs[2 * NV];
        for (int j = 0; j < NV; ++j) {
          __m512i a = _mm512_loadu_si512(r0 + 32 * j);
          __m512i b = odd ? zero : _mm512_loadu_si512(r0 + N + 32 * j);
          pairs[2 * j] = _mm512_unpacklo_epi16(a, b);
          pairs[2 * j + 1] = _mm512_unpackhi_epi16(a, b);
        }
        for (int m = 0; m < MT; ++m) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[m * K2 + k2]);
          for (int j = 0; j < 2 * NV; ++j)
            acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)pairs[j], xv);
        }
      }
      for (int m = 0; m < MT; ++m)
        for (int j = 0; j < 2 * NV; ++j) _mm512_storeu_ps(y + m * N + n + 16 * j, acc[m][j]);
    }
  }
}

// y's 32-column tiles from the lo/hi order back to column order, in place.
static void unpermute(float* y, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n + 32 <= n1; n += 32) {
      float* p = y + m * N + n;
      __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
      _mm512_storeu_ps(p, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}

static void columns_bf16(const uint32_t* xp, const float* x, const uint16_t* w, float* y,
                         int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M * N; m += N) std::memset(y + m + n0, 0, (n1 - n0) * 4);
  const int64_t K2 = (K + 1) / 2;
  const int64_t full = n0 + (n1 - n0) / 32 * 32;  // whole tiles; the rest in column order
  // Tiles of nv x 32 columns up to the last whole 64, then one 32-column tile.
  const int64_t wide = n0 + (full - n0) / 64 * 64;
  for (int64_t m = 0; m < M; m += 8) {
    const uint32_t* xm = xp + m * K2;
    float* ym = y + m * N;
    switch (M - m < 8 ? M - m : 8) {
#define SPECJAX_CASE(mt, nv)                                            \
  case mt:                                                             \
    tile_rows_bf16<mt, nv>(xm, w, ym, K, N, n0, wide);                 \
    if (wide < full) tile_rows_bf16<mt, 1>(xm, w, ym, K, N, wide, full); \
    break;
      SPECJAX_CASE(1, 2) SPECJAX_CASE(2, 2) SPECJAX_CASE(3, 2) SPECJAX_CASE(4, 2)
      SPECJAX_CASE(5, 2) SPECJAX_CASE(6, 2) SPECJAX_CASE(7, 1) SPECJAX_CASE(8, 1)
#undef SPECJAX_CASE
    }
  }
  unpermute(y, M, N, n0, full);
  for (int64_t m = 0; m < M && full < n1; ++m)  // ragged columns: the float32 path
    tile_rows<1, 1>(x + m * K, w, y + m * N, K, N, full, n1);
}
#else
constexpr bool kHaveDpbf16 = false;
static void columns_bf16(const uint32_t*, const float*, const uint16_t*, float*, int64_t,
                         int64_t, int64_t, int64_t, int64_t) {}
#endif


// y[M, N] = x[M, K] @ w[N, K]^T: weights stored one output per row (a tied
// output head reads the [V, D] embedding this way). Each y[m, n] is a dot
// product over contiguous k: 16 (float32) or 32 (vdpbf16ps) lanes of partial
// sums, added in a fixed order at the end, then a scalar tail.
template <int MT, typename W>
static void rows_dot(const float* x, const uint32_t* xp, const W* w, float* y, int64_t K,
                     int64_t N, int64_t r0, int64_t r1) {
  for (int64_t n = r0; n < r1; ++n) {
    const W* row = w + n * K;
    float lanes[MT][16];
    int64_t k = 0;
#if defined(__AVX512BF16__)
    if constexpr (sizeof(W) == 2) {
      if (xp != nullptr) {  // bfloat16 x and w: 32 products per instruction
        __m512 acc[MT];
        for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
        for (; k + 32 <= K; k += 32) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + k);
          for (int m = 0; m < MT; ++m)
            acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(xp + m * ((K + 1) / 2) + k / 2));
        }
        for (int m = 0; m < MT; ++m) _mm512_storeu_ps(lanes[m], acc[m]);
      }
    }
    if (xp == nullptr || sizeof(W) != 2)
#endif
    {
      v16 acc[MT] = {};
      for (; k + 16 <= K; k += 16) {
        const v16 wv = load_w(row + k);
        for (int m = 0; m < MT; ++m) {
          v16 xv;
          std::memcpy(&xv, x + m * K + k, 64);
          acc[m] += xv * wv;
        }
      }
      for (int m = 0; m < MT; ++m) std::memcpy(lanes[m], &acc[m], 64);
    }
    for (int m = 0; m < MT; ++m) {
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += lanes[m][j];
      for (int64_t kk = k; kk < K; ++kk) s = __builtin_fmaf(x[m * K + kk], to_f32(row[kk]), s);
      y[m * N + n] = s;
    }
  }
}

template <typename W>
static void rows_dot_all(const float* x, const uint32_t* xp, const W* w, float* y, int64_t M,
                         int64_t K, int64_t N, int64_t r0, int64_t r1) {
  for (int64_t m = 0; m < M; m += 8) {
    const float* xm = x + m * K;
    const uint32_t* xpm = xp == nullptr ? nullptr : xp + m * ((K + 1) / 2);
    float* ym = y + m * N;
    switch (M - m < 8 ? M - m : 8) {
      case 1: rows_dot<1>(xm, xpm, w, ym, K, N, r0, r1); break;
      case 2: rows_dot<2>(xm, xpm, w, ym, K, N, r0, r1); break;
      case 3: rows_dot<3>(xm, xpm, w, ym, K, N, r0, r1); break;
      case 4: rows_dot<4>(xm, xpm, w, ym, K, N, r0, r1); break;
      case 5: rows_dot<5>(xm, xpm, w, ym, K, N, r0, r1); break;
      case 6: rows_dot<6>(xm, xpm, w, ym, K, N, r0, r1); break;
      case 7: rows_dot<7>(xm, xpm, w, ym, K, N, r0, r1); break;
      case 8: rows_dot<8>(xm, xpm, w, ym, K, N, r0, r1); break;
    }
  }
}

// Column chunks shared by the calling thread and the pool's tasks (`Product`).
struct Chunks {
  std::function<void(int64_t)> work;
  int64_t count = 0;
  std::atomic<int64_t> next{0}, done{0};
  void drain() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
      work(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The two layouts' shared part: checks, x in float32 (and in bfloat16 pairs),
// the threads, y's conversion. `transposed`: w is [N, K].
static ffi::Error Product(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::Result<ffi::AnyBuffer> y, bool transposed) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[transposed ? 1 : 0])
    return ffi::Error::InvalidArgument("specjax_cpu_matmul: x [M, K] and w [K, N] expected");
  const int64_t M = xd[0], K = xd[1], N = wd[transposed ? 0 : 1];
  for (ffi::DataType t : {x.element_type(), w.element_type(), y->element_type()})
    if (t != ffi::F32 && t != ffi::BF16)
      return ffi::Error::InvalidArgument("specjax_cpu_matmul: float32 or bfloat16 only");
  const bool x16 = x.element_type() == ffi::BF16, w16 = w.element_type() == ffi::BF16;
  const bool y16 = y->element_type() == ffi::BF16;
  std::vector<float> xf(M * K), yf(M * N);
  for (int64_t i = 0; i < M * K; ++i)
    xf[i] = x16 ? to_f32(static_cast<const uint16_t*>(x.untyped_data())[i])
                : static_cast<const float*>(x.untyped_data())[i];
  // bfloat16 pairs of x for vdpbf16ps (x is bfloat16 already, so nothing is rounded).
  const bool dp = kHaveDpbf16 && x16 && w16;
  const int64_t K2 = (K + 1) / 2;
  std::vector<uint32_t> xp(dp ? M * K2 : 0);
  if (dp) {
    const auto* xs = static_cast<const uint16_t*>(x.untyped_data());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k2 = 0; k2 < K2; ++k2) {
        uint32_t lo = xs[m * K + 2 * k2], hi = 2 * k2 + 1 < K ? xs[m * K + 2 * k2 + 1] : 0;
        xp[m * K2 + k2] = lo | (hi << 16);
      }
  }
  // Small products stay on the calling thread: a task hand-off costs more than they do.
  int64_t threads = K * N >= (1 << 16) ? pool.num_threads() : 1;
  threads = threads < 1 ? 1 : threads;
  // One chunk of whole 128-wide column tiles (of w's rows when transposed) per
  // thread, handed out one at a time: a pool thread that wakes late (or never,
  // while the pool is busy: XLA may run this on a pool thread) leaves its chunk
  // to the caller instead of the caller waiting for it. More, smaller chunks
  // measured slower (shorter runs along each row of w). An element's sums never
  // depend on the chunking.
  const int64_t align = transposed ? 16 : 128;
  const int64_t wanted = threads;
  const int64_t per = ((N + wanted - 1) / wanted + align - 1) / align * align;
  const void* wp = w.untyped_data();
  const auto* w16p = static_cast<const uint16_t*>(wp);
  const auto* w32p = static_cast<const float*>(wp);
  auto shared = std::make_shared<Chunks>();
  shared->count = (N + per - 1) / per;
  shared->work = [&](int64_t chunk) {
    const int64_t n0 = chunk * per, n1 = n0 + per < N ? n0 + per : N;
    if (transposed) {
      if (w16) rows_dot_all(xf.data(), dp ? xp.data() : nullptr, w16p, yf.data(), M, K, N, n0, n1);
      else rows_dot_all(xf.data(), nullptr, w32p, yf.data(), M, K, N, n0, n1);
    } else if (dp) {
      columns_bf16(xp.data(), xf.data(), w16p, yf.data(), M, K, N, n0, n1);
    } else if (w16) {
      columns(xf.data(), w16p, yf.data(), M, K, N, n0, n1);
    } else {
      columns(xf.data(), w32p, yf.data(), M, K, N, n0, n1);
    }
  };
  const int64_t helpers = (threads < shared->count ? threads : shared->count) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared] { shared->drain(); });
  shared->drain();
  // Only finished chunks are waited for: a task that starts later finds none
  // left and touches nothing but `shared`, which it keeps alive.
  while (shared->done.load(std::memory_order_acquire) < shared->count) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  if (y16) {
    auto* out = static_cast<uint16_t*>(y->untyped_data());
    for (int64_t i = 0; i < M * N; ++i) out[i] = to_bf16(yf[i]);
  } else {
    std::memcpy(y->untyped_data(), yf.data(), M * N * 4);
  }
  return ffi::Error::Success();
}

static ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> y) {
  return Product(pool, x, w, y, false);
}

static ffi::Error MatmulT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::Result<ffi::AnyBuffer> y) {
  return Product(pool, x, w, y, true);
}

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
