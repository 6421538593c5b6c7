// Loads a GGUF file with libllama (CPU) and writes the logits of every position of one batch
// of token ids as raw little-endian f32 (n_tokens x n_vocab) to OUT. The token ids are given
// directly, not as text, so the comparison does not depend on the tokenizer's pre-tokenizer.
// One thread: ggml's CPU kernels are deterministic for a given thread count, so two files with
// the same tensor bytes must give bit-equal logits.
// Usage: gguf_llama_logits MODEL.gguf OUT.f32 TOKEN... ; exit 2: load failed, 3: decode failed.
// Build: see bench/gguf_llama_check.sh (links the static libllama + ggml of a CPU-only build).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static int verbose;

// llama.cpp logs every KV and tensor at load; keep only errors unless asked, so a failed
// load still says why.
static void log_cb(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (verbose || level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.f32 TOKEN...\n", argv[0]);
        return 1;
    }
    verbose = getenv("LLAMA_VERBOSE") != NULL;
    llama_log_set(log_cb, NULL);
    llama_backend_init();

    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 2;

    int n = argc - 3;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = 256;
    cp.n_ubatch = 256;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    cp.no_perf = true;
    // F32 cache and no flash attention: the default F16 cache would round K and V, hiding
    // small differences and widening the gap to transformers' f32 logits.
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) return 2;

    struct llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = atoi(argv[3 + i]);
        b.pos[i] = i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = 1;
    }
    b.n_tokens = n;
    if (llama_decode(ctx, b)) return 3;

    int nv = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE *f = fopen(argv[2], "wb");
    if (!f) return 1;
    for (int i = 0; i < n; i++) {
        const float *l = llama_get_logits_ith(ctx, i);
        if (!l || fwrite(l, sizeof(float), nv, f) != (size_t)nv) return 3;
    }
    fclose(f);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
