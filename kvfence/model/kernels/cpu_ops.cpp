// kvfence CPU kernels (bfloat16): decode attention straight from the KV pages, and the small operators of a
// layer fused (RMSNorm with the residual add, rotary embedding in place, silu(gate) * up).
//
// paged_decode_attention: one query token per row, attending over the first context_lens[b] tokens of the
// pages listed in block_tables[b]. It reads K/V in place (no gather, no head-major copy) and keeps scores,
// softmax and the weighted sum in float32. Only pages of the row's own block table, and only the slots below
// its context length, are ever read: the same reads as the torch path, without the padding.
//
// Work is split over rows; each token's K/V vector is converted from bfloat16 once and used by the G query heads
// that share it.

#include <torch/extension.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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

// acc[g] (64 floats each, g < G <= 4) = sum over t of probs[g * ctx + t] * V_t, V_t the head's row of token t at
// v_head + offsets[t]. A non-zero `prefetch_row` prefetches that many values of the token AHEAD tokens on (the
// first KV head's pass fetches whole rows, so the other heads' passes find them in cache).
inline void weighted_sum_64(float* acc, const float* probs, int64_t ctx, int64_t G, const int64_t* offsets,
                            const uint16_t* v_head, int64_t prefetch_row) {
  __m512 a[4][4];
  for (int g = 0; g < 4; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    if (prefetch_row && t + AHEAD < ctx) prefetch(v_head + offsets[t + AHEAD], prefetch_row * sizeof(uint16_t));
    const uint16_t* v = v_head + offsets[t];
    const __m512 v0 = load_bf16x16(v), v1 = load_bf16x16(v + 16), v2 = load_bf16x16(v + 32), v3 = load_bf16x16(v + 48);
    for (int g = 0; g < 4; ++g) {
      if (g >= G) break;
      const __m512 p = _mm512_set1_ps(probs[g * ctx + t]);
      a[g][0] = _mm512_fmadd_ps(p, v0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(p, v1, a[g][1]);
      a[g][2] = _mm512_fmadd_ps(p, v2, a[g][2]);
      a[g][3] = _mm512_fmadd_ps(p, v3, a[g][3]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * 64 + c * 16, a[g][c]);
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

// scores[h * ctx + t] = scale * (q_h . K_t) for every head and token of one row, 16 tokens at a time: per KV head
// and query head, 16 accumulators of dpbf16 over Dh (a multiple of 32), summed by sum16. While a block is
// scored, the next block's K rows are prefetched, and during the last block the first V rows.
inline void score_blocks(float* scores, int64_t ctx, const int64_t* offsets, const uint16_t* k_base,
                         const uint16_t* v_base, const uint16_t* qb, int64_t Hkv, int64_t G, int64_t Dh, float scale) {
  const int64_t row_bytes = Hkv * Dh * static_cast<int64_t>(sizeof(uint16_t));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
    const int64_t nt = ctx - t0 < 16 ? ctx - t0 : 16;
    if (t0 + 16 < ctx) {
      for (int64_t t = t0 + 16; t < t0 + 32 && t < ctx; ++t) prefetch(k_base + offsets[t], row_bytes);
    } else {
      for (int64_t t = 0; t < AHEAD && t < ctx; ++t) prefetch(v_base + offsets[t], row_bytes);
    }
    const uint16_t* keys[16];
    for (int64_t j = 0; j < 16; ++j) keys[j] = k_base + offsets[t0 + (j < nt ? j : 0)];  // padding: any real row
    const __mmask16 keep = static_cast<__mmask16>(nt == 16 ? 0xffff : (1u << nt) - 1);
    for (int64_t kh = 0; kh < Hkv; ++kh)
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* q = qb + (kh * G + g) * Dh;
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < Dh; d += 32) {
          const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
          for (int j = 0; j < 16; ++j)
            acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(keys[j] + kh * Dh + d));
        }
        _mm512_mask_storeu_ps(scores + (kh * G + g) * ctx + t0, keep, _mm512_mul_ps(sum16(acc), vscale));
      }
  }
}
#endif

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale) {
  // out, q: [B, H, Dh]; kv: one layer's pool [2, P, S, Hkv, Dh]; block_tables: [B, max_pages] int64;
  // context_lens: [B] int64 (tokens to attend over, the current one included, already written)
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu() && out.device().is_cpu() && block_tables.device().is_cpu() &&
                  context_lens.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(kv.is_contiguous() && out.is_contiguous() && block_tables.is_contiguous() &&
                  context_lens.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [B, H, Dh] with contiguous heads");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.size(3) > 0, "kv: [2, P, S, Hkv, Dh]");
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && out.dim() == 3, "table, lengths, out ranks");
  at::assert_no_overlap(out, q);
  at::assert_no_overlap(out, kv);
  const int64_t B = q.size(0), H = q.size(1), Dh = q.size(2);
  const int64_t P = kv.size(1), S = kv.size(2), Hkv = kv.size(3);
  TORCH_CHECK(kv.size(4) == Dh && H % Hkv == 0 && Dh % LANES == 0, "head shapes");
  TORCH_CHECK(out.size(0) == B && out.size(1) == H && out.size(2) == Dh, "out shape");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "one table per row");
  const int64_t G = H / Hkv, max_pages = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // validate every page the rows will read, before reading any
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_pages * S, "context length outside its block table");
    for (int64_t i = 0; i < (lens[b] + S - 1) / S; ++i) {
      const int64_t page = tables[b * max_pages + i];
      TORCH_CHECK(page >= 0 && page < P, "page id outside the pool");
    }
  }
  const uint16_t* k_base = reinterpret_cast<const uint16_t*>(kv.data_ptr());
  const uint16_t* v_base = k_base + P * S * Hkv * Dh;
  const uint16_t* q_base = reinterpret_cast<const uint16_t*>(q.data_ptr());
  uint16_t* out_base = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const float fscale = static_cast<float>(scale);

  // One row at a time, all its heads together. Each token's K (then V) for every KV head is one contiguous run of
  // Hkv * Dh values. With AVX512-BF16 and Dh a multiple of 32, scores come 16 tokens at a time (sum16) and the
  // reads of the next 16 tokens are prefetched while these are computed: pages are scattered over a pool much
  // larger than the caches, and without prefetching a row's reads wait on memory one page at a time (a decode
  // step of 8 rows spent ~40% of its time here, docs/performance.md).
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * Dh), acc(H * Dh), vec(Hkv * Dh), scores, inv_sum(H);
    std::vector<uint16_t> qb(H * Dh);
    std::vector<int64_t> offsets;  // each token's offset in K (and V): its slot * Hkv * Dh
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = lens[b];
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(&qb[h * Dh], q_base + b * q_row + h * q_head, Dh * sizeof(uint16_t));
        bf16_to_f32(&qb[h * Dh], &qf[h * Dh], Dh);
      }
      scores.resize(H * ctx);
      offsets.resize(ctx);
      const int64_t* table = tables + b * max_pages;
      for (int64_t t = 0, i = 0; t < ctx; ++i)
        for (int64_t s = 0; s < S && t < ctx; ++s, ++t) offsets[t] = (table[i] * S + s) * Hkv * Dh;
