// kvfence CPU kernels (bfloat16 on the CPU), one extension module (`kvfence/model/kernels/__init__.py` builds
// every .cpp here into it): what the kernel families share. Each family has its own file:
//   decode_attention.cpp   paged_decode_attention: one query token per row, K/V read in place from the pages
//   write_kv.cpp           write_kv: each token's K and V rows into its slot of one layer's pool
//   prefill_attention.cpp  prefill_attention: causal attention of a chunk over its keys
//   fused_ops.cpp          rms_norm, add_rms_norm_, rotary_, silu_mul: a layer's small operators, fused
//   quant_linear.cpp       quant_linear: bfloat16 activations against the GGUF's Q4_1/Q8_0 blocks
//   panel_linear.cpp       panel_linear (+ _scalar, panel_vnni): int8 activations against repacked blocks (VNNI)
//   output_head.cpp        linear_f32, panel_linear_f32: the output head's float32 logits
//   tile_linear.cpp        tile_linear, pack_tiles: bfloat16 linear layers on AMX tiles, weights prepacked
//   tile_attention.cpp     prefill_attention_tiles: prefill_attention on AMX tiles
//   bindings.cpp           the Python module (PYBIND11_MODULE)
// Here: the includes, the conversions and vector helpers several families use (bfloat16 <-> float32, exp, dot
// products, the horizontal-sum tree, prefetch), the row check of the linear layers, and every kernel's
// declaration. Helpers are inline: each file compiles the same code it did as one file.

#pragma once

#include <torch/types.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace kvfence {

inline void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
  }
#endif
  for (; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

inline uint16_t f32_to_bf16(float value) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(float));
  if (std::isnan(value)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

#ifdef __AVX512F__
// e^x for 16 floats: Cephes' expf polynomial after n = round(x / ln 2), scaled by 2^n (relative error ~1e-7)
inline __m512 exp512(__m512 x) {
  // clamp; operands ordered so that a NaN x stays NaN (min/max return their second operand on NaN)
  x = _mm512_max_ps(_mm512_set1_ps(-88.3762626647949f), _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

#ifdef __AVX512F__
// silu(g) * u for 16 floats: g / (1 + e^-g) * u (silu_mul, and tile_linear's gated form)
inline __m512 silu_times(__m512 g, __m512 u) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
#endif

// v[i] = e^(v[i] - shift); returns the sum of the results
inline float exp_shifted(float* v, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  const __m512 s = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(v + i), s));
    _mm512_storeu_ps(v + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    v[i] = std::exp(v[i] - shift);
    sum += v[i];
  }
  return sum;
}

// the largest of v[0, n), NaNs skipped (-inf when all are NaN or n is 0)
inline float max_of(const float* v, int64_t n) {
  int64_t i = 0;
  float top = -std::numeric_limits<float>::infinity();
#ifdef __AVX512F__
  __m512 acc = _mm512_set1_ps(top);
  for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(_mm512_loadu_ps(v + i), acc);  // a NaN lane keeps acc
  top = _mm512_reduce_max_ps(acc);
#endif
  for (; i < n; ++i) top = v[i] > top ? v[i] : top;
  return top;
}

inline float sum_squares(const float* v, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(v + i), _mm512_loadu_ps(v + i), acc);
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += v[i] * v[i];
  return sum;
}

// dst = bfloat16(src), rounded to nearest even
inline void f32_to_bf16_n(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

constexpr int64_t LANES = 16;  // partial sums kept apart so the compiler vectorizes the dot product

inline float dot(const float* a, const float* b, int64_t n) {  // n is a multiple of LANES
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
#else
  float part[LANES] = {};
  for (int64_t d = 0; d < n; d += LANES)
    for (int64_t l = 0; l < LANES; ++l) part[l] += a[d + l] * b[d + l];
  float sum = 0.0f;
  for (int64_t l = 0; l < LANES; ++l) sum += part[l];
  return sum;
#endif
}

inline void axpy(float* y, float a, const float* x, int64_t n) {  // y += a * x; n is a multiple of LANES
#ifdef __AVX512F__
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t d = 0; d < n; d += LANES)
    _mm512_storeu_ps(y + d, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d)));
#else
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
#endif
}

// q . k for one head, both bfloat16, accumulated in float32 (exact products; AVX512-BF16 pairs them in hardware)
inline float dot_bf16(const uint16_t* q, const uint16_t* k, const float* qf, float* kf, int64_t n) {
#if defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(q + d);
    const __m512bh b = (__m512bh)_mm512_loadu_si512(k + d);
    acc = _mm512_dpbf16_ps(acc, a, b);
  }
  if (d < n) {  // a last 16 (n is a multiple of 16)
    bf16_to_f32(k + d, kf, 16);
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), _mm512_loadu_ps(kf), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  bf16_to_f32(k, kf, n);
  return dot(qf, kf, n);
