// block_attention: attention of many query tokens at once (forwards, prefills), included by
// decode_kernels.cc inside its anonymous namespace (it uses simd.h, Exp, kNegInf and Parallel).
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
//
// Attention-probability dropout (training): the unnormalised weights of query i, key x are kept with
// probability 1 - rate and scaled by 1 / (1 - rate) by the mask jsteer.backbones.dropout.hash_bits
// draws for the weights' [B, K, G * T, S] layout (murmur3's finaliser twice over the element index and
// a seed), so the hand-written path with the same HashDropout drops the same elements.

// R x 16C outputs: y[m, :] (+)= sum_d x[m * xs + d * xd] * w[d * ws + :], d < depth (add: onto y's
// values); x, w, y any alignment.
template <int R, int C>
void Tile(const float* x, int64_t xs, int64_t xd, int64_t depth, const float* w, int64_t ws, float* y, int64_t ys,
          bool add) {
  v16 acc[R][C];
  if (add) {
    for (int m = 0; m < R; ++m) std::memcpy(acc[m], y + m * ys, sizeof acc[m]);
  } else {
    std::memset(acc, 0, sizeof acc);
  }
  for (int64_t d = 0; d < depth; ++d) {
    v16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = *reinterpret_cast<const v16*>(w + d * ws + 16 * c);
#pragma GCC unroll 12
    for (int m = 0; m < R; ++m) {
      const float a = x[m * xs + d * xd];
      for (int c = 0; c < C; ++c) acc[m][c] += a * wv[c];
    }
  }
  for (int m = 0; m < R; ++m) std::memcpy(y + m * ys, acc[m], sizeof acc[m]);
}

using TileFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t, bool);

template <int C, int... I>
constexpr std::array<TileFn, sizeof...(I)> TileTable(std::integer_sequence<int, I...>) {
  return {&Tile<I + 1, C>...};
}

// Rows per tile for C vectors of columns: kAccumulators of them (AVX-512: 24 of 32 registers), at most 12.
constexpr int TileRows(int c) { return kAccumulators / c < 1 ? 1 : kAccumulators / c < 12 ? kAccumulators / c : 12; }

// m rows of x times w's 16C columns, in tiles of TileRows(C) rows (x's depth xd apart; add: onto y).
template <int C>
void Tiles(int64_t m, const float* x, int64_t xs, int64_t depth, const float* w, int64_t ws, float* y, int64_t ys,
           int64_t xd = 1, bool add = false) {
  static constexpr auto table = TileTable<C>(std::make_integer_sequence<int, TileRows(C)>{});
  constexpr int64_t r = TileRows(C);
  for (int64_t m0 = 0; m0 < m; m0 += r) {
    table[(m - m0 < r ? m - m0 : r) - 1](x + m0 * xs, xs, xd, depth, w, ws, y + m0 * ys, ys, add);
  }
}

// m rows of x times a 48-column panel w: 3 vectors a row where a tile then holds 8 rows (AVX-512),
// else 16 columns at a time (AVX2: tiles of 6 rows, each w vector loaded once for the 6).
inline void Tiles48(int64_t m, const float* x, int64_t xs, int64_t depth, const float* w, int64_t ws, float* y,
                    int64_t ys) {
  if (TileRows(3) >= 8) return Tiles<3>(m, x, xs, depth, w, ws, y, ys);
  for (int c = 0; c < 48; c += 16) Tiles<1>(m, x, xs, depth, w + c, ws, y + c, ys);
}

// m rows of x times w's h columns (h a multiple of 16), 64 columns at a time where a tile of them
// holds 6 rows (AVX-512), else 16 (xd, add: see Tiles).
inline void Columns(int64_t m, const float* x, int64_t xs, int64_t depth, const float* w, int64_t ws, float* y,
                    int64_t ys, int64_t h, int64_t xd = 1, bool add = false) {
  constexpr int64_t chunk = TileRows(4) >= 6 ? 64 : 16;
  for (int64_t c0 = 0; c0 < h; c0 += chunk) {
    switch ((h - c0 < chunk ? h - c0 : chunk) / 16) {
      case 4: Tiles<4>(m, x, xs, depth, w + c0, ws, y + c0, ys, xd, add); break;
      case 3: Tiles<3>(m, x, xs, depth, w + c0, ws, y + c0, ys, xd, add); break;
      case 2: Tiles<2>(m, x, xs, depth, w + c0, ws, y + c0, ys, xd, add); break;
      default: Tiles<1>(m, x, xs, depth, w + c0, ws, y + c0, ys, xd, add); break;
    }
  }
}

// n rows of h floats (row r at src + r * stride) -> 48-row panels [ceil(n / 48), h, 48], zero past n.
inline void PackRows(const float* src, int64_t stride, int64_t n, int64_t h, float* dst) {
  std::memset(dst, 0, sizeof(float) * ((n + 47) / 48 * 48) * h);
  for (int64_t r = 0; r < n; ++r) {
    float* d = dst + (r / 48) * h * 48 + r % 48;
    for (int64_t x = 0; x < h; ++x) d[x * 48] = src[r * stride + x];
  }
}

// x grown to at least n floats (scratch reused between tasks).
inline void Grow(std::vector<float>& x, int64_t n) {
  if (static_cast<int64_t>(x.size()) < n) x.resize(n);
}

// Dropout of attention weights by jsteer.backbones.dropout's hash mask (seed == nullptr: none).
struct Drop {
  const uint32_t* seed;
  uint32_t threshold;  // an element is kept when its bits >= threshold
  float inv_keep;      // 1 / (1 - rate)