#if defined(__AVX512BF16__)
      if (Dh % 32 == 0) {
        score_blocks(scores.data(), ctx, offsets.data(), k_base, v_base, qb.data(), Hkv, G, Dh, fscale);
      } else
#endif
      for (int64_t t = 0; t < ctx; ++t) {
        const uint16_t* k = k_base + offsets[t];
        for (int64_t h = 0; h < H; ++h)
          scores[h * ctx + t] = dot_bf16(&qb[h * Dh], k + (h / G) * Dh, &qf[h * Dh], vec.data(), Dh) * fscale;
      }
      for (int64_t h = 0; h < H; ++h) {
        float* row = &scores[h * ctx];
        inv_sum[h] = 1.0f / exp_shifted(row, ctx, max_of(row, ctx));
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
#ifdef __AVX512F__
      if (Dh == 64 && G <= 4) {  // SmolLM2's shape: one KV head's G accumulators stay in registers
        for (int64_t kh = 0; kh < Hkv; ++kh)
          weighted_sum_64(&acc[kh * G * 64], &scores[kh * G * ctx], ctx, G, offsets.data(), v_base + kh * 64,
                          kh == 0 ? Hkv * 64 : 0);
      } else
#endif
      for (int64_t t = 0; t < ctx; ++t) {
        bf16_to_f32(v_base + offsets[t], vec.data(), Hkv * Dh);
        for (int64_t h = 0; h < H; ++h) axpy(&acc[h * Dh], scores[h * ctx + t], &vec[(h / G) * Dh], Dh);
      }
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < Dh; ++d) acc[h * Dh + d] *= inv_sum[h];
        f32_to_bf16_n(&acc[h * Dh], out_base + (b * H + h) * Dh, Dh);
      }
    }
  });
}

