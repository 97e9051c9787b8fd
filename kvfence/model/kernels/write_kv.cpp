// ---- KV write: each token's K and V rows into its slot of one layer's pool ----
//
// One copy per row, instead of torch.stack((k, v)) and index_copy_ (three operators and a temporary per layer,
// about 3 ms of a 200-token prefill and 1 ms of an 8-row decode step, docs/performance.md). Every slot is checked
// against the pool before anything is written.

#include "cpu_ops.h"

namespace kvfence {

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

}  // namespace kvfence
