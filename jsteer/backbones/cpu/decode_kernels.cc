// The two CPU kernels of a decode step, reached from jitted JAX code through XLA FFI:
//
// - small_gemm: y[M, N] = x[M, K] @ W[K, N] (+ b[N]) for few rows M, W pre-packed in column panels;
// - decode_attention: one query token per row against the KV cache, softmax and value product
//   in one pass per (row, key/value head).
//
// Built at first use by jsteer/backbones/cpu/__init__.py (g++ -O3 -march=native); only used on
// CPUs with AVX-512F, or AVX2 with FMA (simd.h). fp32 throughout.
//
// small_gemm. Decoding multiplies a handful of rows by every weight matrix once per token, so the
// time is the time to stream the weights from memory. XLA:CPU's GEMM path reaches about half the
// read bandwidth there for 2 <= M <= 12 (it is built for large M; up to 64 rows this kernel still
// wins). This kernel reads each weight once, contiguously: W is stored as panels
// [ceil(N/48), K, 48] (`pack` in cpu/__init__.py), and each panel's 48 columns for up to 8 rows
// stay in 24 vector accumulators (AVX-512; AVX2 holds 6: 2 rows x 48 columns, or 6 x 16) while the
// panel streams past. Panels are shared out between the caller and XLA's intra-op thread pool.
// Sums run over k in order, one FMA per term, in slices of 32-64 k steps added up. Prefills and
// forwards (many rows) take the same kernel, the rows in blocks that fit in L2: on 2 Xeon cores it
// runs SmolLM2's products at ~260-280 GFLOP/s (XLA:CPU's 140-300, torch's ~300) and its tied
// logits at ~220 (XLA 134-177); built for AVX2 it loses to XLA there, which keeps those products
// (cpu/__init__.py: kernel_rows).

#include <array>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Matrix = ffi::Buffer<ffi::F32, 2>;
using Panels = ffi::Buffer<ffi::F32, 3>;
using Vector = ffi::Buffer<ffi::F32, 1>;

constexpr int64_t kPanel = 48;  // columns per panel: 3 vectors of 16 floats
// rows per register block of C vectors (16C columns): 8 for a panel's 3 on AVX-512; on AVX2 2
// for 3, 6 for 1 (kAccumulators)
constexpr int BlockRows(int c) { return kAccumulators / c < 8 ? kAccumulators / c : 8; }
constexpr int64_t kRows = BlockRows(kAccumulators >= 24 ? 3 : 1);  // rows per block of many rows
constexpr int64_t kFewRows = 64;  // up to here (decode steps) all rows are one row block
// k steps per slice, each slice summed in fresh accumulators and added to y (blocked summation, as
// Eigen's and MKL's GEMMs do). A sum's rounding error grows about as depth / 2 + k / (2 depth) terms'
// worth (the chain inside a slice, then the slices' adds): 32 steps where k >= 1024, 64 below. With
// 128 everywhere SmolLM2's fp32 logits were 1.2e-4 / rms 1.9e-5 from an fp64 run on a Zen 5 VM
// (its MLP outputs reach 2.2e4 by layer 12) against HF fp32's 5.8e-5 / 9.3e-6, which
// tests/test_gguf.py refuses (<= 1.5x); with these depths 4.7e-5 / 9.5e-6, for ~7% of a SmolLM2
// B8xT128 forward there (0.68 -> 0.73 s). One running sum over all of k: 1.6e-4 (a Xeon, s43).
constexpr int64_t kDepthLong = 32, kDepthShort = 64, kLongK = 1024;
constexpr int64_t kRowBytes = 512 * 1024;  // x rows per row block: this many bytes of them (L2)
// Software prefetch, 32 k steps (6 KiB) ahead, into L2 (prefetcht2): at 8 rows a step is ~12
// cycles of FMAs. SmolLM2's 211 decode products at 8 rows on 2 cores (Xeon, Emerald Rapids):
// 8 steps ahead into L1 27.7 ms, 32 ahead 25.5 ms, 32 ahead into L2 24.2 ms (64: level), none
// 34.4 ms; level at 1 row.
constexpr int64_t kAhead = 32 * kPanel;
// R rows (x, y: their first row) times 16C columns of one panel (wp: the first of them, a panel
// row kPanel floats on; cols <= 16C of them real): RC accumulators held in registers while the panel
// streams past. R is a template argument so that each block size gets its own loop: one loop for any
// R kept 4 of the 24 accumulators of 8 rows on the stack, a load and a store each per step
// (SmolLM2's 8-row decode products 27.9 -> 26.4 ms on 2 cores; 16 rows 38.9 -> 35.0).
template <int R, int C>
void Block(int64_t k0, int64_t k1, int64_t k_dim, int64_t n_dim, int64_t cols, const float* x, const float* wp,
           float* y, bool add, const float* bias) {
  v16 acc[R][C];
  std::memset(acc, 0, sizeof acc);
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = wp + k * kPanel;
    v16 wv[C];
    for (int j = 0; j < C; ++j) {
      __builtin_prefetch(w + kAhead + 16 * j, 0, 1);
      wv[j] = *reinterpret_cast<const v16*>(w + 16 * j);
    }
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      const float b = x[m * k_dim + k];
      for (int j = 0; j < C; ++j) acc[m][j] += b * wv[j];
    }
  }
  for (int m = 0; m < R; ++m) {
    float* yr = y + m * n_dim;
    if (cols == 16 * C) {  // whole vectors (y's rows need not be aligned)
      for (int j = 0; j < C; ++j) {
        v16 sum = acc[m][j];
        if (add) {
          v16 old;
          std::memcpy(&old, yr + 16 * j, sizeof old);
          sum += old;
        }
        if (bias != nullptr) {  // after the sum over k, as a separate y + b would be
          v16 b;
          std::memcpy(&b, bias + 16 * j, sizeof b);
          sum += b;
        }
        std::memcpy(yr + 16 * j, &sum, sizeof sum);
      }
    } else {
      float sum[16 * C];
      std::memcpy(sum, acc[m], sizeof sum);
      for (int64_t c = 0; c < cols; ++c) {
        float v = add ? sum[c] + yr[c] : sum[c];
        yr[c] = bias != nullptr ? v + bias[c] : v;
      }
    }
  }
}

