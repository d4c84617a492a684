// Paged decode attention (one query token per sequence) reading K/V blocks where
// they lie in the cache, in four tiers: AVX-512 BF16 dot products (bfloat16,
// head_dim % 32 == 0), AVX-512F float32 math (head_dim % 16 == 0), AVX2 + FMA
// float32 math (head_dim % 8 == 0, CPUs without AVX-512), portable loops. The
// tier depends on the CPU and the model's shape only, never on the batch.
// A sliding window (a query at position p sees keys p - window + 1 .. p) starts a
// sequence's context inside its block table: the tiers walk the `len` tokens from
// in-block offset `off0` of the first block they are given. Soft-capping
// (Gemma 2) bends the scaled scores to cap * tanh(s / cap) before the softmax.
// C ABI for ../ops.py: pointers, sizes and row strides in elements.

#include "common.h"
#include "fp8.h"

namespace tandem_cpu {
namespace {

// In place: rows r < `rows` of `x` (row r at x + r * stride, `len` scores) become
// cap * tanh(x / cap); nothing when cap is 0 (no soft-capping).
inline void softcap_rows(float* x, int64_t rows, int64_t len, int64_t stride, float cap) {
    if (cap == 0.0f) return;
    const float inv = 1.0f / cap;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t t = 0; t < len; ++t) x[r * stride + t] = cap * std::tanh(x[r * stride + t] * inv);
}

// One (sequence, KV head) pair of paged decode attention: the G query heads that
// share KV head `h` attend over the sequence's `len` cached tokens. Two passes
// over the blocks: scores (then an exact float32 softmax), then the weighted sum
// of values. Portable version; the AVX-512 one below is used where available.
template <typename T>
void decode_one_generic(T* out, const T* q, const T* kc, const T* vc, const int32_t* table,
                        int64_t off0, int64_t len, int64_t h, int64_t g_size, int64_t hkv,
                        int64_t d, int64_t bs, float scale, float softcap, float* scores,
                        float* acc) {
    const int64_t row = hkv * d;   // elements of one token in a cache block
    for (int64_t t = 0; t < len; ++t) {
        const int64_t p = off0 + t;
        const T* kp = kc + (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * row + h * d;
        for (int64_t g = 0; g < g_size; ++g) {
            const T* qg = q + (h * g_size + g) * d;
            float s = 0.0f;
            for (int64_t i = 0; i < d; ++i) s += to_float(qg[i]) * to_float(kp[i]);
            scores[g * len + t] = s * scale;
        }
    }
    softcap_rows(scores, g_size, len, len, softcap);
    softmax_rows(scores, g_size, len);
    for (int64_t i = 0; i < g_size * d; ++i) acc[i] = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
        const int64_t p = off0 + t;
        const T* vp = vc + (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * row + h * d;
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
constexpr int64_t kAhead = 2;   // prefetch distance in blocks (1..6 measured: 1-2 are best)

// In place: rows r < `rows` of `x` (row r at x + r * stride, `len` valid floats)
// become their exact float32 softmax.
inline void softmax_rows512(float* x, int64_t rows, int64_t len, int64_t stride) {
    for (int64_t r = 0; r < rows; ++r) {
        float* xr = x + r * stride;
        __m512 mv = _mm512_set1_ps(-1e30f);
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(xr + t));
        const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1u);
        mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, xr + t));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 sum = _mm512_setzero_ps();
        for (t = 0; t + 16 <= len; t += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(xr + t), m));
            _mm512_storeu_ps(xr + t, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __m512 e = _mm512_maskz_mov_ps(tail, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, xr + t), m)));
        _mm512_mask_storeu_ps(xr + t, tail, e);
        sum = _mm512_add_ps(sum, e);
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        for (t = 0; t + 16 <= len; t += 16) _mm512_storeu_ps(xr + t, _mm512_mul_ps(_mm512_loadu_ps(xr + t), inv));
        _mm512_mask_storeu_ps(xr + t, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, xr + t), inv));
    }
}