#endif
}

#ifdef __AVX512F__
inline __m512 load_bf16x16(const uint16_t* src) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
}

constexpr int64_t AHEAD = 16;  // tokens between a prefetch and the read it serves

// Bring `bytes` at p towards L1, one prefetch per 64-byte line.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}
#endif

#if defined(__AVX512BF16__)
// The sums of v[0], ..., v[15] in lanes 0-15 of one vector: a transpose-and-add tree (45 instructions where 16
// horizontal reductions take about twice as many, each a chain of dependent shuffles).
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane L: the lane-L sums of v4i .. v4i+3
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  constexpr int EVEN = 0x88, ODD = 0xdd;  // 128-bit lanes (0, 2) and (1, 3) of each operand
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], EVEN), _mm512_shuffle_f32x4(b[0], b[1], ODD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], EVEN), _mm512_shuffle_f32x4(b[2], b[3], ODD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, EVEN), _mm512_shuffle_f32x4(c0, c1, ODD));
}

// `sum16`'s tree with max instead of add: the maxima of v[0], ..., v[15] in lanes 0-15 of one vector
inline __m512 max16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_max_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_max_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  constexpr int EVEN = 0x88, ODD = 0xdd;
  const __m512 c0 = _mm512_max_ps(_mm512_shuffle_f32x4(b[0], b[1], EVEN), _mm512_shuffle_f32x4(b[0], b[1], ODD));
  const __m512 c1 = _mm512_max_ps(_mm512_shuffle_f32x4(b[2], b[3], EVEN), _mm512_shuffle_f32x4(b[2], b[3], ODD));
  return _mm512_max_ps(_mm512_shuffle_f32x4(c0, c1, EVEN), _mm512_shuffle_f32x4(c0, c1, ODD));
}
#endif

constexpr int64_t TILE = 16;    // rows of an AMX tile
constexpr int64_t TILE_K = 32;  // bfloat16 values of K in one tile row (64 bytes)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- AMX (Intel Sapphire Rapids and later): what the tile kernels share ----

struct alignas(64) TileConfig {  // ldtilecfg's operand, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool amx_permitted() {  // Linux hands out the tile state only to a process that asks (once; oneDNN asks too)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

inline void load_tile_config(TileConfig& cfg) {
  // gcc 12 does not see that ldtilecfg reads the whole struct and drops the stores before it without this barrier
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// The tile kernels' layout (tile_linear.cpp, tile_attention.cpp): tiles 0-1 and 4 hold r0 rows (a block's first 16),
// 2-3 and 5 r1 (its next 16; 0: unused), 6-7 the right operand's 16 rows; every row 64 bytes.
inline void configure_row_tiles(int r0, int r1) {
  TileConfig cfg;
  const int second = r1 > 0 ? r1 : 1;
  for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(r0);
  for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(second);
  cfg.rows[6] = cfg.rows[7] = TILE;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  load_tile_config(cfg);
}
#endif

// Linear-layer operands: bfloat16 rows [T, D], each row contiguous.
inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.stride(1) == 1, name,
              ": bfloat16 [T, D] with contiguous rows");
}

constexpr int64_t QBLOCK = 32;  // weights per Q4_1 / Q8_0 block, along a row
enum QuantKind : int64_t { Q4_1 = 0, Q8_0 = 1 };

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// ---- the kernels (the Python names are the same; bindings.cpp) ----

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale, bool tiles);
void write_kv(torch::Tensor kv, torch::Tensor slots, torch::Tensor k, torch::Tensor v);
void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
void rotary_(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor signed_sin);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m, int64_t kind);
// panel_linear's body: bfloat16 or (out_f32) float32 outputs, the vector path or (scalar) the scalar one
torch::Tensor panel_linear_impl(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m, int64_t kind,
                                int64_t n, int64_t levels, bool out_f32, bool scalar);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m, int64_t kind,
                           int64_t n, int64_t levels);
torch::Tensor panel_linear_scalar(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m,
                                  int64_t kind, int64_t n, int64_t levels, bool out_f32);
bool panel_vnni();
torch::Tensor panel_linear_f32(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m, int64_t kind,
                               int64_t n, int64_t levels);
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, bool tiles);
bool head_tiles();
torch::Tensor pack_tiles(torch::Tensor w);
torch::Tensor tile_linear(torch::Tensor x, torch::Tensor wt, c10::optional<torch::Tensor> bias, int64_t m_block,
                          bool silu);
void prefill_attention_tiles(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale);
bool attention_tiles();

}  // namespace kvfence
