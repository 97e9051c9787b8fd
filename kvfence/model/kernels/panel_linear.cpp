// ---- linear layers with int8 activations against the GGUF's blocks (AVX512-VNNI) ----
//
// For steps of many rows (prefills, full decode batches) a linear layer is compute-bound, and oneDNN's bfloat16
// runs at about 70% of dpbf16's peak. vpdpbusd multiplies 64 byte pairs per instruction where dpbf16 multiplies 32
// bfloat16 pairs, so the activations are quantized as llama.cpp quantizes them against these blocks: per row and
// block of 32, xq = round(x / s) with s = max|x| / 127. Per output column and block:
//   Q4_1: x . w = s * d * (xq . q) + m * s * sum(xq)      (q in 0..15)
//   Q8_0: x . w = s * d * (xq . (q + 128) - 128 * sum(xq))    (dpbusd takes unsigned bytes on one side)
// Both terms use the quantized x: the result is then exactly x' . w for x' = s * xq, whose error against x . w
// is half that of pairing the exact sum(x) with the quantized first term (for Q4_1, whose q all have one sign).
// The integer sums are exact and each row's result depends on that row alone, whatever else is in the step.
//
// The weights are repacked at load into panels of 16 output columns, one column per 32-bit lane, so that a
// vector of results needs no horizontal sum (`QuantBlocks.panels`, kvfence/model/quant.py):
//   Q4_1: per panel and block, 4 groups of 64 bytes; lane c, byte i of group g holds q[k] | q[k + 4] << 4 for
//         k = 8g + i of column c (the low nibbles are keys 8g..8g+3, the high ones 8g+4..8g+7);
//   Q8_0: per panel and block, 8 groups of 64 bytes; lane c, byte i of group g holds q[4g + i] + 128;
//   d, m: per panel and block, the 16 columns' float16 scales (m for Q4_1 only).
// Columns past N in the last panel are zero and never stored.

#include "cpu_ops.h"

namespace kvfence {

namespace {

constexpr int64_t PANEL = 16;  // output columns per panel, one per lane

// Blocks whose largest magnitude is below this count as zeros (flushed, as denormals are): below it 254 * 127 /
// max|x| overflows float32, and the unit of two levels, max|x| / (127 * 254), is no longer a normal float.
constexpr float MIN_AMAX = 127.0f * 254.0f * std::numeric_limits<float>::min();  // about 3.9e-34

// One block of 32 values of x -> its quants q1 (and q2 with two levels) and the sum of its quants (254 * sum(q1) +
// sum(q2) with two levels). `s` gets max|x| / 127, `finite` whether the block holds no NaN and no infinity. A
// block that is not finite, or below MIN_AMAX, gets zero quants (so no sum can overflow). Scalar version: the
// fallback, and the reference the tests hold the vector version to, bit for bit (`panel_linear_scalar`).
int32_t quantize_block_scalar(const uint16_t* x, int64_t levels, int8_t* q1, int8_t* q2, float* s, bool* finite) {
  float xf[QBLOCK];
  bf16_to_f32(x, xf, QBLOCK);
  float amax = 0.0f;
  bool all_finite = true;
  for (float v : xf) amax = std::max(amax, std::fabs(v)), all_finite = all_finite && std::isfinite(v);
  *s = amax / 127.0f;
  *finite = all_finite;
  if (!all_finite || !(amax >= MIN_AMAX)) {
    std::memset(q1, 0, QBLOCK);
    if (levels == 2) std::memset(q2, 0, QBLOCK);
    return 0;
  }
  const float inv = 127.0f / amax, inv2 = inv * 254.0f;
  int32_t sum1 = 0, sum2 = 0;
  for (int64_t j = 0; j < QBLOCK; ++j) {  // within +-127 by construction; nearbyint rounds half to even
    const int32_t v = static_cast<int32_t>(std::nearbyint(xf[j] * inv));
    q1[j] = static_cast<int8_t>(v);
    sum1 += v;
    if (levels == 2) {
      const int32_t w = static_cast<int32_t>(std::nearbyint(std::fma(-static_cast<float>(v), *s, xf[j]) * inv2));
      q2[j] = static_cast<int8_t>(w);
      sum2 += w;
    }
  }
  return levels == 2 ? 254 * sum1 + sum2 : sum1;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define KVFENCE_PANEL_VECTOR 1
// The same with AVX-512 (the same quants: the same float operations, rounded the same way).
int32_t quantize_block_vector(const uint16_t* x, int64_t levels, int8_t* q1, int8_t* q2, float* s, bool* finite) {
  const __m512 lo = load_bf16x16(x), hi = load_bf16x16(x + 16), zero = _mm512_setzero_ps();
  // x * 0 is NaN for a NaN or an infinity and zero otherwise
  const bool all_finite =
      _mm512_reduce_add_ps(_mm512_add_ps(_mm512_mul_ps(lo, zero), _mm512_mul_ps(hi, zero))) == 0.0f;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  *s = amax / 127.0f;
  *finite = all_finite;
  if (!all_finite || !(amax >= MIN_AMAX)) {
    std::memset(q1, 0, QBLOCK);
    if (levels == 2) std::memset(q2, 0, QBLOCK);
    return 0;
  }
  const float inv_s = 127.0f / amax;
  const __m512 inv = _mm512_set1_ps(inv_s);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q1), _mm512_cvtsepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + 16), _mm512_cvtsepi32_epi8(qhi));
  int32_t qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  if (levels == 2) {
    const __m512 sv = _mm512_set1_ps(*s), inv2 = _mm512_set1_ps(inv_s * 254.0f);
    const __m512 rlo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo), sv, lo);
    const __m512 rhi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi), sv, hi);
    const __m512i slo = _mm512_cvtps_epi32(_mm512_mul_ps(rlo, inv2)), shi = _mm512_cvtps_epi32(_mm512_mul_ps(rhi, inv2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q2), _mm512_cvtsepi32_epi8(slo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 16), _mm512_cvtsepi32_epi8(shi));
    qsum = 254 * qsum + _mm512_reduce_add_epi32(_mm512_add_epi32(slo, shi));
  }
  return qsum;
}
#endif

