// Causal prefill attention over paged KV: a FlashAttention-2 loop (Dao 2023, Alg. 1)
// over K/V repacked per KV head into 16-token tiles; bfloat16 on AVX-512 BF16 CPUs
// (vdpbf16ps on bf16-pair tiles), float32 on AVX-512F CPUs (FMAs on key-transposed
// tiles). C ABI for ../ops.py.

#include "common.h"

namespace tandem_cpu {
namespace {

#if defined(__AVX512F__)
constexpr int64_t kTile = 16;      // key tokens per tile (one zmm of float32 scores)
constexpr int64_t kQueryTile = 32; // query positions per task

// One query row's online-softmax step (FlashAttention-2) over a tile of 16 raw
// scores `s`: keys after position `pos` masked, the rest scaled; the row's running
// max `m` and sum `l` updated. Returns the tile's probabilities (against the new
// max) and sets `corr`, the factor the row's accumulators are rescaled by.
inline __m512 softmax_tile(__m512 s, int64_t pos, int64_t tile, float scale, float& m, float& l,
                           float& corr) {
    const int64_t valid = pos - tile * kTile + 1;     // keys <= pos in this tile
    const __mmask16 keep = valid >= kTile ? 0xFFFF
                         : valid <= 0 ? 0 : static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 sr = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-1e30f),
                                           _mm512_mul_ps(s, _mm512_set1_ps(scale)));
    const float m_new = std::max(m, _mm512_reduce_max_ps(sr));
    const __m512 p = exp512(_mm512_sub_ps(sr, _mm512_set1_ps(m_new)));
    corr = fast_exp(m - m_new);
    l = l * corr + _mm512_reduce_add_ps(p);
    m = m_new;
    return p;
}

// Mask the raw scores of a 32-key step, keys 0-15 in `s0` and 16-31 in `s1`, to
// -1e30 from key `valid` on (the keys after the row's position; none when `valid`
// >= 32).
inline void mask_scores32(__m512& s0, __m512& s1, int64_t valid) {
    if (valid >= 32) return;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i v = _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(valid, 0)));
    s0 = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(lane, v), _mm512_set1_ps(-1e30f), s0);
    s1 = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), v),
                              _mm512_set1_ps(-1e30f), s1);
}
#endif

#if defined(__AVX512BF16__)
constexpr int kRows = 8;           // query rows processed together (2, 4, 6, 8, 12, 16 measured: 8 best)

// Repack one (sequence, KV head) context into the pair-interleaved ("VNNI") layouts
// that vdpbf16ps consumes, tiles of 16 tokens, zero past the context:
//   kt[tile][c][j]  = (K[16 tile + j][2c], K[16 tile + j][2c + 1])     (uint32 pairs)
//   vt[tile][p][d]  = (V[16 tile + 2p][d], V[16 tile + 2p + 1][d])
void repack_kv(const bf16* kc, const bf16* vc, const int32_t* table, int64_t len, int64_t h,
               int64_t hkv, int64_t d, int64_t bs, uint32_t* kt, uint32_t* vt) {
    const int64_t row = hkv * d, half = d / 2;
    const int64_t ntiles = (len + kTile - 1) / kTile;
    std::memset(kt, 0, sizeof(uint32_t) * ntiles * half * kTile);
    std::memset(vt, 0, sizeof(uint32_t) * ntiles * half * kTile);
    uint16_t* v16 = reinterpret_cast<uint16_t*>(vt);
    for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(table[t / bs]) * bs + t % bs;
        const uint32_t* k32 = reinterpret_cast<const uint32_t*>(kc + slot * row + h * d);
        const bf16* vrow = vc + slot * row + h * d;
        const int64_t tile = t / kTile, j = t % kTile;
        uint32_t* kdst = kt + tile * half * kTile + j;
        for (int64_t c = 0; c < half; ++c) kdst[c * kTile] = k32[c];
        uint16_t* vdst = v16 + 2 * (tile * half * kTile + (j / 2) * d) + (j % 2);
        for (int64_t i = 0; i < d; ++i) vdst[2 * i] = vrow[i];
    }
}

