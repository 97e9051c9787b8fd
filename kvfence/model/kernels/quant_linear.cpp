// ---- linear layers on the GGUF's own quantized blocks (weight-only: activations stay bfloat16) ----
//
// A decode step's few rows make a linear layer a read of its whole weight; reading the GGUF's blocks instead of
// bfloat16 reads 5/16 of the bytes (Q4_1) or 17/32 (Q8_0). The blocks are the model's real weights (the bfloat16
// copy is rounded from them), so this is also closer to float32 than the bfloat16 path.
//   Q4_1: 32 weights per block, w = d * q + m with q in 0..15 (16 bytes: element j in the low nibble of byte j,
//         element j + 16 in its high nibble).
//   Q8_0: 32 weights per block, w = d * q with q an int8.
// The loader splits each block into qs [N, K/2 or K] bytes and d, m [N, K/32] float16. Products of bfloat16
// pairs are exact (dpbf16), sums are float32, the output is rounded to bfloat16 once.

#include "cpu_ops.h"

namespace kvfence {

namespace {

constexpr int64_t QUANT_ROW_TILE = 8;  // activation rows whose accumulators stay in registers
constexpr int64_t QUANT_N_CHUNK = 32;  // output columns per task: its weights stay in L2 across row tiles


#if defined(__AVX512BF16__)
// Q4_1, four blocks (64 bytes of nibbles) at a time. Byte q of a nibble next to the byte 0x43 is the bfloat16 of
// 128 + q, so unpacking is two masks and four byte interleaves, no conversion. The interleaves put, in 128-bit
// lane i of four vectors, block i's elements 0-7, 8-15, 16-23 and 24-31; `repack_x` lays x out the same way.
// Then x . w = d * (x . (128 + q)) + (m - 128 d) * sum(x), and the four blocks' d sit in their lanes of one
// scale vector, applied once per four dpbf16.
constexpr int64_t Q4_GROUP = 4;                  // blocks per group
constexpr int64_t Q4_GROUP_X = Q4_GROUP * QBLOCK;  // x values per group

// x [rows, K] -> [rows, groups * 128] in the interleaved order above, zero past the last block
void repack_x(const uint16_t* x, int64_t ldx, int64_t rows, int64_t nb, uint16_t* out) {
  const int64_t groups = (nb + Q4_GROUP - 1) / Q4_GROUP;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t v = 0; v < 4; ++v)
        for (int64_t i = 0; i < Q4_GROUP; ++i) {
          uint16_t* dst = out + r * groups * Q4_GROUP_X + g * Q4_GROUP_X + v * QBLOCK + i * 8;
          const int64_t block = g * Q4_GROUP + i;
          if (block < nb)
            std::memcpy(dst, x + r * ldx + block * QBLOCK + v * 8, 8 * sizeof(uint16_t));
          else
            std::memset(dst, 0, 8 * sizeof(uint16_t));
        }
}

template <int64_t MT, int64_t NT>
inline void q4_tile(const uint16_t* xr, const float* xsum, const float* xsum_128, const uint8_t* qs, int64_t ldq,
                    const uint16_t* d, const uint16_t* m, int64_t nb, int64_t n0, uint16_t* out, int64_t ldo) {
  const int64_t groups = (nb + Q4_GROUP - 1) / Q4_GROUP;
  const __m512i low4 = _mm512_set1_epi8(0x0f), magic = _mm512_set1_epi8(0x43);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[MT][NT];
  for (int64_t r = 0; r < MT; ++r)
    for (int64_t c = 0; c < NT; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t left = nb - g * Q4_GROUP;
    __m512bh w[NT][4];
    __m512 scale[NT];
    for (int64_t c = 0; c < NT; ++c) {
      // Masked loads only for a row's last group when it holds fewer than four blocks: on this CPU (AMD Zen) a
      // masked load is much slower from memory than a plain one (2.5x for a whole layer read that way).
      const uint8_t* src = qs + (n0 + c) * ldq + g * Q4_GROUP * 16;
      const uint16_t* dsrc = d + (n0 + c) * nb + g * Q4_GROUP;
      const bool full = left >= Q4_GROUP;
      const __m512i raw = full ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi8((1ULL << (16 * left)) - 1, src);
      const __m128i d4h = full ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(dsrc))
                               : _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << left) - 1), dsrc);
      const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      w[c][0] = (__m512bh)_mm512_unpacklo_epi8(lo, magic);
      w[c][1] = (__m512bh)_mm512_unpackhi_epi8(lo, magic);
      w[c][2] = (__m512bh)_mm512_unpacklo_epi8(hi, magic);
      w[c][3] = (__m512bh)_mm512_unpackhi_epi8(hi, magic);
      const __m128 d4 = _mm_cvtph_ps(d4h);
      scale[c] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d4));
    }
    for (int64_t r = 0; r < MT; ++r) {
      const uint16_t* xg = xr + r * groups * Q4_GROUP_X + g * Q4_GROUP_X;
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xg), x1 = (__m512bh)_mm512_loadu_si512(xg + 32);
      const __m512bh x2 = (__m512bh)_mm512_loadu_si512(xg + 64), x3 = (__m512bh)_mm512_loadu_si512(xg + 96);
      for (int64_t c = 0; c < NT; ++c) {
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), x0, w[c][0]);
        t = _mm512_dpbf16_ps(t, x1, w[c][1]);
        t = _mm512_dpbf16_ps(t, x2, w[c][2]);
        t = _mm512_dpbf16_ps(t, x3, w[c][3]);
        acc[r][c] = _mm512_fmadd_ps(t, scale[c], acc[r][c]);
      }
    }
  }
  for (int64_t b = 0; b < nb; b += 16) {  // + sum over blocks of (m - 128 d) * sum(x in the block)
    const __mmask16 k = nb - b >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (nb - b)) - 1);
    for (int64_t c = 0; c < NT; ++c) {
      const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, m + (n0 + c) * nb + b));
      const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, d + (n0 + c) * nb + b));
      for (int64_t r = 0; r < MT; ++r) {
        acc[r][c] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, xsum + r * nb + b), acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(dv, _mm512_maskz_loadu_ps(k, xsum_128 + r * nb + b), acc[r][c]);
      }
    }
  }
  for (int64_t r = 0; r < MT; ++r)
    for (int64_t c = 0; c < NT; ++c) out[r * ldo + n0 + c] = f32_to_bf16(_mm512_reduce_add_ps(acc[r][c]));
}

