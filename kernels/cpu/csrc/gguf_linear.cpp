// Linear layer y = x W^T with W kept in GGUF's quantized blocks, for ../gguf_linear.py:
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32 weights) and the K-quants Q4_K, Q6_K
// (super-blocks of 256).
//
// The weight is GGUF's own bytes, one row per output feature: row n is K / QB
// consecutive blocks of QB weights (ggml's block_q4_0 ... block_q6_K), little-endian:
//   Q4_0  18 bytes: fp16 d, 16 qs                   w_j = (q_j - 8) d
//   Q4_1  20 bytes: fp16 d, fp16 m, 16 qs           w_j = q_j d + m
//   Q5_0  22 bytes: fp16 d, u32 qh, 16 qs           w_j = (q_j + 16 h_j - 16) d
//   Q5_1  24 bytes: fp16 d, fp16 m, u32 qh, 16 qs   w_j = (q_j + 16 h_j) d + m
//   Q8_0  34 bytes: fp16 d, 32 int8 qs              w_j = qs_j d
// with the 4-bit q_j = qs[j] & 0xF for j < 16 and qs[j - 16] >> 4 for j >= 16, and
// h_j bit j of qh;
//   Q4_K 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc_s and mins m_s
//        of the 8 sub-blocks s of 32 weights, 128 qs: sub-blocks 2i, 2i + 1 are the
//        low and high nibbles of qs[32 i .. 32 i + 31];  w = d sc_s q - dmin m_s
//   Q6_K 210 bytes: 128 ql, 64 qh, 16 int8 scales of 16-weight sub-blocks, fp16 d:
//        weight 128 h + 32 p + l has its low 4 bits in ql[64 h + 32 (p % 2) + l]
//        (high nibble for p >= 2), its high 2 bits at bit 2p of qh[32 h + l];
//        w = d sc_(w / 16) (q - 32).
// and Tandem's own block for GPTQ / AWQ int4 weights (type id 1001, not a ggml type):
//   INT4_ZP 19 bytes: fp16 s, u8 zero z, 16 qs (nibbles as Q4_0)   w_j = (q_j - z) s
// ((q_j - z) s is exact in float32: a 5-bit integer times an fp16).
// Every kernel walks a row in chunks of 32 weights (a block, or one eighth of a
// super-block), so the K-quants share the register tiles of the 32-weight types.
//
// Three entry points:
// - tandem_gguf_linear_{f32,bf16}: the decode-sized product. Each chunk is
//   dequantized in registers (4 x 8 float32 lanes, exactly the values llama.cpp's
//   and gguf-py's dequantization give: every product of a scale and a code is exact
//   in float32, and q d + m is one rounding, as theirs) and multiplied straight into
//   the accumulators of up to 4 activation rows at once, so the weight is read once
//   per 4 rows, as 0.56-1.06 bytes per weight instead of 2 (bfloat16) or 4
//   (float32). The work is split over output rows.
// - tandem_gguf_dequantize: the whole matrix to float32, for prefill-sized
//   products, where a blocked GEMM on the dequantized weight is faster than
//   re-dequantizing per row tile (the dequantization is then O(N K) beside the
//   GEMM's O(M N K)).
// - tandem_gguf_linear_q8_{f32,bf16}: the decode-sized product on int8 activation
//   blocks (each 32 values of x quantized to int8 with a float32 scale, as
//   llama.cpp's CPU backend does): the integer dot of a weight chunk's codes with
//   the activation codes (AVX-512 VNNI vpdpbusd, or AVX2 maddubs), scaled once per
//   chunk; see "int8 activations" below.
// Two tiers: AVX2 + FMA (+ F16C; + AVX-512 VNNI for the int8 dot where the CPU has
// it), and portable loops.
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_GGUF_AVX2 1
#endif