// x [M, K] bfloat16 -> xq [levels, M, K] int8 and per (row, block): the unit u of the integer sums, sum(xq) times
// u, and 128 times sum(xq), where with one level x ~ u * xq1 (u = s = max|x| / 127) and with two x ~ u * (254 *
// xq1 + xq2) (u = s / 254, xq2 the remainder x - s * xq1 quantized in steps of s / 254, within +-127 since the
// remainder is within s / 2). The unit is NaN when the block holds a NaN or an infinity, so that the row's outputs
// become NaN.
void quantize_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t levels, bool vector, int8_t* xq,
                   float* unit, float* xsum, int32_t* xqsum128) {
  const int64_t nb = K / QBLOCK;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = r * nb + b;
        const uint16_t* xb = x + r * ldx + b * QBLOCK;
        int8_t* q1 = xq + r * K + b * QBLOCK;
        int8_t* q2 = levels == 2 ? q1 + M * K : nullptr;
        float s = 0.0f;
        bool finite = true;
#ifdef KVFENCE_PANEL_VECTOR
        const int32_t qsum = vector ? quantize_block_vector(xb, levels, q1, q2, &s, &finite)
                                    : quantize_block_scalar(xb, levels, q1, q2, &s, &finite);
#else
        (void)vector;
        const int32_t qsum = quantize_block_scalar(xb, levels, q1, q2, &s, &finite);
#endif
        unit[i] = finite ? (levels == 2 ? s / 254.0f : s) : std::numeric_limits<float>::quiet_NaN();
        xsum[i] = unit[i] * static_cast<float>(qsum);
        xqsum128[i] = 128 * qsum;
      }
  });
}

struct PanelArgs {
  const int8_t* xq;  // [levels, M, K]
  const float* unit;
  const float* xsum;
  const int32_t* xqsum128;
  const uint8_t* wp;
  const uint16_t* dp;
  const uint16_t* mp;
  int64_t M, K, nb, N;
  void* out;     // [M, N]: float32 when out_f32 (logits), else bfloat16
  bool out_f32;
};

template <int64_t KIND>
constexpr int64_t panel_block_bytes() { return KIND == Q4_1 ? QBLOCK / 2 * PANEL : QBLOCK * PANEL; }

