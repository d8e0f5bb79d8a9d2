// 16-lane vectors for eagle_lab's CPU kernels: one zmm register with AVX-512, two ymm halves without it.
//
// The kernels compute on 16 lanes whatever the instruction set, so a sum's lanes and order (and so its bits) do
// not depend on it. With AVX-512, f32x16 / i32x16 are GCC vector types of 64 bytes. Without AVX-512, GCC lowers a
// 64-byte vector type through memory (pieces moved through general registers, every accumulator spilled: up
// to 5x slower with AVX2 alone, docs/benchmarks.md), so there they are a pair of 32-byte halves with the same
// operators, which stay in registers. Every helper is inlined: a 64-byte argument of a call left out of line is
// passed through memory too.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define ALWAYS_INLINE inline __attribute__((always_inline))

namespace simd {

#if defined(__AVX512F__)

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

ALWAYS_INLINE f32x16 to_f32(i32x16 v) { return __builtin_convertvector(v, f32x16); }
ALWAYS_INLINE i32x16 to_i32(f32x16 v) { return __builtin_convertvector(v, i32x16); }  // truncates

#else

// Two halves of 8 lanes: lanes 0-7 in lo, 8-15 in hi (the memory layout of the 64-byte type). Self is the
// 16-lane type itself, so every operator returns it.
template <class Self, class Half, class Scalar>
struct Pair {
  Half lo, hi;
  static ALWAYS_INLINE Self of(Half lo, Half hi) {
    Self out;
    out.lo = lo;
    out.hi = hi;
    return out;
  }
  friend ALWAYS_INLINE Self operator+(Self a, Self b) { return of(a.lo + b.lo, a.hi + b.hi); }
  friend ALWAYS_INLINE Self operator-(Self a, Self b) { return of(a.lo - b.lo, a.hi - b.hi); }
  friend ALWAYS_INLINE Self operator*(Self a, Self b) { return of(a.lo * b.lo, a.hi * b.hi); }
  friend ALWAYS_INLINE Self operator+(Self a, Scalar s) { return of(a.lo + s, a.hi + s); }
  friend ALWAYS_INLINE Self operator-(Self a, Scalar s) { return of(a.lo - s, a.hi - s); }
  friend ALWAYS_INLINE Self operator*(Self a, Scalar s) { return of(a.lo * s, a.hi * s); }
  friend ALWAYS_INLINE Self operator/(Self a, Scalar s) { return of(a.lo / s, a.hi / s); }
  friend ALWAYS_INLINE Self operator*(Scalar s, Self a) { return of(s * a.lo, s * a.hi); }
  friend ALWAYS_INLINE Self operator-(Scalar s, Self a) { return of(s - a.lo, s - a.hi); }
  ALWAYS_INLINE Self& operator+=(Self b) { return self() = self() + b; }
  ALWAYS_INLINE Self& operator-=(Self b) { return self() = self() - b; }

 private:
  ALWAYS_INLINE Self& self() { return static_cast<Self&>(*this); }
};

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

struct f32x16 : Pair<f32x16, f32x8, float> {};

struct i32x16 : Pair<i32x16, i32x8, int32_t> {
  friend ALWAYS_INLINE i32x16 operator&(i32x16 a, int32_t s) { return of(a.lo & s, a.hi & s); }
  friend ALWAYS_INLINE i32x16 operator>>(i32x16 a, int s) { return of(a.lo >> s, a.hi >> s); }
  friend ALWAYS_INLINE i32x16 operator<<(i32x16 a, int s) { return of(a.lo << s, a.hi << s); }
};

// lanewise a < b ? x : y, as the vector type's comparison and select give
ALWAYS_INLINE f32x16 select_less(f32x16 a, f32x16 b, f32x16 x, f32x16 y) {
  return f32x16::of(a.lo < b.lo ? x.lo : y.lo, a.hi < b.hi ? x.hi : y.hi);
}

ALWAYS_INLINE f32x16 to_f32(i32x16 v) {
  return f32x16::of(__builtin_convertvector(v.lo, f32x8), __builtin_convertvector(v.hi, f32x8));
}
ALWAYS_INLINE i32x16 to_i32(f32x16 v) {  // truncates
  return i32x16::of(__builtin_convertvector(v.lo, i32x8), __builtin_convertvector(v.hi, i32x8));
}

#endif

#if defined(__AVX512F__)
ALWAYS_INLINE f32x16 select_less(f32x16 a, f32x16 b, f32x16 x, f32x16 y) { return a < b ? x : y; }
#endif

ALWAYS_INLINE f32x16 as_f32(i32x16 bits) {  // the same 64 bytes read as float32
  f32x16 v;
#if defined(__AVX512F__)
  std::memcpy(&v, &bits, sizeof v);
#else
  std::memcpy(&v.lo, &bits.lo, sizeof v.lo);
  std::memcpy(&v.hi, &bits.hi, sizeof v.hi);
#endif
  return v;
}

template <class V>
ALWAYS_INLINE V load(const void* p) {  // 64 bytes, any alignment
  V v;
#if defined(__AVX512F__)
  std::memcpy(&v, p, sizeof v);
#else  // half by half: one 64-byte copy into the pair goes through the stack
  std::memcpy(&v.lo, p, sizeof v.lo);
  std::memcpy(&v.hi, static_cast<const char*>(p) + sizeof v.lo, sizeof v.hi);
#endif
  return v;
}

// a * b + c with one rounding, spelled out: where the compiler may contract a * b + c * d either way, the
// result would depend on its choice, and so on the instruction set.
ALWAYS_INLINE f32x16 fma(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  __m512 va, vb, vc;
  std::memcpy(&va, &a, 64);
  std::memcpy(&vb, &b, 64);
  std::memcpy(&vc, &c, 64);
  const __m512 out = _mm512_fmadd_ps(va, vb, vc);
  std::memcpy(&a, &out, 64);
  return a;
#elif defined(__FMA__)
  __m256 lo, hi;
  std::memcpy(&lo, &a.lo, 32);
  std::memcpy(&hi, &a.hi, 32);
  __m256 blo, bhi, clo, chi;
  std::memcpy(&blo, &b.lo, 32);
  std::memcpy(&bhi, &b.hi, 32);
  std::memcpy(&clo, &c.lo, 32);
  std::memcpy(&chi, &c.hi, 32);
  lo = _mm256_fmadd_ps(lo, blo, clo);
  hi = _mm256_fmadd_ps(hi, bhi, chi);
  std::memcpy(&a.lo, &lo, 32);
  std::memcpy(&a.hi, &hi, 32);
  return a;
#else
  return a * b + c;
#endif
}

ALWAYS_INLINE i32x16 splat_i32(int32_t s) { return i32x16{} + s; }

}  // namespace simd
