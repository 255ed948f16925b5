// y = x W^T for the few rows of a decode step, with W read in the GGUF file's own quantized blocks.
//
// At batch 1 a CPU decode step is a chain of matrix-vector products, bound by reading the weights: the
// float32 copy of a Q4_1 model is 6.4x the bytes of its blocks. Here each block (32 weights of one row) is
// expanded to float32 in registers exactly as gguf's numpy dequantization computes it (Q4_0: (q - 8) d,
// Q4_1: q d + m, Q8_0: q d, each one exact product or one rounding, so the weights are bit-identical to the
// dequantized ones) and multiplied into every row of x. Only the summation order differs from a float32
// GEMM's.
//
// Rows of W are shared out over torch's threads in contiguous ranges, so each thread streams one run of
// blocks; a software prefetch ~2 KiB ahead is there to keep more reads in flight than the hardware prefetcher
// alone (a distance chosen by trying; no benchmark here times it). x rows are taken in chunks of
// up to kMaxRows, so that their accumulators stay in registers.
//
// AVX-512 only (with F16C for the block scales): built without it, gguf_linear_supported() is false and
// callers keep the dequantized weights' path.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_GGUF_LINEAR 1
#endif

namespace {

// ggml_type values (ggml.h) and their block sizes in bytes, for 32 weights each.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kGroup = 32;
constexpr int kMaxRows = 8;

constexpr int64_t block_bytes(int64_t ggml_type) {
  switch (ggml_type) {
    case kQ4_0: return 2 + 16;      // f16 d, 32 x 4-bit q
    case kQ4_1: return 2 + 2 + 16;  // f16 d, f16 m, 32 x 4-bit q
    case kQ8_0: return 2 + 32;      // f16 d, 32 x int8 q
    default: return 0;
  }
}

#ifdef TANDEM_GGUF_LINEAR

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

// The block's 32 weights as two vectors of 16 (weights 0-15 and 16-31, as ggml orders them: the low nibbles
// of the 16 bytes, then the high nibbles).
template <int64_t kType>
inline void expand_block(const uint8_t* block, __m512& first, __m512& second) {
  if constexpr (kType == kQ8_0) {
    const __m512 d = _mm512_set1_ps(half_at(block));
    const __m128i* q = reinterpret_cast<const __m128i*>(block + 2);
    first = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
    second = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
  } else {
    constexpr int64_t kQuantsAt = kType == kQ4_1 ? 4 : 2;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kQuantsAt));
    const __m128i nibble = _mm_set1_epi8(0x0f);
    __m512i low = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, nibble));
    __m512i high = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    const __m512 d = _mm512_set1_ps(half_at(block));
    if constexpr (kType == kQ4_1) {
      const __m512 m = _mm512_set1_ps(half_at(block + 2));
      first = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), d, m);  // q d is exact: one rounding, as numpy's
      second = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), d, m);
    } else {
      const __m512i eight = _mm512_set1_epi32(8);
      first = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(low, eight)), d);
      second = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(high, eight)), d);
    }
  }
}

// y[r, n] for rows r < kRows of x and W rows n in [n0, n1).
template <int64_t kType, int kRows>
void rows_times_blocks(const float* x, const uint8_t* blocks, float* y, int64_t K, int64_t N, int64_t n0,
                       int64_t n1) {
  constexpr int64_t kBytes = block_bytes(kType);
  constexpr int64_t kPrefetchAhead = 2048;
  const int64_t blocks_per_row = K / kGroup;
  const uint8_t* block = blocks + n0 * blocks_per_row * kBytes;
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc_first[kRows], acc_second[kRows];
    for (int r = 0; r < kRows; ++r) acc_first[r] = acc_second[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks_per_row; ++b, block += kBytes) {
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchAhead), _MM_HINT_T0);
      __m512 first, second;
      expand_block<kType>(block, first, second);
      for (int r = 0; r < kRows; ++r) {
        const float* xr = x + r * K + b * kGroup;
        acc_first[r] = _mm512_fmadd_ps(first, _mm512_loadu_ps(xr), acc_first[r]);
        acc_second[r] = _mm512_fmadd_ps(second, _mm512_loadu_ps(xr + 16), acc_second[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) y[r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc_first[r], acc_second[r]));
  }
}

template <int64_t kType, int kRows>
void run_rows(const float* x, const uint8_t* blocks, float* y, int64_t K, int64_t N) {
  // Contiguous row ranges per thread; 16 rows at least, so a range is worth a thread.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { rows_times_blocks<kType, kRows>(x, blocks, y, K, N, n0, n1); });
}

template <int64_t kType>
void run_chunk(const float* x, const uint8_t* blocks, float* y, int64_t rows, int64_t K, int64_t N) {
  switch (rows) {
    case 1: return run_rows<kType, 1>(x, blocks, y, K, N);
    case 2: return run_rows<kType, 2>(x, blocks, y, K, N);
    case 3: return run_rows<kType, 3>(x, blocks, y, K, N);
    case 4: return run_rows<kType, 4>(x, blocks, y, K, N);
    case 5: return run_rows<kType, 5>(x, blocks, y, K, N);
    case 6: return run_rows<kType, 6>(x, blocks, y, K, N);
    case 7: return run_rows<kType, 7>(x, blocks, y, K, N);
    default: return run_rows<kType, kMaxRows>(x, blocks, y, K, N);
  }
}

#endif  // TANDEM_GGUF_LINEAR

}  // namespace

bool gguf_linear_supported() {
#ifdef TANDEM_GGUF_LINEAR
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 or bfloat16; blocks uint8 [N, K / 32 * block bytes], row n holding W's row n in the file's
// block layout -> [M, N] in x's dtype (computed in float32).
// The arguments are checked before the CPU: a caller's mistake is said the same on every machine.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t bytes = block_bytes(ggml_type);
  TORCH_CHECK(bytes > 0, "unsupported GGUF block type ", ggml_type, " (supported: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "K (", K, ") must be a multiple of ", kGroup);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) == K / kGroup * bytes,
              "blocks must be contiguous uint8 [N, ", K / kGroup * bytes, "] for K = ", K);
  TORCH_CHECK(gguf_linear_supported(), "gguf_linear needs AVX-512 and F16C, which this build lacks");
  const int64_t N = blocks.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
#ifdef TANDEM_GGUF_LINEAR
  for (int64_t first = 0; first < M; first += kMaxRows) {
    const int64_t rows = std::min<int64_t>(kMaxRows, M - first);
    const float* xs = xf.data_ptr<float>() + first * K;
    float* ys = y.data_ptr<float>() + first * N;
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    if (ggml_type == kQ4_0) run_chunk<kQ4_0>(xs, w, ys, rows, K, N);
    else if (ggml_type == kQ4_1) run_chunk<kQ4_1>(xs, w, ys, rows, K, N);
    else run_chunk<kQ8_0>(xs, w, ys, rows, K, N);
  }
#endif
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}
