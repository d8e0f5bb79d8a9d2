// y = x @ W.T + bias on CPU, float32 in and out, with every output row computed on its own.
//
// Each row's sums run over k in the same order, in the same vector lanes, whatever the number of rows
// in the call, so a forward over N tokens gives each token bitwise the result of a one-token forward.
// The weight is read from memory once per call (one pass per 8 rows over each panel, the later ones from cache),
// so a few-row forward costs little more than one row's: what a draft tree needs on a CPU.
//
// Weights live in panels of 16 output columns, k-major, so a panel is one contiguous stream:
//   f32   [P, K, 16] float32
//   bf16  [P, K, 16] bfloat16 bits (widened to float32 exactly)
//   q8_0  [P, K, 16] int8, scales [P, K/32, 16]: w = q * scale (GGUF Q8_0)
//   q4_1  [P, K/2, 16] uint8 (k = 2j in the low nibble, 2j + 1 in the high), scales and minimums
//         [P, K/32, 16]: w = q * scale + minimum (GGUF Q4_1)
// Weights are widened to float32 and every product and sum is float32.
//
// The "x8" formats compute the way llama.cpp computes its quantized types: each row of x is quantized to
// int8 in groups of 32 along K (a float32 scale per group, GGUF Q8_0/Q8_1), and each group's dot product
// with the weights is an exact integer sum (AVX512-VNNI's vpdpbusd where the CPU has it), scaled into a
// float32 accumulator group by group:
//   q4_1x8  [P, K/8, 64] uint8: for 8 consecutive k, each of the 16 columns holds 4 bytes, byte b with
//           k = 8t + b in its low nibble and k = 8t + 4 + b in its high one; scales and minimums
//           [P, K/32, 16] float16, as GGUF stores them
//   q8_0x8  [P, K/4, 64] int8: 4 consecutive k per column; scales [P, K/32, 16] float16, and each group's
//           sum of weights [P, K/32, 16] int16 (the unsigned-by-signed product needs it)
// Float16 scales read a sixth fewer bytes than float32 ones, which a decode step, bound by memory, sees.
// A row's quantization depends on that row alone and every sum runs in a fixed order, so these formats
// are row-stable too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

#define ALWAYS_LAMBDA __attribute__((always_inline))

namespace {

using simd::f32x16;
using simd::i32x16;
using simd::to_f32;

constexpr int64_t LANES = 16;
constexpr int64_t GROUP = 32;
constexpr int64_t PREFETCH_BYTES = 4096;  // how far ahead of the panel stream to prefetch
#ifdef __AVX512F__
constexpr int64_t MAX_BLOCK_ROWS = 8;  // accumulators in registers: 8 of 32 zmm
#else
constexpr int64_t MAX_BLOCK_ROWS = 4;  // 8 of 16 ymm
#endif

ALWAYS_INLINE f32x16 load_f32(const float* p) { return simd::load<f32x16>(p); }

// 16 bytes -> 16 lanes of 32 bits, zero- or sign-extended (GCC scalarizes __builtin_convertvector here).
template <bool Signed>
ALWAYS_INLINE i32x16 widen_bytes(const uint8_t* p) {
  i32x16 out;
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
#if defined(__AVX512F__)
  __m512i wide = Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  std::memcpy(&out, &wide, sizeof out);
#else
  __m256i low = Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  __m128i upper = _mm_srli_si128(bytes, 8);
  __m256i high = Signed ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
  std::memcpy(&out, &low, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &high, 32);
#endif
  return out;
}

ALWAYS_INLINE void prefetch(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES); }

struct F32Panel {
  const float* w;
  int64_t K;
  template <class Visit>
  ALWAYS_INLINE void each_k(Visit visit) const {
    int64_t k = 0;
    for (; k + 1 < K; k += 2) {
      prefetch(w + k * LANES);
      prefetch(w + (k + 1) * LANES);
      visit(k, load_f32(w + k * LANES), 0);
      visit(k + 1, load_f32(w + (k + 1) * LANES), 1);
    }
    if (k < K) visit(k, load_f32(w + k * LANES), 0);
  }
};

