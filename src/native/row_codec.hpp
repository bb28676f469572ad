// Encoded embedding rows: bytes per row and the decoder the fused gathers call.
//
// The precisions and their row layouts are defined once, in
// triton_rec/precision.py (RowCodec); the codes here are the indices of
// PRECISIONS there, and decode_row() computes exactly what RowCodec.decode does
// (tests/unit/test_precision.py holds the two to each other bit for bit):
//   fp32 (0): float32[D]
//   fp16 (1): IEEE binary16[D], widened exactly
//   int8 (2): uint8 q[D], float32 scale, float32 bias; x = float(q) * scale + bias,
//             rounded after the multiply and after the add (no fused multiply-add)
// Encoding happens in Python (conversion, updates); only decoding is on the hot path.
//
// The decoders are chosen once per process from the CPU's features: an AVX2/F16C
// version where the CPU has them, portable C++ otherwise (same results: both widen
// halves exactly and round each multiply and add to float32).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "hd.hpp"  // half_to_float, int8_value: the arithmetic the GPU kernels share

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TRITON_REC_X86_DISPATCH 1
#endif

namespace triton_rec {

enum class Precision : uint32_t { kFp32 = 0, kFp16 = 1, kInt8 = 2 };
constexpr uint32_t kNumPrecisions = 3;
// Their names (ps.json embedding_precision), in code order: exported as PRECISIONS, which
// triton_rec/precision.py takes as its own.
inline constexpr const char* kPrecisionNames[kNumPrecisions] = {"fp32", "fp16", "int8"};
constexpr size_t kInt8TrailerBytes = 8;  // float32 scale, float32 bias

inline Precision precision_of(int64_t code) {
  if (code < 0 || code >= static_cast<int64_t>(kNumPrecisions)) {
    throw std::invalid_argument("unknown row precision code " + std::to_string(code));
  }
  return static_cast<Precision>(code);
}

inline size_t row_bytes_of(Precision p, size_t dim) noexcept {
  switch (p) {
    case Precision::kFp16:
      return 2 * dim;
    case Precision::kInt8:
      return dim + kInt8TrailerBytes;
    default:
      return 4 * dim;
  }
}

// Decodes one row of `dim` values at `src` into dst[0..dim).
using DecodeFn = void (*)(const void* src, float* dst, size_t dim);

namespace codec_detail {

inline void decode_fp32(const void* src, float* dst, size_t dim) {
  std::memcpy(dst, src, dim * sizeof(float));
}

inline void decode_fp16_portable(const void* src, float* dst, size_t dim) {
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t j = 0; j < dim; ++j) {
    uint16_t h;
    std::memcpy(&h, s + 2 * j, 2);
    dst[j] = half_to_float(h);
  }
}

inline void int8_trailer(const uint8_t* s, size_t dim, float& scale, float& bias) noexcept {
  std::memcpy(&scale, s + dim, 4);
  std::memcpy(&bias, s + dim + 4, 4);
}

inline void decode_int8_portable(const void* src, float* dst, size_t dim) {
  const auto* s = static_cast<const uint8_t*>(src);
  float scale, bias;
  int8_trailer(s, dim, scale, bias);
  for (size_t j = 0; j < dim; ++j) dst[j] = int8_value(s[j], scale, bias);  // two roundings
}

#ifdef TRITON_REC_X86_DISPATCH
// No "fma" in the target list: the compiler may not contract multiply + add.
__attribute__((target("avx2,f16c"))) inline void decode_fp16_avx2(const void* src, float* dst,
                                                                  size_t dim) {
  const auto* s = static_cast<const uint8_t*>(src);
  size_t j = 0;
  for (; j + 8 <= dim; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * j));
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(h));
  }
  for (; j < dim; ++j) {
    uint16_t h;
    std::memcpy(&h, s + 2 * j, 2);
    dst[j] = half_to_float(h);
  }
}

__attribute__((target("avx2,f16c"))) inline void decode_int8_avx2(const void* src, float* dst,
                                                                  size_t dim) {
  const auto* s = static_cast<const uint8_t*>(src);
  float scale, bias;
  int8_trailer(s, dim, scale, bias);
  const __m256 vs = _mm256_set1_ps(scale), vb = _mm256_set1_ps(bias);
  size_t j = 0;
  for (; j + 8 <= dim; j += 8) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + j));
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    _mm256_storeu_ps(dst + j, _mm256_add_ps(_mm256_mul_ps(f, vs), vb));
  }
  for (; j < dim; ++j) dst[j] = int8_value(s[j], scale, bias);
}

inline bool cpu_has_avx2_f16c() noexcept {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

}  // namespace codec_detail

// The decoder of precision `p`; `portable` forces the plain C++ version (tests).
inline DecodeFn decoder_for(Precision p, bool portable = false) noexcept {
#ifdef TRITON_REC_X86_DISPATCH
  const bool simd = !portable && codec_detail::cpu_has_avx2_f16c();
#else
  const bool simd = false;
  (void)portable;
#endif
  switch (p) {
    case Precision::kFp16:
#ifdef TRITON_REC_X86_DISPATCH
      if (simd) return codec_detail::decode_fp16_avx2;
#endif
      return codec_detail::decode_fp16_portable;
    case Precision::kInt8:
#ifdef TRITON_REC_X86_DISPATCH
      if (simd) return codec_detail::decode_int8_avx2;
#endif
      return codec_detail::decode_int8_portable;
    default:
      (void)simd;
      return codec_detail::decode_fp32;
  }
}

// How the rows of one table (or cache) are encoded.
struct RowFormat {
  Precision precision = Precision::kFp32;
  size_t dim = 0;
  size_t row_bytes = 0;
  DecodeFn decode = codec_detail::decode_fp32;

  RowFormat() = default;
  RowFormat(Precision p, size_t d)
      : precision(p), dim(d), row_bytes(row_bytes_of(p, d)), decode(decoder_for(p)) {}
  bool is_fp32() const noexcept { return precision == Precision::kFp32; }
};

}  // namespace triton_rec
