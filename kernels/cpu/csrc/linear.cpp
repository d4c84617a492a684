// Batch-invariant linear layer y = x W^T (float32 and bfloat16), for ../linear.py.
//
// Every output element y[m, n] is one float32 fused-multiply-add chain over
// k = 0, 1, ..., K-1 in that order, started from 0 and rounded once at the store.
// Nothing about that chain depends on M, on where row m sits in the batch, on the
// tiling or on the number of threads: the work is split over output columns only
// (never over K), and the row tiles of every size run the same per-element code.
// So a row's result is bit-identical whatever else is batched with it, which a
// BLAS GEMM does not promise (its blocking, and so its summation order, changes
// with the shape). This is the "batch-invariant matmul" of He et al., "Defeating
// Nondeterminism in LLM Inference" (Thinking Machines, 2025), on a CPU.
//
// Weights are packed once at load (../linear.py) into panels of kNR = 16 output
// columns:
//   float32:  [P][K][16]          element (n, k) at (n / 16) * K * 16 + k * 16 + n % 16
//   bfloat16: [P][Kp / 2][16][2]  pairs of consecutive k per column, Kp = K rounded
//             up to even; (n, k) at (n / 16) * Kp * 16 + (k / 2) * 32 + (n % 16) * 2 + k % 2
// with rows n >= N (and the padding k of bfloat16) zero. The bfloat16 pairs let
// AVX2 widen 8 columns of two k at once: the low halves shifted up are the even k,
// the high halves masked are the odd k.
//
// The micro-kernel keeps an MR x 16 tile of float32 accumulators in registers
// (MR <= 6: 12 ymm accumulators), broadcasting one x element per row and step
// (the BLIS outer-product form). bfloat16 activations are widened to float32 once
// per call. Two tiers: AVX2 + FMA, and portable loops.
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_LINEAR_AVX2 1
#endif

namespace tandem_cpu {
namespace {

constexpr int64_t kNR = 16;  // output columns per packed panel
constexpr int kMR = 6;       // rows per micro-kernel tile

// acc[r][j] = sum_k x[r, k] * W[panel col j, k] for r < MR, j < 16 (float32 weights).
template <int MR>
void tile_f32(const float* x, int64_t xs, const float* wp, int64_t k_len, float* acc) {
#if TANDEM_LINEAR_AVX2
    __m256 c0[MR], c1[MR];
    for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_len; ++k) {
        const __m256 b0 = _mm256_loadu_ps(wp + k * kNR);
        const __m256 b1 = _mm256_loadu_ps(wp + k * kNR + 8);
        for (int r = 0; r < MR; ++r) {
            const __m256 a = _mm256_broadcast_ss(x + r * xs + k);
            c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
        }
    }
    for (int r = 0; r < MR; ++r) {
        _mm256_storeu_ps(acc + r * kNR, c0[r]);
        _mm256_storeu_ps(acc + r * kNR + 8, c1[r]);
    }
#else
    float c[MR][kNR] = {};
    for (int64_t k = 0; k < k_len; ++k)
        for (int r = 0; r < MR; ++r) {
            const float a = x[r * xs + k];
            for (int64_t j = 0; j < kNR; ++j) c[r][j] = std::fma(a, wp[k * kNR + j], c[r][j]);
        }
    std::memcpy(acc, c, sizeof c);
#endif
}

// The same for bfloat16 pair-packed weights; x is float32 [MR][xs] with xs >= Kp
// and x[r, k] = 0 for k >= K. Per element the k order is 0, 1, 2, ... as above.
template <int MR>
void tile_bf16(const float* x, int64_t xs, const bf16* wp, int64_t k_pairs, float* acc) {
#if TANDEM_LINEAR_AVX2
    __m256 c0[MR], c1[MR];
    for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t kk = 0; kk < k_pairs; ++kk) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + kk * 32));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + kk * 32 + 16));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));   // k = 2 kk
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        for (int r = 0; r < MR; ++r) {
            const __m256 a = _mm256_broadcast_ss(x + r * xs + 2 * kk);
            c0[r] = _mm256_fmadd_ps(a, e0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, e1, c1[r]);
        }
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));     // k = 2 kk + 1
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi));
        for (int r = 0; r < MR; ++r) {
            const __m256 a = _mm256_broadcast_ss(x + r * xs + 2 * kk + 1);
            c0[r] = _mm256_fmadd_ps(a, o0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, o1, c1[r]);
        }
    }
    for (int r = 0; r < MR; ++r) {
        _mm256_storeu_ps(acc + r * kNR, c0[r]);
        _mm256_storeu_ps(acc + r * kNR + 8, c1[r]);
    }