// The value pass of decode_one_*: out[h*G + g] = sum_t p[g][t] V[t] for the G query
// heads of KV head h, float32 accumulators; as each V row is read, the row at the
// same offset kAhead blocks ahead is prefetched (see next_16_keys). `p`
// holds G rows of `stride` softmax weights. GT / CT: the group size and head_dim /
// 16 fixed at compile time (0: the runtime `g_size`, `d / 16`); fixed, the loops
// unroll and the G x CT accumulators live in registers, where runtime bounds left
// them on the stack (every FMA a load and a store). Each V vector is loaded where
// it is used: a separate copy loop into a local array compiled to a memcpy call
// per token. The same FMAs in the same order either way.
template <typename T, int GT = 0, int CT = 0>
void weighted_values(T* out, const T* vc, const int32_t* table, int64_t off0, int64_t len,
                     int64_t h, int64_t g_rt, int64_t hkv, int64_t d, int64_t bs,
                     const float* p, int64_t stride) {
    const int64_t g_size = GT ? GT : g_rt, chunks = CT ? CT : d / 16, row = hkv * d;
    __m512 acc[GT ? GT : kMaxGroup][CT ? CT : kMaxChunks];
    for (int64_t g = 0; g < g_size; ++g)
        for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_setzero_ps();
    const int64_t end = off0 + len;          // in the table's token positions
    const int64_t nblk = (end + bs - 1) / bs;
    for (int64_t blk = 0; blk < nblk; ++blk) {
        const T* base = vc + static_cast<int64_t>(table[blk]) * bs * row + h * d;
        const int64_t j0 = blk == 0 ? off0 : 0;
        const int64_t n = blk == nblk - 1 ? end - blk * bs : bs;
        const T* ahead = blk + kAhead < nblk
            ? vc + static_cast<int64_t>(table[blk + kAhead]) * bs * row + h * d : nullptr;
        const float* pb = p + blk * bs - off0;
        for (int64_t j = j0; j < n; ++j) {
            if (ahead != nullptr) prefetch_rows(ahead + j * row, 1, row, d);
            __m512 pj[GT ? GT : kMaxGroup];
            for (int64_t g = 0; g < g_size; ++g) pj[g] = _mm512_set1_ps(pb[g * stride + j]);
            for (int64_t c = 0; c < chunks; ++c) {
                const __m512 v = load16(base + j * row + 16 * c);
                for (int64_t g = 0; g < g_size; ++g) acc[g][c] = _mm512_fmadd_ps(pj[g], v, acc[g][c]);
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

// The K rows of head `h` for tokens t0 .. t0 + 15 (lanes past `len` repeat the
// first: scored, then ignored by the softmax), walking the block table from
// (blk, off), which it advances; each key's row in the block kAhead further on
// is prefetched as the key is taken (`end`: the table position after the last
// token). One row per key spreads the prefetches over the pass: a whole block's
// rows at once, at its start (the earlier way: 32 lines in bfloat16, more than a
// core has line fill buffers), was 7-8% slower at 64 sequences (bfloat16, AMX
// host, `decode_attention_cpu.py --against`).
template <typename T>
inline void next_16_keys(const T** kp, const T* kc, const int32_t* table, int64_t len,
                         int64_t end, int64_t t0, int64_t& blk, int64_t& off, int64_t h,
                         int64_t row, int64_t d, int64_t bs) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t j = 0; j < 16; ++j) {
        if (j < n) {
            kp[j] = kc + (static_cast<int64_t>(table[blk]) * bs + off) * row + h * d;
            if ((blk + kAhead) * bs < end)
                prefetch_rows(kc + (static_cast<int64_t>(table[blk + kAhead]) * bs + off) * row + h * d,
                              1, row, d);
            if (++off == bs) { off = 0; ++blk; }
        } else {
            kp[j] = kp[0];
        }
    }
}

// AVX-512 version of decode_one_generic for head_dim % 16 == 0 and G <= kMaxGroup:
// the G query rows stay in registers as float32 (pre-scaled), the K rows of 16
// tokens at a time are scored against all G rows, each score's D products summed
// in one vector and the 16 vectors reduced together (hsum16x16: one tree
// reduction per 16 scores instead of one horizontal sum per score); the value
// pass keeps the G x D float32 accumulators in registers. `scores` holds G rows
// of `stride` (len rounded up to 16) floats. GT / CT as for weighted_values.
template <typename T, int GT = 0, int CT = 0>
void decode_one_avx512(T* out, const T* q, const T* kc, const T* vc, const int32_t* table,
                       int64_t off0, int64_t len, int64_t h, int64_t g_rt, int64_t hkv,
                       int64_t d, int64_t bs, float scale, float softcap, float* scores,
                       int64_t stride) {
    const int64_t g_size = GT ? GT : g_rt, chunks = CT ? CT : d / 16, row = hkv * d;
    __m512 qv[GT ? GT : kMaxGroup][CT ? CT : kMaxChunks];
    for (int64_t g = 0; g < g_size; ++g)
        for (int64_t c = 0; c < chunks; ++c)
            qv[g][c] = _mm512_mul_ps(load16(q + (h * g_size + g) * d + 16 * c), _mm512_set1_ps(scale));
    const T* kp[16];
    int64_t blk = 0, off = off0;   // block-table index and offset of the next token
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        next_16_keys(kp, kc, table, len, off0 + len, t0, blk, off, h, row, d, bs);
        for (int64_t g = 0; g < g_size; ++g) {
            __m512 part[16];
            for (int64_t j = 0; j < 16; ++j) {
                __m512 acc = _mm512_mul_ps(qv[g][0], load16(kp[j]));
                for (int64_t c = 1; c < chunks; ++c)
                    acc = _mm512_fmadd_ps(qv[g][c], load16(kp[j] + 16 * c), acc);
                part[j] = acc;
            }
            _mm512_storeu_ps(scores + g * stride + t0, hsum16x16(part));
        }
    }
    softcap_rows(scores, g_size, len, stride, softcap);
    softmax_rows512(scores, g_size, len, stride);
    weighted_values<T, GT, CT>(out, vc, table, off0, len, h, g_size, hkv, d, bs, scores, stride);
}
#endif  // __AVX512F__

#if defined(__AVX512BF16__)
// bfloat16 decode_one for head_dim % 32 == 0: scores on the BF16 dot-product
// instruction straight from the cache (no conversion), 16 tokens at a time with
// one tree reduction; exact float32 softmax; values accumulated in float32.
// `scores` holds G rows of `stride` (len rounded up to 16) floats. GT / CT as for
// weighted_values.
template <int GT = 0, int CT = 0>
void decode_one_bf16(bf16* out, const bf16* q, const bf16* kc, const bf16* vc,
                     const int32_t* table, int64_t off0, int64_t len, int64_t h,
                     int64_t g_rt, int64_t hkv, int64_t d, int64_t bs, float scale,
                     float softcap, float* scores, int64_t stride) {
    const int64_t g_size = GT ? GT : g_rt, pairs = CT ? CT / 2 : d / 32, row = hkv * d;
    __m512bh qb[GT ? GT : kMaxGroup][CT ? CT / 2 : kMaxChunks / 2];
    for (int64_t g = 0; g < g_size; ++g)
        for (int64_t c = 0; c < pairs; ++c)
            qb[g][c] = (__m512bh)_mm512_loadu_si512(q + (h * g_size + g) * d + 32 * c);
    const bf16* kp[16];
    int64_t blk = 0, off = off0;   // block-table index and offset of the next token
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        next_16_keys(kp, kc, table, len, off0 + len, t0, blk, off, h, row, d, bs);
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
    softcap_rows(scores, g_size, len, stride, softcap);
    softmax_rows512(scores, g_size, len, stride);
    weighted_values<bf16, GT, CT>(out, vc, table, off0, len, h, g_size, hkv, d, bs, scores, stride);
}
#endif  // __AVX512BF16__

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// 8 float32 lanes from 8 elements of T.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

constexpr int kMaxGroup2 = 8;    // query heads per KV head handled in registers
constexpr int kMaxChunks2 = 32;  // head_dim / 8 (head_dim <= 256)

// r[j] = the sum of the 8 lanes of v[j], for 8 vectors at once: a fixed hadd tree,
// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) per vector. The sum for v[j]
// involves v[j] alone, so a zero vector in another slot changes nothing.
inline __m256 hsum8x8(const __m256* v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), e = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), ce = _mm256_hadd_ps(c, e);
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, ce, 0x20), _mm256_permute2f128_ps(ab, ce, 0x31));
}