namespace tandem_cpu {
namespace {

constexpr int64_t kQK = 32;  // weights per chunk
constexpr int kMT = 4;       // activation rows per register tile
enum : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14,
              kInt4Zp = 1001 };

inline int64_t block_bytes(int qtype) {
    switch (qtype) {
        case kQ4_0: return 18;
        case kQ4_1: return 20;
        case kQ5_0: return 22;
        case kQ5_1: return 24;
        case kQ8_0: return 34;
        case kQ4_K: return 144;
        case kQ6_K: return 210;
        case kInt4Zp: return 19;
        default: return 0;
    }
}

inline int64_t block_weights(int qtype) { return qtype == kQ4_K || qtype == kQ6_K ? 256 : 32; }

// Bytes of one row of k weights (k a multiple of block_weights(qtype)).
inline int64_t row_bytes(int qtype, int64_t k) { return k / block_weights(qtype) * block_bytes(qtype); }

inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// Scale and min codes of Q4_K sub-block s (0..7) from the block's 12 scale bytes.
inline void q4k_scale_min(const uint8_t* q, int s, int* sc, int* m) {
    if (s < 4) {
        *sc = q[s] & 63;
        *m = q[s + 4] & 63;
    } else {
        *sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
        *m = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
}

// What one 32-weight chunk needs, whatever the type: 32 integer codes c_j (as
// bytes), and w_j = c_j * scale_j + offset with scale_j = scale[j / 16] (two
// half-chunk scales: Q6_K's sub-blocks are 16 weights) and one offset. For every
// type the product c_j scale_j is exact in float32 and the sum one rounding.
struct Chunk {
    uint8_t codes[kQK];
    float scale[2];
    float offset;
    bool signed_codes;   // Q8_0: the codes are int8
};

inline void decode_chunk(const uint8_t* row, int qtype, int64_t c, Chunk* ch) {
    ch->signed_codes = false;
    if (qtype == kQ4_K) {
        const uint8_t* b = row + (c / 8) * 144;
        const int s = static_cast<int>(c % 8);
        int sc, m;
        q4k_scale_min(b + 4, s, &sc, &m);
        ch->scale[0] = ch->scale[1] = fp16_to_float(b) * static_cast<float>(sc);
        ch->offset = -(fp16_to_float(b + 2) * static_cast<float>(m));
        const uint8_t* qs = b + 16 + (s / 2) * 32;
        const int shift = (s % 2) * 4;
        for (int j = 0; j < kQK; ++j) ch->codes[j] = (qs[j] >> shift) & 0xF;
        return;
    }
    if (qtype == kQ6_K) {
        const uint8_t* b = row + (c / 8) * 210;
        const int h = static_cast<int>(c % 8) / 4, p = static_cast<int>(c % 8) % 4;
        const uint8_t* ql = b + 64 * h + 32 * (p % 2);
        const uint8_t* qh = b + 128 + 32 * h;
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h + 2 * p);
        const float d = fp16_to_float(b + 208);
        const int lshift = (p / 2) * 4, hshift = 2 * p;
        // Stored as the signed q - 32 (exact), so the offset stays 0.
        for (int j = 0; j < kQK; ++j)
            ch->codes[j] = static_cast<uint8_t>(
                static_cast<int8_t>((((ql[j] >> lshift) & 0xF) | (((qh[j] >> hshift) & 3) << 4)) - 32));
        ch->signed_codes = true;
        ch->scale[0] = d * static_cast<float>(sc[0]);
        ch->scale[1] = d * static_cast<float>(sc[1]);
        ch->offset = 0.0f;
        return;
    }
    const uint8_t* b = row + c * block_bytes(qtype);
    const float d = fp16_to_float(b);
    ch->scale[0] = ch->scale[1] = d;
    if (qtype == kInt4Zp) {
        for (int j = 0; j < 16; ++j) {
            ch->codes[j] = b[3 + j] & 0xF;
            ch->codes[j + 16] = b[3 + j] >> 4;
        }
        ch->offset = -(static_cast<float>(b[2]) * d);   // exact: a 4-bit integer times an fp16
        return;
    }
    if (qtype == kQ8_0) {
        std::memcpy(ch->codes, b + 2, kQK);
        ch->signed_codes = true;
        ch->offset = 0.0f;
        return;
    }
    const bool has_min = qtype == kQ4_1 || qtype == kQ5_1;
    const bool five = qtype == kQ5_0 || qtype == kQ5_1;
    const uint8_t* qs = b + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
    const uint32_t qh = five ? load_u32(b + 2 + (has_min ? 2 : 0)) : 0u;
    for (int j = 0; j < 16; ++j) {
        ch->codes[j] = static_cast<uint8_t>((qs[j] & 0xF) | (((qh >> j) & 1u) << 4));
        ch->codes[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
    }
    // Q4_0 / Q5_0 subtract 8 / 16 from the code before scaling: (q - z) d, with
    // q - z exact, is the one rounding of q d - z d when z d is exact (always: z a
    // power of two), so the offset form gives the same float32.
    ch->offset = has_min ? fp16_to_float(b + 2) : -static_cast<float>(five ? 16 : 8) * d;
}

// The 32 weights of chunk c of a row, scalar.
inline void dequantize_chunk(const uint8_t* row, int qtype, int64_t c, float* w) {
    Chunk ch;
    decode_chunk(row, qtype, c, &ch);
    for (int j = 0; j < kQK; ++j) {
        const float q = ch.signed_codes ? static_cast<float>(static_cast<int8_t>(ch.codes[j]))
                                        : static_cast<float>(ch.codes[j]);
        w[j] = std::fma(q, ch.scale[j / 16], ch.offset);
    }
}

#if TANDEM_GGUF_AVX2
// 32 codes (bytes) -> four registers of 8 float32: codes * scale (per half) + offset.
inline void codes_to_weights(__m256i q, bool is_signed, __m256 s_lo, __m256 s_hi, __m256 off,
                             __m256 w[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) {
        const __m256i q32 = is_signed ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]);
        w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q32), i < 2 ? s_lo : s_hi, off);
    }
}