// Q8_0, one block at a time: 32 int8 -> float32 -> bfloat16 (exact), one dpbf16 per block, scaled by its d.
template <int64_t MT, int64_t NT>
inline void q8_tile(const uint16_t* x, int64_t ldx, const uint8_t* qs, int64_t ldq, const uint16_t* d, int64_t nb,
                    int64_t n0, uint16_t* out, int64_t ldo) {
  __m512 acc[MT][NT];
  for (int64_t r = 0; r < MT; ++r)
    for (int64_t c = 0; c < NT; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512bh w[NT];
    __m512 scale[NT];
    for (int64_t c = 0; c < NT; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (n0 + c) * ldq + b * QBLOCK));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
      w[c] = _mm512_cvtne2ps_pbh(hi, lo);
      scale[c] = _mm512_set1_ps(half_to_float(d[(n0 + c) * nb + b]));
    }
    for (int64_t r = 0; r < MT; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + b * QBLOCK);
      for (int64_t c = 0; c < NT; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv, w[c]), scale[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < MT; ++r)
    for (int64_t c = 0; c < NT; ++c) out[r * ldo + n0 + c] = f32_to_bf16(_mm512_reduce_add_ps(acc[r][c]));
}

struct QuantArgs {  // one call's operands; x is the repacked x for Q4_1
  const uint16_t* x;
  int64_t ldx;
  const float* xsum;
  const float* xsum_128;
  const uint8_t* qs;
  int64_t ldq;
  const uint16_t* d;
  const uint16_t* m;
  int64_t nb;
  uint16_t* out;
  int64_t ldo;
};

// columns [n0, n1) for MT rows, NT columns at a time (fewer accumulators as rows grow), then one at a time
template <int64_t KIND, int64_t MT>
void quant_columns(const QuantArgs& a, int64_t n0, int64_t n1) {
  constexpr int64_t NT = MT == 1 ? 4 : MT <= 4 ? 2 : 1;
  int64_t n = n0;
  if constexpr (KIND == Q4_1) {
    for (; n + NT <= n1; n += NT) q4_tile<MT, NT>(a.x, a.xsum, a.xsum_128, a.qs, a.ldq, a.d, a.m, a.nb, n, a.out, a.ldo);
    for (; n < n1; ++n) q4_tile<MT, 1>(a.x, a.xsum, a.xsum_128, a.qs, a.ldq, a.d, a.m, a.nb, n, a.out, a.ldo);
  } else {
    for (; n + NT <= n1; n += NT) q8_tile<MT, NT>(a.x, a.ldx, a.qs, a.ldq, a.d, a.nb, n, a.out, a.ldo);
    for (; n < n1; ++n) q8_tile<MT, 1>(a.x, a.ldx, a.qs, a.ldq, a.d, a.nb, n, a.out, a.ldo);
  }
}

template <int64_t KIND>
void quant_rows(int64_t rows, const QuantArgs& a, int64_t n0, int64_t n1) {
  switch (rows) {
#define KVFENCE_TILE(R) case R: quant_columns<KIND, R>(a, n0, n1); break;
    KVFENCE_TILE(1) KVFENCE_TILE(2) KVFENCE_TILE(3) KVFENCE_TILE(4)
    KVFENCE_TILE(5) KVFENCE_TILE(6) KVFENCE_TILE(7) KVFENCE_TILE(8)
#undef KVFENCE_TILE
    default: TORCH_CHECK(false, "row tile out of range");
  }
}
#endif