#ifdef KVFENCE_PANEL_VECTOR
// rows [r0, r0 + MT) by panels [p0, p0 + NT); LEVELS 1 or 2 (`quantize_rows`)
template <int64_t KIND, int64_t LEVELS, int64_t MT, int64_t NT>
inline void panel_tile(const PanelArgs& a, int64_t r0, int64_t p0) {
  constexpr int64_t BB = panel_block_bytes<KIND>();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const int64_t level_stride = a.M * a.K;
  __m512 acc[MT][NT];
  for (int64_t r = 0; r < MT; ++r)
    for (int64_t c = 0; c < NT; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i isum[LEVELS][MT][NT];
    for (int64_t l = 0; l < LEVELS; ++l)
      for (int64_t r = 0; r < MT; ++r)
        for (int64_t c = 0; c < NT; ++c) isum[l][r][c] = _mm512_setzero_si512();
    const int8_t* xb = a.xq + r0 * a.K + b * QBLOCK;
    // one group of weights (4 keys of each column, one byte per key and lane) against 4 keys of x at `k`
    auto multiply = [&](const __m512i* w, int64_t k) {
      for (int64_t l = 0; l < LEVELS; ++l)
        for (int64_t r = 0; r < MT; ++r) {
          int32_t xk;
          std::memcpy(&xk, xb + l * level_stride + r * a.K + k, 4);
          const __m512i xv = _mm512_set1_epi32(xk);
          for (int64_t c = 0; c < NT; ++c) isum[l][r][c] = _mm512_dpbusd_epi32(isum[l][r][c], w[c], xv);
        }
    };
    if constexpr (KIND == Q4_1) {
      for (int64_t g = 0; g < 4; ++g) {
        __m512i lo[NT], hi[NT];
        for (int64_t c = 0; c < NT; ++c) {
          const __m512i raw = _mm512_loadu_si512(a.wp + ((p0 + c) * a.nb + b) * BB + g * 64);
          lo[c] = _mm512_and_si512(raw, low4);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
        multiply(lo, 8 * g);
        multiply(hi, 8 * g + 4);
      }
    } else {
      for (int64_t g = 0; g < 8; ++g) {
        __m512i w[NT];
        for (int64_t c = 0; c < NT; ++c) w[c] = _mm512_loadu_si512(a.wp + ((p0 + c) * a.nb + b) * BB + g * 64);
        multiply(w, 4 * g);
      }
    }
    for (int64_t c = 0; c < NT; ++c) {
      const int64_t at = ((p0 + c) * a.nb + b) * PANEL;
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.dp + at)));
      const __m512 mv = KIND == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.mp + at)))
                                     : _mm512_setzero_ps();
      for (int64_t r = 0; r < MT; ++r) {
        const int64_t i = (r0 + r) * a.nb + b;
        __m512i s = isum[0][r][c];
        if constexpr (LEVELS == 2) s = _mm512_add_epi32(_mm512_mullo_epi32(s, _mm512_set1_epi32(254)), isum[1][r][c]);
        if constexpr (KIND == Q8_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(a.xqsum128[i]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(a.unit[i])), acc[r][c]);
        if constexpr (KIND == Q4_1) acc[r][c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.xsum[i]), acc[r][c]);
      }
    }
  }
  for (int64_t c = 0; c < NT; ++c) {
    const int64_t n0 = (p0 + c) * PANEL;
    const __mmask16 keep = a.N - n0 >= PANEL ? static_cast<__mmask16>(0xffff)
                                             : static_cast<__mmask16>((1u << (a.N - n0)) - 1);
    for (int64_t r = 0; r < MT; ++r) {
      const int64_t at = (r0 + r) * a.N + n0;
      if (a.out_f32) _mm512_mask_storeu_ps(static_cast<float*>(a.out) + at, keep, acc[r][c]);
      else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + at, keep, (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
    }
  }
}