// The value pass for CW chunks (8 floats each) of the head dim starting at chunk
// c0: G x CW float32 accumulators in registers, tokens summed in order. GT: the
// group size fixed at compile time (0: the runtime `g_rt`), which keeps the
// accumulators in registers instead of on the stack; the same FMAs either way.
// The first pass (c0 == 0) prefetches the blocks kAhead2 ahead.
constexpr int64_t kAhead2 = 2;   // prefetch distance in blocks
template <typename T, int CW, int GT = 0>
void values_avx2(float* acc, const T* vc, const int32_t* table, int64_t off0, int64_t len,
                 int64_t h, int64_t g_rt, int64_t row, int64_t d, int64_t bs, const float* p,
                 int64_t c0) {
    const int64_t g_size = GT ? GT : g_rt;
    const int64_t nblk = (off0 + len + bs - 1) / bs;
    __m256 a[GT ? GT : kMaxGroup2][CW];
    for (int64_t g = 0; g < g_size; ++g)
        for (int c = 0; c < CW; ++c) a[g][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = off0 + t;
        if (c0 == 0 && pos % bs == 0 && pos / bs + kAhead2 < nblk)
            prefetch_rows(vc + static_cast<int64_t>(table[pos / bs + kAhead2]) * bs * row + h * d,
                          bs, row, d);
        const T* vp = vc + (static_cast<int64_t>(table[pos / bs]) * bs + pos % bs) * row + h * d + 8 * c0;
        __m256 pg[GT ? GT : kMaxGroup2];
        for (int64_t g = 0; g < g_size; ++g) pg[g] = _mm256_set1_ps(p[g * len + t]);
        for (int c = 0; c < CW; ++c) {
            const __m256 v = load8(vp + 8 * c);
            for (int64_t g = 0; g < g_size; ++g) a[g][c] = _mm256_fmadd_ps(pg[g], v, a[g][c]);
        }
    }
    for (int64_t g = 0; g < g_size; ++g)
        for (int c = 0; c < CW; ++c) _mm256_storeu_ps(acc + g * d + 8 * (c0 + c), a[g][c]);
}

