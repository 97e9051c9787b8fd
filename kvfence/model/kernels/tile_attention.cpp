// ---- prefill attention on AMX tiles (Intel Sapphire Rapids and later) ----
//
// The same attention as prefill_attention.cpp: query i of a chunk of Lq sees keys 0 .. Lk - Lq + i, softmax in
// float32, probabilities rounded to bfloat16 for the weighted sum of V (as flash attention does). A block of 32
// queries of one head goes over its keys 32 at a time (online softmax): scores = Q K^T on four product tiles
// (two of 16 queries x two of 16 keys, the head's dims 32 at a time), their softmax in AVX-512, and P V added to
// the block's float32 outputs, 32 dims at a time. K is packed once per call in the tiles' pair layout (pairs of
// dims of 16 keys), V likewise (pairs of keys of 16 dims); keys past Lk are zeros.
//
// A key block on the diagonal (some of its keys unseen by some queries) whose V holds a NaN or an infinity adds P V
// in AVX-512, only the keys each query sees: on the tile unit a probability of 0 times such a value of an unseen
// key is NaN, and no unseen key's value may enter a query's sum. Scores of unseen keys are replaced, not
// multiplied, so they cannot leak. The probabilities take a cheaper e^x than the kernels' exp512 (relative error
// 4e-5 before their rounding to bfloat16).
//
// Why (docs/performance.md, session 27): torch's flash attention, which chunks of 32 queries and more took on such
// CPUs, ran 2,000 x 2,000 causal (14 heads, 2 KV heads) in 15-17 ms here, 1.6x this kernel's 9.5 ms; a later
// chunk (2,048 over 4,096 keys) 68-75 ms against 28; 200 x 200 0.44 against 0.21 ms.

#include "cpu_ops.h"

namespace kvfence {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

constexpr int64_t QB = 32;  // queries of one head per block (two row tiles)
constexpr int64_t KB = 32;  // keys per step of a block (two column tiles of scores; one tile row of P)

// e^x for the probabilities, which are rounded to bfloat16 (8 bits) right after: 2^(x log2 e) as 2^n times a
// degree-4 polynomial of the rest (relative error 4e-5; exp512's 1e-7 costs 1.6x the instructions). Below -88
// it is ~0, a NaN stays NaN; the lanes of unseen keys are masked by the caller.
inline __m512 exp_prob(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-88.3762626647949f), x);  // -inf (an overflowed difference) -> ~0; NaN stays
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945f));  // |f| <= ln2 / 2
  __m512 p = _mm512_set1_ps(1.0f / 24);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// whether every value of n bfloat16 is finite (exponent bits not all ones)
inline bool all_finite(const uint16_t* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if ((v[i] & 0x7f80) == 0x7f80) return false;
  return true;
}

}  // namespace
#endif

bool attention_tiles() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted();
#else
  return false;
#endif
}

