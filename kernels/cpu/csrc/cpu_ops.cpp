// CPU kernels for the per-layer hot path: paged decode attention and causal
// prefill attention that read K/V blocks where they lie in the cache, KV-cache
// writes, RMSNorm with a fused residual add, rotary embedding and SiLU-and-mul.
//
// Plain C ABI (loaded with ctypes, see ../build.py): every function takes raw data
// pointers, sizes in elements and row strides in elements; the innermost [H, D]
// of every tensor is contiguous. Each kernel exists for float32 (suffix _f32) and
// bfloat16 (_bf16, stored as uint16 bit patterns), except prefill attention
// (bfloat16 only). Arithmetic is float32 (the AVX-512 BF16 dot products multiply
// bf16 pairs exactly and accumulate in float32); bfloat16 results are rounded to
// nearest even at the store. Three tiers, chosen at compile time and per shape:
// AVX-512 BF16, AVX-512F, and portable loops the compiler vectorises.
// OpenMP splits the work over the `num_threads` the caller passes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bf16 = uint16_t;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline bf16 from_float<bf16>(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);   // round to nearest, ties to even
    return static_cast<bf16>(u >> 16);
}

// exp(x) for float32, vectorisable (no libm call): x = n ln2 + r, |r| <= ln2 / 2,
// e^r by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n through the
// exponent bits. Inputs are clamped to [-87, 88]; exp(-87) ~ 1.6e-38 stands in for 0.
inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = std::nearbyint(x * 1.44269504088896341f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// In place: each of the `rows` rows of `x` ([rows, n], float32) becomes its softmax.
inline void softmax_rows(float* x, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
        float* xr = x + r * n;
        float m = xr[0];
        for (int64_t t = 1; t < n; ++t) m = xr[t] > m ? xr[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
            const float e = fast_exp(xr[t] - m);
            xr[t] = e;
            sum += e;
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) xr[t] *= inv;
    }
}

#if defined(__AVX512F__)
// exp of 16 float32 lanes: the polynomial of fast_exp, 2^n applied with scalef.
inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif

// One (sequence, KV head) pair of paged decode attention: the G query heads that
// share KV head `h` attend over the sequence's `len` cached tokens. Two passes
// over the blocks: scores (then an exact float32 softmax), then the weighted sum
// of values. Portable version; the AVX-512 one below is used where available.
template <typename T>
void decode_one_generic(T* out, const T* q, const T* kc, const T* vc, const int32_t* table,
                        int64_t len, int64_t h, int64_t g_size, int64_t hkv, int64_t d,
                        int64_t bs, float scale, float* scores, float* acc) {
    const int64_t row = hkv * d;   // elements of one token in a cache block
    for (int64_t t = 0; t < len; ++t) {
        const T* kp = kc + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row + h * d;
        for (int64_t g = 0; g < g_size; ++g) {
            const T* qg = q + (h * g_size + g) * d;
            float s = 0.0f;
            for (int64_t i = 0; i < d; ++i) s += to_float(qg[i]) * to_float(kp[i]);
            scores[g * len + t] = s * scale;
        }
    }
    softmax_rows(scores, g_size, len);
    for (int64_t i = 0; i < g_size * d; ++i) acc[i] = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
        const T* vp = vc + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row + h * d;
        for (int64_t g = 0; g < g_size; ++g) {
            const float p = scores[g * len + t];
            for (int64_t i = 0; i < d; ++i) acc[g * d + i] += p * to_float(vp[i]);
        }
    }
    for (int64_t g = 0; g < g_size; ++g) {
        T* op = out + (h * g_size + g) * d;
        for (int64_t i = 0; i < d; ++i) op[i] = from_float<T>(acc[g * d + i]);
    }
}

#if defined(__AVX512F__)
// 16 float32 lanes from 16 elements of T.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Ask for the `rows` rows of d elements (stride `row`) of the next block early:
// blocks lie anywhere in the cache, so the hardware prefetcher cannot guess them.
template <typename T>
inline void prefetch_rows(const T* p, int64_t rows, int64_t row, int64_t d) {
    for (int64_t j = 0; j < rows; ++j)
        for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64)
            _mm_prefetch(reinterpret_cast<const char*>(p + j * row) + off, _MM_HINT_T0);
}