// values_avx2 with the group size as a compile-time constant where it is 1..8.
template <typename T, int CW>
void values_avx2_g(float* acc, const T* vc, const int32_t* table, int64_t off0, int64_t len,
                   int64_t h, int64_t g_size, int64_t row, int64_t d, int64_t bs, const float* p,
                   int64_t c0) {
    switch (g_size) {
#define TANDEM_CASE(G) \
    case G: values_avx2<T, CW, G>(acc, vc, table, off0, len, h, g_size, row, d, bs, p, c0); return;
        TANDEM_CASE(1) TANDEM_CASE(2) TANDEM_CASE(3) TANDEM_CASE(4)
        TANDEM_CASE(5) TANDEM_CASE(6) TANDEM_CASE(7) TANDEM_CASE(8)
#undef TANDEM_CASE
        default: values_avx2<T, CW>(acc, vc, table, off0, len, h, g_size, row, d, bs, p, c0);
    }
}

// decode_one for AVX2 + FMA (head_dim % 8 == 0): the G scaled query rows as
// float32 in a small buffer; scores 8 tokens at a time (per token and head an FMA
// chain over the D / 8 chunks, then one hadd tree for the 8 tokens); an exact
// float32 softmax; the values summed token by token into float32 accumulators
// held in registers, a few chunks of the head dim per pass. Every step is the same
// for any batch: the result for one (sequence, head) depends only on its query,
// its cached K/V and `len` (a partial group of 8 tokens is padded with zero
// vectors, which the tree keeps apart).
template <typename T>
void decode_one_avx2(T* out, const T* q, const T* kc, const T* vc, const int32_t* table,
                     int64_t off0, int64_t len, int64_t h, int64_t g_size, int64_t hkv,
                     int64_t d, int64_t bs, float scale, float softcap, float* scores,
                     float* acc) {
    const int64_t row = hkv * d, chunks = d / 8, nblk = (off0 + len + bs - 1) / bs;
    alignas(32) float qf[kMaxGroup2 * kMaxChunks2 * 8];
    for (int64_t g = 0; g < g_size; ++g)
        for (int64_t c = 0; c < chunks; ++c)
            _mm256_storeu_ps(qf + (g * chunks + c) * 8,
                             _mm256_mul_ps(load8(q + (h * g_size + g) * d + 8 * c), _mm256_set1_ps(scale)));
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
        const int64_t n = std::min<int64_t>(8, len - t0);
        const T* kp[8];
        for (int64_t i = 0; i < n; ++i) {
            const int64_t t = off0 + t0 + i;
            kp[i] = kc + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row + h * d;
            if (t % bs == 0 && t / bs + kAhead2 < nblk)
                prefetch_rows(kc + static_cast<int64_t>(table[t / bs + kAhead2]) * bs * row + h * d,
                              bs, row, d);
        }
        for (int64_t g = 0; g < g_size; ++g) {
            const float* qg = qf + g * chunks * 8;
            __m256 s[8];
            for (int64_t i = 0; i < 8; ++i) {
                if (i >= n) { s[i] = _mm256_setzero_ps(); continue; }
                __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qg), load8(kp[i]));
                for (int64_t c = 1; c < chunks; ++c)
                    x = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), load8(kp[i] + 8 * c), x);
                s[i] = x;
            }
            alignas(32) float r[8];
            _mm256_store_ps(r, hsum8x8(s));
            for (int64_t i = 0; i < n; ++i) scores[g * len + t0 + i] = r[i];
        }
    }
    softcap_rows(scores, g_size, len, len, softcap);
    softmax_rows(scores, g_size, len);
    const int cw = g_size <= 3 ? 4 : (g_size <= 6 ? 2 : 1);
    for (int64_t c0 = 0; c0 < chunks;) {
        const int64_t left = chunks - c0;
        if (cw >= 4 && left >= 4) {
            values_avx2_g<T, 4>(acc, vc, table, off0, len, h, g_size, row, d, bs, scores, c0);
            c0 += 4;
        } else if (cw >= 2 && left >= 2) {
            values_avx2_g<T, 2>(acc, vc, table, off0, len, h, g_size, row, d, bs, scores, c0);
            c0 += 2;
        } else {
            values_avx2_g<T, 1>(acc, vc, table, off0, len, h, g_size, row, d, bs, scores, c0);
            c0 += 1;
        }
    }
    for (int64_t g = 0; g < g_size; ++g) {
        T* op = out + (h * g_size + g) * d;
        for (int64_t i = 0; i < d; ++i) op[i] = from_float<T>(acc[g * d + i]);
    }
}
#endif  // AVX2 without AVX-512

