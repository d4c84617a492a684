// FP8 E4M3 ("e4m3fn": 1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no
// infinities, 0x7F/0xFF NaN, largest finite 448) <-> float32, for the fp8 KV cache
// (kv_cache_dtype fp8_e4m3). Same encoding as torch.float8_e4m3fn and the OCP
// 8-bit floating point specification (OFP8, 2023). x86 before AVX-512 FP16 has
// no FP8 instructions: encoding is scalar bit manipulation (round to nearest
// even, saturating to +-448, as torch's CPU conversion does); decoding is a
// 256-entry table, or 8 at a time through F16C (an e4m3 byte shifted into the
// fp16 bit positions is the same value times 2^-8, subnormals included).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace tandem_cpu {

using fp8 = uint8_t;

constexpr float kFp8E4m3Max = 448.0f;

// float32 -> e4m3fn: round to nearest, ties to even; |x| >= 448 (and +-inf)
// saturate to +-448; NaN -> 0x7F with x's sign.
inline fp8 fp8_e4m3_from_float(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;          // NaN
    if (a >= 0x43e00000u) return sign | 0x7eu;         // >= 448 (and inf): saturate
    if (a < 0x3c800000u) {                             // below 2^-6: subnormal, m * 2^-9
        float f;
        std::memcpy(&f, &a, sizeof f);
        // f * 512 is exact; nearbyint rounds half to even (default rounding mode).
        // m == 8 is the smallest normal, 0x08: the encoding carries over by itself.
        return sign | static_cast<uint8_t>(std::nearbyint(f * 512.0f));
    }
    // Normal: keep 3 of the 23 mantissa bits, ties to even, then rebias 127 -> 7.
    // A carry out of the mantissa bumps the exponent, as it should; a < 448
    // rounds to 448 at most, so the result never reaches the NaN code.
    const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    return sign | static_cast<uint8_t>((r >> 20) - (120u << 3));
}

// The exact float32 value of each of the 256 codes (NaN for 0x7F and 0xFF).
struct Fp8E4m3Table {
    float v[256];
    Fp8E4m3Table() {
        for (int b = 0; b < 256; ++b) {
            const int e = (b >> 3) & 15, m = b & 7;
            float mag;
            if (e == 15 && m == 7) mag = std::nanf("");
            else if (e == 0) mag = std::ldexp(static_cast<float>(m), -9);
            else mag = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
            v[b] = (b & 0x80) ? -mag : mag;
        }
    }
};

inline const float* fp8_e4m3_table() {
    static const Fp8E4m3Table table;
    return table.v;
}

#if defined(__AVX2__) && defined(__F16C__)
// 8 codes -> 8 float32 values, exact for every code but the two NaNs (which
// the KV cache never holds: writes saturate).
inline __m256 fp8x8_to_float(const fp8* p) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7);
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, mag)), _mm256_set1_ps(256.0f));
}
#endif

// dst[i] = value of src[i], i < n: 8 at a time where F16C is available (exact
// except for the NaN codes), else through the table.
inline void fp8_e4m3_row_to_float(const fp8* src, float* dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, fp8x8_to_float(src + i));
#endif
    const float* table = fp8_e4m3_table();
    for (; i < n; ++i) dst[i] = table[src[i]];
}

}  // namespace tandem_cpu