#else
    float c[MR][kNR] = {};
    for (int64_t kk = 0; kk < k_pairs; ++kk)
        for (int h = 0; h < 2; ++h)
            for (int r = 0; r < MR; ++r) {
                const float a = x[r * xs + 2 * kk + h];
                for (int64_t j = 0; j < kNR; ++j)
                    c[r][j] = std::fma(a, to_float(wp[kk * 32 + j * 2 + h]), c[r][j]);
            }
    std::memcpy(acc, c, sizeof c);
#endif
}

template <typename W>
void tile(int mr, const float* x, int64_t xs, const W* wp, int64_t k_steps, float* acc) {
    // One instantiation per row count, so that a tail tile of 1..5 rows runs the
    // same per-element chain as a full one.
#define TANDEM_TILE_CASE(R)                                                          \
    case R:                                                                          \
        if constexpr (std::is_same_v<W, float>) tile_f32<R>(x, xs, wp, k_steps, acc); \
        else tile_bf16<R>(x, xs, wp, k_steps, acc);                                  \
        break;
    switch (mr) {
        TANDEM_TILE_CASE(1) TANDEM_TILE_CASE(2) TANDEM_TILE_CASE(3)
        TANDEM_TILE_CASE(4) TANDEM_TILE_CASE(5) TANDEM_TILE_CASE(6)
        default: break;
    }
#undef TANDEM_TILE_CASE
}

// out[m, n] for m < M, n < N. `x` is float32 [M][xs]; panels as in the header.
template <typename T, typename W>
void linear(T* out, int64_t out_stride, const float* x, int64_t xs, const W* packed,
            int64_t m_len, int64_t n_len, int64_t panel_elems, int64_t k_steps,
            int num_threads) {
    const int64_t panels = (n_len + kNR - 1) / kNR;
#pragma omp parallel for schedule(static) \
    num_threads(threads_for(m_len * n_len * k_steps, num_threads, 1 << 17))
    for (int64_t p = 0; p < panels; ++p) {
        const W* wp = packed + p * panel_elems;
        const int64_t n0 = p * kNR, cols = std::min(kNR, n_len - n0);
        float acc[kMR * kNR];
        for (int64_t m0 = 0; m0 < m_len; m0 += kMR) {
            const int mr = static_cast<int>(std::min<int64_t>(kMR, m_len - m0));
            tile(mr, x + m0 * xs, xs, wp, k_steps, acc);
            for (int r = 0; r < mr; ++r) {
                T* o = out + (m0 + r) * out_stride + n0;
                for (int64_t j = 0; j < cols; ++j) o[j] = from_float<T>(acc[r * kNR + j]);
            }
        }
    }
}

}  // namespace
}  // namespace tandem_cpu

using namespace tandem_cpu;

extern "C" {

// out [M, N] (row stride out_stride) = x [M, K] (row stride x_stride) W^T, W packed
// float32 [P][K][16].
void tandem_linear_f32(float* out, int64_t out_stride, const float* x, int64_t x_stride,
                       const float* packed, int64_t m, int64_t n, int64_t k, int num_threads) {
    linear<float, float>(out, out_stride, x, x_stride, packed, m, n, k * kNR, k, num_threads);
}

// The same in bfloat16, W packed [P][Kp / 2][16][2]; x is widened to float32 first.
void tandem_linear_bf16(bf16* out, int64_t out_stride, const bf16* x, int64_t x_stride,
                        const bf16* packed, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t kp = k + (k & 1);
    float* x32 = float_scratch(static_cast<size_t>(m * kp));
#pragma omp parallel for schedule(static) num_threads(threads_for(m * k, num_threads, 1 << 15))
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t i = 0; i < k; ++i) x32[r * kp + i] = to_float(x[r * x_stride + i]);
        if (kp != k) x32[r * kp + k] = 0.0f;
    }
    linear<bf16, bf16>(out, out_stride, x32, kp, packed, m, n, kp * kNR, kp / 2, num_threads);
}

}  // extern "C"