// Causal attention of kRows consecutive query positions pos[0..kRows) of one query
// head over the repacked context, flash-attention style (FlashAttention-2, Dao 2023,
// Alg. 1): per 16-token tile the scores come from vdpbf16ps on the pair layout, an
// online softmax rescales the float32 accumulators, and P (rounded to bf16) times V
// is again vdpbf16ps. `q[r]` points at the D elements of row r; rows whose pos is
// negative are padding and are not stored. CT: head_dim / 16 fixed at compile time
// (0: the runtime d / 16); fixed, the loops unroll and the accumulators are
// registers and not a stack array (the same operations in the same order).
template <int CT = 0>
void prefill_rows(const bf16* const* q, const int64_t* pos, bf16* const* out, const uint32_t* kt,
                  const uint32_t* vt, int64_t d_rt, float scale) {
    const int64_t d = CT ? 16 * CT : d_rt, half = d / 2, chunks = d / 16;
    int64_t last = 0;
    for (int r = 0; r < kRows; ++r) last = pos[r] > last ? pos[r] : last;
    float m[kRows], l[kRows];
    __m512 acc[kRows][CT ? CT : kMaxChunks];
    for (int r = 0; r < kRows; ++r) {
        m[r] = -1e30f;
        l[r] = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    alignas(64) uint32_t pp[kRows][kTile / 2];
    const int64_t ntiles = last / kTile + 1;
    for (int64_t tile = 0; tile < ntiles; ++tile) {
        const uint32_t* ktile = kt + tile * half * kTile;
        __m512 s[kRows];
        for (int r = 0; r < kRows; ++r) s[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < half; ++c) {
            const __m512bh kv = (__m512bh)_mm512_load_si512(ktile + c * kTile);
            for (int r = 0; r < kRows; ++r) {
                uint32_t qpair;
                std::memcpy(&qpair, q[r] + 2 * c, sizeof qpair);
                s[r] = _mm512_dpbf16_ps(s[r], kv, (__m512bh)_mm512_set1_epi32(static_cast<int>(qpair)));
            }
        }
        for (int r = 0; r < kRows; ++r) {
            float corr;
            const __m512 p = softmax_tile(s[r], pos[r], tile, scale, m[r], l[r], corr);
            const __m512 cv = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < chunks; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], cv);
            _mm256_store_si256(reinterpret_cast<__m256i*>(pp[r]), (__m256i)_mm512_cvtneps_pbh(p));
        }
        const uint32_t* vtile = vt + tile * half * kTile;
        for (int64_t jp = 0; jp < kTile / 2; ++jp) {
            for (int64_t c = 0; c < chunks; ++c) {
                const __m512bh vv = (__m512bh)_mm512_load_si512(vtile + jp * d + 16 * c);
                for (int r = 0; r < kRows; ++r)
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv,
                                                 (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r][jp])));
            }
        }
    }
    alignas(64) float tmp[16];
    for (int r = 0; r < kRows; ++r) {
        if (pos[r] < 0 || out[r] == nullptr) continue;
        const float inv = 1.0f / l[r];
        for (int64_t c = 0; c < chunks; ++c) {
            _mm512_store_ps(tmp, acc[r][c]);
            for (int i = 0; i < 16; ++i) out[r][16 * c + i] = from_float<bf16>(tmp[i] * inv);
        }
    }
}

