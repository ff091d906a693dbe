// block_attention_grad: the reverse-mode derivative of block_attention (same operands, strides,
// visibility, bias and dropout), included by decode_kernels.cc after block_attention.h.
//
// Given dO [B, T, N, H] and the forward's output O: with P the softmax weights of a query row, M its
// dropout factors (kept: 1 / (1 - rate), dropped: 0) and Pd = P * M the weights the value product
// used,
//   dV = Pd^T dO,   dP = (dO V^T) * M,   dS = P * (dP - D) with D = rowsum(dO * O) = rowsum(dP * P),
//   dQ = scale * dS K,   dK = scale * dS^T Q.
// XLA:CPU runs the hand-written path's backward as six batched products at 45-90 GFLOP/s (torch
// 150-220) plus passes over the [B, N, T, S] tensors in memory (MiniLM B32xT128 train step: ~60 of
// ~280 ms per layer). Here one task per (row b, key/value head) recomputes its queries' scores (the
// forward kept nothing but O), in blocks of up to 64 queries, and accumulates its keys' and values'
// gradients over its G query heads in private buffers: every gradient element is written by exactly
// one task, once, so the output needs no zeroing and no atomics. Keys outside the union of the
// task's visible spans get 0; a query row with no visible key (uniform weights in the forward) gives
// dq = 0 and adds M / S times its dO to every value's gradient. No soft-capping, no KV-cache layout
// (the caller checks).

struct BlockAttendGrad {
  BlockAttend f;             // the forward's operands, strides, options and dropout
  const float *dout, *out;   // dO and O [B, T, K * G, H]
  float *gq, *gk, *gv;       // dQ, dK, dV at q's, k's and v's strides (one buffer for a fused projection)
  int64_t block;             // queries per block

  struct Scratch {
    std::vector<float> kp, vp, kc, qc, dc, p, ds, dk, dv, sums;
  };

