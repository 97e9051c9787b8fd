// ---- the output head in float32: logits that bfloat16 rounding cannot tie ----
//
// x [M, K] bfloat16 @ W^T with W [N, K] bfloat16, returned as float32 [M, N]. Products of bfloat16 pairs are exact
// and the sums stay float32, so two tokens whose float32 logits differ are not rounded to one bfloat16 value (at a
// logit of 25 one bfloat16 step is 0.125; a 0.08 gap became an exact tie and the lower token id won, issue 20).

#include "cpu_ops.h"

namespace kvfence {

// Parallel over chunks of LOGIT_N_CHUNK columns; within a chunk, blocks of LOGIT_ROW_BLOCK rows, and within those
// tiles of up to LOGIT_ROWS rows x LOGIT_COLS columns whose sums stay in registers (one load of a row or a column
// feeds several multiplies).
constexpr int64_t LOGIT_ROWS = 4;
constexpr int64_t LOGIT_COLS = 4;
constexpr int64_t LOGIT_N_CHUNK = 64;
constexpr int64_t LOGIT_ROW_BLOCK = 16;

#if defined(__AVX512BF16__)
// out[r0 + r][n + c] for r < R, c < C: each a sum over K in the same order whatever the tile, so a row's logits
// have the same bits in any batch (and the same as one row and one column at a time).
template <int64_t R, int64_t C>
inline void logit_tile(const uint16_t* xp, int64_t ldx, const uint16_t* wp, float* op, int64_t N, int64_t K,
                       int64_t r0, int64_t n) {
  __m512 acc[R][C];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh w[C];
    for (int64_t c = 0; c < C; ++c) w[c] = (__m512bh)_mm512_loadu_si512(wp + (n + c) * K + k);
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(xp + (r0 + r) * ldx + k);
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, w[c]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) op[(r0 + r) * N + n + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int64_t C>
inline void logit_rows(const uint16_t* xp, int64_t ldx, const uint16_t* wp, float* op, int64_t M, int64_t N,
                       int64_t K, int64_t n) {
  int64_t r0 = 0;
  for (; r0 + LOGIT_ROWS <= M; r0 += LOGIT_ROWS) logit_tile<LOGIT_ROWS, C>(xp, ldx, wp, op, N, K, r0, n);
  switch (M - r0) {
    case 3: logit_tile<3, C>(xp, ldx, wp, op, N, K, r0, n); break;
    case 2: logit_tile<2, C>(xp, ldx, wp, op, N, K, r0, n); break;
    case 1: logit_tile<1, C>(xp, ldx, wp, op, N, K, r0, n); break;
    default: break;
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- AMX: the same float32 sums on the tile unit (Intel Sapphire Rapids and later) ----
//
// The roles are swapped so that the weight is read as it lies: a tile of 16 vocabulary rows x 32 of K is the left
// operand (W's rows, stride K), and the few hidden-state rows, repacked once per call into the tile unit's pair
// layout, are the right one. Each product tile is logits^T (16 vocabulary entries x 16 rows), written back
// transposed. Every logit is the same sum in the same order whatever the other rows: the same rows give the same
// bits in any batch. Tiles: 0-3 products, 4-5 weight, 6-7 hidden rows.

constexpr int64_t VOCAB_STEP = 32;  // vocabulary rows per iteration: two weight tiles

// out[t][v] = c[v][t] for t < rows, v < cols: a 16 x 16 float32 product tile written back transposed, in registers
// (unpacks within 128-bit lanes, then lane shuffles). The 256 scalar loads and stores it replaces took 2.8-4 ms of
// the head at 32-64 rows; with the weights cold, 7.3 -> 6.1 ms at 32 rows, 11.0 -> 8.5 ms at 64 (session 29).
inline void put_transposed(const float* c, int64_t rows, int64_t cols, float* out, int64_t ldo) {
  __m512 r[TILE], t[TILE];
  for (int v = 0; v < TILE; ++v) r[v] = _mm512_load_ps(c + v * TILE);
  for (int i = 0; i < TILE; i += 2) {  // t[i] lane L: (r_i[4L], r_i+1[4L], r_i[4L+1], r_i+1[4L+1]); t[i+1]: 4L+2, 4L+3
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < TILE; i += 4) {  // r[i + j] lane L: rows i .. i + 3 of column 4L + j
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d e = _mm512_castps_pd(t[i + 2]), f = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, e));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, e));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, f));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, f));
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int j = 0; j < 4; ++j) {  // column 4L + j of all 16 rows: lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
    const __m512 even_a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    const __m512 odd_a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    const __m512 even_b = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    const __m512 odd_b = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_f32x4(even_a, even_b, 0x88);       // lane 0: column j
    t[4 + j] = _mm512_shuffle_f32x4(odd_a, odd_b, 0x88);     // lane 1: column 4 + j
    t[8 + j] = _mm512_shuffle_f32x4(even_a, even_b, 0xdd);   // lane 2: column 8 + j
    t[12 + j] = _mm512_shuffle_f32x4(odd_a, odd_b, 0xdd);    // lane 3: column 12 + j
  }
  for (int64_t i = 0; i < rows; ++i) _mm512_mask_storeu_ps(out + i * ldo, keep, t[i]);
}

