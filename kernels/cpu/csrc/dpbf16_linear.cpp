// bfloat16 linear layer y = x W^T for decode-sized inputs on AVX-512 BF16 CPUs
// without AMX (vdpbf16ps), for ../linear.py.
//
// The weight is the 16-column panels of amx_linear.cpp (and of the batch-invariant
// kernel's bfloat16 layout, linear.cpp): [P][K/2][16][2], pairs of consecutive k per
// column, rows n >= N zero. One k pair of a panel is 64 bytes, one zmm: vdpbf16ps
// multiplies it by a broadcast pair of x's row and adds both products to the 16
// columns' float32 accumulators. A micro-kernel holds MR rows (<= 6) by NP panels
// (<= 4) of accumulators (up to 24 zmm) and walks K once; the NP panels' weights
// stream in side by side, so a row block reads NP x 64 bytes of weight per k pair
// and issues MR x NP dot products on them. Threads split the panels; each thread
// takes its panels NP at a time and every row block over them (the NP panels, up
// to 72 KiB at K = 576, stay in L2 between row blocks). Results rounded to
// bfloat16 (nearest even) once, at the store.
//
// At decode sizes (1 to a few dozen rows) a linear layer's time is reading its
// weight; oneDNN's bfloat16 matmul read SmolLM2-135M's layer weights at 14-21 GB/s
// here at 1-16 rows (benchmarks/amx_linear.py).
//
// The same driver multiplies float32 on any AVX-512F CPU (tandem_avx512_f32_linear):
// the float32 panels of linear.cpp, [P][K][16], one k of a panel one zmm, a
// broadcast x element times it added by vfmadd231ps. Each output is then the
// batch-invariant kernel's FMA chain over k in order, bit for bit. oneDNN's packed
// float32 matmul read the same layers at 21 GB/s at 1-4 rows and reached ~110
// GFLOP/s at 16 (the AMD EPYC of benchmarks/README.md).
#include "common.h"

#include <omp.h>

#if defined(__AVX512F__)
namespace tandem_cpu {
namespace {

// The columns of a 16-column panel starting at c0 that exist (n columns in all).
inline __mmask16 column_mask(int64_t c0, int64_t n) {
    return c0 + 16 <= n ? static_cast<__mmask16>(0xffff)
                        : static_cast<__mmask16>((1u << (n - c0)) - 1u);
}

#if defined(__AVX512BF16__)
// bfloat16: acc[r][p] += the 16 columns' pairs of panel p times row r's pair, per k pair.
struct Dpbf16 {
    using T = bf16;
    template <int MR, int NP>
    static void tile(bf16* out, int64_t os, const bf16* x, int64_t xs, const bf16* w,
                     int64_t panel, int64_t n0, int64_t n, int64_t k) {
        __m512 acc[MR][NP];
        for (int r = 0; r < MR; ++r)
            for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
        const int64_t pairs = k / 2;
        for (int64_t kp = 0; kp < pairs; ++kp) {
            __m512bh wv[NP];
            for (int p = 0; p < NP; ++p)
                wv[p] = (__m512bh)_mm512_loadu_si512(w + p * panel + 32 * kp);
            for (int r = 0; r < MR; ++r) {
                uint32_t pair;
                std::memcpy(&pair, x + r * xs + 2 * kp, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
                for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], wv[p], xv);
            }
        }
        for (int p = 0; p < NP; ++p) {
            const int64_t c0 = n0 + 16 * p;
            if (c0 >= n) break;
            const __mmask16 cols = column_mask(c0, n);
            for (int r = 0; r < MR; ++r)
                _mm256_mask_storeu_epi16(out + r * os + c0, cols,
                                         (__m256i)_mm512_cvtneps_pbh(acc[r][p]));
        }
    }
};
#endif  // __AVX512BF16__

// float32: acc[r][p] = fma(x[r][k], the 16 columns of panel p at k, acc[r][p]), k in
// order from 0: each output the batch-invariant kernel's FMA chain (linear.cpp), so
// the same bits.
struct FmaF32 {
    using T = float;
    template <int MR, int NP>
    static void tile(float* out, int64_t os, const float* x, int64_t xs, const float* w,
                     int64_t panel, int64_t n0, int64_t n, int64_t k) {
        __m512 acc[MR][NP];
        for (int r = 0; r < MR; ++r)
            for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
        for (int64_t kk = 0; kk < k; ++kk) {
            __m512 wv[NP];
            for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_ps(w + p * panel + 16 * kk);
            for (int r = 0; r < MR; ++r) {
                const __m512 xv = _mm512_set1_ps(x[r * xs + kk]);
                for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
            }
        }
        for (int p = 0; p < NP; ++p) {
            const int64_t c0 = n0 + 16 * p;
            if (c0 >= n) break;
            const __mmask16 cols = column_mask(c0, n);
            for (int r = 0; r < MR; ++r)
                _mm512_mask_storeu_ps(out + r * os + c0, cols, acc[r][p]);
        }
    }
};

template <class Kernel, int NP>
void panel_rows(int mr, typename Kernel::T* out, int64_t os, const typename Kernel::T* x,
                int64_t xs, const typename Kernel::T* w, int64_t panel, int64_t n0, int64_t n,
                int64_t k) {
    switch (mr) {
        case 1: Kernel::template tile<1, NP>(out, os, x, xs, w, panel, n0, n, k); break;
        case 2: Kernel::template tile<2, NP>(out, os, x, xs, w, panel, n0, n, k); break;
        case 3: Kernel::template tile<3, NP>(out, os, x, xs, w, panel, n0, n, k); break;
        case 4: Kernel::template tile<4, NP>(out, os, x, xs, w, panel, n0, n, k); break;
        case 5: Kernel::template tile<5, NP>(out, os, x, xs, w, panel, n0, n, k); break;
        default: Kernel::template tile<6, NP>(out, os, x, xs, w, panel, n0, n, k); break;
    }
}

constexpr int kMaxRows = 6;     // MR
constexpr int kPanels = 4;      // NP

// out[m, n] = x[m, k] W^T over the 16-column panels (16 * k elements each).
template <class Kernel>
void panel_linear(typename Kernel::T* out, int64_t os, const typename Kernel::T* x, int64_t xs,
                  const typename Kernel::T* w, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t panels = (n + 15) / 16, panel = 16 * k;
    const int nt = threads_for(panels, num_threads, 2);
#pragma omp parallel num_threads(nt)
    {
        // The team the runtime gave (it may give fewer threads than asked for).
        const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
        const int64_t p_begin = panels * t / team, p_end = panels * (t + 1) / team;
        for (int64_t p0 = p_begin; p0 < p_end; p0 += kPanels) {
            const int np = static_cast<int>(std::min<int64_t>(kPanels, p_end - p0));
            const auto* wp = w + p0 * panel;
            for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
                const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
                auto* o = out + r0 * os;
                const auto* xr = x + r0 * xs;
                const int64_t n0 = 16 * p0;
                switch (np) {
                    case 1: panel_rows<Kernel, 1>(mr, o, os, xr, xs, wp, panel, n0, n, k); break;
                    case 2: panel_rows<Kernel, 2>(mr, o, os, xr, xs, wp, panel, n0, n, k); break;
                    case 3: panel_rows<Kernel, 3>(mr, o, os, xr, xs, wp, panel, n0, n, k); break;
                    default: panel_rows<Kernel, 4>(mr, o, os, xr, xs, wp, panel, n0, n, k); break;
                }
            }
        }
    }
}

}  // namespace
}  // namespace tandem_cpu
#endif  // __AVX512F__

