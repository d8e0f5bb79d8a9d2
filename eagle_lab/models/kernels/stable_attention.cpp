// Attention on CPU, float32, with every query computed on its own, in one fixed order.
//
// out[b, t, h] = sum_s p_s v[b, g(h), s] / sum_s p_s, with p_s = exp(scale * q[b, h, t] . k[b, g(h), s] + mask - max)
// over the keys s the mask leaves visible, in increasing s. A query's result depends on its own row, the
// visible keys and nothing else: not on how many queries share the call, how many masked keys follow
// (the attended length), or the batch. So a draft tree scored in one forward gets bitwise what one-token
// steps get (what exact greedy verification needs once activations are quantized, where a last-bit
// difference can move a rounding). Library attention does not promise this: its blocking over keys and
// queries changes the order of its sums with the shapes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using simd::f32x16;
using simd::i32x16;

// The mask's value for (t, s): 0 or an additive bias; `hidden` says the key is not visible.
struct Mask {
  const void* data = nullptr;
  bool is_bool = false;
  int64_t stride_b = 0, stride_t = 0, stride_s = 0;
  inline float at(int64_t b, int64_t t, int64_t s, bool& hidden) const {
    if (data == nullptr) {
      hidden = false;
      return 0.f;
    }
    const int64_t offset = b * stride_b + t * stride_t + s * stride_s;
    if (is_bool) {
      hidden = !static_cast<const bool*>(data)[offset];
      return 0.f;
    }
    const float value = static_cast<const float*>(data)[offset];
    hidden = value <= std::numeric_limits<float>::lowest() / 2;  // additive masks hide with the lowest float
    return value;
  }
};

ALWAYS_INLINE f32x16 load16(const float* p) { return simd::load<f32x16>(p); }

ALWAYS_INLINE float lanes_sum(f32x16 v) {  // always the same order
#if defined(__AVX512F__)
  __m512 z;
  std::memcpy(&z, &v, sizeof z);
  return _mm512_reduce_add_ps(z);
#else
  float l[16];
  std::memcpy(l, &v, sizeof l);
  for (int w = 8; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) l[i] += l[i + w];
  return l[0];
#endif
}

// exp(x) for x <= 0, 16 lanes, to about 2 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times
// 2^n). Written out, so every call computes the same bits; the library's vector exp may differ by CPU path.
ALWAYS_INLINE f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 floor_x = f32x16{} - 87.0f;
  x = simd::select_less(x, floor_x, floor_x, x);
  const f32x16 magic = f32x16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * 1.44269504088896341f + magic) - magic;
  const f32x16 r = x - n * 0.693359375f - n * -2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * simd::as_f32((simd::to_i32(n) + 127) << 23);
}

// q . k over D, in one fixed order: 16-lane partial products over d, then the lanes pairwise (D % 16 == 0),
// else one sum in increasing d.
ALWAYS_INLINE float dot(const float* q, const float* k, int64_t D) {
  if (D % 16 == 0) {
    f32x16 acc = load16(q) * load16(k);
    for (int64_t d = 16; d < D; d += 16) acc += load16(q + d) * load16(k + d);
    return lanes_sum(acc);
  }
  float total = 0.f;
  for (int64_t d = 0; d < D; ++d) total += q[d] * k[d];
  return total;
}

// A query's 16-lane partial products with a key: q . k before its lanes are added (D % 16 == 0).
ALWAYS_INLINE f32x16 partial_dot(const float* q, const float* k, int64_t D) {
  f32x16 acc = load16(q) * load16(k);
  for (int64_t d = 16; d < D; d += 16) acc += load16(q + d) * load16(k + d);
  return acc;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// The lane sums of four partials at once, each in the same fixed order: within 128-bit blocks lanes 0+2 and 1+3,
// then those two, then the blocks 0+2 and 1+3, then those two. A key's sum never depends on the other three.
inline void four_sums(const f32x16* partial, float* out) {
  __m512 p[4];
  std::memcpy(p, partial, sizeof p);
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(p[0], p[1]), _mm512_unpackhi_ps(p[0], p[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(p[2], p[3]), _mm512_unpackhi_ps(p[2], p[3]));
  const __m512 blocks = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));  // [a b c d] per block
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(blocks), _mm512_extractf32x8_ps(blocks, 1));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1)));
}
#endif