// Byte j of the result: 0x10 if bit j of qh is set, else 0 (Q5's fifth bits).
inline __m256i fifth_bits(uint32_t qh) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// The codes of chunk c of a row in one register, with what turns them into weights:
// w_j = q_j * (j < 16 ? s_lo : s_hi) + off, q_j a byte, int8 when is_signed.
struct ChunkCodes {
    __m256i q;
    bool is_signed;
    float s_lo, s_hi, off;
};

inline ChunkCodes chunk_codes(const uint8_t* row, int qtype, int64_t c) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    if (qtype == kQ8_0) {
        const uint8_t* b = row + c * 34;
        const float d = fp16_to_float(b);
        return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), true, d, d, 0.0f};
    }
    if (qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 ||
        qtype == kInt4Zp) {
        const bool has_min = qtype == kQ4_1 || qtype == kQ5_1;
        const bool five = qtype == kQ5_0 || qtype == kQ5_1;
        const bool zp = qtype == kInt4Zp;
        const uint8_t* b = row + c * block_bytes(qtype);
        const float d = fp16_to_float(b);
        // Q4_0 / Q5_0 / INT4_ZP: (q - z) d as q d - z d, the same float32 (see decode_chunk).
        const float zero = zp ? static_cast<float>(b[2]) : static_cast<float>(five ? 16 : 8);
        const float off = has_min ? fp16_to_float(b + 2) : -(zero * d);
        const uint8_t* qs = zp ? b + 3 : b + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
        // Low nibbles are weights 0..15, high nibbles 16..31.
        __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), nib);
        if (five) codes = _mm256_or_si256(codes, fifth_bits(load_u32(b + 2 + (has_min ? 2 : 0))));
        return {codes, false, d, d, off};
    }
    if (qtype == kQ4_K) {
        // 32 nibbles of one 32-byte run, low or high half by the sub-block's parity.
        const uint8_t* b = row + (c / 8) * 144;
        const int s = static_cast<int>(c % 8);
        int sc, mn;
        q4k_scale_min(b + 4, s, &sc, &mn);
        const float d = fp16_to_float(b) * static_cast<float>(sc);
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + (s / 2) * 32));
        return {_mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128((s % 2) * 4)), nib), false,
                d, d, -(fp16_to_float(b + 2) * static_cast<float>(mn))};
    }
    // Q6_K: chunk c % 8 = 4 h + p; low 4 bits from ql, high 2 from qh, minus 32.
    const uint8_t* b = row + (c / 8) * 210;
    const int h = static_cast<int>(c % 8) / 4, p = static_cast<int>(c % 8) % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (p % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((p / 2) * 4)), nib);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * p)),
                                        _mm256_set1_epi8(3));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)),
                                      _mm256_set1_epi8(32));
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h + 2 * p);
    const float d = fp16_to_float(b + 208);
    return {q, true, d * static_cast<float>(sc[0]), d * static_cast<float>(sc[1]), 0.0f};
}