// The bfloat16 kernel as the driver below uses it.
struct Bf16Prefill {
    using T = bf16;
    static constexpr int rows = kRows;
    static constexpr int64_t key_block = kTile;
    // uint32 words of one tile of K (and of V) of one KV head.
    static int64_t tile_words(int64_t d) { return (d / 2) * kTile; }
    static void repack(const bf16* kc, const bf16* vc, const int32_t* table, int64_t len,
                       int64_t h, int64_t hkv, int64_t d, int64_t bs, uint32_t* kt, uint32_t* vt) {
        repack_kv(kc, vc, table, len, h, hkv, d, bs, kt, vt);
    }
    static void run(const bf16* const* q, const int64_t* pos, bf16* const* out, const uint32_t* kt,
                    const uint32_t* vt, int64_t d, float scale) {
        if (d == 64)
            prefill_rows<4>(q, pos, out, kt, vt, d, scale);
        else if (d == 128)
            prefill_rows<8>(q, pos, out, kt, vt, d, scale);
        else
            prefill_rows(q, pos, out, kt, vt, d, scale);
    }
};
#endif  // __AVX512BF16__

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The same FlashAttention-2 loop with its two products on AMX tiles (tdpbf16ps: a
// 16 x 16 float32 tile += a 16 x 32 bf16 tile times a 32 x 16 bf16 tile in pairs),
// 16 query rows by 32 keys per step; the online softmax and the rescaled float32
// accumulators stay on AVX-512. The B operands are the repacked pair layouts of
// repack_kv as they lie: K's tile rows are channel pairs across 16 keys, V's are key
// pairs across the channels. The tiles do the dot products an order of magnitude
// faster than vdpbf16ps, so the softmax sets the pace.
constexpr int kAmxRows = 16;       // query rows per tile

// exp(x) of 16 lanes for x <= 0 (scores minus their running max), as 2^(x log2 e):
// 2^f of the fraction by its degree-5 Taylor polynomial (relative error < 3e-6, far
// below the bf16 rounding P gets next), 2^n by scalef, which also takes a masked
// -1e30 to 0. Nine instructions against exp512's thirteen: with the products on
// AMX tiles, the exps of the softmax are most of the kernel's time.
inline __m512 exp512_nonpositive(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);                       // [-0.5, 0.5]
    __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);          // ln2^5 / 5!
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));   // ln2^4 / 4!
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));   // ln2^3 / 3!
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910072f));    // ln2^2 / 2
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));     // ln2
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
constexpr int64_t kAmxKeys = 32;   // keys per step: two 16-key tiles of repack_kv

