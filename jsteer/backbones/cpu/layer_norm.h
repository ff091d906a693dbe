// layer_norm / layer_norm_grad: LayerNorm over the last axis of x [M, D] (D a multiple of 16), and
// its reverse mode, included by decode_kernels.cc inside its anonymous namespace (it uses v16 and
// Parallel).
//
// y = (x - mean) / sqrt(var + eps) * scale + bias, mean and var over the row in two passes. Reverse,
// with xhat = (x - mean) * rstd and g = dy * scale:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  dscale = sum_rows dy * xhat,  dbias = sum_rows dy.
// XLA:CPU computed the column sums of dscale / dbias as trees of reduce-windows at about a tenth of
// the read bandwidth (MiniLM B32xT128 train step: ~80 ms in 13 LayerNorms, plus the row passes
// fused in several places). Here rows go in fixed blocks of kNormRows, each task writing its block's
// partial column sums to its own row of `parts` (added up by the caller in block order), so the sums
// do not depend on the number of threads.

constexpr int64_t kNormRows = 64;

struct Norm {
  int64_t d;
  float eps;
  const float *x, *scale, *bias, *dy;  // bias: forward only; dy: reverse only
  float *y, *dx, *parts;               // parts [blocks, 2, d]: dscale, dbias partial sums

  // (mean, rstd) of row r.
  void Stats(const float* xr, float& mean, float& rstd) const {
    v16 s = {};
    for (int64_t c = 0; c < d; c += 16) s += *reinterpret_cast<const v16*>(xr + c);
    mean = ReduceAdd(s) / static_cast<float>(d);
    v16 q = {};
    for (int64_t c = 0; c < d; c += 16) {
      const v16 z = *reinterpret_cast<const v16*>(xr + c) - mean;
      q += z * z;
    }
    rstd = 1.0f / std::sqrt(ReduceAdd(q) / static_cast<float>(d) + eps);
  }

  void Forward(int64_t r0, int64_t r1) const {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * d;
      float mean, rstd;
      Stats(xr, mean, rstd);
      for (int64_t c = 0; c < d; c += 16) {
        const v16 z = (*reinterpret_cast<const v16*>(xr + c) - mean) * rstd;
        *reinterpret_cast<v16*>(y + r * d + c) =
            z * *reinterpret_cast<const v16*>(scale + c) + *reinterpret_cast<const v16*>(bias + c);
      }
    }
  }

  void Reverse(int64_t block, int64_t m) const {
    const int64_t r0 = block * kNormRows, r1 = r0 + kNormRows < m ? r0 + kNormRows : m;
    float* ds = parts + block * 2 * d;
    float* db = ds + d;
    std::memset(ds, 0, sizeof(float) * 2 * d);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * d;
      const float* dyr = dy + r * d;
      float mean, rstd;
      Stats(xr, mean, rstd);
      v16 sg = {}, sgx = {};
      for (int64_t c = 0; c < d; c += 16) {
        const v16 z = (*reinterpret_cast<const v16*>(xr + c) - mean) * rstd;
        const v16 dyv = *reinterpret_cast<const v16*>(dyr + c);
        const v16 g = dyv * *reinterpret_cast<const v16*>(scale + c);
        sg += g;
        sgx += g * z;
        *reinterpret_cast<v16*>(ds + c) += dyv * z;
        *reinterpret_cast<v16*>(db + c) += dyv;
      }
      const float a = ReduceAdd(sg) / static_cast<float>(d);
      const float bb = ReduceAdd(sgx) / static_cast<float>(d);
      for (int64_t c = 0; c < d; c += 16) {
        const v16 z = (*reinterpret_cast<const v16*>(xr + c) - mean) * rstd;
        const v16 g = *reinterpret_cast<const v16*>(dyr + c) * *reinterpret_cast<const v16*>(scale + c);
        *reinterpret_cast<v16*>(dx + r * d + c) = (g - a - z * bb) * rstd;
      }
    }
  }
};
