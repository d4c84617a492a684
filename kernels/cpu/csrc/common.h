// Tandem's compiled CPU kernels: paged decode attention (decode_attention.cpp) and
// causal prefill attention (prefill_attention.cpp) reading K/V blocks where they
// lie in the cache; the KV-cache write, RMSNorm + residual, rotary embedding and
// SiLU-and-mul (elementwise.cpp). This header holds their shared helpers:
// bfloat16 <-> float32, a vectorisable exp, row softmax, AVX-512 loads, prefetches
// and reductions.
//
// Conventions: a plain C ABI (loaded with ctypes, see ../build.py); every function
// takes raw data pointers, sizes in elements and row strides in elements; the
// innermost [H, D] of every tensor is contiguous. Each kernel exists for float32
// (suffix _f32) and bfloat16 (_bf16, stored as uint16 bit patterns), except prefill
// attention (bfloat16 only). Arithmetic is float32 (the AVX-512 BF16 dot products
// multiply bf16 pairs exactly and accumulate in float32); bfloat16 results are
// rounded to nearest even at the store. Three tiers, chosen at compile time and per
// shape: AVX-512 BF16, AVX-512F, and portable loops the compiler vectorises.
// OpenMP splits the work over the `num_threads` the caller passes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// Ask for the `rows` rows of d elements (stride `row`) of the next block early:
// blocks lie anywhere in the cache, so the hardware prefetcher cannot guess them.
// Into L2 (T1), not L1: a block's 16-64 lines at once filled L1's few miss buffers
// and each prefetch then stalled the pass (decode attention over 64 x 256 float32
// tokens: 1.35 instead of 1.68 ms per layer).
template <typename T>
inline void prefetch_rows(const T* p, int64_t rows, int64_t row, int64_t d) {
    for (int64_t j = 0; j < rows; ++j)
        for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64)
            _mm_prefetch(reinterpret_cast<const char*>(p + j * row) + off, _MM_HINT_T1);
}
#endif

namespace tandem_cpu {

using bf16 = uint16_t;

#if defined(__AMX_TILE__)
// Linux hands a process AMX tile state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without it the first tile instruction
// raises SIGILL. Asked once per process; false where the kernel refuses.
inline bool amx_permitted() {
    static const bool ok = [] {
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok;
}
#endif

// IEEE fp16 (little-endian, at any alignment) -> float32: F16C where the CPU has it.
inline float fp16_to_float(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {                       // subnormal: normalise
            exp = 113;
            while (!(mant & 0x400u)) { mant <<= 1; --exp; }
            bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

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

// Threads worth waking for `work` units (multiply-adds, or elements touched): 1 for
// small work, at most `num_threads`. Waking a team costs more than a small kernel,
// and far more when the cores are shared with another process (a parallel region
// waits for its slowest thread to be scheduled). The split never changes a
// result: every kernel divides independent outputs only.
// Grow-only float32 scratch (widened activations), one per calling thread, shared by
// the kernels of every source file.
inline float* float_scratch(size_t n) {
    thread_local std::vector<float> buf;
    if (buf.size() < n) buf.resize(n);
    return buf.data();
}

inline int threads_for(int64_t work, int num_threads, int64_t grain) {
    const int64_t n = work / grain;
    return n < 1 ? 1 : (n < num_threads ? static_cast<int>(n) : num_threads);
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

#if defined(__AVX512F__)
// 16 float32 lanes from 16 elements of T.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// 16 bfloat16 (in a register) -> 16 float32 lanes, exactly.
inline __m512 from_bf16x16(__m256i raw) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const bf16* p) {
    return from_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 float32 lanes -> 16 bfloat16, rounded to nearest even, a NaN made quiet, as
// from_float<bf16>: one vcvtneps2bf16 with AVX-512 BF16 (which also flushes a
// denormal input to zero, the one difference), else integer arithmetic.
inline __m256i to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    const __m512i u = _mm512_castps_si512(v);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

constexpr int kMaxGroup = 8;    // query heads per KV head handled in registers
constexpr int kMaxChunks = 16;  // head_dim / 16 (head_dim <= 256)
#endif

#if defined(__AVX512F__)
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
#endif

}  // namespace tandem_cpu