// Palette 1, every tile used as 16 rows of 64 bytes: tmm0-1 the scores of 32 keys,
// tmm2 a query block, tmm4-5 K tiles (later tmm4 a P.V product), tmm6 P, tmm7 V.
struct alignas(64) AmxConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// kAmxRows query rows of one head (see prefill_rows; `d` % 32 == 0, <= 256).
void prefill_rows_amx(const bf16* const* q, const int64_t* pos, bf16* const* out,
                      const uint32_t* kt, const uint32_t* vt, int64_t d, float scale) {
    constexpr int R = kAmxRows;
    const int64_t half = d / 2, tile_words = half * kTile;
    int64_t last = 0;
    for (int r = 0; r < R; ++r) last = pos[r] > last ? pos[r] : last;
    alignas(64) bf16 qbuf[R * 256];
    alignas(64) float acc[R * 256];
    alignas(64) float sbuf[R][kAmxKeys];
    alignas(64) bf16 pbuf[R][kAmxKeys];
    alignas(64) float pv[R][16];
    float m[R], l[R], corr[R];
    for (int r = 0; r < R; ++r) {
        std::memcpy(qbuf + r * d, q[r], sizeof(bf16) * d);
        m[r] = -1e30f;
        l[r] = 0.0f;
    }
    std::memset(acc, 0, sizeof(float) * R * d);
    static const AmxConfig config;
    _tile_loadconfig(&config);
    const int64_t steps = last / kAmxKeys + 1;
    for (int64_t step = 0; step < steps; ++step) {
        const uint32_t* k0 = kt + 2 * step * tile_words;      // keys 32 step .. + 15
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t dc = 0; dc < d / 32; ++dc) {             // 16 channel pairs at a time
            _tile_loadd(2, qbuf + 32 * dc, 2 * d);
            _tile_loadd(4, k0 + 16 * kTile * dc, 64);
            _tile_loadd(5, k0 + tile_words + 16 * kTile * dc, 64);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(1, 2, 5);
        }
        _tile_stored(0, &sbuf[0][0], sizeof(float) * kAmxKeys);
        _tile_stored(1, &sbuf[0][16], sizeof(float) * kAmxKeys);
        // The online softmax over the 32 keys at once (one max and one sum per row).
        const int64_t k0pos = step * kAmxKeys;
        const __m512 vscale = _mm512_set1_ps(scale);
        for (int r = 0; r < R; ++r) {
            __m512 s0 = _mm512_mul_ps(_mm512_load_ps(&sbuf[r][0]), vscale);
            __m512 s1 = _mm512_mul_ps(_mm512_load_ps(&sbuf[r][16]), vscale);
            mask_scores32(s0, s1, pos[r] - k0pos + 1);             // keys <= pos in this step
            const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
            const __m512 mv = _mm512_set1_ps(m_new);
            const __m512 p0 = exp512_nonpositive(_mm512_sub_ps(s0, mv));
            const __m512 p1 = exp512_nonpositive(_mm512_sub_ps(s1, mv));
            corr[r] = fast_exp(m[r] - m_new);
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
            m[r] = m_new;
            _mm512_store_si512(&pbuf[r][0], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        _tile_loadd(6, &pbuf[0][0], sizeof(bf16) * kAmxKeys);
        const uint32_t* v0 = vt + 2 * step * tile_words;      // 16 key pairs, rows of d pairs
        for (int64_t c = 0; c < d / 16; ++c) {
            _tile_zero(4);
            _tile_loadd(7, v0 + 16 * c, 4 * d);
            _tile_dpbf16ps(4, 6, 7);
            _tile_stored(4, &pv[0][0], 64);
            for (int r = 0; r < R; ++r) {
                float* a = acc + r * d + 16 * c;
                _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), _mm512_set1_ps(corr[r]),
                                                   _mm512_load_ps(&pv[r][0])));
            }
        }
    }
    _tile_release();
    for (int r = 0; r < R; ++r) {
        if (pos[r] < 0 || out[r] == nullptr) continue;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int64_t c = 0; c < d / 16; ++c)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + 16 * c),
                                to_bf16x16(_mm512_mul_ps(_mm512_load_ps(acc + r * d + 16 * c), inv)));
    }
}

// The AMX kernel as the driver uses it: Bf16Prefill's layouts, the repacked context
// padded with zeros to whole 32-key steps.
struct AmxPrefill : Bf16Prefill {
    static constexpr int rows = kAmxRows;
    static constexpr int64_t key_block = kAmxKeys;
    static void repack(const bf16* kc, const bf16* vc, const int32_t* table, int64_t len,
                       int64_t h, int64_t hkv, int64_t d, int64_t bs, uint32_t* kt, uint32_t* vt) {
        const int64_t words = (len + kAmxKeys - 1) / kAmxKeys * 2 * tile_words(d);
        std::memset(kt, 0, sizeof(uint32_t) * words);
        std::memset(vt, 0, sizeof(uint32_t) * words);
        repack_kv(kc, vc, table, len, h, hkv, d, bs, kt, vt);
    }
    static void run(const bf16* const* q, const int64_t* pos, bf16* const* out, const uint32_t* kt,
                    const uint32_t* vt, int64_t d, float scale) {
        prefill_rows_amx(q, pos, out, kt, vt, d, scale);
    }
    // Whether this process may run it for head size d.
    static bool usable(int64_t d) { return d % 32 == 0 && d <= 256 && amx_permitted(); }
};
#endif  // AMX

#if defined(__AVX512F__)
constexpr int kRowsF32 = 4;        // query rows processed together in float32

