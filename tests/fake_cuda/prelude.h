// Lets g++ compile kernels/tftf.cu as host code for the fake driver: CUDA's launch built-ins
// become per-thread globals that the fake cuLaunchKernel sets while it walks the grid.
#pragma once
struct dim3 {
    unsigned x, y, z;
};
static thread_local dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    unsigned long long old = *p;
    *p += v;
    return old;
}
static inline unsigned atomicMax(unsigned* p, unsigned v) {
    unsigned old = *p;
    if (v > old) *p = v;
    return old;
}