struct BF16Panel {
  const uint16_t* w;
  int64_t K;
  template <class Visit>
  ALWAYS_INLINE void each_k(Visit visit) const {
    int64_t k = 0;
    for (; k + 1 < K; k += 2) {
      prefetch(w + k * LANES);
      visit(k, at(k), 0);
      visit(k + 1, at(k + 1), 1);
    }
    if (k < K) visit(k, at(k), 0);
  }
  ALWAYS_INLINE f32x16 at(int64_t k) const {  // bf16 bits widened to float32 exactly
    f32x16 v;
#if defined(__AVX512F__)
    const __m512i bits = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * LANES))), 16);
    std::memcpy(&v, &bits, sizeof v);
#else
    const __m256i low = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * LANES))), 16);
    const __m256i high = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * LANES + 8))), 16);
    std::memcpy(&v, &low, 32);
    std::memcpy(reinterpret_cast<char*>(&v) + 32, &high, 32);
#endif
    return v;
  }
};

struct Q8Panel {
  const int8_t* q;
  const float* scales;
  int64_t K;
  ALWAYS_INLINE f32x16 at(int64_t k) const {
    return to_f32(widen_bytes<true>(reinterpret_cast<const uint8_t*>(q + k * LANES)));
  }
  template <class Visit>
  ALWAYS_INLINE void each_k(Visit visit) const {
    for (int64_t g = 0; g < K / GROUP; ++g) {
      const f32x16 scale = load_f32(scales + g * LANES);
      for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += 2) {
        if ((k & 3) == 0) prefetch(q + k * LANES);
        visit(k, at(k) * scale, 0);
        visit(k + 1, at(k + 1) * scale, 1);
      }
    }
  }
};

struct Q4Panel {
  const uint8_t* nibbles;
  const float* scales;
  const float* minimums;
  int64_t K;
  template <class Visit>
  ALWAYS_INLINE void each_k(Visit visit) const {
    for (int64_t g = 0; g < K / GROUP; ++g) {
      const f32x16 scale = load_f32(scales + g * LANES), minimum = load_f32(minimums + g * LANES);
      for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += 2) {
        if ((k & 7) == 0) prefetch(nibbles + (k / 2) * LANES);
        const i32x16 q = widen_bytes<false>(nibbles + (k / 2) * LANES);
        visit(k, to_f32(q & 15) * scale + minimum, 0);
        visit(k + 1, to_f32(q >> 4) * scale + minimum, 1);
      }
    }
  }
};

// ROWS rows of x (row stride K) by one panel: out[r, c] for c < cols.
// Each row sums even and odd k in two accumulators, added at the end: two chains of dependent FMAs in
// flight instead of one, which at a few rows bound the loop by the FMA's latency. Panels visit k with its
// chain (k & 1), so the order of every sum is fixed whatever ROWS is.
template <int ROWS, class Panel>
ALWAYS_INLINE void rows_by_panel(const Panel& panel, const float* x, int64_t K, const float* bias, int64_t cols, float* out,
                          int64_t out_stride) {
  f32x16 acc[2][ROWS];
  for (int r = 0; r < ROWS; ++r) acc[0][r] = acc[1][r] = f32x16{};
  panel.each_k([&](int64_t k, f32x16 w, int chain) ALWAYS_LAMBDA {
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) acc[chain][r] += w * x[r * K + k];
  });
  for (int r = 0; r < ROWS; ++r) {
    const f32x16 sum = acc[0][r] + acc[1][r];
    float lanes[LANES];
    std::memcpy(lanes, &sum, sizeof lanes);
    for (int64_t c = 0; c < cols; ++c) out[r * out_stride + c] = bias ? lanes[c] + bias[c] : lanes[c];
  }
}