// Repack one (sequence, KV head) context for the float32 kernel, tiles of 16 tokens,
// zero past the context up to a whole 32-key step of prefill_rows_f32:
// kt[tile][c][j] = K[16 tile + j][c] (each channel's 16 keys in one vector),
// vt[tile][j][c] = V[16 tile + j][c] (the rows, gathered).
void repack_kv_f32(const float* kc, const float* vc, const int32_t* table, int64_t len,
                   int64_t h, int64_t hkv, int64_t d, int64_t bs, float* kt, float* vt) {
    const int64_t row = hkv * d;
    const int64_t ntiles = (len + 2 * kTile - 1) / (2 * kTile) * 2;
    std::memset(kt, 0, sizeof(float) * ntiles * d * kTile);
    std::memset(vt, 0, sizeof(float) * ntiles * d * kTile);
    for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(table[t / bs]) * bs + t % bs;
        const float* krow = kc + slot * row + h * d;
        const int64_t tile = t / kTile, j = t % kTile;
        float* kdst = kt + tile * d * kTile + j;
        for (int64_t c = 0; c < d; ++c) kdst[c * kTile] = krow[c];
        std::memcpy(vt + (tile * kTile + j) * d, vc + slot * row + h * d, sizeof(float) * d);
    }
}

// float32 version of prefill_rows: kRowsF32 query rows of one head over the
// repacked context, 32 keys (two tiles) per step: the scores by an FMA per channel
// and tile (eight independent accumulators, two K vectors per broadcast query
// element: the FMA units, not their latency or the loads, set the pace), one online
// softmax over the 32 keys (one max and one sum per row, one rescale of the
// accumulators), then P.V by an FMA per key and 16 channels. The context is
// zero-padded to whole steps (F32Prefill::repack). CT: head_dim / 16 fixed at
// compile time (0: runtime).
template <int CT = 0>
void prefill_rows_f32(const float* const* q, const int64_t* pos, float* const* out,
                      const float* kt, const float* vt, int64_t d_rt, float scale) {
    constexpr int R = kRowsF32;
    constexpr int64_t kKeys = 2 * kTile;
    const int64_t d = CT ? 16 * CT : d_rt, chunks = d / 16, tile_floats = d * kTile;
    int64_t last = 0;
    for (int r = 0; r < R; ++r) last = pos[r] > last ? pos[r] : last;
    float m[R], l[R];
    __m512 acc[R][CT ? CT : kMaxChunks];
    for (int r = 0; r < R; ++r) {
        m[r] = -1e30f;
        l[r] = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    alignas(64) float pp[R][kKeys];
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t steps = last / kKeys + 1;
    for (int64_t step = 0; step < steps; ++step) {
        const float* k0 = kt + 2 * step * tile_floats;
        const float* k1 = k0 + tile_floats;
        const int64_t first = step * kKeys;
        // The rows' last step may end inside its first tile: the second is then all
        // masked (its probabilities 0) and is neither multiplied nor summed.
        const bool both = last >= first + kTile;
        __m512 s0[R], s1[R];
        for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
        if (both) {
            for (int64_t c = 0; c < d; ++c) {
                const __m512 kv0 = _mm512_load_ps(k0 + c * kTile);
                const __m512 kv1 = _mm512_load_ps(k1 + c * kTile);
                for (int r = 0; r < R; ++r) {
                    const __m512 qb = _mm512_set1_ps(q[r][c]);
                    s0[r] = _mm512_fmadd_ps(qb, kv0, s0[r]);
                    s1[r] = _mm512_fmadd_ps(qb, kv1, s1[r]);
                }
            }
        } else {
            for (int64_t c = 0; c < d; ++c) {
                const __m512 kv0 = _mm512_load_ps(k0 + c * kTile);
                for (int r = 0; r < R; ++r) s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][c]), kv0, s0[r]);
            }
        }
        for (int r = 0; r < R; ++r) {
            __m512 a = _mm512_mul_ps(s0[r], vscale), b = _mm512_mul_ps(s1[r], vscale);
            mask_scores32(a, b, pos[r] - first + 1);            // keys <= pos in this step
            const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(a, b)));
            const __m512 mv = _mm512_set1_ps(m_new);
            const __m512 p0 = exp512(_mm512_sub_ps(a, mv));
            const __m512 p1 = exp512(_mm512_sub_ps(b, mv));
            if (m_new != m[r]) {     // else the factor is fast_exp(0) = 1 exactly: skipped
                const float corr = fast_exp(m[r] - m_new);
                l[r] *= corr;
                const __m512 cv = _mm512_set1_ps(corr);
                for (int64_t c = 0; c < chunks; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], cv);
                m[r] = m_new;
            }
            l[r] += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
            _mm512_store_ps(&pp[r][0], p0);
            _mm512_store_ps(&pp[r][16], p1);
        }
        const float* vstep = vt + 2 * step * tile_floats;
        for (int64_t j = 0; j < (both ? kKeys : kTile); ++j) {
            __m512 pb[R];
            for (int r = 0; r < R; ++r) pb[r] = _mm512_set1_ps(pp[r][j]);
            for (int64_t c = 0; c < chunks; ++c) {
                const __m512 vv = _mm512_load_ps(vstep + j * d + 16 * c);
                for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(pb[r], vv, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        if (pos[r] < 0 || out[r] == nullptr) continue;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int64_t c = 0; c < chunks; ++c)
            _mm512_storeu_ps(out[r] + 16 * c, _mm512_mul_ps(acc[r][c], inv));
    }
}