using BlockFn = void (*)(int64_t, int64_t, int64_t, int64_t, int64_t, const float*, const float*, float*, bool,
                         const float*);

template <int C, int... I>
constexpr std::array<BlockFn, sizeof...(I)> BlockTable(std::integer_sequence<int, I...>) {
  return {&Block<I + 1, C>...};
}

// Rows m0 .. m1 of the panel's columns c0 .. c0 + 16C (y, bias: at those columns; cols real ones),
// in blocks of up to BlockRows(C).
template <int C>
void PanelColumns(int64_t m0, int64_t m1, int64_t k0, int64_t k1, int64_t k_dim, int64_t n_dim, int64_t cols,
                  const float* x, const float* wp, float* y, bool add, const float* bias) {
  static constexpr auto table = BlockTable<C>(std::make_integer_sequence<int, BlockRows(C)>{});
  constexpr int64_t r = BlockRows(C);
  for (; m0 < m1; m0 += r) {
    table[(m1 - m0 < r ? m1 - m0 : r) - 1](k0, k1, k_dim, n_dim, cols, x + m0 * k_dim, wp, y + m0 * n_dim, add, bias);
  }
}

// Rows m0 .. m1 of one panel (columns n0 .. n0 + 48 of y) over k steps k0 .. k1; add: onto what y
// holds (the sums of the earlier k steps); bias (all n columns, or null): added after the last k
// step. All 48 columns at once (3 vectors a row) where the registers hold a useful block of rows
// that way (AVX-512: 8 rows; AVX2: few rows, whose products stream the weights from memory), else
// 16 columns at a time (AVX2: 6 rows a block, each weight vector loaded once for the 6).
void Panel(int64_t m0, int64_t m1, int64_t k0, int64_t k1, int64_t k_dim, int64_t n_dim, const float* x,
           const float* wp, float* y, int64_t n0, bool add, const float* bias_all) {
  const int64_t cols = n_dim - n0 < kPanel ? n_dim - n0 : kPanel;
  const float* bias = bias_all != nullptr && k1 == k_dim ? bias_all + n0 : nullptr;
  if (BlockRows(3) >= 8 || m1 - m0 <= BlockRows(3)) {
    PanelColumns<3>(m0, m1, k0, k1, k_dim, n_dim, cols, x, wp, y + n0, add, bias);
    return;
  }
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    PanelColumns<1>(m0, m1, k0, k1, k_dim, n_dim, cols - c0 < 16 ? cols - c0 : 16, x, wp + c0, y + n0 + c0, add,
                    bias != nullptr ? bias + c0 : nullptr);
  }
}

// Runs body(c) for c = 0 .. chunks - 1, shared out between the caller and XLA's intra-op pool;
// returns when all have run. A helper that starts after the caller has finished claims nothing
// and touches only the (shared-owned) job, never the buffers.
struct Chunks {
  std::function<void(int64_t)> body;
  int64_t count = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= count) return;
      body(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Workers, the caller included: one per pool thread (the pool has one per core). The caller is
// runnable too, so as many helpers as pool threads put 3 workers on 2 cores, one of them
// descheduled mid-chunk while the others wait (SmolLM2's 211 decode products: 23.5 -> 19.5 ms
// at 1 row, 29.8 -> 27.3 ms at 8, 51.5 -> 39.6 ms at 16, on 2 cores).
int64_t Workers(ffi::ThreadPool& pool) { return pool.num_threads() > 0 ? pool.num_threads() : 1; }

void Parallel(ffi::ThreadPool& pool, int64_t chunks, std::function<void(int64_t)> body) {
  auto job = std::make_shared<Chunks>();
  job->body = std::move(body);
  job->count = chunks;
  const int64_t workers = Workers(pool);
  const int64_t helpers = workers - 1 < chunks - 1 ? workers - 1 : chunks - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([job] { job->Work(); });
  }
  job->Work();
  while (job->done.load(std::memory_order_acquire) < chunks) {
    __builtin_ia32_pause();
  }
}