template <class Panel>
void all_rows_by_panel(const Panel& panel, const float* x, int64_t M, int64_t K, const float* bias, int64_t cols,
                       float* out, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX_BLOCK_ROWS) {
    const float* xs = x + m0 * K;
    float* o = out + m0 * N;
    switch (std::min(MAX_BLOCK_ROWS, M - m0)) {
      case 1: rows_by_panel<1>(panel, xs, K, bias, cols, o, N); break;
      case 2: rows_by_panel<2>(panel, xs, K, bias, cols, o, N); break;
      case 3: rows_by_panel<3>(panel, xs, K, bias, cols, o, N); break;
      case 4: rows_by_panel<4>(panel, xs, K, bias, cols, o, N); break;
#ifdef __AVX512F__
      case 5: rows_by_panel<5>(panel, xs, K, bias, cols, o, N); break;
      case 6: rows_by_panel<6>(panel, xs, K, bias, cols, o, N); break;
      case 7: rows_by_panel<7>(panel, xs, K, bias, cols, o, N); break;
      case 8: rows_by_panel<8>(panel, xs, K, bias, cols, o, N); break;
#endif
    }
  }
}

// One call's input rows, output and bias, checked: what every storage's entry point starts from.
struct Call {
  at::Tensor flat;  // [M, K] contiguous
  at::Tensor out;   // [M, N]
  at::Tensor bias;  // contiguous, or undefined
  std::vector<int64_t> sizes;  // x's sizes with N last
  int64_t M = 0;

  Call(const at::Tensor& x, int64_t panels, int64_t K, int64_t N, const std::optional<at::Tensor>& b) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == K,
                "stable_linear: x must be a float32 CPU tensor [..., ", K, "]");
    TORCH_CHECK(panels * LANES >= N && N > panels * LANES - LANES, "stable_linear: ", panels,
                " panels cannot hold ", N, " output columns");
    flat = x.reshape({-1, K}).contiguous();
    M = flat.size(0);
    sizes = x.sizes().vec();
    sizes.back() = N;
    out = at::empty({M, N}, x.options());
    if (b.has_value()) {
      bias = b->contiguous();
      TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == N, "stable_linear: bias must be float32 [", N,
                  "]");
    }
  }
  const float* bias_at(int64_t panel) const {
    return bias.defined() ? bias.data_ptr<float>() + panel * LANES : nullptr;
  }
  // body(panel, bias of its columns or null, its column count, its first output) for every panel, in parallel
  template <class Body>
  at::Tensor over_panels(int64_t panels, int64_t N, Body body) {
    float* o = out.data_ptr<float>();
    if (M > 0) {
      at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) body(p, bias_at(p), std::min(LANES, N - p * LANES), o + p * LANES);
      });
    }
    return out.view(sizes);
  }
};

template <class PanelAt>
at::Tensor run(const at::Tensor& x, int64_t panels, int64_t K, int64_t N, const std::optional<at::Tensor>& bias,
               PanelAt panel_at) {
  Call call(x, panels, K, N, bias);
  const float* xs = call.flat.data_ptr<float>();
  return call.over_panels(panels, N, [&](int64_t p, const float* b, int64_t cols, float* o) {
    all_rows_by_panel(panel_at(p), xs, call.M, K, b, cols, o, N);
  });
}

void check_panels(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(2) == LANES && t.scalar_type() == dtype &&
                  t.is_contiguous(), "stable_linear: ", what, " must be contiguous ", c10::toString(dtype),
              " [P, *, 16]");
}

at::Tensor stable_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t N) {
  const int64_t P = panels.size(0), K = panels.size(1);
  if (panels.scalar_type() == at::kBFloat16) {
    check_panels(panels, at::kBFloat16, "bf16 panels");
    const auto* w = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
    return run(x, P, K, N, bias, [&](int64_t p) { return BF16Panel{w + p * K * LANES, K}; });
  }
  check_panels(panels, at::kFloat, "panels");
  const float* w = panels.data_ptr<float>();
  return run(x, P, K, N, bias, [&](int64_t p) { return F32Panel{w + p * K * LANES, K}; });
}

void check_groups(const at::Tensor& scales, int64_t P, int64_t K, at::ScalarType dtype = at::kFloat) {
  check_panels(scales, dtype, "scales, minimums and sums");
  TORCH_CHECK(K % GROUP == 0 && scales.size(0) == P && scales.size(1) == K / GROUP,
              "stable_linear: scales must be [P, K/32, 16] with K a multiple of 32");
}

