// bfloat16 linear layer y = x W^T on AMX tiles (TDPBF16PS), for ../linear.py.
//
// The weight is packed once at load into panels of 16 output columns, pairs of
// consecutive k interleaved: [P][K/2][16][2], element (n, k) at
// (n / 16) * K * 16 + (k / 2) * 32 + (n % 16) * 2 + k % 2, rows n >= N zero (the
// batch-invariant kernel's bfloat16 layout, csrc/linear.cpp). 16 k-pair rows of a
// panel, 1 KiB contiguous, are exactly one B tile (16 rows x 64 bytes), so the
// kernel reads the weight as it lies, front to back, in 1 KiB tiles. A tiles are
// 16 rows of x (32 bfloat16 each, x's own row stride); C tiles 16 x 16 float32.
// Each thread takes whole pairs of panels (32 output columns) and, for every two
// row tiles of x, walks K with four C tiles (2 row tiles x 2 panels) in flight;
// a last partial row tile is read from a zero-padded copy. Results rounded to
// bfloat16 (nearest even) once, at the store.
//
// At decode sizes (a few to 64 rows) a linear layer's time is reading its weight;
// this reads each panel pair once per two row tiles, sequentially, with nothing
// else per call than a tile configuration per thread. Prompt-sized inputs (up to
// AMX_LINEAR_MAX_ROWS in ../linear.py) are taken 512 rows a pass (kRowChunk).
#include "common.h"

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace tandem_cpu {
namespace {

// How far ahead the weight is prefetched, in k steps of 32 (1 KiB per panel): 4 and
// 8 measured alike, none read 12-13 instead of 20-24 GB/s (benchmarks/amx_linear.py).
constexpr int64_t kAheadSteps = 4;

// Palette 1: tmm0-3 C (row tile r, panel p at 2r + p), tmm4-5 A, tmm6-7 B; all 16
// rows of 64 bytes.
struct alignas(64) LinearTiles {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// The first `rows` rows of a stored C tile (16 x 16 float32 in `buf`) -> bfloat16
// columns [n0, n0 + 16) of out's rows, those below n.
inline void store_tile(bf16* out, int64_t os, const float* buf, int64_t rows, int64_t n0,
                       int64_t n) {
    if (n0 >= n) return;
    const __mmask16 cols = n0 + 16 <= n ? static_cast<__mmask16>(0xffff)
                                        : static_cast<__mmask16>((1u << (n - n0)) - 1u);
    for (int64_t r = 0; r < rows; ++r)
        _mm256_mask_storeu_epi16(out + r * os + n0, cols,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(buf + 16 * r)));
}

void amx_linear_rows(bf16* out, int64_t os, const bf16* x, int64_t xs, const bf16* w, int64_t m,
                     int64_t n, int64_t k, int num_threads) {
    const int64_t panels = (n + 15) / 16, pairs = (panels + 1) / 2, steps = k / 32;
    const int64_t panel = 16 * k;                 // elements of one panel
    const int64_t tiles = (m + 15) / 16, tail = m % 16;
    const bf16* w_end = w + panels * panel;
    std::vector<bf16> pad;
    if (tail) {   // the last row tile, zero-padded to 16 rows
        pad.assign(static_cast<size_t>(16 * k), 0);
        for (int64_t r = 0; r < tail; ++r)
            std::memcpy(pad.data() + r * k, x + (m - tail + r) * xs, sizeof(bf16) * k);
    }
    auto rows_of = [&](int64_t t, int64_t& stride) -> const bf16* {
        if (tail && t == tiles - 1) { stride = k; return pad.data(); }
        stride = xs;
        return x + 16 * t * xs;
    };
    const int nt = threads_for(pairs, num_threads, 1);
#pragma omp parallel num_threads(nt)
    {
        static const LinearTiles config;
        _tile_loadconfig(&config);
        alignas(64) float buf[16 * 16];
#pragma omp for schedule(static)
        for (int64_t pp = 0; pp < pairs; ++pp) {
            const bf16* b0 = w + 2 * pp * panel;
            const bool two_panels = 2 * pp + 1 < panels;
            const bf16* b1 = two_panels ? b0 + panel : b0;
            for (int64_t t = 0; t < tiles; t += 2) {
                const bool two_tiles = t + 1 < tiles;
                int64_t s0 = 0, s1 = 0;
                const bf16* a0 = rows_of(t, s0);
                const bf16* a1 = two_tiles ? rows_of(t + 1, s1) : a0;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t s = 0; s < steps; ++s) {
                    if (t == 0) {   // the weight kAheadSteps steps on (into the next pair)
                        const bf16* p0 = b0 + 512 * (s + kAheadSteps);
                        const bf16* p1 = b1 + 512 * (s + kAheadSteps);
                        for (int l = 0; l < 16; ++l) {
                            if (p0 + 32 * l < w_end) _mm_prefetch(reinterpret_cast<const char*>(p0 + 32 * l), _MM_HINT_T1);
                            if (p1 + 32 * l < w_end) _mm_prefetch(reinterpret_cast<const char*>(p1 + 32 * l), _MM_HINT_T1);
                        }
                    }
                    _tile_loadd(6, b0 + 512 * s, 64);
                    _tile_loadd(7, b1 + 512 * s, 64);
                    _tile_loadd(4, a0 + 32 * s, 2 * s0);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two_tiles) {
                        _tile_loadd(5, a1 + 32 * s, 2 * s1);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                const int64_t r0 = 16 * t;
                const int64_t rows0 = std::min<int64_t>(16, m - r0);
                _tile_stored(0, buf, 64);
                store_tile(out + r0 * os, os, buf, rows0, 32 * pp, n);
                if (two_panels) {
                    _tile_stored(1, buf, 64);
                    store_tile(out + r0 * os, os, buf, rows0, 32 * pp + 16, n);
                }
                if (two_tiles) {
                    const int64_t rows1 = std::min<int64_t>(16, m - r0 - 16);
                    _tile_stored(2, buf, 64);
                    store_tile(out + (r0 + 16) * os, os, buf, rows1, 32 * pp, n);
                    if (two_panels) {
                        _tile_stored(3, buf, 64);
                        store_tile(out + (r0 + 16) * os, os, buf, rows1, 32 * pp + 16, n);
                    }
                }
            }
        }
        _tile_release();
    }
}

// Rows a call multiplies at a time: every panel pair walks all of them, and past
// ~512 (576 KiB of x at k = 576) they no longer stay in L2 beside the weight
// streaming through (2048 rows at once: 287 ms for SmolLM2-135M's 30 layers, by
// 512: 181; benchmarks/amx_linear.py).
constexpr int64_t kRowChunk = 512;

void amx_linear(bf16* out, int64_t os, const bf16* x, int64_t xs, const bf16* w, int64_t m,
                int64_t n, int64_t k, int num_threads) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowChunk)
        amx_linear_rows(out + r0 * os, os, x + r0 * xs, xs, w, std::min(kRowChunk, m - r0), n, k,
                        num_threads);
}

}  // namespace
}  // namespace tandem_cpu
#endif  // AMX

// 1 when this process may run tandem_amx_linear_bf16 for in_features k: the build
// has AMX-BF16, k % 32 == 0, and the OS granted tile state.
extern "C" int tandem_amx_linear_usable(int64_t k) {
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return k > 0 && k % 32 == 0 && tandem_cpu::amx_permitted() ? 1 : 0;
#else
    (void)k;
    return 0;
#endif
}

// out[m, n] (row stride os) = x[m, k] (row stride xs) W^T, W packed as above;
// call only where tandem_amx_linear_usable(k).
extern "C" void tandem_amx_linear_bf16(void* out, int64_t os, const void* x, int64_t xs,
                                       const void* w, int64_t m, int64_t n, int64_t k, int nt) {
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    tandem_cpu::amx_linear(static_cast<tandem_cpu::bf16*>(out), os,
                           static_cast<const tandem_cpu::bf16*>(x), xs,
                           static_cast<const tandem_cpu::bf16*>(w), m, n, k, nt);
#else
    (void)out; (void)os; (void)x; (void)xs; (void)w; (void)m; (void)n; (void)k; (void)nt;
#endif
}
