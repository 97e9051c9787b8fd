// ---- decode attention over the KV pages ----
//
// paged_decode_attention: one query token per row, attending over the first context_lens[b] tokens of the
// pages listed in block_tables[b]. It reads K/V in place (no gather, no head-major copy) and keeps scores,
// softmax and the weighted sum in float32. Only pages of the row's own block table, and only the slots below
// its context length, are ever read: the same reads as the torch path, without the padding.
//
// Work is split over spans of at most SPAN tokens of a row (rows longer than that are merged from their spans'
// partial sums); each token's K/V vector is converted from bfloat16 once and used by the G query heads that share
// it.
//
// Where the CPU has AMX (`tiles`), the scores and the weighted sum of V run on the tile unit instead, the G query
// heads that share a KV head as one tile: scores = K Q^T with K's rows read as they lie in the pages (16 tokens of
// a page as a tile's rows), and P V with P rounded to bfloat16 (as flash attention and the prefill kernels do) and
// V's rows interleaved in pairs of tokens as the tiles' right operand. A page's slots past the row's length are
// never read: a last, partial block is copied out first. Why (docs/performance.md, session 28): in AVX-512 a
// 0.5B decode step of 32 rows over ~280 tokens spent 14-16 ms of its 75 here, three quarters of it in
// instructions, not in waiting for memory.

#include <memory>

#include "cpu_ops.h"

namespace kvfence {

namespace {

constexpr int64_t SPAN = 1024;      // tokens per work item: a longer row is cut into spans, merged afterwards
constexpr int64_t ITEM_COST = 32;   // an item's fixed cost, in tokens' worth, when items are shared out

#ifdef __AVX512F__
// acc[g * acc_stride ..][0 .. 64) (g < G <= 4) = sum over t of probs[g * ctx + t] * V_t, V_t 64 values of token t
// at v_head + offsets[t]. A non-zero `prefetch_row` prefetches that many values of the token AHEAD tokens on (the
// first pass over a row fetches whole rows, so the other passes find them in cache). Heads with more query heads
// per KV head, or wider than 64, take several passes (`weighted_sums`).
inline void weighted_sum_64(float* acc, int64_t acc_stride, const float* probs, int64_t ctx, int64_t G,
                            const int64_t* offsets, const uint16_t* v_head, int64_t prefetch_row) {
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
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * acc_stride + c * 16, a[g][c]);
}

// acc [H, Dh] = every head's weighted sum of V (scores: [H, ctx] probabilities), Dh a multiple of 64: passes of
// up to 4 query heads x 64 values, so the accumulators stay in registers for any grouping (Qwen2.5-0.5B's 7 query
// heads per KV head take two)
inline void weighted_sums(float* acc, const float* scores, int64_t ctx, int64_t Hkv, int64_t G, int64_t Dh,
                          const int64_t* offsets, const uint16_t* v_base) {
  for (int64_t kh = 0; kh < Hkv; ++kh)
    for (int64_t g0 = 0; g0 < G; g0 += 4)
      for (int64_t c0 = 0; c0 < Dh; c0 += 64) {
        const int64_t h = kh * G + g0;
        const bool first = kh == 0 && g0 == 0 && c0 == 0;
        weighted_sum_64(acc + h * Dh + c0, Dh, scores + h * ctx, ctx, std::min<int64_t>(4, G - g0), offsets,
                        v_base + kh * Dh + c0, first ? Hkv * Dh : 0);
      }
}
#endif

#if defined(__AVX512BF16__)
// scores[h * ctx + t] = scale * (q_h . K_t) for every head and token of one row, 16 tokens at a time: per KV head
// and query head, 16 accumulators of dpbf16 over Dh (a multiple of 32), summed by sum16. While a block is
// scored, the next block's K rows are prefetched, and during the last block the first V rows.
inline void score_blocks(float* scores, int64_t ctx, const int64_t* offsets, const uint16_t* k_base,
                         const uint16_t* v_base, const uint16_t* qb, int64_t Hkv, int64_t G, int64_t Dh, float scale) {
  const int64_t row_bytes = Hkv * Dh * static_cast<int64_t>(sizeof(uint16_t));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < 16 && t < ctx; ++t) prefetch(k_base + offsets[t], row_bytes);  // the first block
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr int64_t TOKENS = 16;  // tokens of a score tile (its rows): one page holds a whole number of them
static_assert(SPAN % TOKENS == 0, "a span starts on a block of 16 tokens, so a full block lies in one page");

// Tiles 0-3: `c_rows` x `c_bytes`; tile 4: 16 x 64 bytes (left operand); tile 5: `b_rows` x `b_bytes` (right).
inline void configure_decode_tiles(int c_rows, int c_bytes, int a_rows, int b_bytes) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(c_rows);
    cfg.colsb[t] = static_cast<uint16_t>(c_bytes);
  }
  cfg.rows[4] = static_cast<uint8_t>(a_rows);
  cfg.colsb[4] = 64;
  cfg.rows[5] = TILE;
  cfg.colsb[5] = static_cast<uint16_t>(b_bytes);
  load_tile_config(cfg);
}