// The visible keys of query (b, t), in increasing s: idx[r] = s and bias[r] = the mask's value for the r-th
// visible key; returns how many. Every later sum runs over r, so a key's place in it depends on the visible
// keys before it, not on its slot: a tree's node and the same token's one-token step (its ancestors compacted
// into consecutive slots) sum the same numbers in the same order.
inline int64_t visible_keys(int64_t S, const Mask& m, int64_t b, int64_t t, int32_t* idx, float* bias) {
  if (m.data == nullptr) {
    for (int64_t s = 0; s < S; ++s) {
      idx[s] = static_cast<int32_t>(s);
      bias[s] = 0.f;
    }
    return S;
  }
  int64_t n = 0, s = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (m.stride_s == 1) {  // 16 mask entries at a time: compare, then compress the visible ones' slots and biases
    const int64_t row = b * m.stride_b + t * m.stride_t;
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 hidden_below = _mm512_set1_ps(std::numeric_limits<float>::lowest() / 2);
    for (; s + 16 <= S; s += 16) {
      __mmask16 seen;
      __m512 values = _mm512_setzero_ps();
      if (m.is_bool) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const bool*>(m.data) + row + s));
        seen = _mm_test_epi8_mask(bytes, bytes);
      } else {
        values = _mm512_loadu_ps(static_cast<const float*>(m.data) + row + s);
        seen = _mm512_cmp_ps_mask(values, hidden_below, _CMP_GT_OQ);
      }
      _mm512_mask_compressstoreu_epi32(idx + n, seen, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(s))));
      _mm512_mask_compressstoreu_ps(bias + n, seen, values);
      n += __builtin_popcount(static_cast<unsigned>(seen));
    }
  }
#endif
  for (; s < S; ++s) {
    bool hidden;
    const float value = m.at(b, t, s, hidden);
    if (hidden) continue;
    idx[n] = static_cast<int32_t>(s);
    bias[n] = value;
    ++n;
  }
  return n;
}

// x[r] = factor * x[r] + bias[r], 16 at a time (a short last block goes through the same vector arithmetic).
inline void scale_and_bias(float* x, const float* bias, int64_t n, float factor) {
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    float scores16[16] = {}, bias16[16] = {};
    const int64_t count = std::min<int64_t>(16, n - r0);
    std::memcpy(scores16, x + r0, count * sizeof(float));
    std::memcpy(bias16, bias + r0, count * sizeof(float));
    const f32x16 y = load16(scores16) * factor + load16(bias16);
    std::memcpy(x + r0, &y, count * sizeof(float));
  }
}

// x[r] = factor * (q . k[idx[r]]) + bias[r] for the n visible keys; each key's dot product in one fixed order
// (16-lane partial products over d, then the lanes), whatever the keys beside it.
inline void visible_scores(const float* q, int64_t D, const float* k, int64_t k_stride, const int32_t* idx,
                           const float* bias, int64_t n, float factor, float* x) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if (D % 16 == 0) {
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
      const int64_t count = std::min<int64_t>(4, n - r0);
      f32x16 partial[4] = {};
      for (int64_t j = 0; j < count; ++j) partial[j] = partial_dot(q, k + idx[r0 + j] * k_stride, D);
      four_sums(partial, x + r0);  // writes 4: x has room for a block past n
    }
  } else
#endif
  {
    for (int64_t r = 0; r < n; ++r) x[r] = dot(q, k + idx[r] * k_stride, D);
  }
  scale_and_bias(x, bias, n, factor);
}

