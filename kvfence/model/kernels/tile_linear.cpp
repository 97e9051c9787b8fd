// ---- bfloat16 linear layers on AMX tiles, on weights packed once at load ----
//
// out [M, N] bfloat16 = x [M, K] @ W^T (+ bias), float32 sums rounded once to nearest even, as oneDNN's product.
// Why not oneDNN's (kvfence/model/linears.py, docs/performance.md, session 27): a decode step of few rows is bound
// by reading the weights, and oneDNN's AMX product read them at 13-15 GB/s on a machine whose two cores read 24;
// here one sequential stream per core, prefetched ahead, reads them at 17-21 GB/s.
//
// The packed weight is oneDNN's BA16a32b2a over (K, N): for each block of 32 output columns and each 32 of K, 2 KB
// holding 16 rows of K pairs, each 32 columns x 2 values: the right operand of two tiles side by side (stride 128
// bytes). A block of 32 columns is one contiguous panel of K / 32 such pieces, read front to back.
//
// x is the left operand as it lies (16 rows x 32 of K, stride its row stride): nothing is repacked per call. Rows
// go in chunks of 32 (tiles 4 and 5), each against two column tiles (6 and 7), into four float32 product tiles
// (0-3): out rows c .. c + 15 and c + 16 .. c + 31 x columns n .. n + 15 and n + 16 .. n + 31. A chunk of fewer
// rows configures its tiles with fewer rows. Each output is the same sum over K in the same order whatever the
// other rows: a row's outputs have the same bits in any batch and any chunking of a prompt.

#include "cpu_ops.h"

namespace kvfence {

constexpr int64_t COLS = 32;           // output columns of one panel (two tiles)
constexpr int64_t CHUNK = 32;          // rows of x per pass over a panel (two tiles)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

constexpr int64_t PIECE = 16 * 64;     // bfloat16 values of one 32-of-K piece of a panel (2 KB)
constexpr int64_t PREFETCH_AHEAD = 4;  // pieces between a prefetch and the load it serves (8 KB)

// Rows of the float32 product tiles c[0..3] -> out, bfloat16, plus the bias (float32 [N], or null).
inline void put_rows(const float (*c)[TILE * TILE], int first, int rows, const float* bias, uint16_t* out,
                     int64_t ldo) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + TILE) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(c[first] + r * TILE), b0);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(c[first + 1] + r * TILE), b1);
    _mm512_storeu_si512(out + r * ldo, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// The gated form (`silu`): the panel's first 16 columns are gate columns and its next 16 the matching up columns;
// out[r][16 p + j] = silu(gate) * up of the float32 sums, rounded once (the layer's [T, 2 I] product and silu_mul's
// pass over it in one).
inline void put_rows_silu(const float (*c)[TILE * TILE], int first, int rows, uint16_t* out, int64_t ldo) {
  for (int r = 0; r < rows; ++r) {
    const __m512 y = silu_times(_mm512_load_ps(c[first] + r * TILE), _mm512_load_ps(c[first + 1] + r * TILE));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), (__m256i)_mm512_cvtneps_pbh(y));
  }
}

}  // namespace
#endif

// Bytes of x a pass keeps in L2: half of this core's L2 as the C library reports it (1 MB of the 2 MB of Sapphire
// Rapids' cores), or 1 MB where it reports none (some virtual machines). Outside the AMX block: tile_linear checks
// its arguments on every build.
static int64_t x_budget() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 >= (256 << 10) ? int64_t{l2} / 2 : int64_t{1} << 20;
  }();
  return bytes;
}

torch::Tensor pack_tiles(torch::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "w: contiguous bfloat16 [N, K] on the CPU");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0 && N > 0 && K > 0, "w: N and K positive multiples of 32");
  auto out = torch::empty({N / 32, K / 32, 16, 64}, w.options());
  const auto* src = reinterpret_cast<const uint32_t*>(w.data_ptr());  // pairs of K
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  const int64_t kb = K / 32, pairs = K / 2;
  at::parallel_for(0, N / 32, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t kk = 0; kk < kb; ++kk)
        for (int64_t i = 0; i < 16; ++i)
          for (int64_t j = 0; j < 32; ++j)
            dst[((p * kb + kk) * 16 + i) * 32 + j] = src[(p * 32 + j) * pairs + kk * 16 + i];
  });
  return out;
}