// The same as weights, in four registers (weights 0-7, 8-15, 16-23, 24-31).
inline void dequantize_chunk(const uint8_t* row, int qtype, int64_t c, __m256 w[4]) {
    const ChunkCodes cc = chunk_codes(row, qtype, c);
    codes_to_weights(cc.q, cc.is_signed, _mm256_set1_ps(cc.s_lo), _mm256_set1_ps(cc.s_hi),
                     _mm256_set1_ps(cc.off), w);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// acc[r] = sum_k x[r, k] w[k] for r < MT over one weight row of `chunks` chunks.
template <int MT>
void row_tile(const float* x, int64_t xs, const uint8_t* row, int qtype, int64_t chunks,
              float* acc) {
#if TANDEM_GGUF_AVX2
    __m256 c[MT][2];
    for (int r = 0; r < MT; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
    __m256 w[4];
    for (int64_t b = 0; b < chunks; ++b) {
        dequantize_chunk(row, qtype, b, w);
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
    for (int64_t b = 0; b < chunks; ++b) {
        dequantize_chunk(row, qtype, b, w);
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
    const int64_t chunks = k / kQK, rb = row_bytes(qtype, k);
#pragma omp parallel for schedule(static) \
    num_threads(threads_for(m_len * n_len * k, num_threads, 1 << 16))
    for (int64_t n = 0; n < n_len; ++n) {
        const uint8_t* row = qweight + n * rb;
        float acc[kMT];
        for (int64_t m0 = 0; m0 < m_len; m0 += kMT) {
            const int64_t mt = std::min<int64_t>(kMT, m_len - m0);
            const float* xt = x + m0 * xs;
            switch (mt) {
                case 1: row_tile<1>(xt, xs, row, qtype, chunks, acc); break;
                case 2: row_tile<2>(xt, xs, row, qtype, chunks, acc); break;
                case 3: row_tile<3>(xt, xs, row, qtype, chunks, acc); break;
                default: row_tile<4>(xt, xs, row, qtype, chunks, acc); break;
            }
            for (int64_t r = 0; r < mt; ++r) out[(m0 + r) * out_stride + n] = from_float<T>(acc[r]);
        }
    }
}

// ---- int8 activations (llama.cpp's vec_dot with Q8_0 activation blocks) ----
// Each 32-value chunk of an activation row becomes int8 codes a_j with one float32
// scale d = max_j |x_j| / 127: a_j = round_half_even(x_j * (1 / d)) in [-127, 127]
// (all zero when d is 0), and dsum = d * sum_j a_j. A weight chunk's contribution is
// then integer arithmetic, as llama.cpp's CPU backend computes it:
//   sum_j w_j x~_j = d (s_lo sum_{j<16} q_j a_j + s_hi sum_{j>=16} q_j a_j) + off dsum
// with x~_j = d a_j. The integer dot is AVX-512 VNNI's vpdpbusd (u8 x s8, four
// products per int32 lane) or AVX2's maddubs + madd; signed codes (Q8_0, Q6_K) go in
// as |q| with the sign moved onto a (vpsignb). No sum overflows: |q| <= 128, |a| <= 127.
template <typename T>
void quantize_activations(const T* x, int64_t xs, int64_t m, int64_t k, int8_t* q, float* d,
                          float* dsum, int num_threads) {
    const int64_t chunks = k / kQK;
#pragma omp parallel for schedule(static) num_threads(threads_for(m * k, num_threads, 1 << 15))
    for (int64_t i = 0; i < m * chunks; ++i) {
        const T* xr = x + (i / chunks) * xs + (i % chunks) * kQK;
        float v[kQK], amax = 0.0f;
        for (int j = 0; j < kQK; ++j) {
            v[j] = to_float(xr[j]);
            amax = std::max(amax, std::fabs(v[j]));
        }
        const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int8_t* qi = q + i * kQK;
        int sum = 0;
        for (int j = 0; j < kQK; ++j) {
            const int a = static_cast<int>(std::nearbyint(v[j] * inv));
            qi[j] = static_cast<int8_t>(std::min(127, std::max(-127, a)));
            sum += qi[j];
        }
        d[i] = scale;
        dsum[i] = scale * static_cast<float>(sum);
    }
}

#if TANDEM_GGUF_AVX2
// Eight int32 lanes, lane i = sum of the four products u_j s_j, j = 4i .. 4i + 3.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

// acc[r] = sum_k x~[r, k] w[k] for r < MT over one weight row; qx [MT][chunks * 32]
// int8, d / dsum [MT][chunks].
template <int MT>
void row_tile_q8(const int8_t* qx, const float* d, const float* dsum, const uint8_t* row,
                 int qtype, int64_t chunks, float* acc) {
    const int64_t kx = chunks * kQK;
    float off[MT];
    for (int r = 0; r < MT; ++r) off[r] = 0.0f;
#if TANDEM_GGUF_AVX2
    __m256 c[MT];
    for (int r = 0; r < MT; ++r) c[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < chunks; ++b) {
        const ChunkCodes cc = chunk_codes(row, qtype, b);
        const __m256i u = cc.is_signed ? _mm256_sign_epi8(cc.q, cc.q) : cc.q;
        const __m256 ws = _mm256_set_m128(_mm_set1_ps(cc.s_hi), _mm_set1_ps(cc.s_lo));
        for (int r = 0; r < MT; ++r) {
            __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * kx + b * kQK));
            if (cc.is_signed) a = _mm256_sign_epi8(a, cc.q);
            const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_u8s8(u, a)), ws);
            c[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(d[r * chunks + b]), c[r]);
            off[r] = std::fma(cc.off, dsum[r * chunks + b], off[r]);
        }
    }
    for (int r = 0; r < MT; ++r) acc[r] = hsum(c[r]) + off[r];
#else
    for (int r = 0; r < MT; ++r) acc[r] = 0.0f;
    Chunk ch;
    for (int64_t b = 0; b < chunks; ++b) {
        decode_chunk(row, qtype, b, &ch);
        for (int r = 0; r < MT; ++r) {
            const int8_t* a = qx + r * kx + b * kQK;
            int32_t s[2] = {0, 0};
            for (int j = 0; j < kQK; ++j) {
                const int q = ch.signed_codes ? static_cast<int8_t>(ch.codes[j]) : ch.codes[j];
                s[j / 16] += q * a[j];
            }
            const float p = static_cast<float>(s[0]) * ch.scale[0] +
                            static_cast<float>(s[1]) * ch.scale[1];
            acc[r] = std::fma(p, d[r * chunks + b], acc[r]);
            off[r] = std::fma(ch.offset, dsum[r * chunks + b], off[r]);
        }
    }
    for (int r = 0; r < MT; ++r) acc[r] += off[r];
#endif
}

