// Paged decode attention on CPU: one query token per sequence, read straight from the paged KV cache.
//
// The torch path gathers every sequence's blocks into a contiguous copy per layer and then runs SDPA over
// it, so each step reads the KV three times (gather read, gather write, attention read) and pads mixed
// lengths. Here each sequence (or, when there are few, each of its KV heads) reads its keys and values once,
// in place, for the query heads that share each KV head (GQA), with scores and softmax in float32 as SDPA
// keeps them.
//
// Built by workers/kernels/cpu_extension.py with torch's cpp_extension (-O3 -march=native -fopenmp):
// `#pragma omp simd` marks the loops the compiler should vectorize, `omp parallel` shares the sequences out
// over torch's own OpenMP threads (the extension links the libgomp torch has already loaded).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (scores minus their maximum), branch-free so that `omp simd` loops vectorize it:
// x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial (Cephes expf coefficients), 2^n built in
// the exponent bits. Relative error ~1e-7, the same order as float32 rounding.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below, e^x underflows anyway; keeps 2^n a normal float
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Cache lines of the next block, requested while the current one is computed: blocks sit at scattered
// addresses, which the hardware prefetcher cannot guess.
template <typename T>
inline void prefetch_rows(const T* rows, int64_t count, int64_t row_elems, int64_t token_stride) {
  for (int64_t t = 0; t < count; ++t) {
    const char* row = reinterpret_cast<const char*>(rows + t * token_stride);
    for (int64_t byte = 0; byte < row_elems * static_cast<int64_t>(sizeof(T)); byte += 64) __builtin_prefetch(row + byte);
  }
}

// Rows [count, heads * D] of one block (the KV heads an item covers), as float32 with row stride `stride`:
// float caches are read in place; reduced-precision ones are converted once into `scratch`, so the G query
// heads sharing a KV head do not convert the same values G times.
template <typename T>
inline const float* block_rows(const T* rows, int64_t count, int64_t row_elems, int64_t token_stride,
                               float* scratch, int64_t& stride) {
  if constexpr (std::is_same_v<T, float>) {
    stride = token_stride;
    return rows;
  } else {
    for (int64_t t = 0; t < count; ++t) {
#pragma omp simd
      for (int64_t i = 0; i < row_elems; ++i) scratch[t * row_elems + i] = to_float(rows[t * token_stride + i]);
    }
    stride = row_elems;
    return scratch;
  }
}

// Attention of one sequence's query heads over KV heads [first_head, first_head + heads). kD is the head
// size when known at compile time (then the loops over it unroll), 0 otherwise.
template <typename T, int kD>
void attend_heads(const T* query, const T* k_cache, const T* v_cache, T* out, const int32_t* table, int64_t len,
                  int64_t first_head, int64_t heads, int64_t group, int64_t head_dim, int64_t num_kv_heads,
                  int64_t block_size, int64_t block_stride, float scale, std::vector<float>& buffers) {
  const int64_t D = kD > 0 ? kD : head_dim;
  const int64_t token_stride = num_kv_heads * D, row_elems = heads * D, rows = heads * group;
  buffers.resize(2 * rows * D + rows + rows * len + block_size * row_elems);
  float* q = buffers.data();
  float* acc = q + rows * D;
  float* inv_sum = acc + rows * D;
  float* scores = inv_sum + rows;  // [rows, len]
  float* scratch = scores + rows * len;
  for (int64_t i = 0; i < rows * D; ++i) q[i] = to_float(query[i]) * scale;
  const int64_t offset = first_head * D;
  // The rows of the block holding token `start` as float32 (see block_rows), the next block's requested.
  auto rows_at = [&](const T* cache, int64_t start, int64_t& stride) {
    auto block = [&](int64_t token) { return cache + table[token / block_size] * block_stride + offset; };
    if (start + block_size < len)
      prefetch_rows(block(start + block_size), std::min(block_size, len - start - block_size), row_elems, token_stride);
    return block_rows(block(start), std::min(block_size, len - start), row_elems, token_stride, scratch, stride);
  };

  // Scores, block by block: scores[r * len + t] = q_r . k_t, query head r reading KV head r / group.
  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t count = std::min(block_size, len - start);
    int64_t stride;
    const float* k = rows_at(k_cache, start, stride);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * D;
      const float* kh = k + (r / group) * D;
      float* s = scores + r * len + start;
      for (int64_t t = 0; t < count; ++t) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * kh[t * stride + d];
        s[t] = dot;
      }
    }
  }
  // Softmax per query head; the normalisation is applied to the output at the end.
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * len;
    float peak = -INFINITY;
    for (int64_t t = 0; t < len; ++t) peak = std::max(peak, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = exp_nonpositive(s[t] - peak);
      sum += s[t];
    }
    inv_sum[r] = 1.0f / sum;
  }
  // Weighted values.
  std::fill(acc, acc + rows * D, 0.0f);
  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t count = std::min(block_size, len - start);
    int64_t stride;
    const float* v = rows_at(v_cache, start, stride);
    for (int64_t r = 0; r < rows; ++r) {
      const float* p = scores + r * len + start;
      const float* vh = v + (r / group) * D;
      float* a = acc + r * D;
      for (int64_t t = 0; t < count; ++t) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p[t] * vh[t * stride + d];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = static_cast<T>(acc[r * D + d] * inv_sum[r]);
}