#if defined(__AVX512F__)
// CALL(GT, CT) with the group size G and head_dim / 16 = C as compile-time constants
// for the shapes models have (G 1..8; C 4 or 8: head_dim 64 or 128), else
// CALL(0, 0): the same kernel with runtime bounds.
#define TANDEM_GROUP_CASES(C, CALL)                                                   \
    case 16 * C + 1: CALL(1, C); break;                                               \
    case 16 * C + 2: CALL(2, C); break;                                               \
    case 16 * C + 3: CALL(3, C); break;                                               \
    case 16 * C + 4: CALL(4, C); break;                                               \
    case 16 * C + 5: CALL(5, C); break;                                               \
    case 16 * C + 6: CALL(6, C); break;                                               \
    case 16 * C + 7: CALL(7, C); break;                                               \
    case 16 * C + 8: CALL(8, C); break;
#define TANDEM_GROUP_SHAPES(G, C, CALL)                                               \
    switch (16 * (C) + (G)) {                                                         \
        TANDEM_GROUP_CASES(4, CALL)                                                   \
        TANDEM_GROUP_CASES(8, CALL)                                                   \
        default: CALL(0, 0);                                                          \
    }
#endif

// One (sequence, KV head) pair: the sequence's `full_len` cached tokens, of which
// only the last `window` are attended when `window` > 0.
template <typename T>
void decode_one(T* out, const T* q, const T* kc, const T* vc, const int32_t* full_table,
                int64_t full_len, int64_t h, int64_t g_size, int64_t hkv, int64_t d, int64_t bs,
                float scale, int64_t window, float softcap, std::vector<float>& buf) {
    const int64_t first = window > 0 && full_len > window ? full_len - window : 0;
    const int32_t* table = full_table + first / bs;
    const int64_t off0 = first % bs, len = full_len - first;
    const int64_t stride = (len + 15) / 16 * 16;
    buf.resize(static_cast<size_t>(g_size * (stride + d)));
    float* scores = buf.data();   // [G, len]: rows of `stride` floats (generic: of `len`)
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
        if (d % 32 == 0 && d / 16 <= kMaxChunks && g_size <= kMaxGroup) {
#define TANDEM_CALL(GT, CT)                                                                  \
    decode_one_bf16<GT, CT>(out, q, kc, vc, table, off0, len, h, g_size, hkv, d, bs, scale, \
                            softcap, scores, stride)
            TANDEM_GROUP_SHAPES(g_size, d / 16, TANDEM_CALL);
#undef TANDEM_CALL
            return;
        }
    }
#endif
#if defined(__AVX512F__)
    if (d % 16 == 0 && d / 16 <= kMaxChunks && g_size <= kMaxGroup) {
#define TANDEM_CALL(GT, CT)                                                                   \
    decode_one_avx512<T, GT, CT>(out, q, kc, vc, table, off0, len, h, g_size, hkv, d, bs,    \
                                 scale, softcap, scores, stride)
        TANDEM_GROUP_SHAPES(g_size, d / 16, TANDEM_CALL);
#undef TANDEM_CALL
        return;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (d % 8 == 0 && d / 8 <= kMaxChunks2 && g_size <= kMaxGroup2) {
        decode_one_avx2<T>(out, q, kc, vc, table, off0, len, h, g_size, hkv, d, bs, scale,
                           softcap, scores, scores + g_size * len);
        return;
    }
#endif
    decode_one_generic<T>(out, q, kc, vc, table, off0, len, h, g_size, hkv, d, bs, scale,
                          softcap, scores, scores + g_size * len);
}

