#include <torch/extension.h>

#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention over the paged KV cache (CPU)");
  m.def("gguf_linear", &gguf_linear, "x W^T with W in GGUF Q4_0 / Q4_1 / Q8_0 blocks (CPU)");
  m.def("gguf_linear_supported", &gguf_linear_supported, "whether this build has the GGUF GEMV (AVX-512 only)");
}