constexpr int kMaxGroup = 8;    // query heads per KV head handled in registers
constexpr int kMaxChunks = 16;  // head_dim / 16 (head_dim <= 256)

// AVX-512 version of decode_one_generic for head_dim % 16 == 0 and G <= kMaxGroup:
// the G query rows stay in registers as float32, each K row is read once (two
// 64-byte lines for bf16, D = 64) and scored against all G rows; the value pass
// keeps the G x D float32 accumulators in registers.
template <typename T>
void decode_one_avx512(T* out, const T* q, const T* kc, const T* vc, const int32_t* table,
                       int64_t len, int64_t h, int64_t g_size, int64_t hkv, int64_t d,
                       int64_t bs, float scale, float* scores) {
    const int64_t row = hkv * d;
    const int64_t chunks = d / 16;
    __m512 qv[kMaxGroup][kMaxChunks];
    for (int64_t g = 0; g < g_size; ++g)
        for (int64_t c = 0; c < chunks; ++c)
            qv[g][c] = _mm512_mul_ps(load16(q + (h * g_size + g) * d + 16 * c), _mm512_set1_ps(scale));
    const int64_t nblk = (len + bs - 1) / bs;
    for (int64_t blk = 0; blk < nblk; ++blk) {
        const T* base = kc + static_cast<int64_t>(table[blk]) * bs * row + h * d;
        const int64_t n = blk == nblk - 1 ? len - blk * bs : bs;
        if (blk + 1 < nblk) prefetch_rows(kc + static_cast<int64_t>(table[blk + 1]) * bs * row + h * d, bs, row, d);
        for (int64_t j = 0; j < n; ++j) {
            const T* kp = base + j * row;
            __m512 kv[kMaxChunks];
            for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(kp + 16 * c);
            for (int64_t g = 0; g < g_size; ++g) {
                __m512 s = _mm512_mul_ps(qv[g][0], kv[0]);
                for (int64_t c = 1; c < chunks; ++c) s = _mm512_fmadd_ps(qv[g][c], kv[c], s);
                scores[g * len + blk * bs + j] = _mm512_reduce_add_ps(s);
            }
        }
    }
    softmax_rows(scores, g_size, len);
    __m512 acc[kMaxGroup][kMaxChunks];
    for (int64_t g = 0; g < g_size; ++g)
        for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nblk; ++blk) {
        const T* base = vc + static_cast<int64_t>(table[blk]) * bs * row + h * d;
        const int64_t n = blk == nblk - 1 ? len - blk * bs : bs;
        if (blk + 1 < nblk) prefetch_rows(vc + static_cast<int64_t>(table[blk + 1]) * bs * row + h * d, bs, row, d);
        for (int64_t j = 0; j < n; ++j) {
            const T* vp = base + j * row;
            __m512 vv[kMaxChunks];
            for (int64_t c = 0; c < chunks; ++c) vv[c] = load16(vp + 16 * c);
            for (int64_t g = 0; g < g_size; ++g) {
                const __m512 p = _mm512_set1_ps(scores[g * len + blk * bs + j]);
                for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
            }
        }
    }
    alignas(64) float tmp[16];
    for (int64_t g = 0; g < g_size; ++g) {
        T* op = out + (h * g_size + g) * d;
        for (int64_t c = 0; c < chunks; ++c) {
            _mm512_store_ps(tmp, acc[g][c]);
            for (int i = 0; i < 16; ++i) op[16 * c + i] = from_float<T>(tmp[i]);
        }
    }
}
#endif

#if defined(__AVX512BF16__)
constexpr int64_t kAhead = 2;   // prefetch distance in blocks (1..6 measured: 2 is best)

