// The kernels' 16-lane float vector and what depends on the vector ISA the build targets
// (-march=native): AVX-512F, or AVX2 with FMA. Included first by decode_kernels.cc.
//
// The kernels compute in units of 16 floats (a v16: one zmm register, or two ymm ones; GCC lowers the
// vector extension to either), so the packed layouts (48-column panels, 16-float heads) and every
// result are the same on both: the reductions below add and compare in one fixed tree. What the ISA
// changes is how many v16 the registers hold, so the register tiles shrink on AVX2 (16 ymm registers
// against 32 zmm: tiles sized for AVX-512 kept half of their accumulators on the stack there).

#include <cstdint>
#include <cstring>
#include <immintrin.h>

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "jsteer's CPU kernels need AVX-512F, or AVX2 with FMA"
#endif

#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
constexpr int kVectorRegisters = 32;  // v16 values the registers hold

inline v8 Lo(v16 x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7); }
inline v8 Hi(v16 x) { return __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15); }
template <typename M, typename V>
inline V Select(M m, V a, V b) {  // a where m (a comparison's result), else b
  return m ? a : b;
}
inline v16i ToInt(v16 x) { return __builtin_convertvector(x, v16i); }  // toward zero
inline v16 AsFloat(v16i x) { return (v16)x; }                          // the same bits
#else
// GCC lowers a 64-byte vector extension type without AVX-512 through memory (every broadcast and
// accumulator on the stack: small_gemm ran at 5 GFLOP/s on Zen 3), so on AVX2 a v16 is two
// 8-lane halves, each a ymm register, with the operators the kernels use.
template <typename L>  // 16 lanes of L
struct __attribute__((may_alias)) Two {
  // declared here, not passed in: a template argument's attributes are dropped (aligned(4) too, and
  // GCC then loaded unaligned rows with vmovaps)
  typedef L H __attribute__((vector_size(32), aligned(4)));
  H lo, hi;
  L operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};
typedef Two<float> v16;
typedef Two<int32_t> v16i;
typedef Two<uint32_t> v16u;
typedef v16::H v8;
typedef v16i::H v8i;
constexpr int kVectorRegisters = 8;  // 16 ymm registers, two a v16

#define JSTEER_TWO_OP(op)                                                                      \
  template <typename L>                                                                        \
  inline Two<L> operator op(Two<L> a, Two<L> b) {                                              \
    return {a.lo op b.lo, a.hi op b.hi};                                                       \
  }                                                                                            \
  template <typename L, typename S>                                                            \
  inline Two<L> operator op(Two<L> a, S b) {                                                   \
    return {a.lo op static_cast<L>(b), a.hi op static_cast<L>(b)};                             \
  }                                                                                            \
  template <typename L, typename S>                                                            \
  inline Two<L> operator op(S a, Two<L> b) {                                                   \
    return {static_cast<L>(a) op b.lo, static_cast<L>(a) op b.hi};                             \
  }                                                                                            \
  template <typename L, typename T>                                                            \
  inline Two<L>& operator op##=(Two<L>& a, T b) { return a = a op b; }
JSTEER_TWO_OP(+)
JSTEER_TWO_OP(-)
JSTEER_TWO_OP(*)
JSTEER_TWO_OP(^)
JSTEER_TWO_OP(>>)
JSTEER_TWO_OP(<<)
#undef JSTEER_TWO_OP

// comparisons: all ones in the lanes where true
#define JSTEER_TWO_CMP(op)                                                                     \
  template <typename L>                                                                        \
  inline v16i operator op(Two<L> a, Two<L> b) {                                                \
    return {(v8i)(a.lo op b.lo), (v8i)(a.hi op b.hi)};                                         \
  }                                                                                            \
  template <typename L, typename S>                                                            \
  inline v16i operator op(Two<L> a, S b) {                                                     \
    return {(v8i)(a.lo op static_cast<L>(b)), (v8i)(a.hi op static_cast<L>(b))};               \
  }
JSTEER_TWO_CMP(<)
JSTEER_TWO_CMP(>)
JSTEER_TWO_CMP(>=)
#undef JSTEER_TWO_CMP

inline v8 Lo(v16 x) { return x.lo; }
inline v8 Hi(v16 x) { return x.hi; }
template <typename L>
inline Two<L> Select(v16i m, Two<L> a, Two<L> b) {  // a where m (a comparison's result), else b
  return {m.lo ? a.lo : b.lo, m.hi ? a.hi : b.hi};
}
inline v16i ToInt(v16 x) { return {__builtin_convertvector(x.lo, v8i), __builtin_convertvector(x.hi, v8i)}; }
inline v16 AsFloat(v16i x) { return {(v8)x.lo, (v8)x.hi}; }
#endif
// 0, 1, ..., 15
inline v16u Lanes() {
  v16u x;
  for (uint32_t i = 0; i < 16; ++i) reinterpret_cast<uint32_t*>(&x)[i] = i;
  return x;
}

// v16 accumulators a register tile may keep: three quarters of the registers, the rest for the
// operands of each step (24 on AVX-512, 6 on AVX2)
constexpr int kAccumulators = kVectorRegisters * 3 / 4;

// The sum / maximum of 16 lanes, as a tree: halves of 8, then of 4, then pairs (what GCC's
// _mm512_reduce_add_ps / _max_ps do), the same on AVX-512 and AVX2 builds.
inline float ReduceAdd(v16 x) {
  const v8 h = Lo(x) + Hi(x);
  const float q0 = h[0] + h[4], q1 = h[1] + h[5], q2 = h[2] + h[6], q3 = h[3] + h[7];
  return (q0 + q2) + (q1 + q3);
}

inline float ReduceMax(v16 x) {
  const v8 lo = Lo(x), hi = Hi(x);
  const v8 h = lo > hi ? lo : hi;
  const auto mx = [](float a, float b) { return a > b ? a : b; };
  return mx(mx(mx(h[0], h[4]), mx(h[2], h[6])), mx(mx(h[1], h[5]), mx(h[3], h[7])));
}

// y where flags[0 .. 16) are true, otherwise `other` (flags: 16 bools, any alignment). Written with
// intrinsics: GCC turned the vector extension's byte-to-lane conversion into 16 scalar moves.
inline v16 Where(const bool* flags, v16 y, v16 other) {
#ifdef __AVX512F__
  const __m512i seen = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(flags)));
  return (v16)_mm512_mask_mov_ps((__m512)other, _mm512_test_epi32_mask(seen, seen), (__m512)y);
#else
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(flags));
  const __m256i zero = _mm256_setzero_si256();
  // all ones in the lanes whose flag is false: blendv takes `other` there
  const __m256 off_lo = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_cvtepu8_epi32(bytes), zero));
  const __m256 off_hi = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)), zero));
  return {(v8)_mm256_blendv_ps((__m256)y.lo, (__m256)other.lo, off_lo),
          (v8)_mm256_blendv_ps((__m256)y.hi, (__m256)other.hi, off_hi)};
#endif
}