// bias: [N] added to every row, or [0] (none).
ffi::Error SmallGemmImpl(ffi::ThreadPool pool, Matrix x, Panels wp, Vector bias, ffi::Result<Matrix> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  const int64_t m = xd[0], k = xd[1], n = yd[1], panels = wd[0];
  if (yd[0] != m || wd[1] != k || wd[2] != kPanel || panels != (n + kPanel - 1) / kPanel ||
      (bias.element_count() != 0 && bias.element_count() != n)) {
    return ffi::Error::InvalidArgument(
        "jsteer_small_gemm: shapes do not match x [M,K], w [ceil(N/48),K,48], bias [N] or [0], y [M,N]");
  }
  const float* xs = x.typed_data();
  const float* ws = wp.typed_data();
  const float* bs = bias.element_count() != 0 ? bias.typed_data() : nullptr;
  float* ys = y->typed_data();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {  // empty sums
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < n; ++c) ys[r * n + c] = bs != nullptr ? bs[c] : 0.0f;
    }
    return ffi::Error::Success();
  }
  const int64_t target = 4 * Workers(pool);  // chunks: a few per worker, for balance
  const int64_t chunk = panels / target > 1 ? panels / target : 1;
  const int64_t groups = (panels + chunk - 1) / chunk;
  // Rows in blocks whose x fits in L2 beside a panel (decode steps: one block); each panel's k
  // steps in slices of `depth`, summed apart and added up (see kDepthLong), each slice staying in L1
  // while every 8-row block of the rows passes. Chunks run row-block-major, so that the workers
  // share one row block at a time.
  const int64_t fit = kRowBytes / (k * static_cast<int64_t>(sizeof(float))) / kRows * kRows;
  const int64_t rows = m <= kFewRows ? m : fit < kRows ? kRows : fit;
  const int64_t row_blocks = (m + rows - 1) / rows;
  const int64_t depth = k >= kLongK ? kDepthLong : kDepthShort;
  Parallel(pool, row_blocks * groups, [=](int64_t c) {
    const int64_t m0 = (c / groups) * rows, m1 = m0 + rows < m ? m0 + rows : m;
    const int64_t g = c % groups, end = (g + 1) * chunk < panels ? (g + 1) * chunk : panels;
    for (int64_t p = g * chunk; p < end; ++p) {
      for (int64_t k0 = 0; k0 < k; k0 += depth) {
        Panel(m0, m1, k0, k0 + depth < k ? k0 + depth : k, k, n, xs, ws + p * k * kPanel, ys, p * kPanel, k0 > 0, bs);
      }
    }
  });
  return ffi::Error::Success();
}

// decode_attention. One query token per row: out[b, j, g] = softmax_s(w_s) @ v[b, j, s, :] with
// w_s = cap(scale * q[b, j, g, :] . k[b, j, :, s]) + bias[b, s], and w_s = -1e30 (jsteer's
// NEG_INF) where !visible[b, s]; cap(x) = softcap * tanh(x / softcap) when softcap > 0. k is the
// cache's [H, S] (keys transposed), v its [S, H]. XLA:CPU runs this step's two batched products as
// small dots, ~80 us each for SmolLM2 at 8 rows and 80 slots (60 a step: 4.8 of a ~29 ms step);
// here one pass per (row, key/value head) reads each key and value once for its G query heads,
// and only the slots between the first and the last visible one (the rest weigh exactly 0).

constexpr float kNegInf = -1e30f;
constexpr float kExpMin = -87.0f;  // exp below this underflows fp32's normal range: taken as 0

// exp(d) for d <= 0 (d < kExpMin -> 0): Cephes' expf (range reduction by ln 2 in two parts, its
// polynomial, times 2^n built in the exponent bits), 16 lanes at a time.
inline v16 Exp(v16 d) {
  const v16 floor = v16{} + kExpMin;
  const v16 x = Select(d < floor, floor, d);
  const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v16i scale = (ToInt(n) + 127) << 23;
  const v16 e = p * AsFloat(scale);
  return Select(d < floor, v16{}, e);
}

struct Attend {
  int64_t kv, g, h, s;  // key/value heads, queries per kv head, head size, cache slots
  int64_t pieces;       // the visible span of each row cut into this many pieces (tasks)
  const float *q, *k, *v, *bias;
  const bool* visible;
  float scale, softcap;
  float* out;
  // pieces > 1: per (head t, piece, query) the piece's max score, weight sum and unnormalised
  // output (h floats), combined by Combine(t)
  float* partial;

  int64_t Stride() const { return h + 2; }
  int64_t OutStride() const { return pieces == 1 ? h : Stride(); }  // between one task's queries