at::Tensor stable_linear_q8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias, int64_t N) {
  check_panels(q, at::kChar, "q8_0 weights");
  const int64_t P = q.size(0), K = q.size(1);
  check_groups(scales, P, K);
  const int8_t* w = q.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  return run(x, P, K, N, bias, [&](int64_t p) { return Q8Panel{w + p * K * LANES, s + p * (K / GROUP) * LANES, K}; });
}

at::Tensor stable_linear_q4(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                            const at::Tensor& minimums, const std::optional<at::Tensor>& bias, int64_t N) {
  check_panels(nibbles, at::kByte, "q4_1 nibbles");
  const int64_t P = nibbles.size(0), K = nibbles.size(1) * 2;
  check_groups(scales, P, K);
  check_groups(minimums, P, K);
  const uint8_t* w = nibbles.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* m = minimums.data_ptr<float>();
  const int64_t groups = K / GROUP;
  return run(x, P, K, N, bias, [&](int64_t p) {
    return Q4Panel{w + p * (K / 2) * LANES, s + p * groups * LANES, m + p * groups * LANES, K};
  });
}

// ---- int8 activations ----

// Each row of x [M, K] quantized in groups of 32: q = round(x / d) with d = max|x| / 127, and per group the
// scale d and d * sum(q) (what Q4_1's minimum multiplies).
struct QuantizedRows {
  std::vector<int8_t> q;      // [M, K]
  std::vector<uint8_t> biased;  // [M, K] q + 128 (the unsigned operand against signed weights)
  std::vector<float> scale;   // [M, K/32]
  std::vector<float> scaled_sum;  // [M, K/32]
};

// One group of 32: q = round-half-even(x * (1 / d)), d = max|x| / 127; writes q (and q + 128 when biased), returns
// sum(q) and sets d. The vector path computes exactly what the scalar one does.
inline int32_t quantize_group(const float* xs, int8_t* q, uint8_t* biased, float& d) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(xs), b = _mm512_loadu_ps(xs + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  d = amax / 127.f;
  const __m512 inverse = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));  // rounds half to even
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  if (biased != nullptr) {
    const __m512i offset = _mm512_set1_epi32(128);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(biased), _mm512_cvtepi32_epi8(_mm512_add_epi32(qa, offset)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(biased + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(qb, offset)));
  }
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
  float amax = 0.f;
  for (int64_t j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(xs[j]));
  d = amax / 127.f;
  const float inverse = d > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < GROUP; ++j) {
    const float y = xs[j] * inverse;
    const int32_t v = static_cast<int32_t>(std::nearbyint(y));
    q[j] = static_cast<int8_t>(v);
    if (biased != nullptr) biased[j] = static_cast<uint8_t>(v + 128);
    sum += v;
  }
  return sum;
#endif
}

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, bool biased) {
  const int64_t groups = K / GROUP;
  QuantizedRows out{std::vector<int8_t>(M * K), std::vector<uint8_t>(biased ? M * K : 0),
                    std::vector<float>(M * groups), std::vector<float>(M * groups)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = m * K + g * GROUP;
      float d;
      const int32_t sum = quantize_group(x + at, out.q.data() + at, biased ? out.biased.data() + at : nullptr, d);
      out.scale[m * groups + g] = d;
      out.scaled_sum[m * groups + g] = d * static_cast<float>(sum);
    }
  }
  return out;
}