// m_block: rows of x per pass over the thread's panels: a pass's first chunk reads a panel from memory, the others
// find it in L2, as they find x's m_block rows there. 0: as many as fit in half of a core's L2 (`x_budget`; 32 to
// 1,024 rows): the panels stream through the other half. A budget of the whole L2 (2 MB, session 27) left no room
// for them and ran chunks of 1,024-2,048 rows 6-13% slower; 256 rows a pass ran 288-512 rows 9-14% slower
// (docs/performance.md, sessions 27 and 29).
// silu: the weight was packed from gate and up rows interleaved 16 by 16 (`interleave_gated` in linears.py):
// out [M, N / 2] = silu(x @ gate^T) * (x @ up^T), no bias.
torch::Tensor tile_linear(torch::Tensor x, torch::Tensor wt, c10::optional<torch::Tensor> bias, int64_t m_block,
                          bool silu) {
  check_rows(x, "x");
  TORCH_CHECK(wt.device().is_cpu() && wt.scalar_type() == at::kBFloat16 && wt.dim() == 4 && wt.is_contiguous() &&
                  wt.size(2) == 16 && wt.size(3) == 64,
              "wt: a weight packed by pack_tiles");
  const int64_t M = x.size(0), K = x.size(1), panels = wt.size(0), kb = wt.size(1), N = panels * COLS;
  TORCH_CHECK(kb * TILE_K == K && kb > 0, "x: ", K, " columns, the packed weight has ", kb * TILE_K);
  if (m_block == 0) m_block = std::clamp<int64_t>(x_budget() / (K * 2) / CHUNK * CHUNK, CHUNK, 1024);
  TORCH_CHECK(m_block >= CHUNK && m_block % CHUNK == 0, "m_block: 0 or a positive multiple of ", CHUNK);
  TORCH_CHECK(!(silu && bias.has_value()), "tile_linear: the gated form takes no bias");
  const int64_t n_out = silu ? N / 2 : N, cols_out = silu ? TILE : COLS;
  const float* bp = nullptr;
  torch::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->dim() == 1, "bias: [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
    bp = bias_f32.data_ptr<float>();
  }
  auto out = torch::empty({M, n_out}, x.options());
  if (M == 0) return out;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(amx_permitted(), "tile_linear: this process may not use AMX tiles");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(wt.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ldx = x.stride(0);
  // each thread a contiguous run of panels: one sequential stream of weights per core
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[4][TILE * TILE];
    int cur0 = -1, cur1 = -1;
    for (int64_t m0 = 0; m0 < M; m0 += m_block) {
      const int64_t m1 = std::min(M, m0 + m_block);
      for (int64_t p = begin; p < end; ++p) {
        const uint16_t* panel = wp + p * kb * PIECE;
        const uint16_t* stream_end = wp + end * kb * PIECE;  // this thread's last panel ends here
        for (int64_t mc = m0; mc < m1; mc += CHUNK) {
          const int r0 = static_cast<int>(std::min<int64_t>(TILE, m1 - mc));
          const int r1 = static_cast<int>(std::clamp<int64_t>(m1 - mc - TILE, 0, TILE));
          if (r0 != cur0 || r1 != cur1) {
            configure_row_tiles(r0, r1);
            cur0 = r0;
            cur1 = r1;
          }
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          const uint16_t* xa = xp + mc * ldx;
          const uint16_t* xb = xa + TILE * ldx;
          const bool first = mc == m0;  // this pass reads the panel from memory: prefetch ahead of the loads
          for (int64_t kk = 0; kk < kb; ++kk) {
            const uint16_t* piece = panel + kk * PIECE;
            const uint16_t* ahead = piece + PREFETCH_AHEAD * PIECE;
            if (first && ahead < stream_end) prefetch(ahead, PIECE * 2);
            _tile_loadd(6, piece, 128);
            _tile_loadd(7, piece + 32, 128);
            _tile_loadd(4, xa + kk * TILE_K, ldx * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (r1 > 0) {
              _tile_loadd(5, xb + kk * TILE_K, ldx * 2);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          const float* b = bp ? bp + p * COLS : nullptr;
          uint16_t* dst = op + mc * n_out + p * cols_out;
          const auto put = [&](int first, int rows, uint16_t* to) {
            if (silu) put_rows_silu(c, first, rows, to, n_out);
            else put_rows(c, first, rows, b, to, n_out);
          };
          put(0, r0, dst);
          if (r1 > 0) {
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            put(2, r1, dst + TILE * n_out);
          }
        }
      }
    }
    _tile_release();
  });
#else
  (void)bp;
  (void)cols_out;
  TORCH_CHECK(false, "tile_linear: built without AMX");
#endif
  return out;
}

}  // namespace kvfence