// The per-thread buffers of the tile path, sized once per call.
struct DecodeTiles {
  std::vector<uint32_t> qpack;  // [Hkv][Dh / 32][16 pairs of dims][16 query heads]: Q^T, the right operand
  std::vector<uint16_t> tail;   // [16][Hkv * Dh]: a last block's real rows, zeros after them
  alignas(64) uint16_t p[TILE * TILE_K];          // [G][32 tokens]: probabilities, bfloat16
  alignas(64) uint16_t vp[4 * TILE * TILE_K];     // [4 tiles of 16 dims][16 pairs of tokens][16 dims][2]
  alignas(64) float c[4][TILE * TILE];            // product tiles, stored
  DecodeTiles(int64_t Hkv, int64_t Dh) : qpack(Hkv * (Dh / 32) * TILE * TILE), tail(TOKENS * Hkv * Dh) {}
};

// scores[h * ctx + t] = scale * (q_h . K_t) for one item, on tiles: for each KV head, blocks of 16 tokens (a
// tile's rows, K as it lies in its page) times Q^T of the G query heads that share it, four blocks at a time.
inline void score_tiles(DecodeTiles& w, float* scores, int64_t ctx, const int64_t* offsets, const uint16_t* k_base,
                        const uint16_t* v_base, const uint16_t* qb, int64_t Hkv, int64_t G, int64_t Dh, float scale) {
  const int64_t row = Hkv * Dh, kk_n = Dh / 32;
  for (int64_t kh = 0; kh < Hkv; ++kh)
    for (int64_t kk = 0; kk < kk_n; ++kk)
      for (int64_t i = 0; i < TILE; ++i)
        for (int64_t g = 0; g < TILE; ++g) {
          uint32_t pair = 0;
          if (g < G) std::memcpy(&pair, qb + (kh * G + g) * Dh + kk * 32 + 2 * i, sizeof(pair));
          w.qpack[((kh * kk_n + kk) * TILE + i) * TILE + g] = pair;
        }
  configure_decode_tiles(TOKENS, static_cast<int>(G * 4), TOKENS, static_cast<int>(G * 4));
  const int64_t rb = row * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t t = 0; t < ctx; t += 4 * TOKENS) {
    const int64_t nb = std::min<int64_t>(4, (ctx - t + TOKENS - 1) / TOKENS);
    const uint16_t* src[4] = {};
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t tok = t + j * TOKENS, n = std::min(TOKENS, ctx - tok);
      if (n == TOKENS) {
        src[j] = k_base + offsets[tok];  // 16 slots of one page, one after the other
      } else {  // the row's last slots: only those are read
        std::fill(w.tail.begin(), w.tail.end(), 0);
        for (int64_t r = 0; r < n; ++r) std::memcpy(&w.tail[r * row], k_base + offsets[tok + r], rb);
        src[j] = w.tail.data();
      }
    }
    // the next round's K pages (or, in the last one, the first V rows): one line each 64 bytes
    const int64_t next = t + 4 * TOKENS;
    if (next < ctx) {
      for (int64_t tok = next; tok < std::min(ctx, next + 4 * TOKENS); tok += TOKENS)
        prefetch(k_base + offsets[tok], std::min(TOKENS, ctx - tok) * rb);
    } else {
      for (int64_t tok = 0; tok < std::min<int64_t>(ctx, 2 * TILE_K); tok += TOKENS)
        prefetch(v_base + offsets[tok], std::min(TOKENS, ctx - tok) * rb);
    }
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kk = 0; kk < kk_n; ++kk) {
        _tile_loadd(5, &w.qpack[(kh * kk_n + kk) * TILE * TILE], 64);
        const int64_t at = kh * Dh + kk * 32;
        _tile_loadd(4, src[0] + at, rb);
        _tile_dpbf16ps(0, 4, 5);
        if (nb > 1) {
          _tile_loadd(4, src[1] + at, rb);
          _tile_dpbf16ps(1, 4, 5);
        }
        if (nb > 2) {
          _tile_loadd(4, src[2] + at, rb);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (nb > 3) {
          _tile_loadd(4, src[3] + at, rb);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, w.c[0], 64);
      if (nb > 1) _tile_stored(1, w.c[1], 64);
      if (nb > 2) _tile_stored(2, w.c[2], 64);
      if (nb > 3) _tile_stored(3, w.c[3], 64);
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t tok = t + j * TOKENS, n = std::min(TOKENS, ctx - tok);
        for (int64_t g = 0; g < G; ++g) {
          float* dst = scores + (kh * G + g) * ctx + tok;
          for (int64_t r = 0; r < n; ++r) dst[r] = w.c[j][r * TILE + g] * scale;
        }
      }
    }
  }
}