// x[0, n) -> exp(x - max) in place; returns their sum: rank r adds into lane r % 16, then the lanes.
inline float softmax_numerators(float* x, int64_t n) {
  if (n == 0) return 0.f;
  float high = x[0];  // the maximum, 16 lanes at a time (exact in any order)
  int64_t r = 0;
  if (n >= 16) {
    f32x16 top = load16(x);
    for (r = 16; r + 16 <= n; r += 16) {
      const f32x16 y = load16(x + r);
      top = simd::select_less(top, y, y, top);
    }
    float l[16];
    std::memcpy(l, &top, sizeof l);
    for (int i = 0; i < 16; ++i) high = std::max(high, l[i]);
  }
  for (; r < n; ++r) high = std::max(high, x[r]);
  f32x16 lanes{};
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    const int64_t k = std::min<int64_t>(16, n - r0);
    float block[16];
    for (int64_t i = 0; i < 16; ++i) block[i] = i < k ? x[r0 + i] : high;
    f32x16 e = exp_nonpositive(load16(block) - high);
    float out[16];
    std::memcpy(out, &e, sizeof out);
    for (int64_t i = k; i < 16; ++i) out[i] = 0.f;  // padding adds nothing
    lanes += load16(out);
    std::memcpy(x + r0, out, k * sizeof(float));
  }
  return lanes_sum(lanes);
}

// out = sum_r p[r] v[idx[r]] / total with D = 16 * NV: two accumulators per 16 lanes, one for even ranks and one
// for odd ranks (two FMA chains in flight), added at the end. `Chains` holds them between blocks of ranks, so that
// the queries sharing a key/value head can take turns over a block whose value rows are in L1, each query's sum
// running over r in the order of a single pass over all ranks.
template <int NV>
struct Chains {
  f32x16 even[NV], odd[NV];
  Chains() {
    for (int j = 0; j < NV; ++j) even[j] = odd[j] = f32x16{};
  }
  // ranks [r0, r1) with r0 even
  ALWAYS_INLINE void add(const float* p, const int32_t* idx, int64_t r0, int64_t r1, const float* vb,
                         int64_t v_stride) {
    f32x16 e[NV], o[NV];  // in registers for the block
    for (int j = 0; j < NV; ++j) e[j] = even[j], o[j] = odd[j];
    int64_t r = r0;
    for (; r + 1 < r1; r += 2) {
      const float* ve = vb + idx[r] * v_stride;
      const float* vo = vb + idx[r + 1] * v_stride;
      for (int j = 0; j < NV; ++j) {
        e[j] += p[r] * load16(ve + 16 * j);
        o[j] += p[r + 1] * load16(vo + 16 * j);
      }
    }
    if (r < r1) {
      const float* ve = vb + idx[r] * v_stride;
      for (int j = 0; j < NV; ++j) e[j] += p[r] * load16(ve + 16 * j);
    }
    for (int j = 0; j < NV; ++j) even[j] = e[j], odd[j] = o[j];
  }
  ALWAYS_INLINE void store(float total, float* out) const {
    for (int j = 0; j < NV; ++j) {
      const f32x16 v = (even[j] + odd[j]) / total;
      std::memcpy(out + 16 * j, &v, sizeof v);
    }
  }
};

// out = sum_r p[r] v[idx[r]] / total for a D without a vector form: one sum per d in increasing rank.
inline void weighted_values_scalar(const float* p, const int32_t* idx, int64_t n, const float* vb, int64_t v_stride,
                                   float total, float* out, int64_t D) {
  for (int64_t d = 0; d < D; ++d) {  // any other D: one sum in increasing rank
    float sum = 0.f;
    for (int64_t r = 0; r < n; ++r) sum += p[r] * vb[idx[r] * v_stride + d];
    out[d] = sum / total;
  }
}

// Keys per block when the heads sharing a key/value head take turns: 64 keys and values of 64 floats are 32 KB,
// in L1 for the turns after the first. A multiple of 16, so blocks cut the sums where one pass groups them anyway.
constexpr int64_t KEY_BLOCK = 64;

