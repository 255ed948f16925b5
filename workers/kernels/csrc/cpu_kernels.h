// The native CPU kernels of workers/kernels/cpu_extension.py; bindings.cpp exposes them to Python.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// Decode attention over the paged KV cache (paged_decode_cpu.cpp).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale);

// y = x W^T with W in GGUF quantized blocks (gguf_linear_cpu.cpp).
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type);
bool gguf_linear_supported();
