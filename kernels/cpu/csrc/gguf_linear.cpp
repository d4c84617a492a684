// Linear layer y = x W^T with W kept in GGUF's quantized blocks (Q4_0, Q4_1, Q8_0),
// for ../gguf_linear.py.
//
// The weight is GGUF's own bytes, one row per output feature: row n is K / 32
// consecutive blocks of 32 weights (ggml's block_q4_0 / block_q4_1 / block_q8_0):
//   Q4_0  18 bytes: fp16 d, 16 bytes qs     w_j = (q_j - 8) d
//   Q4_1  20 bytes: fp16 d, fp16 m, 16 qs   w_j = q_j d + m
//   Q8_0  34 bytes: fp16 d, 32 int8 qs      w_j = qs_j d
// with the 4-bit q_j = qs[j] & 0xF for j < 16 and qs[j - 16] >> 4 for j >= 16.
//
// Two entry points:
// - tandem_gguf_linear_{f32,bf16}: the decode-sized product. Each block is
//   dequantized in registers (4 x 8 float32 lanes, exactly the values llama.cpp's
//   and gguf-py's dequantization give: q d is exact in float32 and q d + m is one
//   fused rounding, as theirs) and multiplied straight into the accumulators of up
//   to 4 activation rows at once, so the weight is read once per 4 rows, as
//   0.56-1.06 bytes per weight instead of 2 (bfloat16) or 4 (float32). The work is
//   split over output rows.
// - tandem_gguf_dequantize: the whole matrix to float32, for prefill-sized
//   products, where a blocked GEMM on the dequantized weight is faster than
//   re-dequantizing per row tile (the dequantization is then O(N K) beside the
//   GEMM's O(M N K)).
// Two tiers: AVX2 + FMA (+ F16C), and portable loops.
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_GGUF_AVX2 1
#endif

namespace tandem_cpu {
namespace {

constexpr int64_t kQK = 32;  // weights per block
constexpr int kMT = 4;       // activation rows per register tile
enum : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // ggml type ids

inline int64_t block_bytes(int qtype) {
    return qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : qtype == kQ8_0 ? 34 : 0;
}

// The 32 weights of one block, scalar.
inline void dequantize_block(const uint8_t* b, int qtype, float* w) {
    const float d = fp16_to_float(b);
    if (qtype == kQ8_0) {
        const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
        for (int j = 0; j < kQK; ++j) w[j] = static_cast<float>(qs[j]) * d;
        return;
    }
    const bool q41 = qtype == kQ4_1;
    const float m = q41 ? fp16_to_float(b + 2) : -8.0f * d;
    const uint8_t* qs = b + (q41 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
        w[j] = std::fma(static_cast<float>(qs[j] & 0xF), d, m);
        w[j + 16] = std::fma(static_cast<float>(qs[j] >> 4), d, m);
    }
}

#if TANDEM_GGUF_AVX2
// The 32 weights of one block in four registers (weights 0-7, 8-15, 16-23, 24-31).
inline void dequantize_block(const uint8_t* b, int qtype, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(fp16_to_float(b));
    if (qtype == kQ8_0) {
        const uint8_t* qs = b + 2;
        for (int i = 0; i < 4; ++i) {
            const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
        }
        return;
    }
    const bool q41 = qtype == kQ4_1;
    const __m256 m = q41 ? _mm256_set1_ps(fp16_to_float(b + 2))
                         : _mm256_mul_ps(_mm256_set1_ps(-8.0f), d);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (q41 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, mask);                      // weights 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);   // weights 16..31
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(w[i], d, m);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// acc[r] = sum_k x[r, k] w[k] for r < MT over one weight row of `blocks` blocks.
template <int MT>
void row_tile(const float* x, int64_t xs, const uint8_t* row, int qtype, int64_t blocks,
              float* acc) {
    const int64_t bb = block_bytes(qtype);
#if TANDEM_GGUF_AVX2
    __m256 c[MT][2];
    for (int r = 0; r < MT; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
    __m256 w[4];
    for (int64_t b = 0; b < blocks; ++b) {
        dequantize_block(row + b * bb, qtype, w);
        for (int r = 0; r < MT; ++r) {
            const float* xr = x + r * xs + b * kQK;
            c[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), c[r][0]);
            c[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), c[r][1]);
            c[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), c[r][0]);
            c[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), c[r][1]);
        }
    }
    for (int r = 0; r < MT; ++r) acc[r] = hsum(_mm256_add_ps(c[r][0], c[r][1]));
#else
    float w[kQK];
    for (int r = 0; r < MT; ++r) acc[r] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        dequantize_block(row + b * bb, qtype, w);
        for (int r = 0; r < MT; ++r) {
            const float* xr = x + r * xs + b * kQK;
            float s = 0.0f;
            for (int j = 0; j < kQK; ++j) s = std::fma(w[j], xr[j], s);
            acc[r] += s;
        }
    }