// ---- KV write: each token's K and V rows into its slot of one layer's pool ----
//
// One copy per row, instead of torch.stack((k, v)) and index_copy_ (three operators and a temporary per layer,
// about 3 ms of a 200-token prefill and 1 ms of an 8-row decode step, docs/performance.md). Every slot is checked
// against the pool before anything is written.
void write_kv(torch::Tensor kv, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  // kv: one layer's pool [2, P, S, Hkv, Dh]; slots: [T] int64 (page * S + offset); k, v: [T, Hkv, Dh], rows of
  // Hkv * Dh contiguous values
  TORCH_CHECK(kv.device().is_cpu() && slots.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.is_contiguous(), "kv: contiguous [2, P, S, Hkv, Dh]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "slots: [T] int64");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == slots.size(0), "k, v: [T, Hkv, Dh]");
  TORCH_CHECK(k.size(1) == kv.size(3) && k.size(2) == kv.size(4), "k, v heads match the pool");
  TORCH_CHECK(k.scalar_type() == kv.scalar_type() && v.scalar_type() == kv.scalar_type(), "one dtype");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k, v: each token's heads contiguous");
  at::assert_no_overlap(kv, k);
  at::assert_no_overlap(kv, v);
  const int64_t T = k.size(0), total = kv.size(1) * kv.size(2);
  const int64_t row = k.size(1) * k.size(2) * static_cast<int64_t>(k.element_size());
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < total, "slot outside the pool");
  auto* kd = static_cast<char*>(kv.data_ptr());
  char* vd = kd + total * row;
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t kstride = k.stride(0) * static_cast<int64_t>(k.element_size());
  const int64_t vstride = v.stride(0) * static_cast<int64_t>(v.element_size());
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kd + sl[t] * row, ks + t * kstride, row);
    std::memcpy(vd + sl[t] * row, vs + t * vstride, row);
  }
}

// ---- prefill attention: causal, over a chunk's own K/V (or the pages read back for a later chunk) ----
//
// Query i of a chunk of Lq sees keys 0 .. Lk - Lq + i. Each KV head's K and V are packed once, before any query
// runs: K in blocks of 16 keys, each 32-bit lane a bfloat16 pair of dims of one key (one dpbf16: 16 keys' partial
// dots); V in pairs of keys, each lane one dim of two keys (one dpbf16: 16 dims of two keys' weighted sum).
// Queries go two at a time, so one load of K or V feeds both. Softmax in float32; the probabilities are rounded
// to bfloat16 for the weighted sum of V (as flash attention does on GPUs), except a key whose pair partner the
// query does not see, which goes through float32 on its own. Scores are computed in whole blocks of 16 keys,
// past what a query sees, and thrown away: no unseen key's probability or value enters a query's sum. The
// work is split in units of one head and two tiles from opposite ends of the chunk, which cost about the same
// under the causal mask, so two threads get equal shares of 9 heads (docs/performance.md, session 8).