// r[j] = sum of the 16 lanes of v[j], for 16 vectors at once (a transpose-and-add
// tree: 45 shuffles and adds instead of 16 full reductions).
inline __m512 hsum16x16(const __m512* v) {
    __m512 w[8], z[4];
    for (int i = 0; i < 8; ++i)   // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { // per 128-bit lane: partial sums of 4 vectors
        const __m512d x = _mm512_castps_pd(w[2 * i]), y = _mm512_castps_pd(w[2 * i + 1]);
        z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// bfloat16 decode_one for head_dim % 32 == 0: scores on the BF16 dot-product
// instruction straight from the cache (no conversion), 16 tokens at a time with
// one tree reduction; exact float32 softmax; values accumulated in float32.
// `scores` holds G rows of `stride` (len rounded up to 16) floats.
void decode_one_bf16(bf16* out, const bf16* q, const bf16* kc, const bf16* vc,
                     const int32_t* table, int64_t len, int64_t h, int64_t g_size, int64_t hkv,
                     int64_t d, int64_t bs, float scale, float* scores, int64_t stride) {
    const int64_t row = hkv * d, pairs = d / 32, chunks = d / 16;
    __m512bh qb[kMaxGroup][kMaxChunks / 2];
    for (int64_t g = 0; g < g_size; ++g)
        for (int64_t c = 0; c < pairs; ++c)
            qb[g][c] = (__m512bh)_mm512_loadu_si512(q + (h * g_size + g) * d + 32 * c);
    const bf16* kp[16];
    int64_t blk = 0, off = 0;   // block-table index and offset of the next token
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, len - t0);
        for (int64_t j = 0; j < 16; ++j) {
            if (j < n) {
                kp[j] = kc + (static_cast<int64_t>(table[blk]) * bs + off) * row + h * d;
                if (++off == bs) { off = 0; ++blk; }
            } else {
                kp[j] = kp[0];   // padding lanes: scored, then ignored by the softmax
            }
        }
        if (off == 0 && (blk + kAhead) * bs < len)   // a new block begins: fetch one kAhead further
            prefetch_rows(kc + static_cast<int64_t>(table[blk + kAhead]) * bs * row + h * d,
                          std::min<int64_t>(bs, 16), row, d);
        for (int64_t g = 0; g < g_size; ++g) {
            __m512 part[16];
            for (int64_t j = 0; j < 16; ++j) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < pairs; ++c)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kp[j] + 32 * c), qb[g][c]);
                part[j] = acc;
            }
            _mm512_storeu_ps(scores + g * stride + t0,
                             _mm512_mul_ps(hsum16x16(part), _mm512_set1_ps(scale)));
        }
    }
    for (int64_t g = 0; g < g_size; ++g) {
        float* sg = scores + g * stride;
        __m512 mv = _mm512_set1_ps(-1e30f);
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + t));
        const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1u);
        mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, sg + t));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 sum = _mm512_setzero_ps();
        for (t = 0; t + 16 <= len; t += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m));
            _mm512_storeu_ps(sg + t, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __m512 e = _mm512_maskz_mov_ps(tail, exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m)));
        _mm512_mask_storeu_ps(sg + t, tail, e);
        sum = _mm512_add_ps(sum, e);
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        for (t = 0; t < len; t += 16) _mm512_storeu_ps(sg + t, _mm512_mul_ps(_mm512_loadu_ps(sg + t), inv));
    }
    __m512 acc[kMaxGroup][kMaxChunks];
    for (int64_t g = 0; g < g_size; ++g)
        for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_setzero_ps();
    const int64_t nblk = (len + bs - 1) / bs;
    for (blk = 0; blk < nblk; ++blk) {
        const bf16* base = vc + static_cast<int64_t>(table[blk]) * bs * row + h * d;
        const int64_t n = blk == nblk - 1 ? len - blk * bs : bs;
        if (blk + kAhead < nblk)
            prefetch_rows(vc + static_cast<int64_t>(table[blk + kAhead]) * bs * row + h * d, bs, row, d);
        for (int64_t j = 0; j < n; ++j) {
            const bf16* vp = base + j * row;
            __m512 vv[kMaxChunks];
            for (int64_t c = 0; c < chunks; ++c) vv[c] = load16(vp + 16 * c);
            for (int64_t g = 0; g < g_size; ++g) {
                const __m512 p = _mm512_set1_ps(scores[g * stride + blk * bs + j]);
                for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
            }
        }
    }
    alignas(64) float tmp[16];
    for (int64_t g = 0; g < g_size; ++g) {
        bf16* op = out + (h * g_size + g) * d;
        for (int64_t c = 0; c < chunks; ++c) {
            _mm512_store_ps(tmp, acc[g][c]);
            for (int i = 0; i < 16; ++i) op[16 * c + i] = from_float<bf16>(tmp[i]);
        }
    }
}
#endif