// acc[h * Dh + d] = sum over t of probs[h * ctx + t] * V_t for one item, on tiles: per KV head and 64 dims, the
// G heads' probabilities (bfloat16) of 32 tokens at a time times those tokens' V in pairs, summed over the item
// in four product tiles. Tokens past ctx weigh zeros (their V is never read).
inline void weighted_sum_tiles(DecodeTiles& w, float* acc, const float* probs, int64_t ctx, const int64_t* offsets,
                               const uint16_t* v_base, int64_t Hkv, int64_t G, int64_t Dh) {
  configure_decode_tiles(static_cast<int>(G), 64, static_cast<int>(G), 64);
  const int64_t rb = Hkv * Dh * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t kh = 0; kh < Hkv; ++kh)
    for (int64_t d0 = 0; d0 < Dh; d0 += 64) {
      const int64_t nd = std::min<int64_t>(4, (Dh - d0) / TILE);  // Dh a multiple of 32: 2 or 4
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t t0 = 0; t0 < ctx; t0 += TILE_K) {
        const int64_t n = std::min(TILE_K, ctx - t0);
        if (t0 + TILE_K < ctx)  // the next block's V rows
          for (int64_t tok = t0 + TILE_K; tok < std::min(ctx, t0 + 2 * TILE_K); tok += TOKENS)
            prefetch(v_base + offsets[tok], std::min(TOKENS, ctx - tok) * rb);
        const __mmask16 lo = static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1);
        const __mmask16 hi = static_cast<__mmask16>(n >= 32 ? 0xffff : n <= 16 ? 0 : (1u << (n - 16)) - 1);
        for (int64_t g = 0; g < G; ++g) {
          const float* pr = probs + (kh * G + g) * ctx + t0;
          const __m512 a = _mm512_maskz_loadu_ps(lo, pr), b = _mm512_maskz_loadu_ps(hi, pr + 16);
          _mm512_store_si512(w.p + g * TILE_K, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
        const __m256i zero = _mm256_setzero_si256();
        for (int64_t i = 0; i < TILE; ++i) {  // tokens t0 + 2i, t0 + 2i + 1 of dims d0 .. d0 + 16 nd
          const uint16_t* v0 = 2 * i < n ? v_base + offsets[t0 + 2 * i] + kh * Dh + d0 : nullptr;
          const uint16_t* v1 = 2 * i + 1 < n ? v_base + offsets[t0 + 2 * i + 1] + kh * Dh + d0 : nullptr;
          for (int64_t j = 0; j < nd; ++j) {
            const __m256i x0 = v0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + j * TILE)) : zero;
            const __m256i x1 = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + j * TILE)) : zero;
            const __m512i pairs =
                _mm512_or_si512(_mm512_cvtepu16_epi32(x0), _mm512_slli_epi32(_mm512_cvtepu16_epi32(x1), 16));
            _mm512_store_si512(w.vp + (j * TILE + i) * TILE_K, pairs);
          }
        }
        _tile_loadd(4, w.p, 64);
        _tile_loadd(5, w.vp, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, w.vp + TILE * TILE_K, 64);
        _tile_dpbf16ps(1, 4, 5);
        if (nd > 2) {
          _tile_loadd(5, w.vp + 2 * TILE * TILE_K, 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(5, w.vp + 3 * TILE * TILE_K, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, w.c[0], 64);
      _tile_stored(1, w.c[1], 64);
      if (nd > 2) {
        _tile_stored(2, w.c[2], 64);
        _tile_stored(3, w.c[3], 64);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < nd; ++j)
          std::memcpy(acc + (kh * G + g) * Dh + d0 + j * TILE, w.c[j] + g * TILE, TILE * sizeof(float));
    }
}
#endif

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale, bool tiles) {
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
  // the tile path: AMX, the heads' dims in 32s, at most 16 query heads a KV head, pages of whole 16-token blocks
  bool use_tiles = false;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  use_tiles = tiles && amx_permitted() && Dh % 32 == 0 && G >= 1 && G <= TILE && S % TOKENS == 0;
#endif
  (void)tiles;
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

  // Work items: each row's context cut into spans of SPAN tokens (the last one shorter). A row of one span is
  // computed and written as a whole; a longer row's spans each leave their unnormalised sums, per-head maxima
  // and sums of exponentials (a partial slot: part_acc, part_max, part_sum), merged in span order afterwards (as
  // flash-decoding does). The spans
  // depend only on the row's own length, so a row's bits do not depend on the other rows of the step nor on the
  // threads; and one long row (a tenant's 2,000-token request decoding beside eight short ones) is spread over
  // the threads instead of holding one of them for the whole step.
  std::vector<int64_t> item_row, item_t0, item_slot;  // per item: its row, first token, partial slot (-1: none)
  std::vector<int64_t> first_slot(B, -1);
  item_row.reserve(B);
  item_t0.reserve(B);
  item_slot.reserve(B);
  int64_t slots = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t spans = (lens[b] + SPAN - 1) / SPAN;
    if (spans > 1) first_slot[b] = slots;
    for (int64_t s = 0; s < spans; ++s) {
      item_row.push_back(b);
      item_t0.push_back(s * SPAN);
      item_slot.push_back(spans > 1 ? slots++ : -1);
    }
  }
  const int64_t items = static_cast<int64_t>(item_row.size());
  std::vector<float> part_acc(slots * H * Dh), part_max(slots * H), part_sum(slots * H);

  // Items go to the threads in order, in runs of about equal cost (tokens plus a fixed cost per item): at::
  // parallel_for splits a range by count, which would give one thread every span of a long row.
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> bounds(tasks + 1, items);
  {
    int64_t total = 0;
    for (int64_t i = 0; i < items; ++i) total += std::min(SPAN, lens[item_row[i]] - item_t0[i]) + ITEM_COST;
    bounds[0] = 0;
    int64_t done = 0, task = 1;
    for (int64_t i = 0; i < items && task < tasks; ++i) {
      done += std::min(SPAN, lens[item_row[i]] - item_t0[i]) + ITEM_COST;
      while (task < tasks && done * tasks >= total * task) bounds[task++] = i + 1;
    }
  }

  // Each item: all the heads of its row over its span. Each token's K (then V) for every KV head is one
  // contiguous run of Hkv * Dh values. With AVX512-BF16 and Dh a multiple of 32, scores come 16 tokens at a time
  // (sum16) and the reads of the next 16 tokens are prefetched while these are computed: pages are scattered
  // over a pool much larger than the caches, and without prefetching a row's reads wait on memory one page at a
  // time (a decode step of 8 rows spent ~40% of its time here, docs/performance.md).
  at::parallel_for(0, tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    std::vector<float> qf(H * Dh), acc(H * Dh), vec(Hkv * Dh), scores, inv_sum(H);
    std::vector<uint16_t> qb(H * Dh);
    std::vector<int64_t> offsets;  // each token's offset in K (and V): its slot * Hkv * Dh
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    std::unique_ptr<DecodeTiles> work;
    if (use_tiles) work = std::make_unique<DecodeTiles>(Hkv, Dh);
#endif
    for (int64_t i = bounds[task_begin]; i < bounds[task_end]; ++i) {
      const int64_t b = item_row[i], t0 = item_t0[i], slot = item_slot[i];
      const int64_t ctx = std::min(SPAN, lens[b] - t0);
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(&qb[h * Dh], q_base + b * q_row + h * q_head, Dh * sizeof(uint16_t));
        bf16_to_f32(&qb[h * Dh], &qf[h * Dh], Dh);
      }
      scores.resize(H * ctx);
      offsets.resize(ctx);
      const int64_t* table = tables + b * max_pages;
      for (int64_t t = 0; t < ctx; ++t) offsets[t] = (table[(t0 + t) / S] * S + (t0 + t) % S) * Hkv * Dh;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (use_tiles) {
        score_tiles(*work, scores.data(), ctx, offsets.data(), k_base, v_base, qb.data(), Hkv, G, Dh, fscale);
      } else
#endif
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
      float* top = slot < 0 ? nullptr : &part_max[slot * H];
      for (int64_t h = 0; h < H; ++h) {
        float* row = &scores[h * ctx];
        const float m = max_of(row, ctx);
        const float sum = exp_shifted(row, ctx, m);
        if (slot < 0) {
          inv_sum[h] = 1.0f / sum;
        } else {
          top[h] = m;
          part_sum[slot * H + h] = sum;
        }
      }
      float* sums = slot < 0 ? acc.data() : &part_acc[slot * H * Dh];
      std::fill(sums, sums + H * Dh, 0.0f);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (use_tiles) {
        weighted_sum_tiles(*work, sums, scores.data(), ctx, offsets.data(), v_base, Hkv, G, Dh);
      } else
#endif
#ifdef __AVX512F__
      if (Dh % 64 == 0) {
        weighted_sums(sums, scores.data(), ctx, Hkv, G, Dh, offsets.data(), v_base);
      } else
#endif
      for (int64_t t = 0; t < ctx; ++t) {
        bf16_to_f32(v_base + offsets[t], vec.data(), Hkv * Dh);
        for (int64_t h = 0; h < H; ++h) axpy(&sums[h * Dh], scores[h * ctx + t], &vec[(h / G) * Dh], Dh);
      }
      if (slot >= 0) continue;  // merged below with the row's other spans
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < Dh; ++d) acc[h * Dh + d] *= inv_sum[h];
        f32_to_bf16_n(&acc[h * Dh], out_base + (b * H + h) * Dh, Dh);
      }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (use_tiles) _tile_release();
#endif
  });

  // Rows of several spans: rescale each span's sums to the row's maximum and add them up, in span order.
  std::vector<int64_t> long_rows;
  for (int64_t b = 0; b < B; ++b)
    if (first_slot[b] >= 0) long_rows.push_back(b);
  at::parallel_for(0, static_cast<int64_t>(long_rows.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(Dh), weight;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = long_rows[r], first = first_slot[b], spans = (lens[b] + SPAN - 1) / SPAN;
      weight.resize(spans);
      for (int64_t h = 0; h < H; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < spans; ++s) m = std::max(m, part_max[(first + s) * H + h]);
        float total = 0.0f;
        for (int64_t s = 0; s < spans; ++s) {
          weight[s] = std::exp(part_max[(first + s) * H + h] - m);
          total += weight[s] * part_sum[(first + s) * H + h];
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t s = 0; s < spans; ++s) axpy(acc.data(), weight[s], &part_acc[((first + s) * H + h) * Dh], Dh);
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < Dh; ++d) acc[d] *= inv;
        f32_to_bf16_n(acc.data(), out_base + (b * H + h) * Dh, Dh);
      }
    }
  });
}

}  // namespace kvfence