  // Task c: piece c % pieces of head t = c / pieces (t = row * kv + j). w: scratch, grown as needed.
  void operator()(int64_t c, std::vector<float>& w) const {
    const int64_t t = c / pieces, piece = c % pieces;
    const int64_t b = t / kv;
    const bool* vis = visible + b * s;
    const float* add = bias + b * s;
    const float* qt = q + t * g * h;
    const float* kt = k + t * h * s;
    const float* vt = v + t * s * h;
    const int64_t stride = OutStride();
    float* o = pieces == 1 ? out + t * g * h : partial + c * g * stride;
    int64_t lo = 0, hi = s;
    while (lo < hi && !vis[lo]) ++lo;
    while (hi > lo && !vis[hi - 1]) --hi;
    if (lo == hi) {  // no visible slot: every score is -1e30, so every slot weighs 1 (XLA's path)
      if (piece > 0) return Nothing(o);
      Uniform(vt, o);
      if (pieces > 1) {  // piece 0 holds the mean, at max score 0 with weight sum 1
        for (int64_t a = 0; a < g; ++a) {
          o[a * stride + h] = 0.0f;
          o[a * stride + h + 1] = 1.0f;
        }
      }
      return;
    }
    const int64_t len = ((hi - lo + pieces - 1) / pieces + 15) / 16 * 16;
    lo += piece * len;
    hi = lo + len < hi ? lo + len : hi;
    if (lo >= hi) return Nothing(o);  // an empty piece (a short span)
    const int64_t n = hi - lo, width = (n + 15) / 16 * 16;
    if (static_cast<int64_t>(w.size()) < g * width + 2 * g) w.resize(g * width + 2 * g);
    float* sc = w.data();
    float* top = sc + g * width;  // each query's max score over the piece
    float* sum = top + g;         // and its sum of weights
    std::memset(sc, 0, sizeof(float) * g * width);
    const int64_t full = n / 16 * 16;
    for (int64_t i = 0; i < h; ++i) {  // scores: each key row read once for the g queries
      const float* kr = kt + i * s + lo;
      const float* ahead = i + 8 < h ? kr + 8 * s : vt + lo * h;  // the value rows come next
      for (int64_t j = 0; j < full; j += 16) {
        __builtin_prefetch(ahead + j, 0, 1);
        const v16 kj = *reinterpret_cast<const v16*>(kr + j);
        for (int64_t a = 0; a < g; ++a) {
          *reinterpret_cast<v16*>(sc + a * width + j) += qt[a * h + i] * kj;
        }
      }
      for (int64_t a = 0; a < g; ++a) {
        for (int64_t j = full; j < n; ++j) sc[a * width + j] += qt[a * h + i] * kr[j];
      }
    }
    for (int64_t a = 0; a < g; ++a) {
      float* row = sc + a * width;
      for (int64_t j = 0; j < n; ++j) {
        float x = row[j] * scale;
        if (softcap > 0.0f) x = std::tanh(x / softcap) * softcap;
        row[j] = vis[lo + j] ? x + add[lo + j] : kNegInf;
      }
      for (int64_t j = n; j < width; ++j) row[j] = kNegInf;  // padding lanes: weight 0
      v16 most = v16{} + kNegInf;
      for (int64_t j = 0; j < width; j += 16) {
        const v16 x = *reinterpret_cast<const v16*>(row + j);
        most = Select(x > most, x, most);
      }
      float m = kNegInf;
      for (int l = 0; l < 16; ++l) m = most[l] > m ? most[l] : m;
      v16 total = {};
      if (m > kNegInf) {  // else a piece with no visible slot: all weights 0
        for (int64_t j = 0; j < width; j += 16) {
          v16& x = *reinterpret_cast<v16*>(row + j);
          x = Exp(x - m);
          total += x;
        }
      } else {
        std::memset(row, 0, sizeof(float) * width);
      }
      top[a] = m;
      sum[a] = 0.0f;
      for (int l = 0; l < 16; ++l) sum[a] += total[l];
    }
    for (int64_t a = 0; a < g; ++a) std::memset(o + a * stride, 0, sizeof(float) * h);
    for (int64_t j = 0; j < n; ++j) {  // value product: each value row read once for the g queries
      const float* vr = vt + (lo + j) * h;
      for (int64_t c2 = 0; c2 < h; c2 += 16) __builtin_prefetch(vr + 8 * h + c2, 0, 1);
      for (int64_t a = 0; a < g; ++a) {
        const float wj = sc[a * width + j];
        float* oa = o + a * stride;
        for (int64_t i = 0; i < h; ++i) oa[i] += wj * vr[i];
      }
    }
    for (int64_t a = 0; a < g; ++a) {
      float* oa = o + a * stride;
      if (pieces == 1) {
        const float inv = 1.0f / sum[a];
        for (int64_t i = 0; i < h; ++i) oa[i] *= inv;
      } else {
        oa[h] = top[a];
        oa[h + 1] = sum[a];
      }
    }
  }