// acc + for each 32-bit lane, the sum of its 4 unsigned bytes of `a` times the 4 signed bytes of `b`: exact
// integers. Without VNNI, vpmaddubsw adds the products in pairs into int16 (saturating) and vpmaddwd adds the pairs
// into int32: exact for the callers, whose pairs stay below 2^15 (4-bit weights: 2 * 15 * 127; dot4_signed:
// 2 * 127 * 127).
ALWAYS_INLINE i32x16 dot4(i32x16 acc, i32x16 a, i32x16 b) {
#if defined(__AVX512VNNI__)
  __m512i va, vb, vacc;
  std::memcpy(&va, &a, 64);
  std::memcpy(&vb, &b, 64);
  std::memcpy(&vacc, &acc, 64);
  vacc = _mm512_dpbusd_epi32(vacc, va, vb);
  std::memcpy(&acc, &vacc, 64);
  return acc;
#elif defined(__AVX512BW__)
  __m512i va, vb, vacc;
  std::memcpy(&va, &a, 64);
  std::memcpy(&vb, &b, 64);
  std::memcpy(&vacc, &acc, 64);
  vacc = _mm512_add_epi32(vacc, _mm512_madd_epi16(_mm512_maddubs_epi16(va, vb), _mm512_set1_epi16(1)));
  std::memcpy(&acc, &vacc, 64);
  return acc;
#elif defined(__AVX2__)
  __m256i va[2], vb[2], vacc[2];
  std::memcpy(va, &a, 64);
  std::memcpy(vb, &b, 64);
  std::memcpy(vacc, &acc, 64);
  for (int h = 0; h < 2; ++h)
    vacc[h] = _mm256_add_epi32(vacc[h], _mm256_madd_epi16(_mm256_maddubs_epi16(va[h], vb[h]), _mm256_set1_epi16(1)));
  std::memcpy(&acc, vacc, 64);
  return acc;
#else
#pragma GCC unroll 4
  for (int byte = 0; byte < 4; ++byte) {
    const i32x16 ua = (a >> (8 * byte)) & 0xFF;
    const i32x16 sb = (b << (24 - 8 * byte)) >> 24;  // arithmetic: sign-extended
    acc += ua * sb;
  }
  return acc;
#endif
}

#if !defined(__AVX512VNNI__)
// acc + for each 32-bit lane, the sum of its 4 signed bytes of `a` (|a| <= 127) times the 4 signed bytes of `b`:
// |a| times b with a's sign, through dot4.
ALWAYS_INLINE i32x16 dot4_signed(i32x16 acc, i32x16 a, i32x16 b) {
#if defined(__AVX512BW__)
  __m512i va, vb;
  std::memcpy(&va, &a, 64);
  std::memcpy(&vb, &b, 64);
  const __m512i signed_b = _mm512_mask_sub_epi8(vb, _mm512_movepi8_mask(va), _mm512_setzero_si512(), vb);
  const __m512i magnitude = _mm512_abs_epi8(va);
  std::memcpy(&a, &magnitude, 64);
  std::memcpy(&b, &signed_b, 64);
  return dot4(acc, a, b);
#elif defined(__AVX2__)
  __m256i va[2], vb[2];
  std::memcpy(va, &a, 64);
  std::memcpy(vb, &b, 64);
  for (int h = 0; h < 2; ++h) {
    vb[h] = _mm256_sign_epi8(vb[h], va[h]);
    va[h] = _mm256_sign_epi8(va[h], va[h]);
  }
  std::memcpy(&a, va, 64);
  std::memcpy(&b, vb, 64);
  return dot4(acc, a, b);
#else
#pragma GCC unroll 4
  for (int byte = 0; byte < 4; ++byte) {
    const i32x16 sa = (a << (24 - 8 * byte)) >> 24, sb = (b << (24 - 8 * byte)) >> 24;
    acc += sa * sb;
  }
  return acc;
#endif
}
#endif

