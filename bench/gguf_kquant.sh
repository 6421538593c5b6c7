#!/usr/bin/env bash
# `tftf gguf --outtype q4_k_m` against the two-step reference, `convert_hf_to_gguf.py --outtype
# f32` then `llama-quantize ref.gguf out.gguf Q4_K_M` (its default thread count), on a small
# Qwen3-shaped BF16 model (bench/gguf_model.py: hidden 1024, intermediate 3072, 8/4 heads,
# vocab 32000, LAYERS layers, default 4: ~230 MB), same run: wall time, CPU and peak RSS of
# each, and whether the two files' tensors are equal byte for byte.
# Usage: LLAMA_CPP_DIR=DIR LLAMA_QUANTIZE=BIN PYTHON=PY bench/gguf_kquant.sh [LAYERS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
LAYERS=${1:-4}
D=$PWD/bench/data
trap 'rm -rf "$D"' EXIT
rm -rf "$D"; mkdir -p "$D"
cargo build --release -q
BIN=$PWD/target/release/tftf
PY=${PYTHON:-python3}
python3 bench/gguf_model.py "$D/m" "$LAYERS" 1024 3072 8 4 32000
echo "model: $(du -sb "$D/m" | cut -f1) bytes, $LAYERS layers; nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"
measure "tftf gguf q4_k_m" "$BIN" gguf -i "$D/m" -o "$D/tftf.gguf" --outtype q4_k_m --vocab-pre qwen2 --no-progress
REF='
import sys
import conversion.base as b
b.TextModel.get_vocab_base_pre = lambda self, tok: "qwen2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
import convert_hf_to_gguf as c
c.main()'
measure "convert_hf_to_gguf f32" env PYTHONPATH="$LLAMA_CPP_DIR:$LLAMA_CPP_DIR/gguf-py" "$PY" -c "$REF" \
    "$D/m" --outfile "$D/ref.f32.gguf" --outtype f32
measure "llama-quantize Q4_K_M" "$LLAMA_QUANTIZE" "$D/ref.f32.gguf" "$D/ref.gguf" Q4_K_M
rm -f "$D/ref.f32.gguf"
PYTHONPATH="$LLAMA_CPP_DIR/gguf-py" "$PY" -c '
import sys, numpy as np
from gguf import GGUFReader
a, b = (GGUFReader(p) for p in sys.argv[1:3])
ta, tb = a.tensors, b.tensors
same = [x.name for x in ta] == [y.name for y in tb] and all(
    x.tensor_type == y.tensor_type and np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8))
    for x, y in zip(ta, tb))
print("tensors equal byte for byte:", same, len(ta))' "$D/tftf.gguf" "$D/ref.gguf"