  // With pieces > 1: head t's output from its pieces' (max, sum, unnormalised output).
  void Combine(int64_t t) const {
    for (int64_t a = 0; a < g; ++a) {
      float m = kNegInf;
      for (int64_t p = 0; p < pieces; ++p) {
        const float mp = partial[((t * pieces + p) * g + a) * Stride() + h];
        m = mp > m ? mp : m;
      }
      float* oa = out + (t * g + a) * h;
      std::memset(oa, 0, sizeof(float) * h);
      float total = 0.0f;
      for (int64_t p = 0; p < pieces; ++p) {
        const float* part = partial + ((t * pieces + p) * g + a) * Stride();
        if (part[h + 1] == 0.0f) continue;
        const float f = std::exp(part[h] - m);
        total += f * part[h + 1];
        for (int64_t i = 0; i < h; ++i) oa[i] += f * part[i];
      }
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < h; ++i) oa[i] *= inv;
    }
  }

 private:
  // A piece that contributes nothing (pieces > 1): weight sum 0, read by Combine as such.
  void Nothing(float* o) const {
    for (int64_t a = 0; a < g; ++a) {
      std::memset(o + a * Stride(), 0, sizeof(float) * h);
      o[a * Stride() + h] = kNegInf;
      o[a * Stride() + h + 1] = 0.0f;
    }
  }

  // Every query of head t gets the mean of all s value rows; o: its outputs, OutStride() apart.
  void Uniform(const float* vt, float* o) const {
    for (int64_t a = 0; a < g; ++a) {
      float* oa = o + a * OutStride();
      std::memset(oa, 0, sizeof(float) * h);
      for (int64_t j = 0; j < s; ++j) {
        for (int64_t i = 0; i < h; ++i) oa[i] += vt[j * h + i];
      }
      for (int64_t i = 0; i < h; ++i) oa[i] /= static_cast<float>(s);
    }
  }
};

// [B, K, ., .], or [B * K, ., .]: the heads' leading axes are read as one
using Heads = ffi::Buffer<ffi::F32>;
using Slots = ffi::Buffer<ffi::F32, 2>;
using SlotFlags = ffi::Buffer<ffi::PRED, 2>;
using Scalar = ffi::Buffer<ffi::F32, 0>;

// (leading axes' product, second-last, last) of a rank 3 or 4 buffer; {-1, -1, -1} otherwise.
struct Dims3 {
  int64_t lead = -1, rows = -1, cols = -1;
};
Dims3 Fold(const Heads& x) {
  const auto d = x.dimensions();
  if (d.size() != 3 && d.size() != 4) return {};
  return {d.size() == 4 ? d[0] * d[1] : d[0], d[d.size() - 2], d[d.size() - 1]};
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, Heads q, Heads k, Heads v, SlotFlags visible, Slots bias,
                               Scalar scale, float softcap, ffi::Result<Heads> out) {
  const Dims3 qd = Fold(q), kd = Fold(k), vd = Fold(v), od = Fold(*out);
  const int64_t b = visible.dimensions()[0], s = visible.dimensions()[1];
  const int64_t heads = qd.lead, g = qd.rows, h = qd.cols;
  const bool fits = b > 0 && heads > 0 && heads % b == 0 && kd.lead == heads && kd.rows == h && kd.cols == s &&
                    vd.lead == heads && vd.rows == s && vd.cols == h && bias.dimensions()[0] == b &&
                    bias.dimensions()[1] == s && od.lead == heads && od.rows == g && od.cols == h;
  if (!fits || s < 1) {
    return ffi::Error::InvalidArgument(
        "jsteer_decode_attention: shapes do not match q [B,K,G,H], k [B,K,H,S], v [B,K,S,H] (or B*K as one "
        "axis), visible and bias [B,S], out as q");
  }
  // Work in floats of keys; below kSerial one thread does it all (a helper's wake-up costs more);
  // a few heads with long spans are cut into pieces (of >= kPiece slots) so every worker gets some.
  constexpr int64_t kSerial = 1 << 16, kPiece = 256, kTasks = 8;
  const bool serial = heads * h * s < kSerial;
  int64_t pieces = serial ? 1 : (kTasks + heads - 1) / heads;
  pieces = pieces < s / kPiece ? pieces : (s / kPiece > 1 ? s / kPiece : 1);
  std::vector<float> partial(pieces > 1 ? heads * pieces * g * (h + 2) : 0);
  const Attend attend{heads / b, g, h, s, pieces, q.typed_data(), k.typed_data(), v.typed_data(),
                      bias.typed_data(), visible.typed_data(), *scale.typed_data(), softcap, out->typed_data(),
                      partial.data()};
  const auto task = [&attend](int64_t c) {
    thread_local std::vector<float> scratch;
    attend(c, scratch);
  };
  if (serial) {
    for (int64_t c = 0; c < heads; ++c) task(c);
  } else {
    Parallel(pool, heads * pieces, task);
  }
  if (pieces > 1) {
    for (int64_t t = 0; t < heads; ++t) attend.Combine(t);
  }
  return ffi::Error::Success();
}