// The float32 kernel as the driver below uses it (float tiles, counted in 4-byte words).
struct F32Prefill {
    using T = float;
    static constexpr int rows = kRowsF32;
    static constexpr int64_t key_block = 2 * kTile;   // keys per step of prefill_rows_f32
    static int64_t tile_words(int64_t d) { return d * kTile; }
    static void repack(const float* kc, const float* vc, const int32_t* table, int64_t len,
                       int64_t h, int64_t hkv, int64_t d, int64_t bs, uint32_t* kt, uint32_t* vt) {
        repack_kv_f32(kc, vc, table, len, h, hkv, d, bs, reinterpret_cast<float*>(kt),
                      reinterpret_cast<float*>(vt));
    }
    static void run(const float* const* q, const int64_t* pos, float* const* out,
                    const uint32_t* kt, const uint32_t* vt, int64_t d, float scale) {
        const float* k = reinterpret_cast<const float*>(kt);
        const float* v = reinterpret_cast<const float*>(vt);
        if (d == 64)
            prefill_rows_f32<4>(q, pos, out, k, v, d, scale);
        else if (d == 128)
            prefill_rows_f32<8>(q, pos, out, k, v, d, scale);
        else
            prefill_rows_f32(q, pos, out, k, v, d, scale);
    }
};

struct PrefillTask {
    int64_t seq, head, first;   // sequence, query head, first query row of the tile
};