// A group's products of int4 weights (unsigned, `a`) and int8 activations (`b`) accumulate in `acc`, then
// int4_group_sum gives each column's 32-bit sum. With VNNI (or without AVX2) every step is a dot4 into 32-bit lanes.
// Without VNNI a dot4 is three instructions (vpmaddubsw, vpmaddwd by ones, vpaddd), so the pair products are added
// in 16 bits instead (vpmaddubsw, vpaddw) and widened once: each pair is at most 2 * 15 * 127 = 3,810 in magnitude
// and a lane takes the 8 of a group (30,480 < 2^15), so every sum, and every result, is the dot4 path's.
#if !defined(__AVX512VNNI__) && (defined(__AVX2__) || defined(__AVX512BW__))
ALWAYS_INLINE i32x16 add_int4_products(i32x16 acc, i32x16 a, i32x16 b) {
#if defined(__AVX512BW__)
  __m512i va, vb, vacc;
  std::memcpy(&va, &a, 64);
  std::memcpy(&vb, &b, 64);
  std::memcpy(&vacc, &acc, 64);
  vacc = _mm512_add_epi16(vacc, _mm512_maddubs_epi16(va, vb));
  std::memcpy(&acc, &vacc, 64);
#else
  __m256i va[2], vb[2], vacc[2];
  std::memcpy(va, &a, 64);
  std::memcpy(vb, &b, 64);
  std::memcpy(vacc, &acc, 64);
  for (int h = 0; h < 2; ++h) vacc[h] = _mm256_add_epi16(vacc[h], _mm256_maddubs_epi16(va[h], vb[h]));
  std::memcpy(&acc, vacc, 64);
#endif
  return acc;
}

// 32 lanes of 16 bits -> 16 lanes of 32 bits, each the sum of its two 16-bit halves (vpmaddwd by ones).
ALWAYS_INLINE i32x16 int4_group_sum(i32x16 pairs) {
#if defined(__AVX512BW__)
  __m512i v;
  std::memcpy(&v, &pairs, 64);
  v = _mm512_madd_epi16(v, _mm512_set1_epi16(1));
  std::memcpy(&pairs, &v, 64);
#else
  __m256i v[2];
  std::memcpy(v, &pairs, 64);
  for (int h = 0; h < 2; ++h) v[h] = _mm256_madd_epi16(v[h], _mm256_set1_epi16(1));
  std::memcpy(&pairs, v, 64);
#endif
  return pairs;
}
#else
ALWAYS_INLINE i32x16 add_int4_products(i32x16 acc, i32x16 a, i32x16 b) { return dot4(acc, a, b); }
ALWAYS_INLINE i32x16 int4_group_sum(i32x16 sums) { return sums; }
#endif

ALWAYS_INLINE f32x16 load_f16(const uint16_t* p) {  // 16 float16 -> float32, exactly
  f32x16 out;
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&out, &wide, sizeof out);
#else
  const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&out, &low, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &high, 32);
#endif
  return out;
}

ALWAYS_INLINE i32x16 load_i16(const int16_t* p) {  // 16 int16 -> int32
  i32x16 out;
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&out, &wide, sizeof out);
#else
  const __m256i low = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i high = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&out, &low, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &high, 32);
#endif
  return out;
}

ALWAYS_INLINE i32x16 load_i32(const void* p) { return simd::load<i32x16>(p); }

ALWAYS_INLINE i32x16 broadcast4(const void* p) {  // 4 bytes repeated in every lane
  int32_t word;
  std::memcpy(&word, p, 4);
  return simd::splat_i32(word);
}

struct Q4x8Panel {
  const uint8_t* packed;  // [K/8, 64]
  const uint16_t* scales;  // float16 bits
  const uint16_t* minimums;
  using Row = int8_t;  // x quantized: q
  static constexpr bool biased = false;
  // rows' integer dot products over group g: isum[r] for r < ROWS (zero on entry)
  template <int ROWS>
  ALWAYS_INLINE void group(int64_t g, const int8_t* const* xq, i32x16* isum) const {
#pragma GCC unroll 4
    for (int t = 0; t < GROUP / 8; ++t) {
      prefetch(packed + (g * (GROUP / 8) + t) * 64);
      const i32x16 v = load_i32(packed + (g * (GROUP / 8) + t) * 64);
      const i32x16 low = v & 0x0F0F0F0F, high = (v >> 4) & 0x0F0F0F0F;
      const int64_t k = g * GROUP + 8 * t;
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        isum[r] = add_int4_products(isum[r], low, broadcast4(xq[r] + k));
        isum[r] = add_int4_products(isum[r], high, broadcast4(xq[r] + k + 4));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) isum[r] = int4_group_sum(isum[r]);
  }
  ALWAYS_INLINE f32x16 term(int64_t g, i32x16 isum, float d, float scaled_sum) const {
    return simd::fma(to_f32(isum), load_f16(scales + g * LANES) * d, load_f16(minimums + g * LANES) * scaled_sum);
  }
};

