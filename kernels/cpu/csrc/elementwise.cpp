// Element-wise kernels of a layer: the KV-cache write, RMSNorm with a fused
// residual add, rotary embedding and SiLU-and-mul. C ABI for ../ops.py.

#include "common.h"
#include "fp8.h"

namespace tandem_cpu {
namespace {

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

// reshape_and_cache into an fp8 (e4m3) cache: element (t, h, i) is stored as
// e4m3(clamp(x / scale[h], +-448)) (saturating, round to nearest even), with the
// division done in float32 as torch's reference does.
template <typename T>
void reshape_and_cache_fp8(const T* key, int64_t key_stride, const T* value, int64_t value_stride,
                           fp8* kc, fp8* vc, const int64_t* slots, int64_t n, int64_t hkv,
                           int64_t d, const float* k_scale, const float* v_scale) {
    const int64_t row = hkv * d;
    for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;   // padding token: nothing to store
        const T* kr = key + t * key_stride;
        const T* vr = value + t * value_stride;
        fp8* ko = kc + slot * row;
        fp8* vo = vc + slot * row;
        for (int64_t h = 0; h < hkv; ++h) {
            const float ks = k_scale[h], vs = v_scale[h];
            for (int64_t i = h * d; i < (h + 1) * d; ++i) {
                ko[i] = fp8_e4m3_from_float(to_float(kr[i]) / ks);
                vo[i] = fp8_e4m3_from_float(to_float(vr[i]) / vs);
            }
        }
    }
}

template <typename T>
void rms_norm(T* out, const T* x, const T* residual, T* residual_out, const T* weight,
              int64_t n, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel num_threads(threads_for(n * hidden, num_threads, 1 << 15))
    {
        std::vector<float> tmp(static_cast<size_t>(hidden));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; ++t) {
            const T* xr = x + t * hidden;
            if (residual != nullptr) {
                const T* rr = residual + t * hidden;
                T* ro = residual_out + t * hidden;
                int64_t i0 = 0;
#if defined(__AVX512F__)
                if constexpr (std::is_same_v<T, bf16>) {     // as silu_and_mul's
                    for (; i0 + 16 <= hidden; i0 += 16) {
                        const __m256i sum = to_bf16x16(_mm512_add_ps(load16(xr + i0), load16(rr + i0)));
                        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ro + i0), sum);
                        _mm512_storeu_ps(tmp.data() + i0, from_bf16x16(sum));
                    }
                }
#endif
                for (int64_t i = i0; i < hidden; ++i) {
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
            int64_t i0 = 0;
#if defined(__AVX512F__)
            if constexpr (std::is_same_v<T, bf16>) {
                const __m512 vinv = _mm512_set1_ps(inv);
                for (; i0 + 16 <= hidden; i0 += 16)
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i0), to_bf16x16(_mm512_mul_ps(
                        _mm512_mul_ps(_mm512_loadu_ps(tmp.data() + i0), vinv), load16(weight + i0))));
            }
#endif
            for (int64_t i = i0; i < hidden; ++i) o[i] = from_float<T>(tmp[i] * inv * to_float(weight[i]));
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
#pragma omp parallel for num_threads(threads_for(n * (hq + hkv) * d, num_threads, 1 << 15)) \
    schedule(static)
    for (int64_t t = 0; t < n; ++t) {
        const float* cs = cos_sin + positions[t] * d;
        rotate<T>(query + t * q_stride, hq, d, cs);
        rotate<T>(key + t * k_stride, hkv, d, cs);
    }
}

// float32 -> IEEE fp16 bits, round to nearest even (as torch's .to(torch.float16)):
// overflow to +-inf, subnormals rounded at 2^-24, NaN kept quiet. Software only, so
// the one code path is the one the tests check on every CPU.
inline uint16_t float_to_fp16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)                             // inf, NaN
        return sign | 0x7c00u | (ax > 0x7f800000u ? 0x0200u : 0u);
    if (ax >= 0x477ff000u) return sign | 0x7c00u;      // >= 65520: rounds to inf
    if (ax < 0x38800000u) {                            // under 2^-14: subnormal (or 0)
        float a;
        std::memcpy(&a, &ax, sizeof a);
        return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));   // x 2^24
    }
    uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu));
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;   // carries into the exponent
    return sign | static_cast<uint16_t>(h);
}

