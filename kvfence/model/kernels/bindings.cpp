// The Python module: every kernel of cpu_ops.h under its own name.

#include <torch/extension.h>

#include "cpu_ops.h"

using namespace kvfence;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL: they touch no Python object, and the server's event loop (same process)
  // can then serve HTTP on another core while a step runs, as it can during torch's own operators.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over KV pages (bfloat16, CPU)",
        py::arg("out"), py::arg("q"), py::arg("kv"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("tiles") = true, nogil);
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
  m.def("linear_f32", &linear_f32, "x @ W^T, bfloat16 in, float32 out (the output head)", py::arg("x"),
        py::arg("w"), py::arg("tiles") = true, nogil);
  m.def("pack_tiles", &pack_tiles, "a bfloat16 weight [N, K] packed for tile_linear", nogil);
  m.def("tile_linear", &tile_linear, "x @ W^T (+ bias) on AMX tiles, W packed by pack_tiles", py::arg("x"),
        py::arg("wt"), py::arg("bias"), py::arg("m_block"), py::arg("silu") = false, nogil);
  m.def("prefill_attention_tiles", &prefill_attention_tiles, "prefill_attention on AMX tiles", nogil);
  m.def("attention_tiles", &attention_tiles, "whether prefill_attention_tiles runs here");
  m.def("head_tiles", &head_tiles, "whether linear_f32 runs on AMX tiles here");
  m.def("panel_vnni", &panel_vnni, "whether panel_linear has its AVX512-VNNI path here");
}