// Causal prefill attention over paged KV for B sequences (see ops.py), with the
// kernel `K` (Bf16Prefill, F32Prefill).
template <typename K, typename T = typename K::T>
void prefill_attention(T* out, int64_t out_stride, const T* q, int64_t q_stride,
                       const T* kc, const T* vc, const int32_t* tables,
                       int64_t table_stride, const int32_t* query_start_loc,
                       const int32_t* seq_lens, int64_t b, int64_t hq, int64_t hkv, int64_t d,
                       int64_t bs, float scale, int num_threads) {
    const int64_t g_size = hq / hkv;
    std::vector<int64_t> offsets(b + 1, 0);   // uint32 offset of each sequence's repacked K
    std::vector<PrefillTask> tasks;
    for (int64_t s = 0; s < b; ++s) {
        const int64_t ntiles = (seq_lens[s] + K::key_block - 1) / K::key_block * (K::key_block / kTile);
        offsets[s + 1] = offsets[s] + ntiles * hkv * K::tile_words(d);
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        for (int64_t first = 0; first < q_len; first += kQueryTile)
            for (int64_t h = 0; h < hq; ++h) tasks.push_back({s, h, first});
    }
    // Longest contexts first so the dynamic schedule ends evenly.
    std::stable_sort(tasks.begin(), tasks.end(), [&](const PrefillTask& x, const PrefillTask& y) {
        return seq_lens[x.seq] - query_start_loc[x.seq + 1] + query_start_loc[x.seq] + x.first >
               seq_lens[y.seq] - query_start_loc[y.seq + 1] + query_start_loc[y.seq] + y.first;
    });
    // 64-byte aligned scratch for the repacked K and V.
    std::vector<uint32_t> storage(2 * offsets[b] + 16);
    uint32_t* kt_all = reinterpret_cast<uint32_t*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~static_cast<uintptr_t>(63));
    uint32_t* vt_all = kt_all + offsets[b];
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < b; ++s) {
            for (int64_t h = 0; h < hkv; ++h) {
                const int64_t per_head = (offsets[s + 1] - offsets[s]) / hkv;
                K::repack(kc, vc, tables + s * table_stride, seq_lens[s], h, hkv, d, bs,
                          kt_all + offsets[s] + h * per_head, vt_all + offsets[s] + h * per_head);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < tasks.size(); ++i) {
            const PrefillTask task = tasks[i];
            const int64_t s = task.seq, h = task.head;
            const int64_t q0 = query_start_loc[s], q_len = query_start_loc[s + 1] - q0;
            const int64_t ctx = seq_lens[s] - q_len;   // tokens before this chunk
            const int64_t per_head = (offsets[s + 1] - offsets[s]) / hkv;
            const uint32_t* kt = kt_all + offsets[s] + (h / g_size) * per_head;
            const uint32_t* vt = vt_all + offsets[s] + (h / g_size) * per_head;
            const int64_t end = std::min(q_len, task.first + kQueryTile);
            for (int64_t i0 = task.first; i0 < end; i0 += K::rows) {
                const T* qr[K::rows];
                T* orow[K::rows];
                int64_t pos[K::rows];
                for (int r = 0; r < K::rows; ++r) {
                    const int64_t i = std::min(i0 + r, end - 1);   // pad with the last row
                    qr[r] = q + (q0 + i) * q_stride + h * d;
                    orow[r] = i0 + r < end ? out + (q0 + i) * out_stride + h * d : nullptr;
                    pos[r] = ctx + i;
                }
                K::run(qr, pos, orow, kt, vt, d, scale);
            }
        }
    }
}
#endif  // __AVX512F__

}  // namespace
}  // namespace tandem_cpu

// 1 when this build has the bfloat16 prefill attention (AVX-512 BF16), else 0.
extern "C" int tandem_has_prefill_attention_bf16() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// 1 when this build has the float32 prefill attention (AVX-512F), else 0.
extern "C" int tandem_has_prefill_attention_f32() {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#define TANDEM_PREFILL_EXPORT(SUFFIX, KERNEL, T)                                                \
    extern "C" void tandem_prefill_attention_##SUFFIX(                                          \
        void* out, int64_t out_stride, const void* q, int64_t q_stride, const void* kc,        \
        const void* vc, const int32_t* tables, int64_t table_stride,                            \
        const int32_t* query_start_loc, const int32_t* seq_lens, int64_t b, int64_t hq,         \
        int64_t hkv, int64_t d, int64_t bs, float scale, int nt) {                              \
        tandem_cpu::prefill_attention<tandem_cpu::KERNEL>(                                      \
            static_cast<T*>(out), out_stride, static_cast<const T*>(q), q_stride,              \
            static_cast<const T*>(kc), static_cast<const T*>(vc), tables, table_stride,        \
            query_start_loc, seq_lens, b, hq, hkv, d, bs, scale, nt);                           \
    }

#if defined(__AVX512BF16__)
TANDEM_PREFILL_EXPORT(bf16, Bf16Prefill, tandem_cpu::bf16)
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
TANDEM_PREFILL_EXPORT(bf16_amx, AmxPrefill, tandem_cpu::bf16)
#endif

// 1 when this process may run tandem_prefill_attention_bf16_amx for head size d: the
// build has it (AMX-BF16), d % 32 == 0 and d <= 256, and the OS granted tile state.
extern "C" int tandem_prefill_attention_bf16_amx_usable(int64_t d) {
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return tandem_cpu::AmxPrefill::usable(d) ? 1 : 0;
#else
    (void)d;
    return 0;
#endif
}
#if defined(__AVX512F__)
TANDEM_PREFILL_EXPORT(f32, F32Prefill, float)
#endif