template <typename T>
void decode_one(T* out, const T* q, const T* kc, const T* vc, const int32_t* table, int64_t len,
                int64_t h, int64_t g_size, int64_t hkv, int64_t d, int64_t bs, float scale,
                std::vector<float>& buf) {
    const int64_t stride = (len + 15) / 16 * 16;
    buf.resize(static_cast<size_t>(g_size * (stride + d)));
    float* scores = buf.data();   // [G, len] (rows of `stride` in the bf16 kernel)
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
        if (d % 32 == 0 && d / 16 <= kMaxChunks && g_size <= kMaxGroup) {
            decode_one_bf16(out, q, kc, vc, table, len, h, g_size, hkv, d, bs, scale, scores,
                            stride);
            return;
        }
    }
#endif
#if defined(__AVX512F__)
    if (d % 16 == 0 && d / 16 <= kMaxChunks && g_size <= kMaxGroup) {
        decode_one_avx512<T>(out, q, kc, vc, table, len, h, g_size, hkv, d, bs, scale, scores);
        return;
    }
#endif
    decode_one_generic<T>(out, q, kc, vc, table, len, h, g_size, hkv, d, bs, scale, scores,
                          scores + g_size * len);
}

template <typename T>
void decode_attention(T* out, int64_t out_stride, const T* q, int64_t q_stride, const T* kc,
                      const T* vc, const int32_t* tables, int64_t table_stride,
                      const int32_t* seq_lens, int64_t b, int64_t hq, int64_t hkv, int64_t d,
                      int64_t bs, float scale, int num_threads) {
    const int64_t g_size = hq / hkv;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> buf;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < b; ++s) {
            for (int64_t h = 0; h < hkv; ++h) {
                decode_one<T>(out + s * out_stride, q + s * q_stride, kc, vc,
                              tables + s * table_stride, seq_lens[s], h, g_size, hkv, d, bs,
                              scale, buf);
            }
        }
    }
}

#if defined(__AVX512BF16__)
constexpr int64_t kTile = 16;      // key tokens per tile (one zmm of float32 scores)
constexpr int kRows = 8;           // query rows processed together (2, 4, 6, 8, 12, 16 measured: 8 best)
constexpr int64_t kQueryTile = 32; // query positions per task

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
// negative are padding and are not stored.
void prefill_rows(const bf16* const* q, const int64_t* pos, bf16* const* out, const uint32_t* kt,
                  const uint32_t* vt, int64_t d, float scale) {
    const int64_t half = d / 2, chunks = d / 16;
    int64_t last = 0;
    for (int r = 0; r < kRows; ++r) last = pos[r] > last ? pos[r] : last;
    float m[kRows], l[kRows];
    __m512 acc[kRows][kMaxChunks];
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
            const int64_t valid = pos[r] - tile * kTile + 1;     // keys <= pos[r] in this tile
            const __mmask16 keep = valid >= kTile ? 0xFFFF
                                 : valid <= 0 ? 0 : static_cast<__mmask16>((1u << valid) - 1u);
            __m512 sr = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-1e30f),
                                             _mm512_mul_ps(s[r], _mm512_set1_ps(scale)));
            const float m_new = std::max(m[r], _mm512_reduce_max_ps(sr));
            const __m512 p = exp512(_mm512_sub_ps(sr, _mm512_set1_ps(m_new)));
            const float corr = fast_exp(m[r] - m_new);
            l[r] = l[r] * corr + _mm512_reduce_add_ps(p);
            m[r] = m_new;
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

