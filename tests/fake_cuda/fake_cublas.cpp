// A fake cuBLAS (libcublas.so) for the test suite: single-precision GEMM with cuBLAS's
// column-major conventions, summed in order, so tftf's operand and leading-dimension choices are
// checked without a GPU.
#include <cstddef>

namespace {
int handle_dummy;
}

extern "C" {
int cublasCreate_v2(void** h) {
    *h = &handle_dummy;
    return 0;
}
int cublasDestroy_v2(void*) { return 0; }
int cublasSetStream_v2(void*, void*) { return 0; }
int cublasSetMathMode(void*, int mode) { return mode == 2 ? 0 : 7; }  // pedantic only
int cublasSgemm_v2(void*, int ta, int tb, int m, int n, int k, const float* alpha,
                   const float* a, int lda, const float* b, int ldb, const float* beta, float* c,
                   int ldc) {
    if (ta > 1 || tb > 1) return 7;  // CUBLAS_STATUS_INVALID_VALUE
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float s = 0.0f;
            for (int l = 0; l < k; l++) {
                float x = ta ? a[l + (size_t)i * lda] : a[i + (size_t)l * lda];
                float y = tb ? b[j + (size_t)l * ldb] : b[l + (size_t)j * ldb];
                s = s + x * y;
            }
            // As cuBLAS: with beta = 0, C is written without being read.
            float* o = &c[i + (size_t)j * ldc];
            *o = *beta == 0.0f ? *alpha * s : *alpha * s + *beta * *o;
        }
    return 0;
}
const char* cublasGetStatusString(int) { return "fake cuBLAS status"; }
const char* cublasGetStatusName(int) { return "CUBLAS_STATUS_FAKE"; }
}
