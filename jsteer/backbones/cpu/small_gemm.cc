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
typedef float v16 __attribute__((vector_size(64), aligned(4)));

// One panel (columns n0 .. n0 + 48 of y) for all M rows.
void Panel(int64_t m_rows, int64_t k_dim, int64_t n_dim, const float* x, const float* wp, float* y,
           int64_t n0) {
  const int64_t cols = n_dim - n0 < kPanel ? n_dim - n0 : kPanel;
  for (int64_t m0 = 0; m0 < m_rows; m0 += kRows) {
    const int64_t rows = m_rows - m0 < kRows ? m_rows - m0 : kRows;
    v16 acc[kRows][3];
    std::memset(acc, 0, sizeof acc);
    const float* xr = x + m0 * k_dim;
    for (int64_t k = 0; k < k_dim; ++k) {
      const float* w = wp + k * kPanel;
      __builtin_prefetch(w + 8 * kPanel);
      __builtin_prefetch(w + 8 * kPanel + 16);
      __builtin_prefetch(w + 8 * kPanel + 32);
      const v16 w0 = *reinterpret_cast<const v16*>(w);
      const v16 w1 = *reinterpret_cast<const v16*>(w + 16);
      const v16 w2 = *reinterpret_cast<const v16*>(w + 32);
      if (rows == kRows) {
#pragma GCC unroll 8
        for (int64_t m = 0; m < kRows; ++m) {
          const float b = xr[m * k_dim + k];
          acc[m][0] += b * w0;
          acc[m][1] += b * w1;
          acc[m][2] += b * w2;
        }
      } else {
        for (int64_t m = 0; m < rows; ++m) {
          const float b = xr[m * k_dim + k];
          acc[m][0] += b * w0;
          acc[m][1] += b * w1;
          acc[m][2] += b * w2;
        }
      }
    }
    for (int64_t m = 0; m < rows; ++m) {
      std::memcpy(y + (m0 + m) * n_dim + n0, acc[m], cols * sizeof(float));
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
  const int64_t threads = pool.num_threads() > 0 ? pool.num_threads() : 0;
  const int64_t target = 4 * (threads + 1);  // chunks: a few per thread, for balance
  job->chunk = job->panels / target > 1 ? job->panels / target : 1;
  job->chunks = (job->panels + job->chunk - 1) / job->chunk;
  const int64_t helpers = threads < job->chunks - 1 ? threads : job->chunks - 1;
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