namespace {

constexpr int64_t KEY_BLOCK = 16;

#if defined(__AVX512BF16__)
// Scores (times `scale`) of two queries against keys [0, 16 * nblk) of packed K; four blocks per pass.
inline void score_two(float* s0, float* s1, const uint16_t* q0, const uint16_t* q1, const uint32_t* kp, int64_t D2,
                      int64_t nblk, float scale) {
  const __m512 sv = _mm512_set1_ps(scale);
  int64_t b = 0;
  for (; b + 4 <= nblk; b += 4) {
    __m512 a[8];
    for (auto& r : a) r = _mm512_setzero_ps();
    const uint32_t* base = kp + b * D2 * KEY_BLOCK;
    for (int64_t d2 = 0; d2 < D2; ++d2) {
      uint32_t p0, p1;
      std::memcpy(&p0, q0 + 2 * d2, sizeof(p0));
      std::memcpy(&p1, q1 + 2 * d2, sizeof(p1));
      const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(p0));
      const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(p1));
      const uint32_t* kd = base + d2 * KEY_BLOCK;
      for (int64_t t = 0; t < 4; ++t) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kd + t * D2 * KEY_BLOCK);
        a[t] = _mm512_dpbf16_ps(a[t], x0, kv);
        a[4 + t] = _mm512_dpbf16_ps(a[4 + t], x1, kv);
      }
    }
    for (int64_t t = 0; t < 4; ++t) {
      _mm512_storeu_ps(s0 + (b + t) * KEY_BLOCK, _mm512_mul_ps(a[t], sv));
      _mm512_storeu_ps(s1 + (b + t) * KEY_BLOCK, _mm512_mul_ps(a[4 + t], sv));
    }
  }
  for (; b < nblk; ++b) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    const uint32_t* base = kp + b * D2 * KEY_BLOCK;
    for (int64_t d2 = 0; d2 < D2; ++d2) {
      uint32_t p0, p1;
      std::memcpy(&p0, q0 + 2 * d2, sizeof(p0));
      std::memcpy(&p1, q1 + 2 * d2, sizeof(p1));
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(base + d2 * KEY_BLOCK);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32(static_cast<int>(p0)), kv);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32(static_cast<int>(p1)), kv);
    }
    _mm512_storeu_ps(s0 + b * KEY_BLOCK, _mm512_mul_ps(a0, sv));
    _mm512_storeu_ps(s1 + b * KEY_BLOCK, _mm512_mul_ps(a1, sv));
  }
}

// s[0, n) -> e^(s - max), rounded to bfloat16 pairs in pp[0, n / 2) (an odd last key stays in s[n - 1]);
// returns 1 / the float32 sum.
inline float softmax_pairs(float* s, int64_t n, uint32_t* pp) {
  const float inv = 1.0f / exp_shifted(s, n, max_of(s, n));
  int64_t j = 0;
  for (; j + 32 <= n; j += 32)
    _mm512_storeu_si512(pp + j / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + j + 16), _mm512_loadu_ps(s + j)));
  for (; j + 1 < n; j += 2)
    pp[j / 2] = static_cast<uint32_t>(f32_to_bf16(s[j])) | (static_cast<uint32_t>(f32_to_bf16(s[j + 1])) << 16);
  return inv;
}

// acc{0,1}[c] (16 dims each, c < C) += the weighted sums of V over key pairs [0, pairs) of packed V (vp, Dh dims).
template <int64_t C>
inline void weigh_pairs(__m512* acc0, __m512* acc1, const uint32_t* pp0, const uint32_t* pp1, const uint32_t* vp,
                        int64_t Dh, int64_t pairs) {
  for (int64_t jp = 0; jp < pairs; ++jp) {
    const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp0[jp]));
    const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp1[jp]));
    const uint32_t* v = vp + jp * Dh;
    for (int64_t c = 0; c < C; ++c) {
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(v + 16 * c);
      acc0[c] = _mm512_dpbf16_ps(acc0[c], x0, vv);
      acc1[c] = _mm512_dpbf16_ps(acc1[c], x1, vv);
    }
  }
}
#endif

}  // namespace

void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(out.device().is_cpu() && q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kBFloat16 &&
                  k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16, "bfloat16 tensors");
  TORCH_CHECK(out.dim() == 3 && q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "[tokens, heads, Dh] tensors");
  TORCH_CHECK(out.stride(2) == 1 && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "contiguous heads");
  const int64_t Lq = q.size(0), H = q.size(1), Dh = q.size(2), Lk = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(Lq >= 1 && Lk >= Lq && Hkv >= 1 && H % Hkv == 0 && Dh % LANES == 0, "shapes");
  TORCH_CHECK(k.size(2) == Dh && v.sizes() == k.sizes() && out.size(0) == Lq && out.size(1) == H &&
                  out.size(2) == Dh, "k, v and out shapes");
  at::assert_no_internal_overlap(out);
  at::assert_no_overlap(out, q);
  at::assert_no_overlap(out, k);
  at::assert_no_overlap(out, v);
  const int64_t G = H / Hkv, D2 = Dh / 2, offset = Lk - Lq;
  const int64_t nblk_all = (Lk + KEY_BLOCK - 1) / KEY_BLOCK, npair_all = (Lk + 1) / 2;
  const auto* qb = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kb = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vb = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* ob = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float fscale = static_cast<float>(scale);
  auto q_row = [&](int64_t i, int64_t h) { return qb + i * q.stride(0) + h * q.stride(1); };
  auto k_row = [&](int64_t j, int64_t kh) { return kb + j * k.stride(0) + kh * k.stride(1); };
  auto v_row = [&](int64_t j, int64_t kh) { return vb + j * v.stride(0) + kh * v.stride(1); };
  auto o_row = [&](int64_t i, int64_t h) { return ob + i * out.stride(0) + h * out.stride(1); };