// fn(s, h, buf) for every (sequence s, KV head h) pair of a batch of `b` sequences
// over OpenMP threads, one grow-only float32 scratch `buf` per thread. With at
// least kSeqsPerThread sequences per thread, a task is one sequence, its KV heads
// in order: a block holds [BS, Hkv, D], so the thread then reads whole blocks
// (K, then V) instead of one head's row of every token, which left a third of each
// row to other threads at other times (bfloat16, SmolLM2's 3 KV heads, 64
// sequences of 290 tokens: 1.20 -> 1.02 ms per layer on 2 cores). Fewer
// sequences keep (sequence, head) tasks, so that every thread has work. Each
// pair's arithmetic is the same either way.
constexpr int64_t kSeqsPerThread = 4;
template <typename Fn>
void for_each_sequence_head(const int32_t* seq_lens, int64_t b, int64_t hq, int64_t hkv,
                            int64_t d, int num_threads, Fn fn) {
    int64_t tokens = 0;
    for (int64_t s = 0; s < b; ++s) tokens += seq_lens[s];
    const int nt = threads_for(tokens * hq * d, num_threads, 1 << 16);
    const int64_t heads_per_task = b >= kSeqsPerThread * nt ? hkv : 1;
    const int64_t tasks = b * hkv / heads_per_task;
#pragma omp parallel num_threads(nt)
    {
        std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t)      // pairs in (sequence, head) order
            for (int64_t p = t * heads_per_task; p < (t + 1) * heads_per_task; ++p)
                fn(p / hkv, p % hkv, buf);
    }
}

template <typename T>
void decode_attention(T* out, int64_t out_stride, const T* q, int64_t q_stride, const T* kc,
                      const T* vc, const int32_t* tables, int64_t table_stride,
                      const int32_t* seq_lens, int64_t b, int64_t hq, int64_t hkv, int64_t d,
                      int64_t bs, float scale, int64_t window, float softcap, int num_threads) {
    const int64_t g_size = hq / hkv;
    for_each_sequence_head(seq_lens, b, hq, hkv, d, num_threads,
                           [&](int64_t s, int64_t h, std::vector<float>& buf) {
        decode_one<T>(out + s * out_stride, q + s * q_stride, kc, vc, tables + s * table_stride,
                      seq_lens[s], h, g_size, hkv, d, bs, scale, window, softcap, buf);
    });
}

// The value pass of the decoders that decode each cached V row to float32 first
// (fp8, int4): out[h*G + g] = out_scale * sum_t p[g][t] V[t] with `row_to_float(t, x)`
// writing token t's V row (D floats) into x; `acc` holds G x D floats.
template <typename T, typename RowToFloat>
void decoded_values(T* out, const float* scores, float* acc, float* x, int64_t len, int64_t h,
                    int64_t g_size, int64_t d, float out_scale, RowToFloat row_to_float) {
    for (int64_t i = 0; i < g_size * d; ++i) acc[i] = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
        row_to_float(t, x);
        for (int64_t g = 0; g < g_size; ++g) {
            const float p = scores[g * len + t];
            float* ag = acc + g * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ag[i] += p * x[i];
        }
    }
    for (int64_t g = 0; g < g_size; ++g) {
        T* op = out + (h * g_size + g) * d;
        for (int64_t i = 0; i < d; ++i) op[i] = from_float<T>(acc[g * d + i] * out_scale);
    }
}

// Decode attention over an fp8 (e4m3) cache with per-KV-head scales: K = k_scale[h]
// * e4m3 value, V = v_scale[h] * e4m3 value. One (sequence, KV head) pair: the G
// query rows, times the softmax scale and k_scale[h], are kept as float32; each
// cached K row is decoded to float32 once (F16C, see fp8.h) and scored against
// all G rows; exact float32 softmax; each V row decoded once and accumulated
// into G x D float32 sums, scaled by v_scale[h] at the end. The same steps for
// any batch.
template <typename T>
void decode_one_fp8(T* out, const T* q, const fp8* kc, const fp8* vc, const int32_t* table,
                    int64_t len, int64_t h, int64_t g_size, int64_t hkv, int64_t d, int64_t bs,
                    float scale, float k_scale, float v_scale, std::vector<float>& buf) {
    buf.resize(static_cast<size_t>(g_size * (len + 2 * d) + d));
    float* scores = buf.data();            // [G, len]
    float* acc = scores + g_size * len;    // [G, D]
    float* qf = acc + g_size * d;          // [G, D]
    float* x = qf + g_size * d;            // [D]: one decoded K or V row
    const int64_t row = hkv * d;
    const float qscale = scale * k_scale;
    for (int64_t g = 0; g < g_size; ++g)
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_float(q[(h * g_size + g) * d + i]) * qscale;
    for (int64_t t = 0; t < len; ++t) {
        fp8_e4m3_row_to_float(kc + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row + h * d,
                              x, d);
        for (int64_t g = 0; g < g_size; ++g) {
            const float* qg = qf + g * d;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < d; ++i) s += qg[i] * x[i];
            scores[g * len + t] = s;
        }
    }
    softmax_rows(scores, g_size, len);
    decoded_values<T>(out, scores, acc, x, len, h, g_size, d, v_scale, [&](int64_t t, float* xr) {
        fp8_e4m3_row_to_float(vc + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row + h * d,
                              xr, d);
    });
}

