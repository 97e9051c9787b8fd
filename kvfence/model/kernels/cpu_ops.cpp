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

// acc[g] (64 floats each, g < G <= 4) = sum over t of probs[g * ctx + t] * V_t, V_t the head's row of token t
inline void weighted_sum_64(float* acc, const float* probs, int64_t ctx, int64_t G, const int64_t* table, int64_t S,
                            const uint16_t* v_head, int64_t token_stride) {
  __m512 a[4][4];
  for (int g = 0; g < 4; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    const uint16_t* v = v_head + (table[t / S] * S + t % S) * token_stride;
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

  // One row at a time, all its heads together: each token's K (then V) for every KV head is one contiguous run of
  // Hkv * Dh values, and a page's tokens follow each other, so the reads stream through each page in order.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * Dh), acc(H * Dh), vec(Hkv * Dh), scores, inv_sum(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = lens[b];
      std::vector<uint16_t> qb(H * Dh);
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(&qb[h * Dh], q_base + b * q_row + h * q_head, Dh * sizeof(uint16_t));
        bf16_to_f32(&qb[h * Dh], &qf[h * Dh], Dh);
      }
      scores.resize(H * ctx);
      const int64_t* table = tables + b * max_pages;
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / S] * S + t % S;
        const uint16_t* k = k_base + slot * Hkv * Dh;
        for (int64_t h = 0; h < H; ++h)
          scores[h * ctx + t] = dot_bf16(&qb[h * Dh], k + (h / G) * Dh, &qf[h * Dh], vec.data(), Dh) * fscale;
      }
      for (int64_t h = 0; h < H; ++h) {
        float* row = &scores[h * ctx];
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < ctx; ++t) top = row[t] > top ? row[t] : top;
        inv_sum[h] = 1.0f / exp_shifted(row, ctx, top);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
#ifdef __AVX512F__
      if (Dh == 64 && G <= 4) {  // SmolLM2's shape: one KV head's G accumulators stay in registers
        for (int64_t kh = 0; kh < Hkv; ++kh) weighted_sum_64(&acc[kh * G * 64], &scores[kh * G * ctx], ctx, G, table, S,
                                                          v_base + kh * 64, Hkv * 64);
      } else
#endif
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / S] * S + t % S;
        bf16_to_f32(v_base + slot * Hkv * Dh, vec.data(), Hkv * Dh);
        for (int64_t h = 0; h < H; ++h) axpy(&acc[h * Dh], scores[h * ctx + t], &vec[(h / G) * Dh], Dh);
      }
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < Dh; ++d) acc[h * Dh + d] *= inv_sum[h];
        f32_to_bf16_n(&acc[h * Dh], out_base + (b * H + h) * Dh, Dh);
      }
    }
  });
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over KV pages (bfloat16, CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm_", &add_rms_norm_, "x += delta in place, then RMSNorm of x");
  m.def("rotary_", &rotary_, "rotary embedding in place on the first heads");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
}
