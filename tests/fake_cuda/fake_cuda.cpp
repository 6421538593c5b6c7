// A fake CUDA driver (libcuda.so.1) for the test suite: "device" memory is host memory, streams
// run each call at once, and cuLaunchKernel runs the kernels of kernels/tftf.cu compiled for the
// host, walking the grid block by block and thread by thread. It lets CI run tftf's whole GPU
// path (cudarc calls, lanes, pinned staging, launch arguments, flags, downloads) without a GPU.
// It also enforces two rules of the real backend: pinned staging is never write-combined, and
// asynchronous copies only ever use pinned host memory. TFTF_FAKE_CUDA_LOG=FILE appends the name
// of every kernel launched; TFTF_FAKE_CUDA_INTEGRATED=1 makes it a unified-memory device;
// TFTF_FAKE_CUDA_CORRUPT=1 makes it a broken one. Host memory registered with cuMemHostRegister
// counts as pinned (it must be page-aligned, and is logged as "register BYTES" / "unregister");
// TFTF_FAKE_CUDA_NO_REGISTER=1 refuses registration, as a driver or system that cannot pin
// would; a range still registered when the process exits is reported on stderr.
#include "prelude.h"
#include "../../kernels/tftf.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {
std::mutex lock;
std::vector<std::pair<char*, size_t>> pinned;
// Ranges registered with cuMemHostRegister (a separate list: cuMemFreeHost must not free them).
std::vector<std::pair<char*, size_t>> registered;
int ctx_dummy, stream_dummy, event_dummy;

bool is_pinned(const void* p, size_t n) {
    std::lock_guard<std::mutex> g(lock);
    for (auto* list : {&pinned, &registered})
        for (auto& r : *list)
            if ((const char*)p >= r.first && (const char*)p + n <= r.first + r.second)
                return true;
    return false;
}

// Drops the range of `list` that starts at `p` (under the lock); false when there is none.
bool remove_range(std::vector<std::pair<char*, size_t>>& list, void* p) {
    std::lock_guard<std::mutex> g(lock);
    for (size_t i = 0; i < list.size(); i++)
        if (list[i].first == p) {
            list.erase(list.begin() + i);
            return true;
        }
    return false;
}

void log_line(const std::string& line) {
    if (const char* log = getenv("TFTF_FAKE_CUDA_LOG"))
        if (FILE* l = fopen(log, "a")) {
            fprintf(l, "%s\n", line.c_str());
            fclose(l);
        }
}

// Pinned pages left registered at exit would be a leak in a long-lived process.
struct LeakCheck {
    ~LeakCheck() {
        if (!registered.empty())
            fprintf(stderr, "fake CUDA: %zu host ranges still registered at exit\n",
                    registered.size());
    }
} leak_check;

struct Module {
    std::string ptx;
};
struct Function {
    std::string name;
};

// Runs `body` for every (block, thread) of the launch, as the GPU would (sequentially).
template <typename F>
void walk(unsigned gx, unsigned bx, F body) {
    gridDim = {gx, 1, 1};
    blockDim = {bx, 1, 1};
    for (unsigned b = 0; b < gx; b++)
        for (unsigned t = 0; t < bx; t++) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            body();
        }
}

template <typename T>
T arg(void** params, int i) {
    return *(T*)params[i];
}
}  // namespace