// every row against panels [p0, p0 + NT): as few tiles as MAX_MT rows allow, of sizes within one of each other.
// Each tile unpacks the panel's weights again and scales its sums per block, so fewer, fuller tiles cost less:
// SmolLM2's four linears of a layer, Q4_1, two levels, AMD Zen4, best of 4 runs: 9 rows (5 + 4, was 4 + 4 + 1)
// 220 -> 210 us, 10 rows 236 -> 228, 16 rows 377 -> 359 (session 23). A row's sums do not depend on its tile.
template <int64_t KIND, int64_t LEVELS, int64_t NT>
void panel_rows(const PanelArgs& a, int64_t p0) {
  constexpr int64_t MAX_MT = LEVELS == 2 ? 6 : 4;  // accumulators: LEVELS * MT * NT integer, MT * NT float
  const int64_t tiles = (a.M + MAX_MT - 1) / MAX_MT;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = (a.M - r) / (tiles - t);
    switch (rows) {
      case 6: if constexpr (MAX_MT >= 6) panel_tile<KIND, LEVELS, 6, NT>(a, r, p0); break;
      case 5: if constexpr (MAX_MT >= 5) panel_tile<KIND, LEVELS, 5, NT>(a, r, p0); break;
      case 4: panel_tile<KIND, LEVELS, 4, NT>(a, r, p0); break;
      case 3: panel_tile<KIND, LEVELS, 3, NT>(a, r, p0); break;
      case 2: panel_tile<KIND, LEVELS, 2, NT>(a, r, p0); break;
      case 1: panel_tile<KIND, LEVELS, 1, NT>(a, r, p0); break;
      default: break;
    }
    r += rows;
  }
}

template <int64_t KIND, int64_t LEVELS>
void panel_range(const PanelArgs& a, int64_t panels, int64_t t0, int64_t t1) {
  constexpr int64_t NT = LEVELS == 1 ? 2 : 1;  // panels per tile (two levels need twice the accumulators)
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t p0 = t * NT;
    if (p0 + NT <= panels) panel_rows<KIND, LEVELS, NT>(a, p0);
    else for (int64_t p = p0; p < panels; ++p) panel_rows<KIND, LEVELS, 1>(a, p);
  }
}
#endif

// The same integer sums and scaling, one column at a time: the path of CPUs without AVX512-VNNI and BF16, and
// the reference for the vector path, which gives the same bits (the same float operations in the same order),
// except that its conversion to bfloat16 flushes denormal outputs to zero and keeps the sign of a NaN.
template <int64_t KIND>
void panel_columns_scalar(const PanelArgs& a, int64_t levels, int64_t p0, int64_t p1) {
  constexpr int64_t BB = panel_block_bytes<KIND>();
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t lane = 0; lane < PANEL && p * PANEL + lane < a.N; ++lane)
      for (int64_t r = 0; r < a.M; ++r) {
        float acc = 0.0f;
        for (int64_t b = 0; b < a.nb; ++b) {
          const uint8_t* w = a.wp + (p * a.nb + b) * BB + lane * 4;
          int32_t s = 0;
          for (int64_t l = 0; l < levels; ++l) {
            const int8_t* xb = a.xq + l * a.M * a.K + r * a.K + b * QBLOCK;
            int32_t dot = 0;
            for (int64_t k = 0; k < QBLOCK; ++k) {
              int32_t q;
              if constexpr (KIND == Q4_1) {
                const uint8_t byte = w[(k / 8) * 64 + (k % 4)];
                q = (k % 8) < 4 ? byte & 0x0f : byte >> 4;
              } else {
                q = w[(k / 4) * 64 + (k % 4)];
              }
              dot += q * xb[k];
            }
            s = l == 0 ? dot : 254 * s + dot;
          }
          const int64_t i = r * a.nb + b, at = (p * a.nb + b) * PANEL + lane;
          if constexpr (KIND == Q8_0) s -= a.xqsum128[i];
          acc = std::fma(static_cast<float>(s), half_to_float(a.dp[at]) * a.unit[i], acc);
          if constexpr (KIND == Q4_1) acc = std::fma(half_to_float(a.mp[at]), a.xsum[i], acc);
        }
        const int64_t at = r * a.N + p * PANEL + lane;
        if (a.out_f32) static_cast<float*>(a.out)[at] = acc;
        else static_cast<uint16_t*>(a.out)[at] = f32_to_bf16(acc);
      }
}

}  // namespace