// The weighted values of `heads` queries over the same visible keys, a block of value rows at a time: each query's
// chains run over r in one pass's order. False for a D without a vector form (the caller sums per query).
template <int NV, class Scores, class Output>
void values_in_blocks(Scores scores_of, const float* totals, int64_t heads, const int32_t* idx, int64_t n,
                      const float* vb, int64_t v_stride, Output output_of) {
  constexpr int64_t MAX_HEADS = 8;
  for (int64_t h0 = 0; h0 < heads; h0 += MAX_HEADS) {
    const int64_t count = std::min(MAX_HEADS, heads - h0);
    Chains<NV> chains[MAX_HEADS];
    for (int64_t r0 = 0; r0 < n; r0 += KEY_BLOCK)
      for (int64_t i = 0; i < count; ++i)
        chains[i].add(scores_of(h0 + i), idx, r0, std::min(n, r0 + KEY_BLOCK), vb, v_stride);
    for (int64_t i = 0; i < count; ++i) chains[i].store(totals[h0 + i], output_of(h0 + i));
  }
}

// The weighted values for any D that is a multiple of 16, in column chunks of 16 * NV (the largest NV in 8, 4, 2, 1
// that divides D): a lane's sum is the same whatever chunk holds it, so D = 256 runs as two chunks of 128 with no
// register spills. False for a D without a vector form (the caller sums per query).
template <class Scores, class Output>
bool values_by_block(int64_t D, Scores scores_of, const float* totals, int64_t heads, const int32_t* idx, int64_t n,
                     const float* vb, int64_t v_stride, Output output_of) {
  if (D % 16 != 0) return false;
  const int64_t lanes_per_chunk = D % 128 == 0 ? 128 : D % 64 == 0 ? 64 : D % 32 == 0 ? 32 : 16;
  for (int64_t c = 0; c < D; c += lanes_per_chunk) {
    auto chunk_of = [&](int64_t i) { return output_of(i) + c; };
    switch (lanes_per_chunk) {
      case 128: values_in_blocks<8>(scores_of, totals, heads, idx, n, vb + c, v_stride, chunk_of); break;
      case 64: values_in_blocks<4>(scores_of, totals, heads, idx, n, vb + c, v_stride, chunk_of); break;
      case 32: values_in_blocks<2>(scores_of, totals, heads, idx, n, vb + c, v_stride, chunk_of); break;
      default: values_in_blocks<1>(scores_of, totals, heads, idx, n, vb + c, v_stride, chunk_of); break;
    }
  }
  return true;
}

