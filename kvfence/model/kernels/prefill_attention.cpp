// ---- prefill attention: causal, over a chunk's own K/V (or the pages read back for a later chunk) ----
//
// Query i of a chunk of Lq sees keys 0 .. Lk - Lq + i. Each KV head's K and V are packed once, before any query
// runs: K in blocks of 16 keys, each 32-bit lane a bfloat16 pair of dims of one key (one dpbf16: 16 keys' partial
// dots); V in pairs of keys, each lane one dim of two keys (one dpbf16: 16 dims of two keys' weighted sum).
// Queries go four at a time (consecutive positions of one head), so one load of K or V feeds four multiplies;
// the packed K and V and the score rows start on 64-byte boundaries. Softmax in float32; the probabilities are
// rounded to bfloat16 for the weighted sum of V (as flash attention does on GPUs), except the keys past the
// pairs that every query of the tile sees, which go through float32 one at a time. Session 23, AMD Zen4, 256
// queries x 1,792 keys of SmolLM2: 5.0-5.1 ms -> 3.2-3.5 ms, about 65% of the two cores' dpbf16 rate (3.6e9 a
// core a second); most of it from keeping the sums of V in registers (`weigh_tile`), the rest from four queries a
// tile and aligned buffers (unaligned, some processes ran 1.6x slower, as the allocation fell). Scores are computed in whole blocks of 16 keys,
// past what a query sees, and thrown away: no unseen key's probability or value enters a query's sum. The
// work is split in units of one head and two tiles from opposite ends of the chunk, which cost about the same
// under the causal mask, so two threads get equal shares of 9 heads (docs/performance.md, session 8).

#include "cpu_ops.h"