// The same sums without AVX512-BF16 (a CPU that lacks it): dequantize one block, multiply in float32.
void quant_rows_scalar(int64_t kind, int64_t rows, const uint16_t* x, int64_t ldx, const uint8_t* qs, int64_t ldq,
                       const uint16_t* d, const uint16_t* m, int64_t nb, int64_t n0, int64_t n1, uint16_t* out,
                       int64_t ldo) {
  float w[QBLOCK], xf[QBLOCK];
  const int64_t bytes = kind == Q4_1 ? QBLOCK / 2 : QBLOCK;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* q = qs + n * ldq + b * bytes;
        const float scale = half_to_float(d[n * nb + b]);
        for (int64_t j = 0; j < QBLOCK; ++j) {
          if (kind == Q4_1)
            w[j] = scale * static_cast<float>(j < 16 ? q[j] & 0x0f : q[j - 16] >> 4) + half_to_float(m[n * nb + b]);
          else
            w[j] = scale * static_cast<float>(static_cast<int8_t>(q[j]));
        }
        bf16_to_f32(x + r * ldx + b * QBLOCK, xf, QBLOCK);
        for (int64_t j = 0; j < QBLOCK; ++j) sum += w[j] * xf[j];
      }
      out[r * ldo + n] = f32_to_bf16(sum);
    }
}

}  // namespace

// x [M, K] bfloat16 @ W^T with W given as quantized blocks: qs [N, K/2 (Q4_1) or K (Q8_0)] uint8, d and m
// [N, K/32] float16 (m unused for Q8_0). Returns [M, N] bfloat16.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m, int64_t kind) {
  check_rows(x, "x");
  TORCH_CHECK(kind == Q4_1 || kind == Q8_0, "kind: 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(qs.device().is_cpu() && d.device().is_cpu() && m.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(qs.scalar_type() == at::kByte && d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf,
              "qs uint8, d and m float16");
  TORCH_CHECK(qs.dim() == 2 && d.dim() == 2 && qs.is_contiguous() && d.is_contiguous() && m.is_contiguous(),
              "qs and d: contiguous [N, ...]");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / QBLOCK;
  TORCH_CHECK(K % QBLOCK == 0 && K > 0, "K must be a positive multiple of 32");
  TORCH_CHECK(qs.size(1) == (kind == Q4_1 ? K / 2 : K) && d.size(0) == N && d.size(1) == nb, "block shapes");
  TORCH_CHECK(kind == Q8_0 || (m.dim() == 2 && m.size(0) == N && m.size(1) == nb), "m: [N, K/32] for Q4_1");
  auto out = torch::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t ldx = x.stride(0);
  const auto* qp = qs.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = kind == Q4_1 ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
#if defined(__AVX512BF16__)
  // Q4_1: each row's sum over each block (and -128 times it), and x in the interleaved order of q4_tile
  const int64_t groups = (nb + 3) / 4;
  std::vector<float> xsum(kind == Q4_1 ? M * nb : 0), xsum_128(xsum.size());
  std::vector<uint16_t> xr(kind == Q4_1 ? M * groups * 128 : 0);
  if (kind == Q4_1) {
    float xf[QBLOCK];
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        bf16_to_f32(xp + r * ldx + b * QBLOCK, xf, QBLOCK);
        float s = 0.0f;
        for (float v : xf) s += v;
        xsum[r * nb + b] = s;
        xsum_128[r * nb + b] = -128.0f * s;
      }
    repack_x(xp, ldx, M, nb, xr.data());
  }
#endif
  at::parallel_for(0, (N + QUANT_N_CHUNK - 1) / QUANT_N_CHUNK, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * QUANT_N_CHUNK, n1 = std::min(N, end * QUANT_N_CHUNK);
    for (int64_t c = n0; c < n1; c += QUANT_N_CHUNK) {
      const int64_t c1 = std::min(n1, c + QUANT_N_CHUNK);
      for (int64_t r = 0; r < M; r += QUANT_ROW_TILE) {
        const int64_t rows = std::min(QUANT_ROW_TILE, M - r);
#if defined(__AVX512BF16__)
        if (kind == Q4_1)
          quant_rows<Q4_1>(rows, {xr.data() + r * groups * 128, 0, xsum.data() + r * nb, xsum_128.data() + r * nb,
                                  qp, qs.size(1), dp, mp, nb, op + r * N, N}, c, c1);
        else
          quant_rows<Q8_0>(rows, {xp + r * ldx, ldx, nullptr, nullptr, qp, qs.size(1), dp, mp, nb, op + r * N, N},
                           c, c1);
#else
        quant_rows_scalar(kind, rows, xp + r * ldx, ldx, qp, qs.size(1), dp, mp, nb, c, c1, op + r * N, N);
#endif
      }
    }
  });
  return out;
}

}  // namespace kvfence
