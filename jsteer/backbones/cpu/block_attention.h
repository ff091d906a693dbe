// block_attention: attention of many query tokens at once (forwards, prefills), included by
// decode_kernels.cc inside its anonymous namespace (it uses v16, Exp, kNegInf and Parallel).
//
// out[b, i, n] = softmax_s(w_s) @ v[b, s, n / G] with w_s = cap(scale * q[b, i, n] . k[b, s, n / G])
// + bias[b, i, s], and w_s = -1e30 where !visible[b, i, s]: jsteer's dot_product_attention. XLA:CPU
// runs that function as head transposes of q, k and v (copies), two batched products at ~100
// GFLOP/s on 2 Xeon cores (torch ~250) and passes over the [B, N, T, S] score tensor in memory
// (MiniLM B32xT128: ~14 of a layer's ~68 ms). Here one task per (row b, key/value head, block of
// queries: all T while their scores fit in L2 and the rows and heads make enough tasks, else up to
// 64) reads q, k and v where they lie (strides: a fused [B, T, 3, N, H] projection,
// separate [B, T, N, H] ones, or the KV cache's [B, K, H, S] / [B, K, S, H]), scores only the keys
// between the block's first and last visible one (a causal block skips the keys after it; a
// prefill skips the cache's empty slots), and keeps the block's scores in L2.
//
// A row with no visible key, or whose every score is -1e30, weighs all S keys equally, as
// dot_product_attention does. Scores go through register tiles of 8 queries x 48 keys (k packed
// per task in 48-key panels), the value product through tiles of up to 12 queries x 64 columns.

// R x 16C outputs: y[m, :] = sum_d x[m * xs + d] * w[d * ws + :], d < depth; x, w, y any alignment.
template <int R, int C>
void Tile(const float* x, int64_t xs, int64_t depth, const float* w, int64_t ws, float* y, int64_t ys) {
  v16 acc[R][C];
  std::memset(acc, 0, sizeof acc);
  for (int64_t d = 0; d < depth; ++d) {
    v16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = *reinterpret_cast<const v16*>(w + d * ws + 16 * c);
#pragma GCC unroll 12
    for (int m = 0; m < R; ++m) {
      const float a = x[m * xs + d];
      for (int c = 0; c < C; ++c) acc[m][c] += a * wv[c];
    }
  }
  for (int m = 0; m < R; ++m) std::memcpy(y + m * ys, acc[m], sizeof acc[m]);
}

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t);

template <int C, int... I>
constexpr std::array<TileFn, sizeof...(I)> TileTable(std::integer_sequence<int, I...>) {
  return {&Tile<I + 1, C>...};
}

// Rows per tile for C vectors of columns: 24 of the 32 vector registers hold accumulators.
constexpr int TileRows(int c) { return c == 1 ? 12 : 24 / c < 12 ? 24 / c : 12; }

// m rows of x times w's 16C columns, in tiles of TileRows(C) rows.
template <int C>
void Tiles(int64_t m, const float* x, int64_t xs, int64_t depth, const float* w, int64_t ws, float* y, int64_t ys) {
  static constexpr auto table = TileTable<C>(std::make_integer_sequence<int, TileRows(C)>{});
  constexpr int64_t r = TileRows(C);
  for (int64_t m0 = 0; m0 < m; m0 += r) {
    table[(m - m0 < r ? m - m0 : r) - 1](x + m0 * xs, xs, depth, w, ws, y + m0 * ys, ys);
  }
}

struct BlockAttend {
  int64_t t, s, kv, g, h;      // queries, keys, key/value heads, query heads per kv head, head size
  int64_t qb, qt, qn;           // q strides: row, query, head (a head's h floats contiguous)
  int64_t kb, ks, kk, kh;       // k strides: row, key, kv head, head dimension
  int64_t vb, vs, vk;           // v strides: row, key, kv head (a value's h floats contiguous)
  int64_t vis_t, bias_t;        // visible / bias rows per batch row: 1 (shared) or t
  const float *q, *k, *v, *bias;  // bias: nullptr when there is none
  const bool* visible;
  float scale, softcap;
  float* out;                   // [B, T, K * G, H]
  int64_t block, blocks;        // queries per task, tasks per (row, kv head)

  struct Scratch {
    std::vector<float> panels, scores, acc, sums;
  };