#include "block_attention.h"

using Any = ffi::AnyBuffer;
using Flags = ffi::Buffer<ffi::PRED>;
using Out4 = ffi::Buffer<ffi::F32, 4>;

// The largest element index a [B, S, K, H] walk with these strides reaches (-1 if any count is 0).
int64_t Reach(int64_t b, int64_t s, int64_t k, int64_t h, int64_t sb, int64_t ss, int64_t sk, int64_t sh) {
  if (b < 1 || s < 1 || k < 1 || h < 1) return -1;
  return (b - 1) * sb + (s - 1) * ss + (k - 1) * sk + (h - 1) * sh;
}

#include "block_attention_grad.h"

using Seed = ffi::Buffer<ffi::U32, 1>;

// q, k and v are read at the element offsets q_off / k_off / v_off with the strides given (one
// buffer may be passed for all three: a fused projection); bias_t = 0: no bias (its operand unread);
// seed: 2 words (dropout at the threshold and 1 / (1 - rate) given) or none. Fills `attend` (all but
// out, block and blocks), or says why the operands do not fit.
ffi::Error Operands(Any q, Any k, Any v, Flags visible, Any bias, Scalar scale, Seed seed, int64_t b, int64_t t,
                    int64_t n, int64_t h, int64_t s, int64_t kv, int64_t q_off, int64_t qb, int64_t qt, int64_t qn,
                    int64_t k_off, int64_t kb, int64_t ks, int64_t kk, int64_t kh, int64_t v_off, int64_t vb,
                    int64_t vs, int64_t vk, int64_t vis_t, int64_t bias_t, float softcap, int64_t threshold,
                    float inv_keep, BlockAttend& attend) {
  const bool has_bias = bias_t > 0;
  const bool fits = kv > 0 && n % kv == 0 && h % 16 == 0 && s > 0 && q.element_type() == ffi::F32 &&
                    k.element_type() == ffi::F32 && v.element_type() == ffi::F32 &&
                    bias.element_type() == ffi::F32 && q_off >= 0 && k_off >= 0 && v_off >= 0 &&
                    q_off + Reach(b, t, n, h, qb, qt, qn, 1) < int64_t(q.element_count()) &&
                    k_off + Reach(b, s, kv, h, kb, ks, kk, kh) < int64_t(k.element_count()) &&
                    v_off + Reach(b, s, kv, h, vb, vs, vk, 1) < int64_t(v.element_count()) && (vis_t == 1 || vis_t == t) &&
                    int64_t(visible.element_count()) == b * vis_t * s &&
                    (!has_bias || ((bias_t == 1 || bias_t == t) && int64_t(bias.element_count()) == b * bias_t * s)) &&
                    (seed.element_count() == 0 || seed.element_count() == 2) && threshold >= 0 &&
                    threshold < (int64_t(1) << 32) && b * n * t * s < (int64_t(1) << 32);
  if (!fits) {
    return ffi::Error::InvalidArgument(
        "jsteer_block_attention: q, k, v, visible [B, 1|T, S], bias [B, 1|T, S], seed [0|2] and out [B, T, N, H] "
        "(H a multiple of 16, N a multiple of the kv heads, B*N*T*S < 2**32) do not match the strides given");
  }
  attend = BlockAttend{t, s, kv, n / kv, h, qb, qt, qn, kb, ks, kk, kh, vb, vs, vk, vis_t, bias_t,
                       static_cast<const float*>(q.untyped_data()) + q_off,
                       static_cast<const float*>(k.untyped_data()) + k_off,
                       static_cast<const float*>(v.untyped_data()) + v_off,
                       has_bias ? static_cast<const float*>(bias.untyped_data()) : nullptr, visible.typed_data(),
                       *scale.typed_data(), softcap, nullptr, 0, 0,
                       Drop{seed.element_count() == 2 ? seed.typed_data() : nullptr,
                            static_cast<uint32_t>(threshold), inv_keep}};
  return ffi::Error::Success();
}

// body(0 .. tasks - 1) on the pool, or in the caller alone when there are fewer than 2^16 elements of
// work (a helper's wake-up costs more).
void Run(ffi::ThreadPool& pool, int64_t tasks, int64_t work, std::function<void(int64_t)> body) {
  if (work < (1 << 16)) {
    for (int64_t c = 0; c < tasks; ++c) body(c);
  } else {
    Parallel(pool, tasks, std::move(body));
  }
}

// Run for tasks that take a per-thread Task::Scratch.
template <typename Task>
void RunTasks(ffi::ThreadPool& pool, int64_t tasks, int64_t work, const Task& task) {
  Run(pool, tasks, work, [&task](int64_t c) {
    thread_local typename Task::Scratch scratch;
    task(c, scratch);
  });
}

