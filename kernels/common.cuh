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

TFTF_HD u32 f2u(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    u32 u;
    __builtin_memcpy(&u, &x, 4);
    return u;
#endif
}

TFTF_HD float u2f(u32 u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    __builtin_memcpy(&x, &u, 4);
    return x;
#endif
}

TFTF_HD u64 d2u(double x) {
#ifdef __CUDA_ARCH__
    return (u64)__double_as_longlong(x);
#else
    u64 u;
    __builtin_memcpy(&u, &x, 8);
    return u;
#endif
}

TFTF_HD double u2d(u64 u) {
#ifdef __CUDA_ARCH__
    return __longlong_as_double((long long)u);
#else
    double x;
    __builtin_memcpy(&x, &u, 8);
    return x;
#endif
}

TFTF_HD int clz64(u64 x) {
#ifdef __CUDA_ARCH__
    return __clzll((long long)x);
#else
    return __builtin_clzll(x);
#endif
}

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