// The per-token int4 KV write (format in tandem/kernels/int4_kv.py): each of the n
// tokens' K and V rows [Hkv, D] is quantized per group of `grp` channels (lo =
// fp16(min), step = fp16((max - lo) / 15), codes round((x - lo) / step) in 0..15,
// the float32 steps of int4_kv.quantize_int4_tokens, bit for bit) and stored as
// one `rb`-byte row per (token, KV head) at its slot: D/2 bytes of nibbles (low
// nibble first), then (step, lo) fp16 per group, zeros after. slot < 0: skipped.
template <typename T>
void int4_write_row(const T* x, uint8_t* r, int64_t d, int64_t grp, int64_t rb) {
    std::memset(r, 0, static_cast<size_t>(rb));
    uint8_t* params = r + d / 2;
    for (int64_t g0 = 0; g0 < d; g0 += grp) {
        float mn = to_float(x[g0]), mx = mn;
        for (int64_t j = 1; j < grp; ++j) {
            const float v = to_float(x[g0 + j]);
            mn = std::min(mn, v);
            mx = std::max(mx, v);
        }
        const uint16_t lo16 = float_to_fp16(mn);
        const float lo = fp16_to_float(reinterpret_cast<const uint8_t*>(&lo16));
        const uint16_t step16 = float_to_fp16((mx - lo) / 15.0f);
        const float step = fp16_to_float(reinterpret_cast<const uint8_t*>(&step16));
        const float inv = step > 0.0f ? 1.0f / step : 0.0f;
        std::memcpy(params + 4 * (g0 / grp), &step16, 2);
        std::memcpy(params + 4 * (g0 / grp) + 2, &lo16, 2);
        auto code = [&](int64_t i) {
            const float q = std::nearbyint((to_float(x[i]) - lo) * inv);
            return static_cast<uint32_t>(std::min(15.0f, std::max(0.0f, q)));
        };
        for (int64_t i = g0; i < g0 + grp; i += 2)
            r[i / 2] = static_cast<uint8_t>(code(i) | (code(i + 1) << 4));
    }
}

template <typename T>
void reshape_and_cache_int4(const T* key, int64_t key_stride, const T* value,
                            int64_t value_stride, uint8_t* kc, uint8_t* vc, const int64_t* slots,
                            int64_t n, int64_t hkv, int64_t d, int64_t grp, int64_t rb,
                            int num_threads) {
#pragma omp parallel for num_threads(threads_for(n * hkv * d, num_threads, 1 << 14)) schedule(static)
    for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;   // padding token: nothing to store
        for (int64_t h = 0; h < hkv; ++h) {
            int4_write_row(key + t * key_stride + h * d, kc + (slot * hkv + h) * rb, d, grp, rb);
            int4_write_row(value + t * value_stride + h * d, vc + (slot * hkv + h) * rb, d, grp, rb);
        }
    }
}

template <typename T>
void silu_and_mul(T* out, const T* x, int64_t n, int64_t f, int num_threads) {
#pragma omp parallel for num_threads(threads_for(n * f, num_threads, 1 << 14)) schedule(static)
    for (int64_t t = 0; t < n; ++t) {
        const T* gate = x + t * 2 * f;
        const T* up = gate + f;
        T* o = out + t * f;
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, bf16>) {
            // The loop below does not vectorise for bfloat16 (its rounding's NaN
            // branch): 3x slower than float32 on the same rows. The same arithmetic,
            // 16 lanes at a time (exp512 is fast_exp's polynomial).
            for (; i + 16 <= f; i += 16) {
                const __m512 g = load16(gate + i);
                const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
                const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
                const __m512 sr = from_bf16x16(to_bf16x16(s));   // rounded twice, as below
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                                    to_bf16x16(_mm512_mul_ps(sr, load16(up + i))));
            }
        }
#endif
#pragma omp simd
        for (int64_t j = i; j < f; ++j) {
            const float g = to_float(gate[j]);
            // Rounded twice like the reference (silu in T, then the product in T).
            const float silu = to_float(from_float<T>(g / (1.0f + fast_exp(-g))));
            o[j] = from_float<T>(silu * to_float(up[j]));
        }
    }
}

}  // namespace
}  // namespace tandem_cpu

using tandem_cpu::bf16;