at::Tensor stable_attention(const at::Tensor& query, const at::Tensor& key_in, const at::Tensor& value_in,
                            const std::optional<at::Tensor>& mask, double scale) {
  // any strides are read in place (a static cache's views) as long as D is contiguous; else a contiguous copy
  const at::Tensor key = key_in.dim() == 4 && key_in.stride(3) != 1 ? key_in.contiguous() : key_in;
  const at::Tensor value = value_in.dim() == 4 && value_in.stride(3) != 1 ? value_in.contiguous() : value_in;
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.dim() == 4,
              "stable_attention: query must be float32 CPU [B, H, T, D]");
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat && key.dim() == 4 &&
                  value.sizes() == key.sizes(),
              "stable_attention: keys and values must be float32 [B, kvH, S, D]");
  const at::Tensor q = query.contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t kvH = key.size(1), S = key.size(2);
  TORCH_CHECK(key.size(0) == B && key.size(3) == D && kvH > 0 && H % kvH == 0,
              "stable_attention: keys [B, kvH, S, D] must match the queries, kvH dividing H");
  Mask m;
  at::Tensor mask_c;
  if (mask.has_value()) {
    mask_c = *mask;
    TORCH_CHECK(mask_c.dim() == 4 && mask_c.size(1) == 1 && mask_c.size(2) == T && mask_c.size(3) >= S &&
                    (mask_c.size(0) == B || mask_c.size(0) == 1) &&
                    (mask_c.scalar_type() == at::kFloat || mask_c.scalar_type() == at::kBool),
                "stable_attention: the mask must be float32 or bool [B or 1, 1, T, >= S]");
    m.data = mask_c.data_ptr();
    m.is_bool = mask_c.scalar_type() == at::kBool;
    m.stride_b = mask_c.size(0) == 1 ? 0 : mask_c.stride(0);
    m.stride_t = mask_c.stride(2);
    m.stride_s = mask_c.stride(3);
  }
  at::Tensor out = at::zeros({B, T, H, D}, q.options());  // [B, T, H, D]; a query that sees nothing stays 0
  const float* qs = q.data_ptr<float>();
  const float* ks = key.data_ptr<float>();
  const float* vs = value.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t group = H / kvH;
  const float factor = static_cast<float>(scale);
  // One task per (batch, query, key/value head, run of its query heads): the run's heads see the same keys (one
  // mask row), so the visible keys are found once and each block of keys and values is read into L1 once for all
  // of them. Runs are as long as the group unless that leaves fewer than two tasks per thread.
  int64_t per_task = group;
  const int64_t threads = at::get_num_threads();
  while (per_task > 1 && B * T * kvH * ((group + per_task - 1) / per_task) < 2 * threads)
    per_task = (per_task + 1) / 2;
  const int64_t runs = (group + per_task - 1) / per_task;
  at::parallel_for(0, B * T * kvH * runs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(per_task * (S + 4)), bias(S), totals(per_task);  // x: per head, room for a block of 4
    std::vector<int32_t> idx(S);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t run = index % runs, g = (index / runs) % kvH, t = (index / (runs * kvH)) % T;
      const int64_t b = index / (runs * kvH * T);
      const int64_t h0 = g * group + run * per_task, heads = std::min(per_task, (g + 1) * group - h0);
      const float* kb = ks + b * key.stride(0) + g * key.stride(1);
      const float* vb = vs + b * value.stride(0) + g * value.stride(1);
      const int64_t n = visible_keys(S, m, b, t, idx.data(), bias.data());
      if (n == 0) continue;
      auto query_of = [&](int64_t i) { return qs + ((b * H + h0 + i) * T + t) * D; };  // [D]
      auto output_of = [&](int64_t i) { return os + ((b * T + t) * H + h0 + i) * D; };
      auto scores_of = [&](int64_t i) { return x.data() + i * (S + 4); };
      for (int64_t r0 = 0; r0 < n; r0 += KEY_BLOCK) {  // scores, a block of keys at a time for every head
        const int64_t count = std::min(KEY_BLOCK, n - r0);
        for (int64_t i = 0; i < heads; ++i)
          visible_scores(query_of(i), D, kb, key.stride(2), idx.data() + r0, bias.data() + r0, count, factor,
                         scores_of(i) + r0);
      }
      for (int64_t i = 0; i < heads; ++i) totals[i] = softmax_numerators(scores_of(i), n);
      if (!values_by_block(D, scores_of, totals.data(), heads, idx.data(), n, vb, value.stride(2), output_of))
        for (int64_t i = 0; i < heads; ++i)
          weighted_values_scalar(scores_of(i), idx.data(), n, vb, value.stride(2), totals[i], output_of(i), D);
    }
  });
  return out;
}

}  // namespace

// flexible_layout: a compiled graph hands the op the static cache's own keys and values, strided views of the
// whole cache, instead of copying them to contiguous tensors first (the kernel reads any stride but the last).
TORCH_LIBRARY(eagle_lab_attention, m) {
  m.def("stable_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor",
        {at::Tag::flexible_layout});
}

TORCH_LIBRARY_IMPL(eagle_lab_attention, CPU, m) { m.impl("stable_attention", &stable_attention); }