  void operator()(int64_t c, Scratch& w) const {
    const int64_t t = f.t, s = f.s, h = f.h, g = f.g, n_heads = f.kv * f.g;
    const int64_t b = c / f.kv, j = c % f.kv;
    int64_t lo, hi;  // the union of the task's visible spans
    f.Span(b, 0, t, lo, hi);
    const int64_t span = hi > lo ? hi - lo : 0, width = (span + 47) / 48 * 48, nps = width / 48;
    const int64_t rows_max = block < t ? block : t;
    Grow(w.kp, width * h);
    Grow(w.vp, width * h);
    Grow(w.kc, width * h);
    Grow(w.qc, rows_max * h);
    Grow(w.dc, rows_max * h);
    Grow(w.p, rows_max * width);
    Grow(w.ds, rows_max * width);
    Grow(w.dk, s * h);
    Grow(w.dv, s * h);
    Grow(w.sums, rows_max);
    const float* kj = f.k + b * f.kb + lo * f.ks + j * f.kk;
    const float* vj = f.v + b * f.vb + lo * f.vs + j * f.vk;
    // Every row this task reads lies a projection row apart from the next (MiniLM: 4.5 KiB): asked
    // for all at once into L2, their misses overlap instead of stalling the copies one by one.
    Prefetch(kj, f.ks, span, h);
    Prefetch(vj, f.vs, span, h);
    for (int64_t a = 0; a < g; ++a) {
      Prefetch(f.q + b * f.qb + (j * g + a) * f.qn, f.qt, t, h);
      Prefetch(dout + (b * t * n_heads + j * g + a) * h, n_heads * h, t, h);
      Prefetch(out + (b * t * n_heads + j * g + a) * h, n_heads * h, t, h);
    }
    // Rows a product walks by depth are copied contiguous: at the projections' strides (MiniLM: 4.5
    // KiB) a head's 128 rows fall in 8 of L1's 64 sets and evict each other.
    float *kc = w.kc.data(), *qc = w.qc.data(), *dc = w.dc.data();
    Gather(kj, f.ks, span, h, kc);
    PackRows(kc, h, span, h, w.kp.data());
    PackRows(vj, f.vs, span, h, w.vp.data());
    float *dk = w.dk.data(), *dv = w.dv.data();
    std::memset(dk, 0, sizeof(float) * s * h);
    std::memset(dv, 0, sizeof(float) * s * h);
    const v16 scale = v16{} + f.scale;
    for (int64_t a = 0; a < g; ++a) {
      const int64_t n = j * g + a;
      for (int64_t i0 = 0; i0 < t; i0 += block) {
        const int64_t rows = t - i0 < block ? t - i0 : block;
        const float* qa = f.q + b * f.qb + i0 * f.qt + n * f.qn;
        const float* da = dout + ((b * t + i0) * n_heads + n) * h;  // rows n_heads * h apart
        const float* oa = out + ((b * t + i0) * n_heads + n) * h;
        Gather(qa, f.qt, rows, h, qc);
        Gather(da, n_heads * h, rows, h, dc);
        float *p = w.p.data(), *ds = w.ds.data(), *sums = w.sums.data();
        for (int64_t q0 = 0; q0 < nps; ++q0) {
          Tiles48(rows, qc, h, h, w.kp.data() + q0 * h * 48, 48, p + q0 * 48, width);
          Tiles48(rows, dc, h, h, w.vp.data() + q0 * h * 48, 48, ds + q0 * 48, width);  // dO V^T
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* pr = p + r * width;
          float* dr = ds + r * width;
          sums[r] = f.Softmax(b, i0 + r, lo, span, width, pr);
          const uint32_t idx = f.Index(b, j, a, i0 + r);
          if (sums[r] == 0.0f) {  // no visible key: uniform weights over all s keys, dq = 0
            const float* dor = dc + r * h;
            for (int64_t x = 0; x < s; ++x) {
              const float m = (f.drop.seed == nullptr ? 1.0f : f.drop.Factor(idx + static_cast<uint32_t>(x))) / s;
              for (int64_t d = 0; d < h; ++d) dv[x * h + d] += m * dor[d];
            }
            std::memset(pr, 0, sizeof(float) * width);
            std::memset(dr, 0, sizeof(float) * width);
            continue;
          }
          v16 dsum = {};  // D = rowsum(dO * O)
          for (int64_t d = 0; d < h; d += 16) {
            dsum += *reinterpret_cast<const v16*>(dc + r * h + d) * *reinterpret_cast<const v16*>(oa + r * n_heads * h + d);
          }
          const v16 inv = v16{} + 1.0f / sums[r], big_d = v16{} + ReduceAdd(dsum);
          for (int64_t x = 0; x < width; x += 16) {
            v16& pv = *reinterpret_cast<v16*>(pr + x);
            v16& dv16 = *reinterpret_cast<v16*>(dr + x);
            const v16 prob = pv * inv;
            const v16 m = f.drop.seed == nullptr ? v16{} + 1.0f : f.drop.Factors(idx + static_cast<uint32_t>(lo + x));
            dv16 = prob * (dv16 * m - big_d) * scale;  // dS, scaled
            pv = prob * m;                              // Pd
          }
        }
        // dQ rows: dS [rows, span] times the span's keys, straight into the gradient buffer
        Columns(rows, ds, width, span, kc, h, gq + b * f.qb + i0 * f.qt + n * f.qn, f.qt, h);
        // dV += Pd^T dO and dK += dS^T Q: the key is the row (adjacent floats), the query the depth
        Columns(span, p, 1, rows, dc, h, dv + lo * h, h, h, width, true);
        Columns(span, ds, 1, rows, qc, h, dk + lo * h, h, h, width, true);
      }
    }
    for (int64_t x = 0; x < s; ++x) {
      std::memcpy(gk + b * f.kb + x * f.ks + j * f.kk, dk + x * h, sizeof(float) * h);
      std::memcpy(gv + b * f.vb + x * f.vs + j * f.vk, dv + x * h, sizeof(float) * h);
    }
  }

 private:
  static void Prefetch(const float* src, int64_t stride, int64_t n, int64_t h) {
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t x = 0; x < h; x += 16) _mm_prefetch(reinterpret_cast<const char*>(src + r * stride + x), _MM_HINT_T1);
    }
  }

  static void Gather(const float* src, int64_t stride, int64_t n, int64_t h, float* dst) {
    for (int64_t r = 0; r < n; ++r) std::memcpy(dst + r * h, src + r * stride, sizeof(float) * h);
  }

};