struct Q8x8Panel {
  const int8_t* packed;  // [K/4, 64]
  const uint16_t* scales;  // float16 bits
  const int16_t* sums;  // [K/32, 16]
#if defined(__AVX512VNNI__)
  using Row = uint8_t;  // x quantized and biased: q + 128 (vpdpbusd's unsigned operand)
  static constexpr bool biased = true;
#else
  using Row = int8_t;  // x quantized: q (dot4_signed folds its sign into the weights)
  static constexpr bool biased = false;
#endif
  template <int ROWS>
  ALWAYS_INLINE void group(int64_t g, const Row* const* xs, i32x16* isum) const {
#pragma GCC unroll 8
    for (int t = 0; t < GROUP / 4; ++t) {
      prefetch(packed + (g * (GROUP / 4) + t) * 64);
      const i32x16 w = load_i32(packed + (g * (GROUP / 4) + t) * 64);
      const int64_t k = g * GROUP + 4 * t;
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
#if defined(__AVX512VNNI__)
        isum[r] = dot4(isum[r], broadcast4(xs[r] + k), w);
#else
        isum[r] = dot4_signed(isum[r], broadcast4(xs[r] + k), w);
#endif
      }
    }
#if defined(__AVX512VNNI__)
    const i32x16 correction = load_i16(sums + g * LANES) * 128;  // (q + 128) . w - 128 * sum(w) = q . w
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) isum[r] -= correction;
#endif
  }
  ALWAYS_INLINE f32x16 term(int64_t g, i32x16 isum, float d, float) const {
    return to_f32(isum) * (load_f16(scales + g * LANES) * d);
  }
};

// ROWS quantized rows by one panel; every row's groups are added into its accumulator in order.
template <int ROWS, class Panel>
ALWAYS_INLINE void quantized_rows_by_panel(const Panel& panel, const QuantizedRows& xq, int64_t m0, int64_t K,
                                    const float* bias, int64_t cols, float* out, int64_t out_stride) {
  const int64_t groups = K / GROUP;
  using Row = typename Panel::Row;
  f32x16 acc[ROWS];
  const Row* rows[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = f32x16{};
    if constexpr (Panel::biased) {
      rows[r] = xq.biased.data() + (m0 + r) * K;
    } else {
      rows[r] = xq.q.data() + (m0 + r) * K;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    i32x16 isum[ROWS];
    for (int r = 0; r < ROWS; ++r) isum[r] = i32x16{};
    panel.template group<ROWS>(g, rows, isum);
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (m0 + r) * groups + g;
      acc[r] += panel.term(g, isum[r], xq.scale[at], xq.scaled_sum[at]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float lanes[LANES];
    std::memcpy(lanes, &acc[r], sizeof lanes);
    for (int64_t c = 0; c < cols; ++c) out[r * out_stride + c] = bias ? lanes[c] + bias[c] : lanes[c];
  }
}

template <class Panel>
void all_quantized_rows_by_panel(const Panel& panel, const QuantizedRows& xq, int64_t M, int64_t K,
                                 const float* bias, int64_t cols, float* out, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX_BLOCK_ROWS) {
    float* o = out + m0 * N;
    switch (std::min(MAX_BLOCK_ROWS, M - m0)) {
      case 1: quantized_rows_by_panel<1>(panel, xq, m0, K, bias, cols, o, N); break;
      case 2: quantized_rows_by_panel<2>(panel, xq, m0, K, bias, cols, o, N); break;
      case 3: quantized_rows_by_panel<3>(panel, xq, m0, K, bias, cols, o, N); break;
      case 4: quantized_rows_by_panel<4>(panel, xq, m0, K, bias, cols, o, N); break;
#ifdef __AVX512F__
      case 5: quantized_rows_by_panel<5>(panel, xq, m0, K, bias, cols, o, N); break;
      case 6: quantized_rows_by_panel<6>(panel, xq, m0, K, bias, cols, o, N); break;
      case 7: quantized_rows_by_panel<7>(panel, xq, m0, K, bias, cols, o, N); break;
      case 8: quantized_rows_by_panel<8>(panel, xq, m0, K, bias, cols, o, N); break;
#endif
    }
  }
}

template <class PanelAt>
at::Tensor run_quantized(const at::Tensor& x, int64_t panels, int64_t K, int64_t N,
                         const std::optional<at::Tensor>& bias, bool biased, PanelAt panel_at) {
  TORCH_CHECK(K % GROUP == 0, "stable_linear: K must be a multiple of 32 for int8 activations");
  Call call(x, panels, K, N, bias);
  const QuantizedRows xq = quantize_rows(call.flat.data_ptr<float>(), call.M, K, biased);
  return call.over_panels(panels, N, [&](int64_t p, const float* b, int64_t cols, float* o) {
    all_quantized_rows_by_panel(panel_at(p), xq, call.M, K, b, cols, o, N);
  });
}

void check_packed(const at::Tensor& t, at::ScalarType dtype, int64_t k_per_block, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(2) == 4 * LANES && t.scalar_type() == dtype &&
                  t.is_contiguous(), "stable_linear: ", what, " must be contiguous ", c10::toString(dtype),
              " [P, K/", k_per_block, ", 64]");
}