struct PrefillTask {
    int64_t seq, head, first;   // sequence, query head, first query row of the tile
};

// Causal prefill attention over paged KV for B sequences (see ops.py).
void prefill_attention(bf16* out, int64_t out_stride, const bf16* q, int64_t q_stride,
                       const bf16* kc, const bf16* vc, const int32_t* tables,
                       int64_t table_stride, const int32_t* query_start_loc,
                       const int32_t* seq_lens, int64_t b, int64_t hq, int64_t hkv, int64_t d,
                       int64_t bs, float scale, int num_threads) {
    const int64_t g_size = hq / hkv;
    std::vector<int64_t> offsets(b + 1, 0);   // uint32 offset of each sequence's repacked K
    std::vector<PrefillTask> tasks;
    for (int64_t s = 0; s < b; ++s) {
        const int64_t ntiles = (seq_lens[s] + kTile - 1) / kTile;
        offsets[s + 1] = offsets[s] + ntiles * hkv * (d / 2) * kTile;
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
                repack_kv(kc, vc, tables + s * table_stride, seq_lens[s], h, hkv, d, bs,
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
            for (int64_t i0 = task.first; i0 < end; i0 += kRows) {
                const bf16* qr[kRows];
                bf16* orow[kRows];
                int64_t pos[kRows];
                for (int r = 0; r < kRows; ++r) {
                    const int64_t i = std::min(i0 + r, end - 1);   // pad with the last row
                    qr[r] = q + (q0 + i) * q_stride + h * d;
                    orow[r] = i0 + r < end ? out + (q0 + i) * out_stride + h * d : nullptr;
                    pos[r] = ctx + i;
                }
                prefill_rows(qr, pos, orow, kt, vt, d, scale);
            }
        }
    }
}
#endif  // __AVX512BF16__

template <typename T>
void reshape_and_cache(const T* key, int64_t key_stride, const T* value, int64_t value_stride,
                       T* kc, T* vc, const int64_t* slots, int64_t n, int64_t row) {
    for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;   // padding token: nothing to store
        std::memcpy(kc + slot * row, key + t * key_stride, sizeof(T) * row);
        std::memcpy(vc + slot * row, value + t * value_stride, sizeof(T) * row);
    }
}

template <typename T>
void rms_norm(T* out, const T* x, const T* residual, T* residual_out, const T* weight,
              int64_t n, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> tmp(static_cast<size_t>(hidden));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; ++t) {
            const T* xr = x + t * hidden;
            if (residual != nullptr) {
                const T* rr = residual + t * hidden;
                T* ro = residual_out + t * hidden;
                for (int64_t i = 0; i < hidden; ++i) {
                    const T sum = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
                    ro[i] = sum;
                    tmp[i] = to_float(sum);
                }
            } else {
                for (int64_t i = 0; i < hidden; ++i) tmp[i] = to_float(xr[i]);
            }
            float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < hidden; ++i) ss += tmp[i] * tmp[i];
            const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + eps);
            T* o = out + t * hidden;
            for (int64_t i = 0; i < hidden; ++i) o[i] = from_float<T>(tmp[i] * inv * to_float(weight[i]));
        }
    }
}

template <typename T>
void rotate(T* x, int64_t heads, int64_t d, const float* cs) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; ++h) {
        T* xh = x + h * d;
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = to_float(xh[i]), x2 = to_float(xh[i + half]);
            const float c = cs[i], s = cs[half + i];
            xh[i] = from_float<T>(x1 * c - x2 * s);
            xh[i + half] = from_float<T>(x2 * c + x1 * s);
        }
    }
}

template <typename T>
void rotary_embedding(const int64_t* positions, T* query, int64_t q_stride, int64_t hq, T* key,
                      int64_t k_stride, int64_t hkv, int64_t d, const float* cos_sin,
                      int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; ++t) {
        const float* cs = cos_sin + positions[t] * d;
        rotate<T>(query + t * q_stride, hq, d, cs);
        rotate<T>(key + t * k_stride, hkv, d, cs);
    }
}