extern "C" {
typedef unsigned long long CUdeviceptr;

int cuInit(unsigned) { return 0; }
int cuDriverGetVersion(int* v) {
    *v = 12020;
    return 0;
}
int cuDeviceGetCount(int* c) {
    *c = 1;
    return 0;
}
int cuDeviceGet(int* d, int ordinal) {
    if (ordinal != 0) return 101;  // CUDA_ERROR_INVALID_DEVICE
    *d = 0;
    return 0;
}
int cuDeviceGetName(char* name, int len, int) {
    snprintf(name, len, "tftf fake CUDA device");
    return 0;
}
int cuDeviceGetAttribute(int* v, int attrib, int) {
    switch (attrib) {
        case 75: *v = 9; break;  // compute capability major
        case 76: *v = 0; break;  // minor
        case 18: *v = getenv("TFTF_FAKE_CUDA_INTEGRATED") ? 1 : 0; break;
        case 19: *v = 1; break;  // can map host memory
        default: *v = 0;
    }
    return 0;
}
int cuDevicePrimaryCtxRetain(void** ctx, int) {
    *ctx = &ctx_dummy;
    return 0;
}
int cuDevicePrimaryCtxRelease(int) { return 0; }
int cuDevicePrimaryCtxRelease_v2(int) { return 0; }
int cuCtxSetCurrent(void*) { return 0; }
int cuCtxGetCurrent(void** c) {
    *c = &ctx_dummy;
    return 0;
}
int cuCtxPushCurrent_v2(void*) { return 0; }
int cuCtxPopCurrent_v2(void** c) {
    if (c) *c = &ctx_dummy;
    return 0;
}
int cuCtxSynchronize() { return 0; }
int cuStreamCreate(void** s, unsigned) {
    *s = &stream_dummy;
    return 0;
}
int cuStreamCreateWithPriority(void** s, unsigned, int) {
    *s = &stream_dummy;
    return 0;
}
int cuStreamDestroy(void*) { return 0; }
int cuStreamDestroy_v2(void*) { return 0; }
int cuStreamSynchronize(void*) { return 0; }
int cuStreamWaitEvent(void*, void*, unsigned) { return 0; }
int cuEventCreate(void** e, unsigned) {
    *e = &event_dummy;
    return 0;
}
int cuEventRecord(void*, void*) { return 0; }
int cuEventSynchronize(void*) { return 0; }
int cuEventQuery(void*) { return 0; }
int cuEventDestroy(void*) { return 0; }
int cuEventDestroy_v2(void*) { return 0; }
int cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    *p = (CUdeviceptr)malloc(n);
    return *p ? 0 : 2;  // CUDA_ERROR_OUT_OF_MEMORY
}
int cuMemFree_v2(CUdeviceptr p) {
    free((void*)p);
    return 0;
}
int cuMemHostAlloc(void** p, size_t n, unsigned flags) {
    if (flags & 0x04) {  // CU_MEMHOSTALLOC_WRITECOMBINED
        fprintf(stderr, "fake CUDA: write-combined staging would make host reads slow\n");
        return 1;
    }
    *p = malloc(n);
    std::lock_guard<std::mutex> g(lock);
    pinned.push_back({(char*)*p, n});
    return 0;
}
int cuMemFreeHost(void* p) {
    if (!remove_range(pinned, p)) return 1;
    free(p);
    return 0;
}
int cuMemHostRegister_v2(void* p, size_t n, unsigned) {
    if (getenv("TFTF_FAKE_CUDA_NO_REGISTER")) return 801;  // CUDA_ERROR_NOT_SUPPORTED
    if ((size_t)p % 4096 != 0 || n == 0) {
        fprintf(stderr, "fake CUDA: cuMemHostRegister of memory that is not page-aligned\n");
        return 1;  // CUDA_ERROR_INVALID_VALUE
    }
    std::lock_guard<std::mutex> g(lock);
    for (auto& r : registered)
        if ((char*)p < r.first + r.second && r.first < (char*)p + n)
            return 712;  // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    registered.push_back({(char*)p, n});
    log_line("register " + std::to_string(n));
    return 0;
}
int cuMemHostUnregister(void* p) {
    if (remove_range(registered, p)) {
        log_line("unregister");
        return 0;
    }
    fprintf(stderr, "fake CUDA: cuMemHostUnregister of memory not registered\n");
    return 713;  // CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
}
int cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned) {
    *d = (CUdeviceptr)p;
    return 0;
}
int cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void*) {
    if (!is_pinned(src, n)) {
        fprintf(stderr, "fake CUDA: asynchronous copy from pageable memory\n");
        return 1;
    }
    memcpy((void*)dst, src, n);
    return 0;
}
int cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void*) {
    if (!is_pinned(dst, n)) {
        fprintf(stderr, "fake CUDA: asynchronous copy into pageable memory\n");
        return 1;
    }
    memcpy(dst, (const void*)src, n);
    return 0;
}
int cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void*) {
    memset((void*)d, v, n);
    return 0;
}
int cuModuleLoadData(void** m, const void* image) {
    *m = new Module{std::string((const char*)image)};
    return 0;
}
int cuModuleUnload(void* m) {
    delete (Module*)m;
    return 0;
}
int cuModuleGetFunction(void** f, void* m, const char* name) {
    // The loaded PTX must define the kernel, as a real driver would check.
    if (((Module*)m)->ptx.find(std::string(".entry ") + name + "(") == std::string::npos)
        return 500;  // CUDA_ERROR_NOT_FOUND
    *f = new Function{name};
    return 0;
}
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned, void*, void** p, void**) {
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || gx == 0 || bx == 0) return 1;
    const std::string& n = ((Function*)f)->name;
    if (const char* log = getenv("TFTF_FAKE_CUDA_LOG")) {
        std::lock_guard<std::mutex> g(lock);
        if (FILE* l = fopen(log, "a")) {
            fprintf(l, "%s\n", n.c_str());
            fclose(l);
        }
    }
    typedef const u8* in;
    if (n == "tftf_cast")
        walk(gx, bx, [&] {
            tftf_cast(arg<in>(p, 0), arg<u8*>(p, 1), arg<u64>(p, 2), arg<int>(p, 3),
                      arg<int>(p, 4));
        });
    else if (n == "tftf_dequant_fp8")
        walk(gx, bx, [&] {
            tftf_dequant_fp8(arg<in>(p, 0), arg<in>(p, 1), arg<u8*>(p, 2), arg<u64>(p, 3),
                             arg<DequantParams>(p, 4), arg<int*>(p, 5));
        });
    else if (n == "tftf_dequant_fp4")
        walk(gx, bx, [&] {
            tftf_dequant_fp4(arg<in>(p, 0), arg<in>(p, 1), arg<in>(p, 2), arg<u8*>(p, 3),
                             arg<u64>(p, 4), arg<Fp4Params>(p, 5), arg<int*>(p, 6));
        });
    else if (n == "tftf_dequant_int")
        walk(gx, bx, [&] {
            tftf_dequant_int(arg<in>(p, 0), arg<in>(p, 1), arg<in>(p, 2), arg<u8*>(p, 3),
                             arg<u64>(p, 4), arg<IntParams>(p, 5));
        });
    else if (n == "tftf_dequant_gptq")
        walk(gx, bx, [&] {
            tftf_dequant_gptq(arg<in>(p, 0), arg<in>(p, 1), arg<in>(p, 2), arg<in>(p, 3),
                              arg<u8*>(p, 4), arg<u64>(p, 5), arg<GptqParams>(p, 6),
                              arg<int*>(p, 7));
        });
    else if (n == "tftf_dequant_int4_modelopt")
        walk(gx, bx, [&] {
            tftf_dequant_int4_modelopt(arg<in>(p, 0), arg<in>(p, 1), arg<u8*>(p, 2),
                                       arg<u64>(p, 3), arg<Int4Params>(p, 4), arg<int*>(p, 5));
        });
    else if (n == "tftf_nv_block_scales")
        walk(gx, bx, [&] {
            tftf_nv_block_scales(arg<in>(p, 0), arg<u8*>(p, 1), arg<u64>(p, 2), arg<int>(p, 3),
                                 arg<int*>(p, 4));
        });
    else if (n == "tftf_nv_reencode")
        walk(gx, bx, [&] {
            tftf_nv_reencode(arg<in>(p, 0), arg<in>(p, 1), arg<u8*>(p, 2), arg<u64>(p, 3),
                             arg<int>(p, 4));
        });
    else if (n == "tftf_engram_blocks")
        walk(gx, bx, [&] {
            tftf_engram_blocks(arg<in>(p, 0), arg<in>(p, 1), arg<u8*>(p, 2), arg<u8*>(p, 3),
                               arg<BlockSums*>(p, 4), arg<u64>(p, 5), arg<int*>(p, 6),
                               arg<unsigned long long*>(p, 7));
        });
    else if (n == "tftf_engram_rows")
        walk(gx, bx, [&] {
            tftf_engram_rows(arg<const BlockSums*>(p, 0), arg<RowSums*>(p, 1), arg<u64>(p, 2),
                             arg<u64>(p, 3));
        });
    else if (n == "tftf_lora_delta")
        walk(gx, bx, [&] {
            tftf_lora_delta(arg<const float*>(p, 0), arg<const float*>(p, 1), arg<float*>(p, 2),
                            arg<u64>(p, 3), arg<DeltaParams>(p, 4));
        });
    else if (n == "tftf_dora_factors")
        walk(gx, bx, [&] {
            tftf_dora_factors(arg<in>(p, 0), arg<const float*>(p, 1), arg<const float*>(p, 2),
                              arg<float*>(p, 3), arg<u64>(p, 4), arg<LoraParams>(p, 5));
        });
    else if (n == "tftf_lora")
        walk(gx, bx, [&] {
            tftf_lora(arg<in>(p, 0), arg<const float*>(p, 1), arg<const float*>(p, 2),
                      arg<u8*>(p, 3), arg<u64>(p, 4), arg<LoraParams>(p, 5));
        });
    else if (n == "tftf_quantize_groups")
        walk(gx, bx, [&] {
            tftf_quantize_groups(arg<in>(p, 0), arg<u8*>(p, 1), arg<u8*>(p, 2), arg<u64>(p, 3),
                                 arg<QuantParams>(p, 4), arg<int*>(p, 5));
        });
    else if (n == "tftf_quantize_fp8_amax")
        walk(gx, bx, [&] {
            tftf_quantize_fp8_amax(arg<in>(p, 0), arg<u32*>(p, 1), arg<u64>(p, 2),
                                   arg<QuantParams>(p, 3), arg<int*>(p, 4));
        });
    else if (n == "tftf_quantize_fp8_scales")
        walk(gx, bx, [&] {
            tftf_quantize_fp8_scales(arg<u32*>(p, 0), arg<u8*>(p, 1), arg<u64>(p, 2),
                                     arg<QuantParams>(p, 3), arg<int*>(p, 4));
        });
    else if (n == "tftf_gguf")
        walk(gx, bx, [&] {
            tftf_gguf(arg<in>(p, 0), arg<const u32*>(p, 1), arg<u8*>(p, 2), arg<u64>(p, 3),
                      arg<GgufParams>(p, 4));
        });
    else if (n == "tftf_merge")
        walk(gx, bx, [&] {
            tftf_merge(arg<in>(p, 0), arg<const double*>(p, 1), arg<u8*>(p, 2), arg<u64>(p, 3),
                       arg<MergeParams>(p, 4));
        });
    else if (n == "tftf_gguf_blocks")
        walk(gx, bx, [&] {
            tftf_gguf_blocks(arg<in>(p, 0), arg<const u32*>(p, 1), arg<const float*>(p, 2),
                             arg<in>(p, 3), arg<u8*>(p, 4), arg<u64>(p, 5), arg<GgufParams>(p, 6));
        });
    else if (n == "tftf_quantize_fp8_codes")
        walk(gx, bx, [&] {
            tftf_quantize_fp8_codes(arg<in>(p, 0), arg<const u32*>(p, 1), arg<u8*>(p, 2),
                                    arg<u64>(p, 3), arg<QuantParams>(p, 4));
        });
    else
        return 500;
    // A broken device, for the selftest's own test: one flipped bit in a cast's output.
    if (n == "tftf_cast" && getenv("TFTF_FAKE_CUDA_CORRUPT")) arg<u8*>(p, 1)[0] ^= 1;
    return 0;
}
int cuGetErrorString(int, const char** s) {
    *s = "fake CUDA error";
    return 0;
}
int cuGetErrorName(int, const char** s) {
    *s = "CUDA_ERROR_FAKE";
    return 0;
}
}