ffi::Error BlockAttentionImpl(ffi::ThreadPool pool, Any q, Any k, Any v, Flags visible, Any bias, Scalar scale,
                              Seed seed, int64_t s, int64_t kv, int64_t q_off, int64_t qb, int64_t qt, int64_t qn,
                              int64_t k_off, int64_t kb, int64_t ks, int64_t kk, int64_t kh, int64_t v_off, int64_t vb,
                              int64_t vs, int64_t vk, int64_t vis_t, int64_t bias_t, float softcap, int64_t threshold,
                              float inv_keep, ffi::Result<Out4> out) {
  const auto od = out->dimensions();
  const int64_t b = od[0], t = od[1], n = od[2], h = od[3];
  BlockAttend attend;
  const ffi::Error e = Operands(q, k, v, visible, bias, scale, seed, b, t, n, h, s, kv, q_off, qb, qt, qn, k_off, kb,
                                ks, kk, kh, v_off, vb, vs, vk, vis_t, bias_t, softcap, threshold, inv_keep, attend);
  if (e.failure()) return e;
  if (b * t * n * h == 0) return ffi::Error::Success();
  const int64_t workers = Workers(pool);
  // Queries per task: all of them while their scores fit in 256 KiB (L2) and the rows and heads
  // alone make enough tasks (k is packed once per task), else 64, fewer until the tasks balance.
  const int64_t all_fit = t * (s + 47) / 48 * 48 * 4 <= (256 << 10);
  int64_t block = all_fit && b * kv >= 4 * workers ? t : t < 64 ? t : 64;
  while (block > 8 && b * kv * ((t + block - 1) / block) < 4 * workers) block = (block + 1) / 2;
  attend.out = out->typed_data();
  attend.block = block;
  attend.blocks = (t + block - 1) / block;
  RunTasks(pool, b * kv * attend.blocks, b * t * n * h * s, attend);
  return ffi::Error::Success();
}

// block_attention's reverse mode: the same operands and attributes, plus dO and O [B, T, N, H];
// dQ, dK and dV are written into `grads` at the offsets gq_off / gk_off / gv_off with q's, k's and
// v's strides (a fused projection: its gradient, the offsets q_off / k_off / v_off).
ffi::Error BlockAttentionGradImpl(ffi::ThreadPool pool, Any q, Any k, Any v, Flags visible, Any bias, Scalar scale,
                                  Seed seed, Out4 dout, Out4 out, int64_t s, int64_t kv, int64_t q_off, int64_t qb,
                                  int64_t qt, int64_t qn, int64_t k_off, int64_t kb, int64_t ks, int64_t kk, int64_t kh,
                                  int64_t v_off, int64_t vb, int64_t vs, int64_t vk, int64_t vis_t, int64_t bias_t,
                                  int64_t threshold, float inv_keep, int64_t gq_off, int64_t gk_off, int64_t gv_off,
                                  ffi::Result<Any> grads) {
  const auto od = out.dimensions();
  const int64_t b = od[0], t = od[1], n = od[2], h = od[3];
  BlockAttend attend;
  const ffi::Error e = Operands(q, k, v, visible, bias, scale, seed, b, t, n, h, s, kv, q_off, qb, qt, qn, k_off, kb,
                                ks, kk, kh, v_off, vb, vs, vk, vis_t, bias_t, 0.0f, threshold, inv_keep, attend);
  if (e.failure()) return e;
  const int64_t size = grads->element_count();
  const auto dd = dout.dimensions();
  if (kh != 1 || dd[0] != b || dd[1] != t || dd[2] != n || dd[3] != h || grads->element_type() != ffi::F32 ||
      gq_off < 0 || gk_off < 0 || gv_off < 0 || gq_off + Reach(b, t, n, h, qb, qt, qn, 1) >= size ||
      gk_off + Reach(b, s, kv, h, kb, ks, kk, 1) >= size || gv_off + Reach(b, s, kv, h, vb, vs, vk, 1) >= size) {
    return ffi::Error::InvalidArgument(
        "jsteer_block_attention_grad: dO must be O's shape, k rows contiguous, and grads hold dQ, dK and dV");
  }
  if (b * t * n * h == 0) return ffi::Error::Success();
  float* g = static_cast<float*>(grads->untyped_data());
  const BlockAttendGrad grad{attend, dout.typed_data(), out.typed_data(), g + gq_off, g + gk_off, g + gv_off, 64};
  RunTasks(pool, b * kv, b * t * n * h * s, grad);
  return ffi::Error::Success();
}

#include "layer_norm.h"