template <typename T, int kD>
void decode_attention(const T* query, const T* k_cache, const T* v_cache, T* out, const int32_t* block_tables,
                      const int32_t* seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t blocks_per_seq, int64_t block_stride,
                      float scale) {
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  // With enough sequences to share out, an item is a whole sequence, so that each block's [block_size, Hkv,
  // D] rows stream in whole; with few, it is one KV head of one sequence, so that every thread has work.
  const int64_t heads_per_item = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  // Items vary with their sequence's length: handed out longest first, one at a time, to whichever thread is
  // free (an even static split leaves one thread idle while the other finishes the long ones).
  std::vector<int64_t> order(num_seqs * items_per_seq);
  if (order.empty()) return;
  for (int64_t i = 0; i < static_cast<int64_t>(order.size()); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return seq_lens[a / items_per_seq] > seq_lens[b / items_per_seq]; });
#pragma omp parallel num_threads(std::min<int64_t>(at::get_num_threads(), order.size()))
  {
    std::vector<float> buffers;
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < order.size(); ++i) {
      const int64_t seq = order[i] / items_per_seq, first_head = (order[i] % items_per_seq) * heads_per_item;
      const int64_t offset = (seq * num_heads + first_head * group) * head_dim;
      attend_heads<T, kD>(query + offset, k_cache, v_cache, out + offset, block_tables + seq * blocks_per_seq,
                          seq_lens[seq], first_head, heads_per_item, group, head_dim, num_kv_heads, block_size,
                          block_stride, scale, buffers);
    }
  }
}

}  // namespace

// query [B, Hq, D] contiguous; k_cache / v_cache [num_blocks, block_size, Hkv, D], each block's rows contiguous
// (the block stride may span other layers); block_tables int32 [B, max_blocks]; seq_lens int32 [B] (>= 1).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && block_tables.device().is_cpu() &&
              seq_lens.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [B, Hq, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must be [num_blocks, block_size, Hkv, D] views of one layout");
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == head_dim && k_cache.stride(1) == num_kv_heads * head_dim,
              "each cache block must be contiguous [block_size, Hkv, D]");
  TORCH_CHECK(query.size(2) == head_dim && query.size(1) % num_kv_heads == 0 && query.size(1) > 0,
              "query heads do not match the cache");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be contiguous int32 [B, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens must be contiguous int32");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.numel() == query.size(0), "one table row and length per query");
  auto out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    // The usual head sizes get loops unrolled at compile time.
    auto run = [&](auto kernel) {
      kernel(query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             out.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), query.size(0),
             query.size(1), num_kv_heads, head_dim, block_size, block_tables.size(1), k_cache.stride(0),
             static_cast<float>(scale));
    };
    if (head_dim == 64) run(decode_attention<scalar_t, 64>);
    else if (head_dim == 128) run(decode_attention<scalar_t, 128>);
    else run(decode_attention<scalar_t, 0>);
  });
  return out;
}