void configure_tiles() {  // every tile 16 rows of 64 bytes
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = TILE;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// out [M, N] float32 = x [M, K] @ w^T, w [N, K] bfloat16, K % 32 == 0
void linear_f32_tiles(const uint16_t* xp, int64_t ldx, const uint16_t* wp, float* op, int64_t M, int64_t N,
                      int64_t K) {
  const int64_t blocks = (M + TILE - 1) / TILE, kb = K / TILE_K;
  // x in pair layout: xv[b][kk][i][t][2] = x[b * 16 + t][kk * 32 + 2i .. 2i + 1], zero beyond M
  std::vector<uint16_t> xv(blocks * kb * TILE * TILE * 2, 0);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k)
      xv[(((r / TILE) * kb + k / TILE_K) * TILE + (k % TILE_K) / 2) * TILE * 2 + (r % TILE) * 2 + k % 2] =
          xp[r * ldx + k];
  const int64_t steps = (N + VOCAB_STEP - 1) / VOCAB_STEP;
  at::parallel_for(0, steps, 8, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[TILE * TILE];
    std::vector<uint16_t> tail;  // the last vocabulary rows when N % 32 != 0, zero-padded to a whole step
    for (int64_t s = begin; s < end; ++s) {
      const int64_t n0 = s * VOCAB_STEP, valid = std::min(VOCAB_STEP, N - n0);
      const uint16_t* w = wp + n0 * K;
      if (valid < VOCAB_STEP) {
        tail.assign(VOCAB_STEP * K, 0);
        std::memcpy(tail.data(), w, valid * K * sizeof(uint16_t));
        w = tail.data();
      }
      for (int64_t b = 0; b < blocks; b += 2) {
        const bool pair = b + 1 < blocks;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kk = 0; kk < kb; ++kk) {
          _tile_loadd(4, w + kk * TILE_K, K * 2);
          _tile_loadd(5, w + TILE * K + kk * TILE_K, K * 2);
          _tile_loadd(6, xv.data() + (b * kb + kk) * TILE * TILE * 2, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
          if (pair) {
            _tile_loadd(7, xv.data() + ((b + 1) * kb + kk) * TILE * TILE * 2, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        auto put = [&](int64_t half, int64_t block) {  // product tile -> out, transposed
          const int64_t v0 = half * TILE, rows = std::min(TILE, M - block * TILE);
          const int64_t cols = std::clamp<int64_t>(valid - v0, 0, TILE);
          if (cols > 0) put_transposed(c, rows, cols, op + block * TILE * N + n0 + v0, N);
        };
        _tile_stored(0, c, 64);
        put(0, b);
        _tile_stored(2, c, 64);
        put(1, b);
        if (pair) {
          _tile_stored(1, c, 64);
          put(0, b + 1);
          _tile_stored(3, c, 64);
          put(1, b + 1);
        }
      }
    }
    _tile_release();
  });
}
#endif

bool head_tiles() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted();
#else
  return false;
#endif
}

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, bool tiles) {
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (tiles && amx_permitted()) {
    linear_f32_tiles(xp, ldx, wp, op, M, N, K);
    return out;
  }
#endif
  (void)tiles;
  at::parallel_for(0, (N + LOGIT_N_CHUNK - 1) / LOGIT_N_CHUNK, 1, [&](int64_t begin, int64_t end) {
    const int64_t n1 = std::min(N, end * LOGIT_N_CHUNK);
#if defined(__AVX512BF16__)
    // a chunk of columns (115 KB of weights at K = 896) stays in L2 while blocks of LOGIT_ROW_BLOCK rows (28 KB,
    // L1) pass over it: the weight is read from memory once per call, whatever the number of rows. Session 23
    // (AMD Zen4): the sums of one column by a runtime number of rows lived in memory, 22-58e9 multiply-adds a
    // second.
    for (int64_t c = begin * LOGIT_N_CHUNK; c < n1; c += LOGIT_N_CHUNK) {
      const int64_t c1 = std::min(n1, c + LOGIT_N_CHUNK);
      for (int64_t rb = 0; rb < M; rb += LOGIT_ROW_BLOCK) {
        const int64_t rows = std::min(LOGIT_ROW_BLOCK, M - rb);
        const uint16_t* xb = xp + rb * ldx;
        float* ob = op + rb * N;
        int64_t n = c;
        // a row or two read the weights as one stream, a column at a time (four columns side by side ran 1.5x
        // slower at one row: bound by memory, where one sequential stream is read fastest)
        if (rows >= LOGIT_ROWS)
          for (; n + LOGIT_COLS <= c1; n += LOGIT_COLS) logit_rows<LOGIT_COLS>(xb, ldx, wp, ob, rows, N, K, n);
        for (; n < c1; ++n) logit_rows<1>(xb, ldx, wp, ob, rows, N, K, n);
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

// panel_linear (panel_linear.cpp) with float32 outputs: the head's logits from the GGUF's blocks
torch::Tensor panel_linear_f32(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m, int64_t kind,
                               int64_t n, int64_t levels) {
  return panel_linear_impl(x, wp, d, m, kind, n, levels, true, false);
}

}  // namespace kvfence