template <typename T>
void decode_attention_fp8(T* out, int64_t out_stride, const T* q, int64_t q_stride, const fp8* kc,
                          const fp8* vc, const int32_t* tables, int64_t table_stride,
                          const int32_t* seq_lens, int64_t b, int64_t hq, int64_t hkv, int64_t d,
                          int64_t bs, float scale, const float* k_scale, const float* v_scale,
                          int num_threads) {
    const int64_t g_size = hq / hkv;
    for_each_sequence_head(seq_lens, b, hq, hkv, d, num_threads,
                           [&](int64_t s, int64_t h, std::vector<float>& buf) {
        decode_one_fp8<T>(out + s * out_stride, q + s * q_stride, kc, vc,
                          tables + s * table_stride, seq_lens[s], h, g_size, hkv, d, bs, scale,
                          k_scale[h], v_scale[h], buf);
    });
}

// Decode attention over an int4 cache (kv_cache_dtype int4; format in
// tandem/kernels/int4_kv.py): rows of `rb` bytes per (token, KV head), D/2 bytes of
// nibbles q (low nibble first) and a parameter area. V rows, and the K rows of a
// sequence's last block while it is not full, are per token: (step, lo) fp16 per
// group of `grp` channels, element q * step + lo. The K rows of a full block are
// per channel: the block's D (step, lo) pairs are spread over its BS rows (row j
// holds channels [j D / BS, (j + 1) D / BS)); they are gathered once per block.
// A sequence's open last block's K is read from the open-block K store instead
// (`store` [S, BS, Hkv, D] in the query's dtype, entry `entry`; -1 or no store:
// its per-token rows).
inline void int4_row_to_float(const uint8_t* r, float* x, int64_t d, int64_t grp) {
    const uint8_t* params = r + d / 2;
    for (int64_t g0 = 0; g0 < d; g0 += grp) {
        const float step = fp16_to_float(params + 4 * (g0 / grp));
        const float lo = fp16_to_float(params + 4 * (g0 / grp) + 2);
        const uint8_t* nib = r + g0 / 2;
#pragma omp simd
        for (int64_t j = 0; j < grp / 2; ++j) {
            x[g0 + 2 * j] = static_cast<float>(nib[j] & 15) * step + lo;
            x[g0 + 2 * j + 1] = static_cast<float>(nib[j] >> 4) * step + lo;
        }
    }
}

template <typename T>
void decode_one_int4(T* out, const T* q, const uint8_t* kc, const uint8_t* vc,
                     const int32_t* table, int64_t len, int64_t h, int64_t g_size, int64_t hkv,
                     int64_t d, int64_t bs, int64_t grp, int64_t rb, float scale,
                     const T* store, int64_t entry, std::vector<float>& buf) {
    buf.resize(static_cast<size_t>(g_size * (len + 2 * d) + 3 * d));
    float* scores = buf.data();            // [G, len]
    float* acc = scores + g_size * len;    // [G, D]
    float* qf = acc + g_size * d;          // [G, D]
    float* x = qf + g_size * d;            // [D]: one decoded K or V row
    float* cstep = x + d;                  // [D]: a full block's per-channel steps
    float* clo = cstep + d;                // [D]: ... and minima
    const int64_t row = hkv * rb;          // bytes of one token in a block
    const int64_t per_row = d / bs;        // channels whose pair a K row of a full block holds
    for (int64_t g = 0; g < g_size; ++g)
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_float(q[(h * g_size + g) * d + i]) * scale;
    const int64_t nblk = (len + bs - 1) / bs;
    for (int64_t blk = 0; blk < nblk; ++blk) {
        const uint8_t* base = kc + static_cast<int64_t>(table[blk]) * bs * row + h * rb;
        const int64_t n = std::min<int64_t>(bs, len - blk * bs);
        const bool full = n == bs;
        if (full) {
            for (int64_t j = 0; j < bs; ++j) {
                const uint8_t* p = base + j * row + d / 2;
                for (int64_t c = 0; c < per_row; ++c) {
                    cstep[j * per_row + c] = fp16_to_float(p + 4 * c);
                    clo[j * per_row + c] = fp16_to_float(p + 4 * c + 2);
                }
            }
        }
        for (int64_t j = 0; j < n; ++j) {
            const uint8_t* r = base + j * row;
            if (!full && store != nullptr && entry >= 0) {
                const T* e = store + ((entry * bs + j) * hkv + h) * d;
                for (int64_t i = 0; i < d; ++i) x[i] = to_float(e[i]);
            } else if (full) {
#pragma omp simd
                for (int64_t i = 0; i < d / 2; ++i) {
                    x[2 * i] = static_cast<float>(r[i] & 15) * cstep[2 * i] + clo[2 * i];
                    x[2 * i + 1] = static_cast<float>(r[i] >> 4) * cstep[2 * i + 1] + clo[2 * i + 1];
                }
            } else {
                int4_row_to_float(r, x, d, grp);
            }
            for (int64_t g = 0; g < g_size; ++g) {
                const float* qg = qf + g * d;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < d; ++i) s += qg[i] * x[i];
                scores[g * len + blk * bs + j] = s;
            }
        }
    }
    softmax_rows(scores, g_size, len);
    decoded_values<T>(out, scores, acc, x, len, h, g_size, d, 1.0f, [&](int64_t t, float* xr) {
        int4_row_to_float(vc + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row + h * rb,
                          xr, d, grp);
    });
}