ffi::Error LayerNormImpl(ffi::ThreadPool pool, Matrix x, Vector scale, Vector bias, float eps, ffi::Result<Matrix> y) {
  const int64_t m = x.dimensions()[0], d = x.dimensions()[1];
  if (d % 16 || scale.element_count() != size_t(d) || bias.element_count() != size_t(d) ||
      y->dimensions()[0] != m || y->dimensions()[1] != d) {
    return ffi::Error::InvalidArgument("jsteer_layer_norm: x [M, D] (D a multiple of 16), scale / bias [D], y [M, D]");
  }
  const Norm norm{d, eps, x.typed_data(), scale.typed_data(), bias.typed_data(), nullptr, y->typed_data(), nullptr,
                  nullptr};
  Run(pool, (m + kNormRows - 1) / kNormRows, m * d,
      [&](int64_t b) { norm.Forward(b * kNormRows, (b + 1) * kNormRows < m ? (b + 1) * kNormRows : m); });
  return ffi::Error::Success();
}

// parts [ceil(M / kNormRows), 2, D]: each row block's dscale and dbias partial sums.
ffi::Error LayerNormGradImpl(ffi::ThreadPool pool, Matrix x, Vector scale, Matrix dy, float eps,
                             ffi::Result<Matrix> dx, ffi::Result<Panels> parts) {
  const int64_t m = x.dimensions()[0], d = x.dimensions()[1], blocks = (m + kNormRows - 1) / kNormRows;
  const auto pd = parts->dimensions();
  if (d % 16 || scale.element_count() != size_t(d) || dy.dimensions()[0] != m || dy.dimensions()[1] != d ||
      dx->dimensions()[0] != m || dx->dimensions()[1] != d || pd[0] != blocks || pd[1] != 2 || pd[2] != d) {
    return ffi::Error::InvalidArgument(
        "jsteer_layer_norm_grad: x, dy, dx [M, D] (D a multiple of 16), scale [D], parts [ceil(M / 64), 2, D]");
  }
  const Norm norm{d, eps, x.typed_data(), scale.typed_data(), nullptr, dy.typed_data(), nullptr, dx->typed_data(),
                  parts->typed_data()};
  Run(pool, blocks, m * d, [&](int64_t b) { norm.Reverse(b, m); });
  return ffi::Error::Success();
}

// A copy XLA cannot look through: what a caller computes before it is materialised once instead of
// being fused into (and recomputed by) each consumer.
ffi::Error MaterializeImpl(Any x, ffi::Result<Any> y) {
  if (x.size_bytes() != y->size_bytes()) return ffi::Error::InvalidArgument("jsteer_materialize: sizes differ");
  std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsteerSmallGemm, SmallGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Panels>()
                                  .Arg<Vector>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsteerDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Heads>()
                                  .Arg<Heads>()
                                  .Arg<Heads>()
                                  .Arg<SlotFlags>()
                                  .Arg<Slots>()
                                  .Arg<Scalar>()
                                  .Attr<float>("softcap")
                                  .Ret<Heads>());

// The operands (q, k, v, visible, bias, scale, seed) block_attention and its reverse mode share...
template <typename Binding>
auto AttentionOperands(Binding binding) {
  return std::move(binding)
      .template Arg<Any>()
      .template Arg<Any>()
      .template Arg<Any>()
      .template Arg<Flags>()
      .template Arg<Any>()
      .template Arg<Scalar>()
      .template Arg<Seed>();
}

// ... and their layout attributes: key count, kv heads, the strides and offsets of q, k and v, the rows
// of visible and bias.
template <typename Binding>
auto AttentionLayout(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("s")
      .template Attr<int64_t>("kv")
      .template Attr<int64_t>("q_off")
      .template Attr<int64_t>("qb")
      .template Attr<int64_t>("qt")
      .template Attr<int64_t>("qn")
      .template Attr<int64_t>("k_off")
      .template Attr<int64_t>("kb")
      .template Attr<int64_t>("ks")
      .template Attr<int64_t>("kk")
      .template Attr<int64_t>("kh")
      .template Attr<int64_t>("v_off")
      .template Attr<int64_t>("vb")
      .template Attr<int64_t>("vs")
      .template Attr<int64_t>("vk")
      .template Attr<int64_t>("vis_t")
      .template Attr<int64_t>("bias_t");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsteerBlockAttention, BlockAttentionImpl,
                              AttentionLayout(AttentionOperands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()))
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("threshold")
                                  .Attr<float>("inv_keep")
                                  .Ret<Out4>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsteerBlockAttentionGrad, BlockAttentionGradImpl,
                              AttentionLayout(AttentionOperands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                                                  .Arg<Out4>()
                                                  .Arg<Out4>())
                                  .Attr<int64_t>("threshold")
                                  .Attr<float>("inv_keep")
                                  .Attr<int64_t>("gq_off")
                                  .Attr<int64_t>("gk_off")
                                  .Attr<int64_t>("gv_off")
                                  .Ret<Any>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsteerLayerNorm, LayerNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Vector>()
                                  .Arg<Vector>()
                                  .Attr<float>("eps")
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsteerLayerNormGrad, LayerNormGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Vector>()
                                  .Arg<Matrix>()
                                  .Attr<float>("eps")
                                  .Ret<Matrix>()
                                  .Ret<Panels>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsteerMaterialize, MaterializeImpl, ffi::Ffi::Bind().Arg<Any>().Ret<Any>());