// x [M, K] bfloat16 @ W^T with W [N, K] as panels of blocks (`QuantBlocks.panels`): wp uint8, d and m float16
// [ceil(N / 16), K / 32, 16] (m empty for Q8_0). Activations are quantized per row and block of 32 to one level of
// int8 (llama.cpp's precision) or two (`quantize_rows`; finer than bfloat16, twice the multiplies). Returns [M, N]
// bfloat16, or float32 with `out_f32` (the output head's logits: the float32 sums, not rounded to bfloat16).
// `scalar`: the scalar path even where the vector one exists (`panel_linear_scalar`, for tests).
torch::Tensor panel_linear_impl(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m, int64_t kind,
                                int64_t n, int64_t levels, bool out_f32, bool scalar) {
  check_rows(x, "x");
  TORCH_CHECK(kind == Q4_1 || kind == Q8_0, "kind: 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(levels == 1 || levels == 2, "levels: 1 or 2");
  TORCH_CHECK(wp.device().is_cpu() && d.device().is_cpu() && m.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(wp.scalar_type() == at::kByte && d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf,
              "wp uint8, d and m float16");
  TORCH_CHECK(wp.is_contiguous() && d.is_contiguous() && m.is_contiguous(), "contiguous panels");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QBLOCK, panels = (n + PANEL - 1) / PANEL;
  TORCH_CHECK(K % QBLOCK == 0 && K > 0 && n > 0, "K must be a positive multiple of 32");
  const int64_t bb = kind == Q4_1 ? panel_block_bytes<Q4_1>() : panel_block_bytes<Q8_0>();
  TORCH_CHECK(wp.numel() == panels * nb * bb && d.dim() == 3 && d.size(0) == panels && d.size(1) == nb &&
                  d.size(2) == PANEL, "panel shapes");
  TORCH_CHECK(kind == Q8_0 || m.sizes() == d.sizes(), "m: the shape of d for Q4_1");
  auto out = torch::empty({M, n}, x.options().dtype(out_f32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  std::vector<int8_t> xq(levels * M * K);
  std::vector<float> unit(M * nb), xsum(M * nb);
  std::vector<int32_t> xqsum128(M * nb);
  quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M, K, levels, !scalar, xq.data(),
                unit.data(), xsum.data(), xqsum128.data());
  const PanelArgs a{xq.data(), unit.data(), xsum.data(), xqsum128.data(), wp.data_ptr<uint8_t>(),
                    reinterpret_cast<const uint16_t*>(d.data_ptr()),
                    kind == Q4_1 ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr,
                    M, K, nb, n, out.data_ptr(), out_f32};
#ifdef KVFENCE_PANEL_VECTOR
  if (!scalar) {
    const int64_t per_task = levels == 1 ? 2 : 1;
    at::parallel_for(0, (panels + per_task - 1) / per_task, 1, [&](int64_t begin, int64_t end) {
      if (kind == Q4_1 && levels == 1) panel_range<Q4_1, 1>(a, panels, begin, end);
      else if (kind == Q4_1) panel_range<Q4_1, 2>(a, panels, begin, end);
      else if (levels == 1) panel_range<Q8_0, 1>(a, panels, begin, end);
      else panel_range<Q8_0, 2>(a, panels, begin, end);
    });
    return out;
  }
#endif
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    if (kind == Q4_1) panel_columns_scalar<Q4_1>(a, levels, begin, end);
    else panel_columns_scalar<Q8_0>(a, levels, begin, end);
  });
  return out;
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m, int64_t kind,
                           int64_t n, int64_t levels) {
  return panel_linear_impl(x, wp, d, m, kind, n, levels, false, false);
}

torch::Tensor panel_linear_scalar(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m,
                                  int64_t kind, int64_t n, int64_t levels, bool out_f32) {
  return panel_linear_impl(x, wp, d, m, kind, n, levels, out_f32, true);
}

// Whether panel_linear runs on vector instructions here (else on its slow scalar path).
bool panel_vnni() {
#ifdef KVFENCE_PANEL_VECTOR
  return true;
#else
  return false;
#endif
}

}  // namespace kvfence