namespace kvfence {

namespace {

constexpr int64_t KEY_BLOCK = 16;
constexpr int64_t QT = 4;  // queries per tile: consecutive positions of one head

// `n` zeroed values in `buf`, starting at a 64-byte boundary: every 512-bit load of packed K and V, and of the
// scores, stays within one cache line (a large vector's data starts 16 bytes past a page, so half its loads
// crossed two lines).
template <class T>
T* aligned_zeros(std::vector<T>& buf, int64_t n) {
  buf.assign(n + 64 / sizeof(T), T{});
  const auto at = reinterpret_cast<std::uintptr_t>(buf.data());
  return buf.data() + ((64 - at % 64) % 64) / sizeof(T);
}

#if defined(__AVX512BF16__)
// Scores (times `scale`) of QT queries against keys [0, 16 * nblk) of packed K; four blocks per pass, so one load
// of K feeds QT multiplies (16 accumulators).
inline void score_tile(float* const* s, const uint16_t* const* q, const uint32_t* kp, int64_t D2, int64_t nblk,
                       float scale) {
  const __m512 sv = _mm512_set1_ps(scale);
  auto broadcast = [&](__m512bh* x, int64_t d2) {
    for (int64_t r = 0; r < QT; ++r) {
      uint32_t p;
      std::memcpy(&p, q[r] + 2 * d2, sizeof(p));
      x[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(p));
    }
  };
  int64_t b = 0;
  for (; b + 4 <= nblk; b += 4) {
    __m512 a[QT][4];
    for (auto& row : a)
      for (auto& v : row) v = _mm512_setzero_ps();
    const uint32_t* base = kp + b * D2 * KEY_BLOCK;
    for (int64_t d2 = 0; d2 < D2; ++d2) {
      __m512bh x[QT];
      broadcast(x, d2);
      const uint32_t* kd = base + d2 * KEY_BLOCK;
      for (int64_t t = 0; t < 4; ++t) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kd + t * D2 * KEY_BLOCK);
        for (int64_t r = 0; r < QT; ++r) a[r][t] = _mm512_dpbf16_ps(a[r][t], x[r], kv);
      }
    }
    for (int64_t r = 0; r < QT; ++r)
      for (int64_t t = 0; t < 4; ++t) _mm512_storeu_ps(s[r] + (b + t) * KEY_BLOCK, _mm512_mul_ps(a[r][t], sv));
  }
  for (; b < nblk; ++b) {
    __m512 a[QT];
    for (auto& v : a) v = _mm512_setzero_ps();
    const uint32_t* base = kp + b * D2 * KEY_BLOCK;
    for (int64_t d2 = 0; d2 < D2; ++d2) {
      __m512bh x[QT];
      broadcast(x, d2);
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(base + d2 * KEY_BLOCK);
      for (int64_t r = 0; r < QT; ++r) a[r] = _mm512_dpbf16_ps(a[r], x[r], kv);
    }
    for (int64_t r = 0; r < QT; ++r) _mm512_storeu_ps(s[r] + b * KEY_BLOCK, _mm512_mul_ps(a[r], sv));
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

// acc[r][c] (16 dims each, c < C <= 4) += query r's weighted sum of V over key pairs [0, pairs) of packed V (vp,
// Dh dims): one load of V feeds QT multiplies.
// The sums stay in a local array: __m512 may alias anything, so sums kept behind `acc` would go through memory
// after every store the compiler cannot rule out (that made this loop 2.5x slower than the scores').
template <int64_t C>
inline void weigh_tile(__m512 (*acc)[4], const uint32_t* const* pp, const uint32_t* vp, int64_t Dh, int64_t pairs) {
  __m512 a[QT][C];
  for (int64_t r = 0; r < QT; ++r)
    for (int64_t c = 0; c < C; ++c) a[r][c] = acc[r][c];
  const uint32_t* p[QT];
  for (int64_t r = 0; r < QT; ++r) p[r] = pp[r];
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh x[QT];
    for (int64_t r = 0; r < QT; ++r) x[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r][jp]));
    const uint32_t* v = vp + jp * Dh;
    for (int64_t c = 0; c < C; ++c) {
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(v + 16 * c);
      for (int64_t r = 0; r < QT; ++r) a[r][c] = _mm512_dpbf16_ps(a[r][c], x[r], vv);
    }
  }
  for (int64_t r = 0; r < QT; ++r)
    for (int64_t c = 0; c < C; ++c) acc[r][c] = a[r][c];
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
  std::vector<uint32_t> kbuf, vbuf;
  uint32_t* kp = aligned_zeros(kbuf, Hkv * nblk_all * D2 * KEY_BLOCK);
  uint32_t* vp = aligned_zeros(vbuf, Hkv * npair_all * Dh);
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
  // tiles of QT queries (the last query repeated to fill the last tile); unit u of a head: tiles u, T - 1 - u
  const int64_t T = (Lq + QT - 1) / QT, per_head = (T + 1) / 2, stride_s = nblk_all * KEY_BLOCK;
  const int64_t stride_p = (npair_all + 31) / 16 * 16;  // 64-byte rows, room past the last pair
  at::parallel_for(0, H * per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sbuf;
    std::vector<uint32_t> pbuf;
    float* s0 = aligned_zeros(sbuf, QT * stride_s);
    uint32_t* p0 = aligned_zeros(pbuf, QT * stride_p);
    float* s[QT];
    uint32_t* pp[QT];
    for (int64_t r = 0; r < QT; ++r) s[r] = s0 + r * stride_s, pp[r] = p0 + r * stride_p;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t h = unit / per_head, kh = h / G, u = unit % per_head;
      const uint32_t* kd = &kp[kh * nblk_all * D2 * KEY_BLOCK];
      const uint32_t* vd = &vp[kh * npair_all * Dh];
      const int64_t tiles[2] = {u, T - 1 - u};  // u <= T - 1 - u; equal for the middle tile of an odd T
      for (int64_t t = 0; t < (tiles[1] == u ? 1 : 2); ++t) {
        int64_t i[QT], n[QT];  // queries, and the keys each sees (n[0] <= ... <= n[QT - 1])
        const uint16_t* qr[QT];
        float inv[QT];
        for (int64_t r = 0; r < QT; ++r) {
          i[r] = std::min(tiles[t] * QT + r, Lq - 1);
          n[r] = offset + i[r] + 1;
          qr[r] = q_row(i[r], h);
        }
        score_tile(s, qr, kd, D2, (n[QT - 1] + KEY_BLOCK - 1) / KEY_BLOCK, fscale);
        for (int64_t r = 0; r < QT; ++r) inv[r] = softmax_pairs(s[r], n[r], pp[r]);
        const int64_t pairs = n[0] / 2;  // whole pairs every query sees
        for (int64_t c0 = 0; c0 < Dh; c0 += 64) {  // 64 dims (4 vectors per query) at a time in registers
          const int64_t C = std::min<int64_t>(4, (Dh - c0) / 16);
          __m512 a[QT][4];
          for (auto& row : a)
            for (auto& v : row) v = _mm512_setzero_ps();
          switch (C) {
            case 1: weigh_tile<1>(a, pp, vd + c0, Dh, pairs); break;
            case 2: weigh_tile<2>(a, pp, vd + c0, Dh, pairs); break;
            case 3: weigh_tile<3>(a, pp, vd + c0, Dh, pairs); break;
            default: weigh_tile<4>(a, pp, vd + c0, Dh, pairs); break;
          }
          // the keys past the shared pairs, one at a time in float32 (at most QT + 1), for the queries that see them
          for (int64_t j = 2 * pairs; j < n[QT - 1]; ++j) {
            const uint16_t* vr = v_row(j, kh) + c0;
            for (int64_t c = 0; c < C; ++c) {
              const __m512 vv = load_bf16x16(vr + 16 * c);
              for (int64_t r = 0; r < QT; ++r)
                if (j < n[r]) a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[r][j]), vv, a[r][c]);
            }
          }
          for (int64_t r = 0; r < QT; ++r) {
            const __m512 iv = _mm512_set1_ps(inv[r]);
            for (int64_t c = 0; c < C; ++c)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(o_row(i[r], h) + c0 + 16 * c),
                                  (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a[r][c], iv)));
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

}  // namespace kvfence