constexpr int kMT8 = 8;   // activation rows per int8 tile (the codes are 1 byte per value)

template <typename T>
void gguf_linear_q8(T* out, int64_t out_stride, const T* x, int64_t xs, const uint8_t* qweight,
                    int qtype, int64_t m_len, int64_t n_len, int64_t k, int num_threads) {
    const int64_t chunks = k / kQK, rb = row_bytes(qtype, k);
    thread_local std::vector<int8_t> qbuf;
    thread_local std::vector<float> dbuf;
    if (qbuf.size() < static_cast<size_t>(m_len * k)) qbuf.resize(m_len * k);
    if (dbuf.size() < static_cast<size_t>(2 * m_len * chunks)) dbuf.resize(2 * m_len * chunks);
    int8_t* qx = qbuf.data();
    float* d = dbuf.data();
    float* dsum = d + m_len * chunks;
    quantize_activations(x, xs, m_len, k, qx, d, dsum, num_threads);
#pragma omp parallel for schedule(static) \
    num_threads(threads_for(m_len * n_len * k, num_threads, 1 << 16))
    for (int64_t n = 0; n < n_len; ++n) {
        const uint8_t* row = qweight + n * rb;
        float acc[kMT8];
        for (int64_t m0 = 0; m0 < m_len; m0 += kMT8) {
            const int64_t mt = std::min<int64_t>(kMT8, m_len - m0);
            const int8_t* qt = qx + m0 * k;
            const float* dt = d + m0 * chunks;
            const float* st = dsum + m0 * chunks;
            switch (mt) {
                case 1: row_tile_q8<1>(qt, dt, st, row, qtype, chunks, acc); break;
                case 2: row_tile_q8<2>(qt, dt, st, row, qtype, chunks, acc); break;
                case 3: row_tile_q8<3>(qt, dt, st, row, qtype, chunks, acc); break;
                case 4: row_tile_q8<4>(qt, dt, st, row, qtype, chunks, acc); break;
                case 5: row_tile_q8<5>(qt, dt, st, row, qtype, chunks, acc); break;
                case 6: row_tile_q8<6>(qt, dt, st, row, qtype, chunks, acc); break;
                case 7: row_tile_q8<7>(qt, dt, st, row, qtype, chunks, acc); break;
                default: row_tile_q8<8>(qt, dt, st, row, qtype, chunks, acc); break;
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

// Weights of one block of `qtype` (32, or 256 for the K-quants).
int tandem_gguf_block_weights(int qtype) { return static_cast<int>(block_weights(qtype)); }

// out [M, N] (row stride out_stride) = x [M, K] (row stride x_stride) W^T, W the
// GGUF blocks of `qtype`, [N][K / QB blocks]; K a multiple of the block's QB weights.
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

// The integer dot product the int8-activation kernels use: 2 AVX-512 VNNI (or AVX-VNNI),
// 1 AVX2 maddubs, 0 portable loops.
int tandem_gguf_int8_dot_tier() {
#if TANDEM_GGUF_AVX2 && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 2;
#elif TANDEM_GGUF_AVX2
    return 1;
#else
    return 0;
#endif
}

// x [M, K] float32 (row stride x_stride) -> int8 codes q [M, K], scales d [M, K / 32]
// and d * sum(codes) dsum [M, K / 32]: the activation blocks of the _q8 products.
void tandem_gguf_quantize_activations_f32(const float* x, int64_t x_stride, int64_t m, int64_t k,
                                          int8_t* q, float* d, float* dsum, int num_threads) {
    quantize_activations(x, x_stride, m, k, q, d, dsum, num_threads);
}

// out [M, N] = x~ W^T with x~ the int8 activation blocks of x (see above); arguments
// as tandem_gguf_linear_f32's.
void tandem_gguf_linear_q8_f32(float* out, int64_t out_stride, const float* x, int64_t x_stride,
                               const uint8_t* qweight, int qtype, int64_t m, int64_t n, int64_t k,
                               int num_threads) {
    gguf_linear_q8<float>(out, out_stride, x, x_stride, qweight, qtype, m, n, k, num_threads);
}

// The same for bfloat16 activations and output.
void tandem_gguf_linear_q8_bf16(bf16* out, int64_t out_stride, const bf16* x, int64_t x_stride,
                                const uint8_t* qweight, int qtype, int64_t m, int64_t n, int64_t k,
                                int num_threads) {
    gguf_linear_q8<bf16>(out, out_stride, x, x_stride, qweight, qtype, m, n, k, num_threads);
}

// out [N, K] float32 = the weights of `qweight` ([N][K / QB blocks] of `qtype`).
void tandem_gguf_dequantize(float* out, const uint8_t* qweight, int qtype, int64_t n, int64_t k,
                            int num_threads) {
    const int64_t chunks = k / kQK, rb = row_bytes(qtype, k);
#pragma omp parallel for schedule(static) num_threads(threads_for(n * k, num_threads, 1 << 16))
    for (int64_t i = 0; i < n * chunks; ++i) {
        float* o = out + i * kQK;
        const uint8_t* row = qweight + (i / chunks) * rb;
#if TANDEM_GGUF_AVX2
        __m256 w[4];
        dequantize_chunk(row, qtype, i % chunks, w);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + 8 * j, w[j]);
#else
        dequantize_chunk(row, qtype, i % chunks, o);
#endif
    }
}

}  // extern "C"
