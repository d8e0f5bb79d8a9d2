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

namespace {

typedef float f32x16 __attribute__((vector_size(64)));

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

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float lanes_sum(f32x16 v) {  // always the same order
#if defined(__AVX512F__)
  __m512 z;
  std::memcpy(&z, &v, sizeof z);
  return _mm512_reduce_add_ps(z);
#endif
  float l[16];
  std::memcpy(l, &v, sizeof l);
  for (int w = 8; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) l[i] += l[i + w];
  return l[0];
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

// exp(x) for x <= 0, 16 lanes, to about 2 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times
// 2^n). Written out, so every call computes the same bits; the library's vector exp may differ by CPU path.
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 floor_x = f32x16{} - 87.0f;
  x = x < floor_x ? floor_x : x;
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
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// q . k over D, in one fixed order: 16-lane partial products over d, then the lanes pairwise (D % 16 == 0),
// else one sum in increasing d.
inline float dot(const float* q, const float* k, int64_t D) {
  if (D % 16 == 0) {
    f32x16 acc = load16(q) * load16(k);
    for (int64_t d = 16; d < D; d += 16) acc += load16(q + d) * load16(k + d);
    return lanes_sum(acc);
  }
  float total = 0.f;
  for (int64_t d = 0; d < D; ++d) total += q[d] * k[d];
  return total;
}

constexpr int64_t QUERY_TILE = 4;  // queries whose value sums share one read of each value row

at::Tensor stable_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.dim() == 4,
              "stable_attention: query must be float32 CPU [B, H, T, D]");
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat && key.dim() == 4 &&
                  value.sizes() == key.sizes() && key.stride(3) == 1 && value.stride(3) == 1,
              "stable_attention: keys and values must be float32 [B, kvH, S, D] with D contiguous");
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
  at::Tensor out = at::zeros({B, T, H, D}, q.options());  // [B, T, H, D]
  const float* qs = q.data_ptr<float>();
  const float* ks = key.data_ptr<float>();
  const float* vs = value.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t group = H / kvH;
  const float factor = static_cast<float>(scale);
  constexpr float NONE = -std::numeric_limits<float>::infinity();
  // one task per (batch, query head): its T queries share each key and value row read
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(T * S);  // [T, S] scores, then exp(score - max); NONE / 0 where hidden
    std::vector<float> acc(QUERY_TILE * D);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t h = index % H, b = index / H;
      const float* qh = qs + (b * H + h) * T * D;  // [T, D]
      const float* kb = ks + b * key.stride(0) + (h / group) * key.stride(1);
      const float* vb = vs + b * value.stride(0) + (h / group) * value.stride(1);
      for (int64_t s = 0; s < S; ++s) {
        const float* kr = kb + s * key.stride(2);
        for (int64_t t = 0; t < T; ++t) weights[t * S + s] = dot(qh + t * D, kr, D);
      }
      std::vector<float> totals(T, 0.f);
      for (int64_t t = 0; t < T; ++t) {
        float* w = weights.data() + t * S;
        float top = NONE;
        for (int64_t s = 0; s < S; ++s) {
          bool hidden;
          const float bias = m.at(b, t, s, hidden);
          w[s] = hidden ? NONE : w[s] * factor + bias;
          top = std::max(top, w[s]);
        }
        if (top == NONE) {
          std::fill(w, w + S, 0.f);
          continue;
        }
        // exp(w - top), 16 keys at a time; key s adds into lane s % 16, whatever S is (hidden keys add 0)
        f32x16 lanes{};
        for (int64_t s0 = 0; s0 < S; s0 += 16) {
          float block[16];
          const int64_t n = std::min<int64_t>(16, S - s0);
          for (int64_t i = 0; i < 16; ++i) block[i] = i < n ? w[s0 + i] : NONE;
          f32x16 x = load16(block);
          const f32x16 e = exp_nonpositive(x - top);
          float out[16];
          std::memcpy(out, &e, sizeof out);
          for (int64_t i = 0; i < n; ++i) out[i] = block[i] == NONE ? 0.f : out[i];
          for (int64_t i = n; i < 16; ++i) out[i] = 0.f;
          lanes += load16(out);
          std::memcpy(w + s0, out, n * sizeof(float));
        }
        totals[t] = lanes_sum(lanes);
      }
      for (int64_t t0 = 0; t0 < T; t0 += QUERY_TILE) {
        const int64_t tiles = std::min(QUERY_TILE, T - t0);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t s = 0; s < S; ++s) {
          const float* vr = vb + s * value.stride(2);
          for (int64_t i = 0; i < tiles; ++i) {
            const float p = weights[(t0 + i) * S + s];
            if (p == 0.f) continue;  // hidden: adds nothing
            float* a = acc.data() + i * D;
            if (D % 16 == 0) {
              for (int64_t d = 0; d < D; d += 16) {
                const f32x16 sum = load16(a + d) + p * load16(vr + d);
                std::memcpy(a + d, &sum, sizeof sum);
              }
            } else {
              for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
            }
          }
        }
        for (int64_t i = 0; i < tiles; ++i) {
          const int64_t t = t0 + i;
          if (totals[t] == 0.f) continue;  // nothing visible: zeros
          float* o = os + ((b * T + t) * H + h) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = acc[i * D + d] / totals[t];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(eagle_lab_attention, m) {
  m.def("stable_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle_lab_attention, CPU, m) { m.impl("stable_attention", &stable_attention); }
