// ---- the small operators of a layer, fused (bfloat16 in and out, float32 inside, one rounding) ----

#include "cpu_ops.h"

namespace kvfence {

namespace {

constexpr int64_t ROW_GRAIN = 32;  // rows per task: a decode step's few rows run inline, a prefill's in parallel

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
      for (; i + 16 <= inter; i += 16)
        _mm512_storeu_ps(&a[i], silu_times(_mm512_loadu_ps(&a[i]), _mm512_loadu_ps(&b[i])));
#endif
      for (; i < inter; ++i) a[i] = a[i] / (1.0f + std::exp(-a[i])) * b[i];
      f32_to_bf16_n(a.data(), o + r * inter, inter);
    }
  });
  return out;
}

}  // namespace kvfence