void prefill_attention_tiles(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  for (const auto* t : {&out, &q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->stride(2) == 1,
                "bfloat16 [L, heads, Dh] with contiguous heads");
  const int64_t Lq = q.size(0), H = q.size(1), Dh = q.size(2), Lk = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(out.sizes() == q.sizes() && v.sizes() == k.sizes() && k.size(2) == Dh && Lk >= Lq && Hkv > 0 &&
                  H % Hkv == 0 && Dh % 32 == 0 && Dh <= 256,
              "shapes");
  at::assert_no_internal_overlap(out);
  at::assert_no_overlap(out, q);
  at::assert_no_overlap(out, k);
  at::assert_no_overlap(out, v);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(amx_permitted(), "prefill_attention_tiles: this process may not use AMX tiles");
  if (Lq == 0) return;
  const int64_t group = H / Hkv, kk_n = Dh / 32, dt_n = Dh / 16, kblocks = (Lk + KB - 1) / KB;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1), sk0 = k.stride(0), sk1 = k.stride(1);
  const int64_t sv0 = v.stride(0), sv1 = v.stride(1), so0 = out.stride(0), so1 = out.stride(1);
  // packed K: [Hkv][key block of 16][Dh / 32][16 pairs of dims][16 keys] of 32-bit pairs: a tile per 16 x 32
  // packed V: [Hkv][key block of 32][Dh / 16][16 pairs of keys][16 dims][2]: a tile per 32 keys x 16 dims
  const int64_t kslots = kblocks * KB;
  std::vector<uint32_t> kpack(Hkv * kslots * Dh / 2);
  std::vector<uint16_t> vpack(Hkv * kslots * Dh);
  std::vector<uint8_t> finite(Hkv * kblocks);  // whether a block's V values are all finite (then 0 x v is 0)
  at::parallel_for(0, Hkv * kblocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u / kblocks, b = u % kblocks;
      for (int64_t key = b * KB; key < (b + 1) * KB; ++key) {
        const bool real = key < Lk;
        const uint16_t* kr = kp + key * sk0 + g * sk1;
        const uint16_t* vr = vp + key * sv0 + g * sv1;
        uint32_t* kdst = kpack.data() + (g * kslots + (key / 16) * 16) * (Dh / 2);
        for (int64_t d2 = 0; d2 < Dh / 2; ++d2) {
          uint32_t pair = 0;
          if (real) std::memcpy(&pair, kr + 2 * d2, sizeof(pair));
          kdst[((d2 / 16) * 16 + d2 % 16) * 16 + key % 16] = pair;
        }
        uint16_t* vdst = vpack.data() + (g * kslots + b * KB) * Dh;
        const int64_t i = (key % KB) / 2, t = key % 2;
        for (int64_t d = 0; d < Dh; ++d) vdst[(((d / 16) * 16 + i) * 16 + d % 16) * 2 + t] = real ? vr[d] : 0;
      }
      finite[u] = all_finite(vpack.data() + (g * kslots + b * KB) * Dh, KB * Dh);
    }
  });
  const int64_t qblocks = (Lq + QB - 1) / QB, offset = Lk - Lq;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, H * qblocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float s[QB * KB];
    alignas(64) uint16_t p[QB * KB];
    std::vector<float> o(QB * Dh), vf(KB * Dh);
    alignas(64) float m[QB], l[QB];
    int cur0 = -1, cur1 = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t h = u / qblocks, q0 = (u % qblocks) * QB, g = h / group;
      const int64_t rows = std::min(QB, Lq - q0);
      const int r0 = static_cast<int>(std::min<int64_t>(TILE, rows)), r1 = static_cast<int>(rows - r0);
      if (r0 != cur0 || r1 != cur1) {
        configure_row_tiles(r0, r1);
        cur0 = r0;
        cur1 = r1;
      }
      std::fill(o.begin(), o.end(), 0.0f);
      std::fill(m, m + QB, -std::numeric_limits<float>::infinity());
      std::fill(l, l + QB, 0.0f);
      const uint16_t* qa = qp + q0 * sq0 + h * sq1;
      const uint16_t* qb = qa + TILE * sq0;
      const int64_t seen_by_all = offset + q0, seen_by_last = offset + q0 + rows - 1;  // last key of first, last row
      const uint32_t* kg = kpack.data() + g * kslots * (Dh / 2);
      const uint16_t* vg = vpack.data() + g * kslots * Dh;
      for (int64_t b = 0; b * KB <= seen_by_last; ++b) {
        const int64_t key0 = b * KB;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kk = 0; kk < kk_n; ++kk) {
          _tile_loadd(6, kg + ((2 * b) * kk_n + kk) * 256, 64);
          _tile_loadd(7, kg + ((2 * b + 1) * kk_n + kk) * 256, 64);
          _tile_loadd(4, qa + kk * 32, sq0 * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (r1 > 0) {
            _tile_loadd(5, qb + kk * 32, sq0 * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, s, KB * 4);
        _tile_stored(1, s + TILE, KB * 4);
        if (r1 > 0) {
          _tile_stored(2, s + TILE * KB, KB * 4);
          _tile_stored(3, s + TILE * KB + TILE, KB * 4);
        }
        const bool diagonal = key0 + KB - 1 > seen_by_all;  // some row does not see every key of this block
        for (int64_t g0 = 0; g0 < rows; g0 += TILE) {  // 16 rows at a time: their maxima and sums as one vector
          const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), scv = _mm512_set1_ps(sc);
          __m512 lo[TILE], hi[TILE], part[TILE];
          __mmask32 vis[TILE];
          for (int64_t i = 0; i < TILE; ++i) {
            const int64_t r = g0 + i;
            const int64_t seen = r < rows ? std::min<int64_t>(KB, offset + q0 + r - key0 + 1) : 0;
            vis[i] = seen >= KB ? ~__mmask32{0} : seen <= 0 ? 0 : (__mmask32{1} << seen) - 1;
            lo[i] = _mm512_mask_mul_ps(ninf, static_cast<__mmask16>(vis[i]), _mm512_loadu_ps(s + r * KB), scv);
            hi[i] = _mm512_mask_mul_ps(ninf, static_cast<__mmask16>(vis[i] >> 16), _mm512_loadu_ps(s + r * KB + 16),
                                       scv);
            part[i] = _mm512_max_ps(lo[i], hi[i]);
          }
          const __m512 m_old = _mm512_loadu_ps(m + g0);
          const __m512 m_new = _mm512_max_ps(m_old, max16(part));
          // 1 where the maximum did not move (also -inf to -inf: a row with nothing seen yet), else e^(old - new)
          const __m512 corr = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_old, m_new, _CMP_EQ_OQ),
                                                   exp512(_mm512_sub_ps(m_old, m_new)), _mm512_set1_ps(1.0f));
          alignas(64) float mrow[TILE], crow[TILE];
          _mm512_store_ps(mrow, m_new);
          _mm512_store_ps(crow, corr);
          for (int64_t i = 0; i < TILE; ++i) {
            const __m512 mv = _mm512_set1_ps(mrow[i]);
            const __m512 plo = _mm512_maskz_mov_ps(static_cast<__mmask16>(vis[i]), exp_prob(_mm512_sub_ps(lo[i], mv)));
            const __m512 phi =
                _mm512_maskz_mov_ps(static_cast<__mmask16>(vis[i] >> 16), exp_prob(_mm512_sub_ps(hi[i], mv)));
            const __m512bh pb = _mm512_cvtne2ps_pbh(phi, plo);
            if (g0 + i < rows) _mm512_store_si512(p + (g0 + i) * KB, (__m512i)pb);
            // the probabilities as they weigh V (rounded), so that a row's weights sum to 1
            part[i] = _mm512_add_ps(
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256((__m512i)pb)), 16)),
                _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64((__m512i)pb, 1)), 16)));
          }
          _mm512_storeu_ps(l + g0, _mm512_fmadd_ps(_mm512_loadu_ps(l + g0), corr, sum16(part)));
          _mm512_storeu_ps(m + g0, m_new);
          for (int64_t i = 0; i < TILE && g0 + i < rows; ++i) {
            if (crow[i] == 1.0f) continue;
            const __m512 cv = _mm512_set1_ps(crow[i]);
            float* orow = &o[(g0 + i) * Dh];
            for (int64_t d = 0; d < Dh; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), cv));
          }
        }
        const uint16_t* vb = vg + b * KB * Dh;
        if (diagonal && !finite[g * kblocks + b]) {  // only the keys each row sees, in AVX-512
          for (int64_t j = 0; j < KB; ++j) {  // the block's V in float32, from the packed layout
            const int64_t i = j / 2, t = j % 2;
            for (int64_t d = 0; d < Dh; ++d) {
              uint32_t bits = static_cast<uint32_t>(vb[(((d / 16) * 16 + i) * 16 + d % 16) * 2 + t]) << 16;
              std::memcpy(&vf[j * Dh + d], &bits, sizeof(float));
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t seen = std::min<int64_t>(KB, offset + q0 + r - key0 + 1);
            for (int64_t j = 0; j < seen; ++j) {
              uint32_t bits = static_cast<uint32_t>(p[r * KB + j]) << 16;
              float w;
              std::memcpy(&w, &bits, sizeof(w));
              axpy(&o[r * Dh], w, &vf[j * Dh], Dh);
            }
          }
          continue;
        }
        for (int64_t dt = 0; dt < dt_n; dt += 2) {
          _tile_loadd(0, &o[dt * 16], Dh * 4);
          _tile_loadd(1, &o[(dt + 1) * 16], Dh * 4);
          _tile_loadd(6, vb + dt * 512, 64);
          _tile_loadd(7, vb + (dt + 1) * 512, 64);
          _tile_loadd(4, p, KB * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_stored(0, &o[dt * 16], Dh * 4);
          _tile_stored(1, &o[(dt + 1) * 16], Dh * 4);
          if (r1 > 0) {
            _tile_loadd(2, &o[TILE * Dh + dt * 16], Dh * 4);
            _tile_loadd(3, &o[TILE * Dh + (dt + 1) * 16], Dh * 4);
            _tile_loadd(5, p + TILE * KB, KB * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            _tile_stored(2, &o[TILE * Dh + dt * 16], Dh * 4);
            _tile_stored(3, &o[TILE * Dh + (dt + 1) * 16], Dh * 4);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        uint16_t* dst = op + (q0 + r) * so0 + h * so1;
        for (int64_t d = 0; d < Dh; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&o[r * Dh + d]), inv)));
      }
    }
    _tile_release();
  });
#else
  (void)scale;
  TORCH_CHECK(false, "prefill_attention_tiles: built without AMX");
#endif
}

}  // namespace kvfence