#endif
}

template <typename T>
void gguf_linear(T* out, int64_t out_stride, const float* x, int64_t xs, const uint8_t* qweight,
                 int qtype, int64_t m_len, int64_t n_len, int64_t k, int num_threads) {
    const int64_t blocks = k / kQK, row_bytes = blocks * block_bytes(qtype);
#pragma omp parallel for schedule(static) \
    num_threads(threads_for(m_len * n_len * k, num_threads, 1 << 16))
    for (int64_t n = 0; n < n_len; ++n) {
        const uint8_t* row = qweight + n * row_bytes;
        float acc[kMT];
        for (int64_t m0 = 0; m0 < m_len; m0 += kMT) {
            const int64_t mt = std::min<int64_t>(kMT, m_len - m0);
            const float* xt = x + m0 * xs;
            switch (mt) {
                case 1: row_tile<1>(xt, xs, row, qtype, blocks, acc); break;
                case 2: row_tile<2>(xt, xs, row, qtype, blocks, acc); break;
                case 3: row_tile<3>(xt, xs, row, qtype, blocks, acc); break;
                default: row_tile<4>(xt, xs, row, qtype, blocks, acc); break;
            }
            for (int64_t r = 0; r < mt; ++r) out[(m0 + r) * out_stride + n] = from_float<T>(acc[r]);
        }
    }
}

}  // namespace
}  // namespace tandem_cpu

using namespace tandem_cpu;

extern "C" {

// Bytes of one GGUF block of `qtype` (0: a type these kernels do not read).
int tandem_gguf_block_bytes(int qtype) { return static_cast<int>(block_bytes(qtype)); }

// out [M, N] (row stride out_stride) = x [M, K] (row stride x_stride) W^T, W the
// GGUF blocks of `qtype`, [N][K / 32 blocks]; K a multiple of 32.
void tandem_gguf_linear_f32(float* out, int64_t out_stride, const float* x, int64_t x_stride,
                            const uint8_t* qweight, int qtype, int64_t m, int64_t n, int64_t k,
                            int num_threads) {
    gguf_linear<float>(out, out_stride, x, x_stride, qweight, qtype, m, n, k, num_threads);
}

// The same for bfloat16 activations and output; x is widened to float32 first.
void tandem_gguf_linear_bf16(bf16* out, int64_t out_stride, const bf16* x, int64_t x_stride,
                             const uint8_t* qweight, int qtype, int64_t m, int64_t n, int64_t k,
                             int num_threads) {
    float* x32 = float_scratch(static_cast<size_t>(m * k));
    for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < k; ++i) x32[r * k + i] = to_float(x[r * x_stride + i]);
    gguf_linear<bf16>(out, out_stride, x32, k, qweight, qtype, m, n, k, num_threads);
}

// out [N, K] float32 = the weights of `qweight` ([N][K / 32 blocks] of `qtype`).
void tandem_gguf_dequantize(float* out, const uint8_t* qweight, int qtype, int64_t n, int64_t k,
                            int num_threads) {
    const int64_t blocks = k / kQK, bb = block_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(threads_for(n * k, num_threads, 1 << 16))
    for (int64_t i = 0; i < n * blocks; ++i) {
        float* o = out + i * kQK;
#if TANDEM_GGUF_AVX2
        __m256 w[4];
        dequantize_block(qweight + i * bb, qtype, w);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + 8 * j, w[j]);
#else
        dequantize_block(qweight + i * bb, qtype, o);
#endif
    }
}

}  // extern "C"