template <typename T>
void silu_and_mul(T* out, const T* x, int64_t n, int64_t f, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; ++t) {
        const T* gate = x + t * 2 * f;
        const T* up = gate + f;
        T* o = out + t * f;
#pragma omp simd
        for (int64_t i = 0; i < f; ++i) {
            const float g = to_float(gate[i]);
            // Rounded twice like the reference (silu in T, then the product in T).
            const float silu = to_float(from_float<T>(g / (1.0f + fast_exp(-g))));
            o[i] = from_float<T>(silu * to_float(up[i]));
        }
    }
}

}  // namespace

#define TANDEM_EXPORT(SUFFIX, T)                                                                  \
    extern "C" void tandem_decode_attention_##SUFFIX(                                            \
        void* out, int64_t out_stride, const void* q, int64_t q_stride, const void* kc,          \
        const void* vc, const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,    \
        int64_t b, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int nt) {        \
        decode_attention<T>(static_cast<T*>(out), out_stride, static_cast<const T*>(q), q_stride,  \
                            static_cast<const T*>(kc), static_cast<const T*>(vc), tables,        \
                            table_stride, seq_lens, b, hq, hkv, d, bs, scale, nt);               \
    }                                                                                             \
    extern "C" void tandem_reshape_and_cache_##SUFFIX(                                           \
        const void* key, int64_t key_stride, const void* value, int64_t value_stride, void* kc,  \
        void* vc, const int64_t* slots, int64_t n, int64_t row) {                                \
        reshape_and_cache<T>(static_cast<const T*>(key), key_stride,                             \
                             static_cast<const T*>(value), value_stride, static_cast<T*>(kc),    \
                             static_cast<T*>(vc), slots, n, row);                                \
    }                                                                                             \
    extern "C" void tandem_rms_norm_##SUFFIX(void* out, const void* x, const void* residual,      \
                                             void* residual_out, const void* weight, int64_t n,   \
                                             int64_t hidden, float eps, int nt) {                 \
        rms_norm<T>(static_cast<T*>(out), static_cast<const T*>(x),                              \
                    static_cast<const T*>(residual), static_cast<T*>(residual_out),              \
                    static_cast<const T*>(weight), n, hidden, eps, nt);                          \
    }                                                                                             \
    extern "C" void tandem_rotary_embedding_##SUFFIX(                                            \
        const int64_t* positions, void* query, int64_t q_stride, int64_t hq, void* key,          \
        int64_t k_stride, int64_t hkv, int64_t d, const float* cos_sin, int64_t n, int nt) {     \
        rotary_embedding<T>(positions, static_cast<T*>(query), q_stride, hq,                     \
                            static_cast<T*>(key), k_stride, hkv, d, cos_sin, n, nt);             \
    }                                                                                             \
    extern "C" void tandem_silu_and_mul_##SUFFIX(void* out, const void* x, int64_t n, int64_t f,  \
                                                 int nt) {                                        \
        silu_and_mul<T>(static_cast<T*>(out), static_cast<const T*>(x), n, f, nt);               \
    }

TANDEM_EXPORT(f32, float)
TANDEM_EXPORT(bf16, bf16)

// 1 when this build has the bfloat16 prefill attention (AVX-512 BF16), else 0.
extern "C" int tandem_has_prefill_attention_bf16() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
extern "C" void tandem_prefill_attention_bf16(
    void* out, int64_t out_stride, const void* q, int64_t q_stride, const void* kc, const void* vc,
    const int32_t* tables, int64_t table_stride, const int32_t* query_start_loc,
    const int32_t* seq_lens, int64_t b, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
    float scale, int nt) {
    prefill_attention(static_cast<bf16*>(out), out_stride, static_cast<const bf16*>(q), q_stride,
                      static_cast<const bf16*>(kc), static_cast<const bf16*>(vc), tables,
                      table_stride, query_start_loc, seq_lens, b, hq, hkv, d, bs, scale, nt);
}
#endif
