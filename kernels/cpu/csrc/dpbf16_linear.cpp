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
#include "common.h"

#include <omp.h>

#if defined(__AVX512BF16__)
namespace tandem_cpu {
namespace {

template <int MR, int NP>
void dpbf16_tile(bf16* out, int64_t os, const bf16* x, int64_t xs, const bf16* w,
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
        const __mmask16 cols = c0 + 16 <= n ? static_cast<__mmask16>(0xffff)
                                            : static_cast<__mmask16>((1u << (n - c0)) - 1u);
        for (int r = 0; r < MR; ++r)
            _mm256_mask_storeu_epi16(out + r * os + c0, cols, (__m256i)_mm512_cvtneps_pbh(acc[r][p]));
    }
}

template <int NP>
void dpbf16_rows(int mr, bf16* out, int64_t os, const bf16* x, int64_t xs, const bf16* w,
                 int64_t panel, int64_t n0, int64_t n, int64_t k) {
    switch (mr) {
        case 1: dpbf16_tile<1, NP>(out, os, x, xs, w, panel, n0, n, k); break;
        case 2: dpbf16_tile<2, NP>(out, os, x, xs, w, panel, n0, n, k); break;
        case 3: dpbf16_tile<3, NP>(out, os, x, xs, w, panel, n0, n, k); break;
        case 4: dpbf16_tile<4, NP>(out, os, x, xs, w, panel, n0, n, k); break;
        case 5: dpbf16_tile<5, NP>(out, os, x, xs, w, panel, n0, n, k); break;
        default: dpbf16_tile<6, NP>(out, os, x, xs, w, panel, n0, n, k); break;
    }
}

constexpr int kMaxRows = 6;     // MR
constexpr int kPanels = 4;      // NP

void dpbf16_linear(bf16* out, int64_t os, const bf16* x, int64_t xs, const bf16* w, int64_t m,
                   int64_t n, int64_t k, int num_threads) {
    const int64_t panels = (n + 15) / 16, panel = 16 * k;
    const int nt = threads_for(panels, num_threads, 2);
#pragma omp parallel num_threads(nt)
    {
        // The team the runtime gave (it may give fewer threads than asked for).
        const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
        const int64_t p_begin = panels * t / team, p_end = panels * (t + 1) / team;
        for (int64_t p0 = p_begin; p0 < p_end; p0 += kPanels) {
            const int np = static_cast<int>(std::min<int64_t>(kPanels, p_end - p0));
            const bf16* wp = w + p0 * panel;
            for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
                const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
                bf16* o = out + r0 * os;
                const bf16* xr = x + r0 * xs;
                switch (np) {
                    case 1: dpbf16_rows<1>(mr, o, os, xr, xs, wp, panel, 16 * p0, n, k); break;
                    case 2: dpbf16_rows<2>(mr, o, os, xr, xs, wp, panel, 16 * p0, n, k); break;
                    case 3: dpbf16_rows<3>(mr, o, os, xr, xs, wp, panel, 16 * p0, n, k); break;
                    default: dpbf16_rows<4>(mr, o, os, xr, xs, wp, panel, 16 * p0, n, k); break;
                }
            }
        }
    }
}

}  // namespace
}  // namespace tandem_cpu
#endif  // __AVX512BF16__

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
    tandem_cpu::dpbf16_linear(static_cast<tandem_cpu::bf16*>(out), os,
                              static_cast<const tandem_cpu::bf16*>(x), xs,
                              static_cast<const tandem_cpu::bf16*>(w), m, n, k, nt);
#else
    (void)out; (void)os; (void)x; (void)xs; (void)w; (void)m; (void)n; (void)k; (void)nt;
#endif
}
