// y[M, N] = x[M, K] @ W[K, N] for few rows M (decoding), with W pre-packed in column panels.
//
// Decoding multiplies a handful of rows by every weight matrix once per token, so the time is
// the time to stream the weights from memory. XLA:CPU's GEMM path reaches about half the read
// bandwidth there for 2 <= M <= 12 (it is built for large M; up to 64 rows this kernel still wins). This kernel reads each weight
// once, contiguously: W is stored as panels [ceil(N/48), K, 48] (`pack` in cpu/__init__.py), and
// each panel's 48 columns for up to 8 rows stay in 24 vector accumulators (AVX-512) while the
// panel streams past. Panels are shared out between the caller and XLA's intra-op thread pool.
//
// Built at first use by jsteer/backbones/cpu/__init__.py (g++ -O3 -march=native); only used on
// CPUs with AVX-512F. fp32 throughout; sums run over k in order, one FMA per term.

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Matrix = ffi::Buffer<ffi::F32, 2>;
using Panels = ffi::Buffer<ffi::F32, 3>;

constexpr int64_t kPanel = 48;  // columns per panel: 3 vectors of 16 floats
constexpr int64_t kRows = 8;    // rows per register block: 8 x 3 accumulators
// Software prefetch, 32 k steps (6 KiB) ahead, into L2 (prefetcht2): at 8 rows a step is ~12
// cycles of FMAs. SmolLM2's 211 decode products at 8 rows on 2 cores (Xeon, Emerald Rapids):
// 8 steps ahead into L1 27.7 ms, 32 ahead 25.5 ms, 32 ahead into L2 24.2 ms (64: level), none
// 34.4 ms; level at 1 row.
constexpr int64_t kAhead = 32 * kPanel;
typedef float v16 __attribute__((vector_size(64), aligned(4)));

// R rows (x, y: their first row) of one panel: 3R accumulators held in registers while the
// panel streams past. R is a template argument so that each block size gets its own loop: one
// loop for any R kept 4 of the 24 accumulators of 8 rows on the stack, a load and a store each
// per step (SmolLM2's 8-row decode products 27.9 -> 26.4 ms on 2 cores; 16 rows 38.9 -> 35.0).
template <int R>
void Block(int64_t k_dim, int64_t n_dim, int64_t cols, const float* x, const float* wp, float* y) {
  v16 acc[R][3];
  std::memset(acc, 0, sizeof acc);
  for (int64_t k = 0; k < k_dim; ++k) {
    const float* w = wp + k * kPanel;
    __builtin_prefetch(w + kAhead, 0, 1);
    __builtin_prefetch(w + kAhead + 16, 0, 1);
    __builtin_prefetch(w + kAhead + 32, 0, 1);
    const v16 w0 = *reinterpret_cast<const v16*>(w);
    const v16 w1 = *reinterpret_cast<const v16*>(w + 16);
    const v16 w2 = *reinterpret_cast<const v16*>(w + 32);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      const float b = x[m * k_dim + k];
      acc[m][0] += b * w0;
      acc[m][1] += b * w1;
      acc[m][2] += b * w2;
    }
  }
  for (int m = 0; m < R; ++m) {
    std::memcpy(y + m * n_dim, acc[m], cols * sizeof(float));
  }
}

// One panel (columns n0 .. n0 + 48 of y) for all M rows, in blocks of up to 8 rows.
void Panel(int64_t m_rows, int64_t k_dim, int64_t n_dim, const float* x, const float* wp, float* y,
           int64_t n0) {
  const int64_t cols = n_dim - n0 < kPanel ? n_dim - n0 : kPanel;
  for (int64_t m0 = 0; m0 < m_rows; m0 += kRows) {
    const float* xr = x + m0 * k_dim;
    float* yr = y + m0 * n_dim + n0;
    switch (m_rows - m0 < kRows ? m_rows - m0 : kRows) {
      case 8: Block<8>(k_dim, n_dim, cols, xr, wp, yr); break;
      case 7: Block<7>(k_dim, n_dim, cols, xr, wp, yr); break;
      case 6: Block<6>(k_dim, n_dim, cols, xr, wp, yr); break;
      case 5: Block<5>(k_dim, n_dim, cols, xr, wp, yr); break;
      case 4: Block<4>(k_dim, n_dim, cols, xr, wp, yr); break;
      case 3: Block<3>(k_dim, n_dim, cols, xr, wp, yr); break;
      case 2: Block<2>(k_dim, n_dim, cols, xr, wp, yr); break;
      default: Block<1>(k_dim, n_dim, cols, xr, wp, yr); break;
    }
  }
}

struct Job {
  int64_t m, k, n, panels, chunk, chunks;
  const float* x;
  const float* wp;
  float* y;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Claims chunks of panels until none are left. A helper that starts after the caller has
// finished claims nothing and touches only the (shared-owned) job, never the buffers.
void Work(Job& job) {
  for (;;) {
    const int64_t c = job.next.fetch_add(1, std::memory_order_relaxed);
    if (c >= job.chunks) return;
    const int64_t end = (c + 1) * job.chunk < job.panels ? (c + 1) * job.chunk : job.panels;
    for (int64_t p = c * job.chunk; p < end; ++p) {
      Panel(job.m, job.k, job.n, job.x, job.wp + p * job.k * kPanel, job.y, p * kPanel);
    }
    job.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error SmallGemmImpl(ffi::ThreadPool pool, Matrix x, Panels wp, ffi::Result<Matrix> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  if (yd[0] != m || wd[1] != k || wd[2] != kPanel || wd[0] != (n + kPanel - 1) / kPanel) {
    return ffi::Error::InvalidArgument("jsteer_small_gemm: shapes do not match x [M,K], w [ceil(N/48),K,48], y [M,N]");
  }
  auto job = std::make_shared<Job>();
  job->m = m; job->k = k; job->n = n; job->panels = wd[0];
  job->x = x.typed_data(); job->wp = wp.typed_data(); job->y = y->typed_data();
  // Workers, the caller included: one per pool thread (the pool has one per core). The caller is
  // runnable too, so as many helpers as pool threads put 3 workers on 2 cores, one of them
  // descheduled mid-chunk while the others wait (SmolLM2's 211 decode products: 23.5 -> 19.5 ms
  // at 1 row, 29.8 -> 27.3 ms at 8, 51.5 -> 39.6 ms at 16, on 2 cores).
  const int64_t workers = pool.num_threads() > 0 ? pool.num_threads() : 1;
  const int64_t target = 4 * workers;  // chunks: a few per worker, for balance
  job->chunk = job->panels / target > 1 ? job->panels / target : 1;
  job->chunks = (job->panels + job->chunk - 1) / job->chunk;
  const int64_t helpers = workers - 1 < job->chunks - 1 ? workers - 1 : job->chunks - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([job] { Work(*job); });
  }
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->chunks) {
    __builtin_ia32_pause();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsteerSmallGemm, SmallGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Panels>()
                                  .Ret<Matrix>());