#if defined(__AVX512BF16__)
  // K as [block][dim pair][key in block], V as [key pair][dim]: 32-bit bfloat16 pairs, zero past Lk
  std::vector<uint32_t> kp(Hkv * nblk_all * D2 * KEY_BLOCK, 0u), vp(Hkv * npair_all * Dh, 0u);
  at::parallel_for(0, Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kh = begin; kh < end; ++kh) {
      uint32_t* kd = &kp[kh * nblk_all * D2 * KEY_BLOCK];
      uint32_t* vd = &vp[kh * npair_all * Dh];
      for (int64_t j = 0; j < Lk; ++j) {
        const uint16_t *kr = k_row(j, kh), *vr = v_row(j, kh);
        for (int64_t d2 = 0; d2 < D2; ++d2) {
          uint32_t pair;
          std::memcpy(&pair, kr + 2 * d2, sizeof(pair));
          kd[((j / KEY_BLOCK) * D2 + d2) * KEY_BLOCK + j % KEY_BLOCK] = pair;
        }
        const int shift = j % 2 ? 16 : 0;
        for (int64_t d = 0; d < Dh; ++d) vd[(j / 2) * Dh + d] |= static_cast<uint32_t>(vr[d]) << shift;
      }
    }
  });
  // tiles of two queries (the last alone when Lq is odd, computed twice); unit u of a head: tiles u, T - 1 - u
  const int64_t T = (Lq + 1) / 2, per_head = (T + 1) / 2;
  at::parallel_for(0, H * per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s0(nblk_all * KEY_BLOCK), s1(nblk_all * KEY_BLOCK);
    std::vector<uint32_t> pp0(npair_all + 16), pp1(npair_all + 16);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t h = unit / per_head, kh = h / G, u = unit % per_head;
      const uint32_t* kd = &kp[kh * nblk_all * D2 * KEY_BLOCK];
      const uint32_t* vd = &vp[kh * npair_all * Dh];
      const int64_t tiles[2] = {u, T - 1 - u};  // u <= T - 1 - u; equal for the middle tile of an odd T
      for (int64_t t = 0; t < (tiles[1] == u ? 1 : 2); ++t) {
        const int64_t tile = tiles[t];
        const int64_t i0 = 2 * tile, i1 = std::min(i0 + 1, Lq - 1);
        const int64_t n0 = offset + i0 + 1, n1 = offset + i1 + 1;  // keys each sees (n1 >= n0)
        score_two(s0.data(), s1.data(), q_row(i0, h), q_row(i1, h), kd, D2, (n1 + KEY_BLOCK - 1) / KEY_BLOCK, fscale);
        const float inv0 = softmax_pairs(s0.data(), n0, pp0.data());
        const float inv1 = softmax_pairs(s1.data(), n1, pp1.data());
        const int64_t pairs = n0 / 2;  // whole pairs both queries see
        for (int64_t c0 = 0; c0 < Dh; c0 += 128) {  // 128 dims (8 vectors per query) at a time in registers
          const int64_t C = std::min<int64_t>(8, (Dh - c0) / 16);
          __m512 a0[8], a1[8];
          for (int64_t c = 0; c < 8; ++c) a0[c] = a1[c] = _mm512_setzero_ps();
          switch (C) {
#define KVFENCE_PAIRS(N) case N: weigh_pairs<N>(a0, a1, pp0.data(), pp1.data(), vd + c0, Dh, pairs); break;
            KVFENCE_PAIRS(1) KVFENCE_PAIRS(2) KVFENCE_PAIRS(3) KVFENCE_PAIRS(4)
            KVFENCE_PAIRS(5) KVFENCE_PAIRS(6) KVFENCE_PAIRS(7) KVFENCE_PAIRS(8)
#undef KVFENCE_PAIRS
          }
          // the keys past the shared pairs, one at a time in float32: at most one for query 0, two for query 1
          for (int64_t j = 2 * pairs; j < n1; ++j) {
            const uint16_t* vr = v_row(j, kh) + c0;
            const __m512 p0 = _mm512_set1_ps(j < n0 ? s0[j] : 0.0f), p1 = _mm512_set1_ps(s1[j]);
            for (int64_t c = 0; c < C; ++c) {
              const __m512 vv = load_bf16x16(vr + 16 * c);
              if (j < n0) a0[c] = _mm512_fmadd_ps(p0, vv, a0[c]);
              a1[c] = _mm512_fmadd_ps(p1, vv, a1[c]);
            }
          }
          const __m512 iv0 = _mm512_set1_ps(inv0), iv1 = _mm512_set1_ps(inv1);
          for (int64_t c = 0; c < C; ++c) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o_row(i0, h) + c0 + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a0[c], iv0)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o_row(i1, h) + c0 + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a1[c], iv1)));
          }
        }
      }
    }
  });
