// Code that both compilers build: g++ (the native core, the CPU twins the tests run) and
// NVRTC (the GPU kernels, src/native/kernels/*.cu, compiled at model load or in CI to PTX
// with no device). Nothing here includes a standard header under NVRTC, which has none.
//
// TREC_HD marks a function of both worlds. Where the two must differ in *how* (a 128-bit
// product, reinterpreting bits, keeping two float roundings), each branch computes the
// same value bit for bit; tests/unit/test_gpu_kernels.py holds the CPU side to the numpy
// references, and the GPU check (tests/gpu) holds the kernels to them.
#pragma once

#if defined(__CUDACC__)
#define TREC_HD __host__ __device__ __forceinline__
#else
#define TREC_HD inline
#endif

#if defined(__CUDACC_RTC__)
// NVRTC has no <cstdint>: the LP64 types the host side uses (int64_t is `long` there).
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;
typedef unsigned long uint64_t;
#else
#include <cstdint>
#include <cstring>
#endif

namespace triton_rec {

constexpr int64_t kInt64Max = 9223372036854775807L;
constexpr int64_t kInt64Min = -kInt64Max - 1;

// splitmix64 finalizer: a bijective, strong 64-bit mixer (the node store's index, the CPU
// cache's sets and sketch, the device cache's sets and sketch all use it).
TREC_HD uint64_t mix64(uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// floor(h * n / 2^64) for n < 2^32: an index in [0, n) from the high bits of h
// ("fastrange"), exactly, in uint64 arithmetic: with h = hi * 2^32 + lo it is
// (hi * n + (lo * n >> 32)) >> 32 (array_cache.fastrange computes the same in numpy).
TREC_HD uint64_t fastrange(uint64_t h, uint64_t n) noexcept {
  return ((h >> 32) * n + (((h & 0xffffffffULL) * n) >> 32)) >> 32;
}

TREC_HD float bits_to_float(uint32_t bits) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// IEEE binary16 -> float32, exactly (subnormals normalised, inf/NaN payload kept).
TREC_HD float half_to_float(uint16_t h) noexcept {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    exp = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  return bits_to_float(bits);
}

// q * scale + bias with the product rounded to float32 before the sum (no fused
// multiply-add): RowCodec.decode's int8 arithmetic.
TREC_HD float int8_value(uint8_t q, float scale, float bias) noexcept {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(static_cast<float>(q), scale), bias);
#else
  volatile float prod = static_cast<float>(q) * scale;
  return prod + bias;
#endif
}

// A little-endian uint32 at any byte address (int8 rows put their scale and bias at an
// offset of `dim` bytes, which need not be aligned).
TREC_HD uint32_t load_u32(const uint8_t* p) noexcept {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

// Row precisions: the codes of triton_rec/precision.py (PRECISIONS) and row_codec.hpp.
constexpr uint32_t kPrecisionFp32 = 0;
constexpr uint32_t kPrecisionFp16 = 1;
constexpr uint32_t kPrecisionInt8 = 2;

// Bytes of one encoded row of `dim` values (row_codec.hpp's row_bytes_of).
TREC_HD int64_t encoded_row_bytes(uint32_t precision, int64_t dim) noexcept {
  return precision == kPrecisionFp16 ? 2 * dim : precision == kPrecisionInt8 ? dim + 8 : 4 * dim;
}

// How a rule reads memory: PlainLoad (data nobody writes meanwhile: the tables), or
// FreshLoad (the cache, which writers in other processes and on other SMs change: on a
// GPU a load past the SM's L1, which is not coherent, as every seqlock-guarded read
// must be; on the CPU a volatile load).
struct PlainLoad {
  template <class T>
  static TREC_HD T at(const T* p) noexcept {
    return *p;
  }
};

struct FreshLoad {
#if defined(__CUDA_ARCH__)
  static __device__ float at(const float* p) noexcept { return __ldcg(p); }
  static __device__ uint16_t at(const uint16_t* p) noexcept {
    return __ldcg(reinterpret_cast<const unsigned short*>(p));
  }
  static __device__ uint8_t at(const uint8_t* p) noexcept {
    return __ldcg(reinterpret_cast<const unsigned char*>(p));
  }
  static __device__ int64_t at(const int64_t* p) noexcept {
    return static_cast<int64_t>(__ldcg(reinterpret_cast<const long long*>(p)));
  }
#else
  template <class T>
  static T at(const T* p) noexcept {
    return *const_cast<const volatile T*>(p);
  }
#endif
};

// Decodes values [first, dim) stepping by `step` of the encoded row `row` into dst
// (dst[j] for each such j). One lane of a group of `step` lanes calls it with first = its
// lane; a single thread with first = 0, step = 1.
template <class Load = PlainLoad>
TREC_HD void decode_row_part(const uint8_t* row, uint32_t precision, int64_t dim, float* dst,
                             int64_t first, int64_t step) noexcept {
  if (precision == kPrecisionFp32) {
    const float* src = reinterpret_cast<const float*>(row);
    for (int64_t j = first; j < dim; j += step) dst[j] = Load::at(src + j);
  } else if (precision == kPrecisionFp16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(row);
    for (int64_t j = first; j < dim; j += step) dst[j] = half_to_float(Load::at(src + j));
  } else {
    uint8_t tail[8];
    for (int b = 0; b < 8; ++b) tail[b] = Load::at(row + dim + b);
    const float scale = bits_to_float(load_u32(tail));
    const float bias = bits_to_float(load_u32(tail + 4));
    for (int64_t j = first; j < dim; j += step) dst[j] = int8_value(Load::at(row + j), scale, bias);
  }
}

// The node store's index (hash_index.hpp has the persisted layout): slots of (key, row),
// row -1 empty, linear probing from the home slot `h`. Returns the row of `key` (what its
// slot holds, unchecked; *slot is where) or -1. A full (corrupt) index is scanned once.
TREC_HD int64_t index_probe(const int64_t* slots, uint64_t capacity, int64_t key, uint64_t h,
                            uint64_t* slot) noexcept {
  const uint64_t mask = capacity - 1;
  for (uint64_t n = 0; n < capacity; ++n, h = (h + 1) & mask) {
    const int64_t row = slots[2 * h + 1];
    if (row == -1) return -1;
    if (slots[2 * h] == key) {
      *slot = h;
      return row;
    }
  }
  return -1;
}

// index_probe from the key's home slot, mix64(key) & (capacity - 1).
TREC_HD int64_t probe_index(const int64_t* slots, uint64_t capacity, int64_t key) noexcept {
  uint64_t slot = 0;
  return index_probe(slots, capacity, key, mix64(static_cast<uint64_t>(key)) & (capacity - 1),
                     &slot);
}

}  // namespace triton_rec