// 1 when this build has tandem_dpbf16_linear_bf16 (AVX-512 BF16) and in_features k
// is even (whole pairs), else 0.
extern "C" int tandem_dpbf16_linear_usable(int64_t k) {
#if defined(__AVX512BF16__)
    return k > 0 && k % 2 == 0 ? 1 : 0;
#else
    (void)k;
    return 0;
#endif
}

// out[m, n] (row stride os) = x[m, k] (row stride xs) W^T, W packed as above;
// call only where tandem_dpbf16_linear_usable(k).
extern "C" void tandem_dpbf16_linear_bf16(void* out, int64_t os, const void* x, int64_t xs,
                                          const void* w, int64_t m, int64_t n, int64_t k, int nt) {
#if defined(__AVX512BF16__)
    tandem_cpu::panel_linear<tandem_cpu::Dpbf16>(static_cast<tandem_cpu::bf16*>(out), os,
                                                 static_cast<const tandem_cpu::bf16*>(x), xs,
                                                 static_cast<const tandem_cpu::bf16*>(w), m, n,
                                                 k, nt);
#else
    (void)out; (void)os; (void)x; (void)xs; (void)w; (void)m; (void)n; (void)k; (void)nt;
#endif
}

// 1 when this build has tandem_avx512_f32_linear_f32 (AVX-512F) and k > 0, else 0.
extern "C" int tandem_avx512_f32_linear_usable(int64_t k) {
#if defined(__AVX512F__)
    return k > 0 ? 1 : 0;
#else
    (void)k;
    return 0;
#endif
}

// float32 out[m, n] (row stride os) = x[m, k] (row stride xs) W^T, W in the float32
// panels [P][K][16] of linear.cpp; call only where tandem_avx512_f32_linear_usable(k).
extern "C" void tandem_avx512_f32_linear_f32(void* out, int64_t os, const void* x, int64_t xs,
                                             const void* w, int64_t m, int64_t n, int64_t k,
                                             int nt) {
#if defined(__AVX512F__)
    tandem_cpu::panel_linear<tandem_cpu::FmaF32>(static_cast<float*>(out), os,
                                                 static_cast<const float*>(x), xs,
                                                 static_cast<const float*>(w), m, n, k, nt);
#else
    (void)out; (void)os; (void)x; (void)xs; (void)w; (void)m; (void)n; (void)k; (void)nt;
#endif
}