#else
  // Without AVX512-BF16: one query at a time in float32.
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Dh), kf(Dh), vf(Dh), scores(Lk), acc(Dh);
    for (int64_t h = begin; h < end; ++h) {
      const int64_t kh = h / G;
      for (int64_t i = 0; i < Lq; ++i) {
        const int64_t n = offset + i + 1;
        bf16_to_f32(q_row(i, h), qf.data(), Dh);
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          bf16_to_f32(k_row(j, kh), kf.data(), Dh);
          scores[j] = dot(qf.data(), kf.data(), Dh) * fscale;
          top = scores[j] > top ? scores[j] : top;
        }
        const float inv = 1.0f / exp_shifted(scores.data(), n, top);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < n; ++j) {
          bf16_to_f32(v_row(j, kh), vf.data(), Dh);
          axpy(acc.data(), scores[j], vf.data(), Dh);
        }
        for (int64_t d = 0; d < Dh; ++d) acc[d] *= inv;
        f32_to_bf16_n(acc.data(), o_row(i, h), Dh);
      }
    }
  });
#endif
}

// ---- the small operators of a layer, fused (bfloat16 in and out, float32 inside, one rounding) ----

namespace {

constexpr int64_t ROW_GRAIN = 32;  // rows per task: a decode step's few rows run inline, a prefill's in parallel

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.stride(1) == 1, name,
              ": bfloat16 [T, D] with contiguous rows");
}

inline void normalize_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps, float* buf) {
  bf16_to_f32(x, buf, n);
  const float inv = 1.0f / std::sqrt(sum_squares(buf, n) / static_cast<float>(n) + eps);
  float* wf = buf + n;  // the caller's buffer holds 2n floats
  bf16_to_f32(w, wf, n);
  for (int64_t i = 0; i < n; ++i) buf[i] = buf[i] * inv * wf[i];
  f32_to_bf16_n(buf, out, n);
}

}  // namespace

// RMSNorm of every row: out = x / sqrt(mean(x^2) + eps) * weight
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.numel() == x.size(1), "weight");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), stride = x.stride(0);
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, x.size(0), ROW_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * n);
    for (int64_t r = begin; r < end; ++r) normalize_row(xs + r * stride, w, o + r * n, n, static_cast<float>(eps), buf.data());
  });
  return out;
}

// x += delta (rounded to bfloat16, as `x + delta` would be), then RMSNorm of the new x: the residual stream's add
// and the next norm in one pass. x is updated in place; the normalized rows are returned.
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(x.is_contiguous() && delta.sizes() == x.sizes(), "x contiguous, delta of the same shape");
  at::assert_no_overlap(x, delta);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.numel() == x.size(1), "weight");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1), dstride = delta.stride(0);
  auto* xs = reinterpret_cast<uint16_t*>(x.data_ptr());
  const auto* ds = reinterpret_cast<const uint16_t*>(delta.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, x.size(0), ROW_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> a(2 * n), b(n);
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* xr = xs + r * n;
      bf16_to_f32(xr, a.data(), n);
      bf16_to_f32(ds + r * dstride, b.data(), n);
      for (int64_t i = 0; i < n; ++i) a[i] += b[i];
      f32_to_bf16_n(a.data(), xr, n);
      normalize_row(xr, w, o + r * n, n, static_cast<float>(eps), a.data());
    }
  });
  return out;
}