#define TANDEM_EXPORT(SUFFIX, T)                                                                  \
    extern "C" void tandem_reshape_and_cache_##SUFFIX(                                           \
        const void* key, int64_t key_stride, const void* value, int64_t value_stride, void* kc,  \
        void* vc, const int64_t* slots, int64_t n, int64_t row) {                                \
        tandem_cpu::reshape_and_cache<T>(static_cast<const T*>(key), key_stride,                             \
                             static_cast<const T*>(value), value_stride, static_cast<T*>(kc),    \
                             static_cast<T*>(vc), slots, n, row);                                \
    }                                                                                             \
    extern "C" void tandem_rms_norm_##SUFFIX(void* out, const void* x, const void* residual,      \
                                             void* residual_out, const void* weight, int64_t n,   \
                                             int64_t hidden, float eps, int nt) {                 \
        tandem_cpu::rms_norm<T>(static_cast<T*>(out), static_cast<const T*>(x),                              \
                    static_cast<const T*>(residual), static_cast<T*>(residual_out),              \
                    static_cast<const T*>(weight), n, hidden, eps, nt);                          \
    }                                                                                             \
    extern "C" void tandem_rotary_embedding_##SUFFIX(                                            \
        const int64_t* positions, void* query, int64_t q_stride, int64_t hq, void* key,          \
        int64_t k_stride, int64_t hkv, int64_t d, const float* cos_sin, int64_t n, int nt) {     \
        tandem_cpu::rotary_embedding<T>(positions, static_cast<T*>(query), q_stride, hq,                     \
                            static_cast<T*>(key), k_stride, hkv, d, cos_sin, n, nt);             \
    }                                                                                             \
    extern "C" void tandem_silu_and_mul_##SUFFIX(void* out, const void* x, int64_t n, int64_t f,  \
                                                 int nt) {                                        \
        tandem_cpu::silu_and_mul<T>(static_cast<T*>(out), static_cast<const T*>(x), n, f, nt);               \
    }                                                                                             \
    extern "C" void tandem_reshape_and_cache_fp8_##SUFFIX(                                       \
        const void* key, int64_t key_stride, const void* value, int64_t value_stride, void* kc,  \
        void* vc, const int64_t* slots, int64_t n, int64_t hkv, int64_t d, const float* k_scale, \
        const float* v_scale) {                                                                   \
        tandem_cpu::reshape_and_cache_fp8<T>(static_cast<const T*>(key), key_stride,             \
                                             static_cast<const T*>(value), value_stride,         \
                                             static_cast<tandem_cpu::fp8*>(kc),                  \
                                             static_cast<tandem_cpu::fp8*>(vc), slots, n, hkv, d, \
                                             k_scale, v_scale);                                   \
    }                                                                                             \
    extern "C" void tandem_reshape_and_cache_int4_##SUFFIX(                                      \
        const void* key, int64_t key_stride, const void* value, int64_t value_stride, void* kc,  \
        void* vc, const int64_t* slots, int64_t n, int64_t hkv, int64_t d, int64_t grp,          \
        int64_t rb, int nt) {                                                                     \
        tandem_cpu::reshape_and_cache_int4<T>(static_cast<const T*>(key), key_stride,            \
                                              static_cast<const T*>(value), value_stride,        \
                                              static_cast<uint8_t*>(kc), static_cast<uint8_t*>(vc), \
                                              slots, n, hkv, d, grp, rb, nt);                     \
    }

TANDEM_EXPORT(f32, float)
TANDEM_EXPORT(bf16, bf16)

// float32 -> fp16 bits on its own, for tests against torch's .to(torch.float16).
extern "C" void tandem_float_to_fp16(const float* x, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = tandem_cpu::float_to_fp16(x[i]);
}

// e4m3 conversions on their own, for tests against torch.float8_e4m3fn.
extern "C" void tandem_fp8_e4m3_encode(const float* x, uint8_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = tandem_cpu::fp8_e4m3_from_float(x[i]);
}

// vectorized != 0: the row decoder of the fp8 attention kernels (F16C where
// available); 0: the 256-entry table alone.
extern "C" void tandem_fp8_e4m3_decode(const uint8_t* x, float* out, int64_t n, int vectorized) {
    if (vectorized) {
        tandem_cpu::fp8_e4m3_row_to_float(x, out, n);
        return;
    }
    const float* table = tandem_cpu::fp8_e4m3_table();
    for (int64_t i = 0; i < n; ++i) out[i] = table[x[i]];
}
