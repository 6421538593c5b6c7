// Shared by the CUDA kernels (tftf.cu) and the host build of the same arithmetic that the test
// suite compares bit for bit with the Rust CPU ops (tests/kernels.rs). Everything here is plain
// C++ on builtin types: no CUDA or C library headers, so NVRTC, nvcc and g++ all take it.
//
// Floating point: every expression is written in the order the Rust op evaluates it, and the
// build turns off contraction (NVRTC/nvcc `--fmad=false`, g++ `-ffp-contract=off`), so each
// `a * b + c` rounds twice on every device, as it does in Rust.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TFTF_HD __host__ __device__ __forceinline__
#else
#define TFTF_HD static inline
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef signed char i8;
typedef int i32;

// Bit casts, a leading-zero count and correctly rounded square roots: intrinsics on the device, memcpy (which compilers turn
// into register moves) on the host.
#ifdef __CUDA_ARCH__
TFTF_HD u32 f2u(float x) { return __float_as_uint(x); }
TFTF_HD float u2f(u32 u) { return __uint_as_float(u); }
TFTF_HD u64 d2u(double x) { return (u64)__double_as_longlong(x); }
TFTF_HD double u2d(u64 u) { return __longlong_as_double((long long)u); }
TFTF_HD int clz64(u64 x) { return __clzll((long long)x); }
TFTF_HD float sqrt_f32(float x) { return __fsqrt_rn(x); }
TFTF_HD double sqrt_f64(double x) { return __dsqrt_rn(x); }
#else
template <typename To, typename From>
TFTF_HD To tftf_bit_cast(From x) {
    To t;
    __builtin_memcpy(&t, &x, sizeof(To));
    return t;
}
TFTF_HD u32 f2u(float x) { return tftf_bit_cast<u32>(x); }
TFTF_HD float u2f(u32 u) { return tftf_bit_cast<float>(u); }
TFTF_HD u64 d2u(double x) { return tftf_bit_cast<u64>(x); }
TFTF_HD double u2d(u64 u) { return tftf_bit_cast<double>(u); }
TFTF_HD int clz64(u64 x) { return __builtin_clzll(x); }
TFTF_HD float sqrt_f32(float x) { return __builtin_sqrtf(x); }
TFTF_HD double sqrt_f64(double x) { return __builtin_sqrt(x); }
#endif

TFTF_HD bool is_nan_f32(float x) { return (f2u(x) & 0x7FFFFFFFu) > 0x7F800000u; }
TFTF_HD bool is_finite_f32(float x) { return (f2u(x) & 0x7F800000u) != 0x7F800000u; }

// The canonical NaN of every f32 result the tools compute (GPUs make 0x7FFFFFFF, x86 0xFFC00000,
// Arm 0x7FC00000; a fixed pattern keeps output bytes independent of the device).
#define TFTF_NAN_F32 0x7FC00000u

// 2^n for n within the normal range of f64 (exact).
TFTF_HD double pow2_f64(int n) { return u2d((u64)(n + 1023) << 52); }

// Little-endian element loads and stores. On the device every input and output sits in its own
// allocation (aligned to 256 bytes), so typed accesses are aligned; on the host the bytes come
// from Rust slices of any alignment.
#ifdef __CUDA_ARCH__
#define TFTF_LOAD(T, p, i) (((const T*)(p))[i])
#define TFTF_STORE(T, p, i, v) (((T*)(p))[i] = (v))
#else
template <typename T>
static inline T tftf_load(const u8* p, u64 i) {
    T v;
    __builtin_memcpy(&v, p + i * sizeof(T), sizeof(T));
    return v;
}
template <typename T>
static inline void tftf_store(u8* p, u64 i, T v) {
    __builtin_memcpy(p + i * sizeof(T), &v, sizeof(T));
}
#define TFTF_LOAD(T, p, i) tftf_load<T>((const u8*)(p), (i))
#define TFTF_STORE(T, p, i, v) tftf_store<T>((u8*)(p), (i), (v))
#endif
