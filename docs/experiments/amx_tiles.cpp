// A one-off measurement, not part of eagle_lab: one 1536 x 576 layer in the w4a8 kernel's layout (int4 weights,
// int8 activations, groups of 32) on one thread, the VNNI loop of models/kernels/stable_linear.cpp against AMX
// tiles that take one group per tile product (each product stored and scaled on its own, as the groups need).
// g++ -O3 -march=native -mamx-tile -mamx-int8 -o amx_tiles amx_tiles.cpp && ./amx_tiles
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

constexpr int K = 576, N = 1536, G = K / 32, P = N / 16;
struct TileCfg { uint8_t palette; uint8_t start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; };

std::vector<uint8_t> packed(P * (K / 8) * 64);
std::vector<float> wscale(P * G * 16), wmin(P * G * 16);
std::vector<int8_t> xq(16 * K);
std::vector<float> xd(16 * G), xs(16 * G);

template <int M>
__attribute__((noinline)) void vnni(float* out) {
  for (int p = 0; p < P; ++p) {
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* w = packed.data() + p * (K / 8) * 64;
    for (int g = 0; g < G; ++g) {
      __m512i isum[M];
      for (int r = 0; r < M; ++r) isum[r] = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        __m512i v = _mm512_loadu_si512(w + (g * 4 + t) * 64);
        __m512i lo = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
        int k = g * 32 + 8 * t;
        for (int r = 0; r < M; ++r) {
          int32_t a, b;
          memcpy(&a, &xq[r * K + k], 4);
          memcpy(&b, &xq[r * K + k + 4], 4);
          isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(a));
          isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(b));
        }
      }
      __m512 sc = _mm512_loadu_ps(&wscale[(p * G + g) * 16]), mn = _mm512_loadu_ps(&wmin[(p * G + g) * 16]);
      for (int r = 0; r < M; ++r)
        acc[r] = _mm512_add_ps(acc[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(sc, _mm512_set1_ps(xd[r * G + g])),
                                 _mm512_mul_ps(mn, _mm512_set1_ps(xs[r * G + g]))));
    }
    for (int r = 0; r < M; ++r) _mm512_storeu_ps(out + r * N + p * 16, acc[r]);
  }
}

// AMX: per group one tile product C[M x 16] += A[M x 32 s8] . B[8 x 64 u8], stored and scaled per row.
__attribute__((noinline)) void amx(int M, float* out) {
  alignas(64) uint8_t bbuf[2][8 * 64];
  alignas(64) int32_t cbuf[2][16 * 16];
  for (int p = 0; p < P; p += 2) {
    __m512 acc[2][16];
    for (int q = 0; q < 2; ++q) for (int r = 0; r < M; ++r) acc[q][r] = _mm512_setzero_ps();
    for (int g = 0; g < G; ++g) {
      for (int q = 0; q < 2; ++q) {
        const uint8_t* w = packed.data() + (p + q) * (K / 8) * 64;
        for (int t = 0; t < 4; ++t) {
          __m512i v = _mm512_loadu_si512(w + (g * 4 + t) * 64);
          _mm512_store_si512(bbuf[q] + (2 * t) * 64, _mm512_and_si512(v, _mm512_set1_epi8(0x0F)));
          _mm512_store_si512(bbuf[q] + (2 * t + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)));
        }
      }
      _tile_loadd(0, &xq[g * 32], K);  // A: M rows x 32 bytes
      _tile_loadd(1, bbuf[0], 64);
      _tile_loadd(2, bbuf[1], 64);
      _tile_zero(3);
      _tile_zero(4);
      _tile_dpbsud(3, 0, 1);
      _tile_dpbsud(4, 0, 2);
      _tile_stored(3, cbuf[0], 64);
      _tile_stored(4, cbuf[1], 64);
      for (int q = 0; q < 2; ++q) {
        __m512 sc = _mm512_loadu_ps(&wscale[((p + q) * G + g) * 16]), mn = _mm512_loadu_ps(&wmin[((p + q) * G + g) * 16]);
        for (int r = 0; r < M; ++r)
          acc[q][r] = _mm512_add_ps(acc[q][r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf[q] + r * 16)),
                                      _mm512_mul_ps(sc, _mm512_set1_ps(xd[r * G + g])),
                                      _mm512_mul_ps(mn, _mm512_set1_ps(xs[r * G + g]))));
      }
    }
    for (int q = 0; q < 2; ++q) for (int r = 0; r < M; ++r) _mm512_storeu_ps(out + r * N + (p + q) * 16, acc[q][r]);
  }
}

void configure(int M) {
  TileCfg cfg{};
  cfg.palette = 1;
  cfg.rows[0] = M; cfg.colsb[0] = 32;
  cfg.rows[1] = 8; cfg.colsb[1] = 64;
  cfg.rows[2] = 8; cfg.colsb[2] = 64;
  cfg.rows[3] = M; cfg.colsb[3] = 64;
  cfg.rows[4] = M; cfg.colsb[4] = 64;
  _tile_loadconfig(&cfg);
}

template <class F>
double best_us(F f) {
  f();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 500; ++i) {
    f();
    asm volatile("" ::: "memory");
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / 500;
}

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("no AMX permission\n"); return 1; }
  std::mt19937 rng(0);
  for (auto& b : packed) b = rng();
  for (auto& s : wscale) s = (rng() % 100) / 1000.f;
  for (auto& s : wmin) s = (rng() % 100) / 1000.f - 0.05f;
  for (auto& x : xq) x = int8_t(rng() % 255 - 127);
  for (auto& d : xd) d = (rng() % 100) / 1000.f;
  for (auto& d : xs) d = (rng() % 100) / 100.f;
  std::vector<float> o1(16 * N), o2(16 * N);
  for (int M : {1, 2, 3, 4, 8, 16}) {
    double tv;
    switch (M) {
      case 1: tv = best_us([&] { vnni<1>(o1.data()); }); break;
      case 2: tv = best_us([&] { vnni<2>(o1.data()); }); break;
      case 3: tv = best_us([&] { vnni<3>(o1.data()); }); break;
      case 4: tv = best_us([&] { vnni<4>(o1.data()); }); break;
      case 8: tv = best_us([&] { vnni<8>(o1.data()); }); break;
      default: tv = best_us([&] { vnni<8>(o1.data()); vnni<8>(o1.data() + 8 * N); }); break;
    }
    if (M == 16) { vnni<8>(o1.data()); }
    configure(M);
    double ta = best_us([&] { amx(M, o2.data()); });
    if (M <= 8) { switch (M) { case 1: vnni<1>(o1.data()); break; case 2: vnni<2>(o1.data()); break; case 3: vnni<3>(o1.data()); break; case 4: vnni<4>(o1.data()); break; case 8: vnni<8>(o1.data()); break; } }
    int diff = 0;
    if (M <= 8) for (int i = 0; i < M * N; ++i) diff += o1[i] != o2[i];
    printf("M=%2d  vnni %7.1f us  amx %7.1f us  bitwise-different outputs: %d\n", M, tv, ta, diff);
  }
}