  void operator()(int64_t c, Scratch& w) const {
    const int64_t b = c / (kv * blocks), j = (c / blocks) % kv;
    const int64_t i0 = (c % blocks) * block, i1 = i0 + block < t ? i0 + block : t, rows = i1 - i0;
    int64_t lo = s, hi = 0;  // the block's visible keys lie in [lo, hi)
    for (int64_t i = i0; i < i1; ++i) {
      const bool* vr = visible + (b * vis_t + (vis_t == 1 ? 0 : i)) * s;
      int64_t a = 0, e = s;
      while (a < e && !vr[a]) ++a;
      while (e > a && !vr[e - 1]) --e;
      if (a < e) {
        lo = a < lo ? a : lo;
        hi = e > hi ? e : hi;
      }
      if (vis_t == 1) break;
    }
    const int64_t span = hi > lo ? hi - lo : 0, width = (span + 47) / 48 * 48, nps = width / 48;
    // k of the span in 48-key panels [nps, h, 48], zero past the span
    if (static_cast<int64_t>(w.panels.size()) < width * h) w.panels.resize(width * h);
    if (static_cast<int64_t>(w.scores.size()) < rows * width) w.scores.resize(rows * width);
    if (static_cast<int64_t>(w.acc.size()) < rows * h) w.acc.resize(rows * h);
    if (static_cast<int64_t>(w.sums.size()) < rows) w.sums.resize(rows);
    float* kp = w.panels.data();
    const float* kj = k + b * kb + lo * ks + j * kk;
    std::memset(kp, 0, sizeof(float) * width * h);
    if (kh == 1) {  // each key's h floats contiguous: read them in order
      for (int64_t key = 0; key < span; ++key) {
        float* dst = kp + (key / 48) * h * 48 + key % 48;
        for (int64_t d = 0; d < h; ++d) dst[d * 48] = kj[key * ks + d];
      }
    } else {  // the cache's [H, S]: each dimension's keys contiguous
      for (int64_t key0 = 0; key0 < span; key0 += 48) {
        const int64_t n = span - key0 < 48 ? span - key0 : 48;
        for (int64_t d = 0; d < h; ++d) std::memcpy(kp + (key0 * h + d * 48), kj + key0 * ks + d * kh, n * 4);
      }
    }
    const float* vj = v + b * vb + lo * vs + j * vk;
    for (int64_t a = 0; a < g; ++a) {
      const int64_t n = j * g + a;
      const float* qa = q + b * qb + i0 * qt + n * qn;
      float* sc = w.scores.data();
      for (int64_t p = 0; p < nps; ++p) {
        Tiles<3>(rows, qa, qt, h, kp + p * h * 48, 48, sc + p * 48, width);
      }
      float* o = w.acc.data();
      float* sums = w.sums.data();
      for (int64_t r = 0; r < rows; ++r) sums[r] = Softmax(b, i0 + r, lo, span, width, sc + r * width);
      for (int64_t c0 = 0; c0 < h; c0 += 64) {  // the value product, 64 columns at a time
        const int64_t cols = h - c0 < 64 ? h - c0 : 64;
        switch (cols / 16) {
          case 4: Tiles<4>(rows, sc, width, span, vj + c0, vs, o + c0, h); break;
          case 3: Tiles<3>(rows, sc, width, span, vj + c0, vs, o + c0, h); break;
          case 2: Tiles<2>(rows, sc, width, span, vj + c0, vs, o + c0, h); break;
          default: Tiles<1>(rows, sc, width, span, vj + c0, vs, o + c0, h); break;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out + (((b * t + i0 + r) * kv + j) * g + a) * h;
        if (sums[r] == 0.0f) {
          Mean(b, j, dst);
          continue;
        }
        const float inv = 1.0f / sums[r];
        for (int64_t x = 0; x < h; ++x) dst[x] = o[r * h + x] * inv;
      }
    }
  }

 private:
  // Query i's products with keys lo .. lo + span (row: width floats, the rest padding) -> its
  // unnormalised weights exp(w - max w); returns their sum, or 0 when every score is -1e30 (the
  // row then weighs all s keys equally).
  float Softmax(int64_t b, int64_t i, int64_t lo, int64_t span, int64_t width, float* row) const {
    const bool* vr = visible + (b * vis_t + (vis_t == 1 ? 0 : i)) * s + lo;
    const float* br = bias == nullptr ? nullptr : bias + (b * bias_t + (bias_t == 1 ? 0 : i)) * s + lo;
    const int64_t full = softcap > 0.0f ? 0 : span / 16 * 16;  // soft-capping: the scalar loop
    const v16 neg = v16{} + kNegInf;
    v16 most = neg;
    for (int64_t x = 0; x < full; x += 16) {
      v16 y = *reinterpret_cast<const v16*>(row + x) * scale;
      if (br != nullptr) y += *reinterpret_cast<const v16*>(br + x);
      const __m512i seen = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vr + x)));
      y = (v16)_mm512_mask_mov_ps((__m512)neg, _mm512_test_epi32_mask(seen, seen), (__m512)y);
      *reinterpret_cast<v16*>(row + x) = y;
      most = y > most ? y : most;
    }
    float m = _mm512_reduce_max_ps((__m512)most);  // a tree, not a chain of 16: rows are short
    for (int64_t x = full; x < span; ++x) {
      float y = row[x] * scale;
      if (softcap > 0.0f) y = std::tanh(y / softcap) * softcap;
      if (br != nullptr) y += br[x];
      row[x] = vr[x] ? y : kNegInf;
      m = row[x] > m ? row[x] : m;
    }
    for (int64_t x = span; x < width; ++x) row[x] = kNegInf;
    if (m <= kNegInf) return 0.0f;  // (a NaN score is not taken for "nothing visible": it propagates)
    v16 total = {};
    for (int64_t x = 0; x < width; x += 16) {
      v16& y = *reinterpret_cast<v16*>(row + x);
      y = Exp(y - m);
      total += y;
    }
    return _mm512_reduce_add_ps((__m512)total);
  }

  // Every key's value, averaged, for query head (row b, kv head j): what a row with no visible key gets.
  void Mean(int64_t b, int64_t j, float* dst) const {
    std::memset(dst, 0, sizeof(float) * h);
    for (int64_t x = 0; x < s; ++x) {
      const float* vr = v + b * vb + x * vs + j * vk;
      for (int64_t d = 0; d < h; ++d) dst[d] += vr[d];
    }
    for (int64_t d = 0; d < h; ++d) dst[d] /= static_cast<float>(s);
  }
};