  // murmur3's 32-bit finaliser, on one word or 16 lanes.
  template <typename T>
  static T Fmix(T x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    return x ^ (x >> 16);
  }
  // The factors (kept: 1 / (1 - rate), dropped: 0) of elements idx .. idx + 15 (uint32 indices).
  v16 Factors(uint32_t idx) const {
    const v16u bits = Fmix(Fmix((Lanes() + idx) * 0x9E3779B9u + seed[0]) ^ seed[1]);
    return Select(bits >= threshold, v16{} + inv_keep, v16{});
  }
  float Factor(uint32_t idx) const {
    return Fmix(Fmix(idx * 0x9E3779B9u + seed[0]) ^ seed[1]) >= threshold ? inv_keep : 0.0f;
  }
  // row[0 .. n) (n a multiple of 16), the weights of elements idx .. idx + n, times their factors.
  void Apply(uint32_t idx, float* row, int64_t n) const {
    for (int64_t x = 0; x < n; x += 16) {
      v16& y = *reinterpret_cast<v16*>(row + x);
      y *= Factors(idx + static_cast<uint32_t>(x));
    }
  }
};

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
  Drop drop;

  // The dropout index of (row b, kv head j, its query head a, query i, key 0).
  uint32_t Index(int64_t b, int64_t j, int64_t a, int64_t i) const {
    return static_cast<uint32_t>((((b * kv + j) * g + a) * t + i) * s);
  }

  struct Scratch {
    std::vector<float> panels, scores, acc, sums;
  };

  void operator()(int64_t c, Scratch& w) const {
    const int64_t b = c / (kv * blocks), j = (c / blocks) % kv;
    const int64_t i0 = (c % blocks) * block, i1 = i0 + block < t ? i0 + block : t, rows = i1 - i0;
    int64_t lo, hi;  // the block's visible keys lie in [lo, hi)
    Span(b, i0, i1, lo, hi);
    const int64_t span = hi > lo ? hi - lo : 0, width = (span + 47) / 48 * 48, nps = width / 48;
    // k of the span in 48-key panels [nps, h, 48], zero past the span
    Grow(w.panels, width * h);
    Grow(w.scores, rows * width);
    Grow(w.acc, rows * h);
    Grow(w.sums, rows);
    float* kp = w.panels.data();
    const float* kj = k + b * kb + lo * ks + j * kk;
    const float* vj = v + b * vb + lo * vs + j * vk;
    if (kh == 1) {  // rows a projection row apart: their misses overlap when all are asked for at once
      for (int64_t key = 0; key < span; ++key) {
        for (int64_t d = 0; d < h; d += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(kj + key * ks + d), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(vj + key * vs + d), _MM_HINT_T1);
        }
      }
    }
    if (kh == 1) {  // each key's h floats contiguous: read them in order
      PackRows(kj, ks, span, h, kp);
    } else {  // the cache's [H, S]: each dimension's keys contiguous
      std::memset(kp, 0, sizeof(float) * width * h);
      for (int64_t key0 = 0; key0 < span; key0 += 48) {
        const int64_t n = span - key0 < 48 ? span - key0 : 48;
        for (int64_t d = 0; d < h; ++d) std::memcpy(kp + (key0 * h + d * 48), kj + key0 * ks + d * kh, n * 4);
      }
    }
    for (int64_t a = 0; a < g; ++a) {
      const int64_t n = j * g + a;
      const float* qa = q + b * qb + i0 * qt + n * qn;
      float* sc = w.scores.data();
      for (int64_t p = 0; p < nps; ++p) {
        Tiles48(rows, qa, qt, h, kp + p * h * 48, 48, sc + p * 48, width);
      }
      float* o = w.acc.data();
      float* sums = w.sums.data();
      for (int64_t r = 0; r < rows; ++r) {
        sums[r] = Softmax(b, i0 + r, lo, span, width, sc + r * width);
        if (drop.seed != nullptr && sums[r] != 0.0f) drop.Apply(Index(b, j, a, i0 + r) + lo, sc + r * width, width);
      }
      Columns(rows, sc, width, span, vj, vs, o, h, h);  // the value product
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out + (((b * t + i0 + r) * kv + j) * g + a) * h;
        if (sums[r] == 0.0f) {
          Mean(b, j, a, i0 + r, dst);
          continue;
        }
        const float inv = 1.0f / sums[r];
        for (int64_t x = 0; x < h; ++x) dst[x] = o[r * h + x] * inv;
      }
    }
  }

  // [lo, hi): the union of the visible keys of row b's queries i0 .. i1 - 1 (lo >= hi: none).
  void Span(int64_t b, int64_t i0, int64_t i1, int64_t& lo, int64_t& hi) const {
    lo = s;
    hi = 0;
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
  }

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
      y = Where(vr + x, y, neg);
      *reinterpret_cast<v16*>(row + x) = y;
      most = Select(y > most, y, most);
    }
    float m = ReduceMax(most);  // a tree, not a chain of 16: rows are short
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
    return ReduceAdd(total);
  }

  // Every key's value, averaged (each weighed by its dropout factor), for query i of head a of (row b,
  // kv head j): what a row with no visible key gets.
  void Mean(int64_t b, int64_t j, int64_t a, int64_t i, float* dst) const {
    std::memset(dst, 0, sizeof(float) * h);
    for (int64_t x = 0; x < s; ++x) {
      const float* vr = v + b * vb + x * vs + j * vk;
      const float f = drop.seed == nullptr ? 1.0f : drop.Factor(Index(b, j, a, i) + static_cast<uint32_t>(x));
      for (int64_t d = 0; d < h; ++d) dst[d] += f * vr[d];
    }
    for (int64_t d = 0; d < h; ++d) dst[d] /= static_cast<float>(s);
  }
};