template <typename T>
void decode_attention_int4(T* out, int64_t out_stride, const T* q, int64_t q_stride,
                           const uint8_t* kc, const uint8_t* vc, const int32_t* tables,
                           int64_t table_stride, const int32_t* seq_lens, int64_t b, int64_t hq,
                           int64_t hkv, int64_t d, int64_t bs, int64_t grp, int64_t rb,
                           float scale, const T* store, const int64_t* entries, int num_threads) {
    const int64_t g_size = hq / hkv;
    for_each_sequence_head(seq_lens, b, hq, hkv, d, num_threads,
                           [&](int64_t s, int64_t h, std::vector<float>& buf) {
        decode_one_int4<T>(out + s * out_stride, q + s * q_stride, kc, vc,
                           tables + s * table_stride, seq_lens[s], h, g_size, hkv, d, bs, grp,
                           rb, scale, store, entries == nullptr ? -1 : entries[s], buf);
    });
}

}  // namespace
}  // namespace tandem_cpu

using tandem_cpu::bf16;

#define TANDEM_EXPORT(SUFFIX, T)                                                                  \
    extern "C" void tandem_decode_attention_##SUFFIX(                                            \
        void* out, int64_t out_stride, const void* q, int64_t q_stride, const void* kc,          \
        const void* vc, const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,    \
        int64_t b, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int64_t window, \
        float softcap, int nt) {                                                                  \
        tandem_cpu::decode_attention<T>(static_cast<T*>(out), out_stride, static_cast<const T*>(q), q_stride,  \
                            static_cast<const T*>(kc), static_cast<const T*>(vc), tables,        \
                            table_stride, seq_lens, b, hq, hkv, d, bs, scale, window, softcap,   \
                            nt);                                                                  \
    }                                                                                             \
    extern "C" void tandem_decode_attention_fp8_##SUFFIX(                                        \
        void* out, int64_t out_stride, const void* q, int64_t q_stride, const void* kc,          \
        const void* vc, const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,    \
        int64_t b, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale,                  \
        const float* k_scale, const float* v_scale, int nt) {                                    \
        tandem_cpu::decode_attention_fp8<T>(                                                      \
            static_cast<T*>(out), out_stride, static_cast<const T*>(q), q_stride,                \
            static_cast<const tandem_cpu::fp8*>(kc), static_cast<const tandem_cpu::fp8*>(vc),    \
            tables, table_stride, seq_lens, b, hq, hkv, d, bs, scale, k_scale, v_scale, nt);     \
    }                                                                                             \
    extern "C" void tandem_decode_attention_int4_##SUFFIX(                                       \
        void* out, int64_t out_stride, const void* q, int64_t q_stride, const void* kc,          \
        const void* vc, const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,    \
        int64_t b, int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t grp, int64_t rb,      \
        float scale, const void* store, const int64_t* entries, int nt) {                        \
        tandem_cpu::decode_attention_int4<T>(                                                     \
            static_cast<T*>(out), out_stride, static_cast<const T*>(q), q_stride,                \
            static_cast<const uint8_t*>(kc), static_cast<const uint8_t*>(vc), tables,             \
            table_stride, seq_lens, b, hq, hkv, d, bs, grp, rb, scale,                           \
            static_cast<const T*>(store), entries, nt);                                          \
    }

TANDEM_EXPORT(f32, float)
TANDEM_EXPORT(bf16, bf16)