// Rotary embedding in place on the first `heads` heads of x [T, >= heads, Dh] (rotate_half layout):
// x = x * cos + cat(x2, x1) * signed_sin, with cos and signed_sin [T, Dh] float32 rows of the step's positions.
void rotary_(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor signed_sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && signed_sin.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.stride(2) == 1 && heads >= 0 &&
                  heads <= x.size(1), "x");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && signed_sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  signed_sin.is_contiguous() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  signed_sin.sizes() == cos.sizes(), "tables: float32 [T, Dh]");
  const int64_t dh = x.size(2), half = dh / 2, row = x.stride(0), head = x.stride(1);
  auto* xs = reinterpret_cast<uint16_t*>(x.data_ptr());
  const float* c = cos.data_ptr<float>();
  const float* s = signed_sin.data_ptr<float>();
  at::parallel_for(0, x.size(0), ROW_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> v(dh), r(dh);
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + t * dh;
      const float* st = s + t * dh;
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* p = xs + t * row + h * head;
        bf16_to_f32(p, v.data(), dh);
        for (int64_t i = 0; i < half; ++i) r[i] = v[i] * ct[i] + v[i + half] * st[i];
        for (int64_t i = half; i < dh; ++i) r[i] = v[i] * ct[i] + v[i - half] * st[i];
        f32_to_bf16_n(r.data(), p, dh);
      }
    }
  });
}

// silu(gate) * up for gate_up [T, 2I] laid out [gate | up]; returns [T, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  const auto* g = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, gate_up.size(0), ROW_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> a(inter), b(inter);
    for (int64_t r = begin; r < end; ++r) {
      bf16_to_f32(g + r * stride, a.data(), inter);
      bf16_to_f32(g + r * stride + inter, b.data(), inter);
      int64_t i = 0;
#ifdef __AVX512F__
      const __m512 one = _mm512_set1_ps(1.0f);
      for (; i + 16 <= inter; i += 16) {
        const __m512 g = _mm512_loadu_ps(&a[i]);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(&a[i], _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_loadu_ps(&b[i])));
      }
#endif
      for (; i < inter; ++i) a[i] = a[i] / (1.0f + std::exp(-a[i])) * b[i];
      f32_to_bf16_n(a.data(), o + r * inter, inter);
    }
  });
  return out;
}

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

namespace {

constexpr int64_t QBLOCK = 32;
constexpr int64_t QUANT_ROW_TILE = 8;  // activation rows whose accumulators stay in registers
constexpr int64_t QUANT_N_CHUNK = 32;  // output columns per task: its weights stay in L2 across row tiles
enum QuantKind : int64_t { Q4_1 = 0, Q8_0 = 1 };

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

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
// vector of results needs no horizontal sum (`pack_panels`, kvfence/model/loader.py):
//   Q4_1: per panel and block, 4 groups of 64 bytes; lane c, byte i of group g holds q[k] | q[k + 4] << 4 for
//         k = 8g + i of column c (the low nibbles are keys 8g..8g+3, the high ones 8g+4..8g+7);
//   Q8_0: per panel and block, 8 groups of 64 bytes; lane c, byte i of group g holds q[4g + i] + 128;
//   d, m: per panel and block, the 16 columns' float16 scales (m for Q4_1 only).
// Columns past N in the last panel are zero and never stored.

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

// every row against panels [p0, p0 + NT): tiles of MT rows, then the rows left over
template <int64_t KIND, int64_t LEVELS, int64_t NT>
void panel_rows(const PanelArgs& a, int64_t p0) {
  constexpr int64_t MT = 4;
  int64_t r = 0;
  for (; r + MT <= a.M; r += MT) panel_tile<KIND, LEVELS, MT, NT>(a, r, p0);
  switch (a.M - r) {
    case 3: panel_tile<KIND, LEVELS, 3, NT>(a, r, p0); break;
    case 2: panel_tile<KIND, LEVELS, 2, NT>(a, r, p0); break;
    case 1: panel_tile<KIND, LEVELS, 1, NT>(a, r, p0); break;
    default: break;
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

// x [M, K] bfloat16 @ W^T with W [N, K] as panels of blocks (`pack_panels`): wp uint8, d and m float16
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

torch::Tensor panel_linear_f32(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m, int64_t kind,
                               int64_t n, int64_t levels) {
  return panel_linear_impl(x, wp, d, m, kind, n, levels, true, false);
}

torch::Tensor panel_linear_scalar(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m,
                                  int64_t kind, int64_t n, int64_t levels, bool out_f32) {
  return panel_linear_impl(x, wp, d, m, kind, n, levels, out_f32, true);
}

// ---- the output head in float32: logits that bfloat16 rounding cannot tie ----
//
// x [M, K] bfloat16 @ W^T with W [N, K] bfloat16, returned as float32 [M, N]. Products of bfloat16 pairs are exact
// and the sums stay float32, so two tokens whose float32 logits differ are not rounded to one bfloat16 value (at a
// logit of 25 one bfloat16 step is 0.125; a 0.08 gap became an exact tie and the lower token id won, issue 20).
// Parallel over blocks of columns; each column's weights are read once for a tile of up to LOGIT_ROW_TILE rows.
constexpr int64_t LOGIT_ROW_TILE = 8;
constexpr int64_t LOGIT_N_CHUNK = 64;

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w) {
  check_rows(x, "x");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "w: contiguous bfloat16 [N, K] on the CPU");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 32 == 0 && K > 0, "K: the same for x and w, a positive multiple of 32");
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const int64_t ldx = x.stride(0);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + LOGIT_N_CHUNK - 1) / LOGIT_N_CHUNK, 1, [&](int64_t begin, int64_t end) {
    const int64_t n1 = std::min(N, end * LOGIT_N_CHUNK);
#if defined(__AVX512BF16__)
    // one chunk of columns (72 KB of weights at K = 576) stays in L2 while every row tile passes over it: the
    // weight is read from memory once per call, whatever the number of rows
    for (int64_t c = begin * LOGIT_N_CHUNK; c < n1; c += LOGIT_N_CHUNK)
    for (int64_t r0 = 0; r0 < M; r0 += LOGIT_ROW_TILE) {
      const int64_t rows = std::min(LOGIT_ROW_TILE, M - r0);
      for (int64_t n = c; n < std::min(n1, c + LOGIT_N_CHUNK); ++n) {
        __m512 acc[LOGIT_ROW_TILE];
        for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(wp + n * K + k);
          for (int64_t r = 0; r < rows; ++r)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(xp + (r0 + r) * ldx + k), wv);
        }
        for (int64_t r = 0; r < rows; ++r) op[(r0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]);
      }
    }
