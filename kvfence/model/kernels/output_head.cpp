// ---- the output head in float32: logits that bfloat16 rounding cannot tie ----
//
// x [M, K] bfloat16 @ W^T with W [N, K] bfloat16, returned as float32 [M, N]. Products of bfloat16 pairs are exact
// and the sums stay float32, so two tokens whose float32 logits differ are not rounded to one bfloat16 value (at a
// logit of 25 one bfloat16 step is 0.125; a 0.08 gap became an exact tie and the lower token id won, issue 20).

#include "cpu_ops.h"

namespace kvfence {

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

// panel_linear (panel_linear.cpp) with float32 outputs: the head's logits from the GGUF's blocks
torch::Tensor panel_linear_f32(torch::Tensor x, torch::Tensor wp, torch::Tensor d, torch::Tensor m, int64_t kind,
                               int64_t n, int64_t levels) {
  return panel_linear_impl(x, wp, d, m, kind, n, levels, true, false);
}

}  // namespace kvfence