at::Tensor stable_linear_q4x8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const at::Tensor& minimums, const std::optional<at::Tensor>& bias, int64_t N) {
  check_packed(packed, at::kByte, 8, "q4_1x8 weights");
  const int64_t P = packed.size(0), K = packed.size(1) * 8;
  check_groups(scales, P, K, at::kHalf);
  check_groups(minimums, P, K, at::kHalf);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* m = reinterpret_cast<const uint16_t*>(minimums.data_ptr<at::Half>());
  const int64_t groups = K / GROUP;
  return run_quantized(x, P, K, N, bias, Q4x8Panel::biased, [&](int64_t p) {
    return Q4x8Panel{w + p * (K / 2) * LANES, s + p * groups * LANES, m + p * groups * LANES};
  });
}

at::Tensor stable_linear_q8x8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const at::Tensor& sums, const std::optional<at::Tensor>& bias, int64_t N) {
  check_packed(packed, at::kChar, 4, "q8_0x8 weights");
  const int64_t P = packed.size(0), K = packed.size(1) * 4;
  check_groups(scales, P, K, at::kHalf);
  check_groups(sums, P, K, at::kShort);
  const int8_t* w = packed.data_ptr<int8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const int16_t* sum = sums.data_ptr<int16_t>();
  const int64_t groups = K / GROUP;
  return run_quantized(x, P, K, N, bias, Q8x8Panel::biased, [&](int64_t p) {
    return Q8x8Panel{w + p * K * LANES, s + p * groups * LANES, sum + p * groups * LANES};
  });
}

}  // namespace

TORCH_LIBRARY(eagle_lab_kernels, m) {
  m.def("stable_linear(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor");
  m.def("stable_linear_q8(Tensor x, Tensor q, Tensor scales, Tensor? bias, int n) -> Tensor");
  m.def("stable_linear_q4(Tensor x, Tensor nibbles, Tensor scales, Tensor minimums, Tensor? bias, int n) -> Tensor");
  m.def("stable_linear_q4x8(Tensor x, Tensor packed, Tensor scales, Tensor minimums, Tensor? bias, int n) -> Tensor");
  m.def("stable_linear_q8x8(Tensor x, Tensor packed, Tensor scales, Tensor sums, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle_lab_kernels, CPU, m) {
  m.impl("stable_linear", &stable_linear);
  m.impl("stable_linear_q8", &stable_linear_q8);
  m.impl("stable_linear_q4", &stable_linear_q4);
  m.impl("stable_linear_q4x8", &stable_linear_q4x8);
  m.impl("stable_linear_q8x8", &stable_linear_q8x8);
}