#else
    std::vector<float> xf(M * K), wf(K);
    for (int64_t r = 0; r < M; ++r) bf16_to_f32(xp + r * ldx, xf.data() + r * K, K);
    for (int64_t n = begin * LOGIT_N_CHUNK; n < n1; ++n) {
      bf16_to_f32(wp + n * K, wf.data(), K);
      for (int64_t r = 0; r < M; ++r) op[r * N + n] = dot(xf.data() + r * K, wf.data(), K);
    }
#endif
  });
  return out;
}

// Whether panel_linear runs on vector instructions here (else on its slow scalar path).
bool panel_vnni() {
#ifdef KVFENCE_PANEL_VECTOR
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL: they touch no Python object, and the server's event loop (same process)
  // can then serve HTTP on another core while a step runs, as it can during torch's own operators.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over KV pages (bfloat16, CPU)", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row", nogil);
  m.def("add_rms_norm_", &add_rms_norm_, "x += delta in place, then RMSNorm of x", nogil);
  m.def("rotary_", &rotary_, "rotary embedding in place on the first heads", nogil);
  m.def("write_kv", &write_kv, "each token's K and V into its slot of one layer's pool", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up", nogil);
  m.def("prefill_attention", &prefill_attention, "causal attention of a chunk over its keys (bfloat16, CPU)", nogil);
  m.def("quant_linear", &quant_linear, "x @ W^T with W as Q4_1 or Q8_0 blocks (bfloat16 activations)", nogil);
  m.def("panel_linear", &panel_linear, "x @ W^T with W as panels of Q4_1 or Q8_0 blocks (int8 activations)", nogil);
  m.def("panel_linear_f32", &panel_linear_f32, "panel_linear with float32 outputs (the output head)", nogil);
  m.def("panel_linear_scalar", &panel_linear_scalar, "panel_linear on its scalar path (tests)", py::arg("x"),
        py::arg("wp"), py::arg("d"), py::arg("m"), py::arg("kind"), py::arg("n"), py::arg("levels"),
        py::arg("out_f32") = false, nogil);
  m.def("linear_f32", &linear_f32, "x @ W^T, bfloat16 in, float32 out (the output head)", nogil);
  m.def("panel_vnni", &panel_vnni, "whether panel_linear has its AVX512-VNNI path here");
}
