#!/usr/bin/env bash
# Loads tftf gguf's and convert_hf_to_gguf.py's outputs in llama.cpp (CPU) and compares their
# logits with each other and with transformers', on small models of every supported
# architecture and outtypes f32/f16/bf16/q8_0 (bench/gguf_llama_check.py); prints the table
# recorded in bench/RESULTS.md. Builds libllama (static, CPU only, no native tuning) from
# LLAMA_CPP_DIR into $LLAMA_BUILD_DIR (default /tmp/tftf-llama-build) unless already there.
# Usage: bench/gguf_llama_check.sh PYTHON LLAMA_CPP_DIR [ARCH...]
#   PYTHON needs torch, transformers, safetensors, numpy, sentencepiece (as gguf_reference.sh).
set -euo pipefail
py=${1:?python with torch+transformers}; lcp=$(cd "${2:?llama.cpp dir}" && pwd); shift 2
here=$(cd "$(dirname "$0")" && pwd)
build=${LLAMA_BUILD_DIR:-/tmp/tftf-llama-build}
cargo build --release --manifest-path "$here/../Cargo.toml" >/dev/null
if [ ! -f "$build/src/libllama.a" ]; then
    cmake -S "$lcp" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_OPENMP=OFF >/dev/null
    nice -n 10 cmake --build "$build" --target llama -j2 >/dev/null
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
gcc -O2 -c -I"$lcp/include" -I"$lcp/ggml/include" "$here/gguf_llama_logits.c" -o "$work/logits.o"
g++ "$work/logits.o" -o "$work/gguf_llama_logits" -L"$build/src" -L"$build/ggml/src" \
    -lllama -lggml -lggml-cpu -lggml-base -lpthread -lm
LLAMA_LOGITS=$work/gguf_llama_logits "$py" "$here/gguf_llama_check.py" "$lcp" "$here/../target/release/tftf" "$work" "$@"
