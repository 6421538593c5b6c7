#!/usr/bin/env bash
# tftf gguf vs llama.cpp's convert_hf_to_gguf.py on small models of every supported
# architecture; prints the table recorded in bench/RESULTS.md ("GGUF output").
# Usage: bench/gguf_reference.sh PYTHON LLAMA_CPP_DIR [ARCH...]
#   PYTHON needs torch, transformers, safetensors, numpy, sentencepiece (the converter imports it).
set -euo pipefail
py=${1:?python with torch+transformers}; lcp=${2:?llama.cpp dir (convert_hf_to_gguf.py, gguf-py)}; shift 2
here=$(cd "$(dirname "$0")" && pwd)
cargo build --release --manifest-path "$here/../Cargo.toml" >/dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
"$py" "$here/gguf_reference.py" "$lcp" "$here/../target/release/tftf" "$work" "$@"
