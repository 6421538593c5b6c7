#!/usr/bin/env bash
# `tftf gguf --outtype q4_k_m` against the two-step reference, `convert_hf_to_gguf.py --outtype
# f32` then `llama-quantize ref.gguf out.gguf Q4_K_M` (its default thread count), on a small
# Qwen3-shaped BF16 model (bench/gguf_model.py: hidden 1024, intermediate 3072, 8/4 heads,
# vocab 32000, LAYERS layers, default 4: ~230 MB; or the shape given after LAYERS, e.g.
# `32 2048 6144 16 8 151936`: 4.47 GB), same run: wall time, CPU and peak RSS of each, and
# whether the two files' tensors are equal byte for byte.
# With IMATRIX=FILE (llama-imatrix's output for this model) both also run with `--imatrix FILE`,
# and the two imatrix outputs are compared too. MODEL=DIR takes that model instead of
# generating one (kept afterwards). TYPE=T measures llama-quantize type T instead of Q4_K_M.
# Usage: LLAMA_CPP_DIR=DIR LLAMA_QUANTIZE=BIN PYTHON=PY [IMATRIX=F] [MODEL=DIR] [TYPE=T]
#        bench/gguf_kquant.sh [LAYERS [HIDDEN INTER HEADS KV_HEADS VOCAB]]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
LAYERS=${1:-4}
SHAPE=("${@:2}")
TYPE=${TYPE:-Q4_K_M}
type=$(echo "$TYPE" | tr '[:upper:]' '[:lower:]')
[ ${#SHAPE[@]} -gt 0 ] || SHAPE=(1024 3072 8 4 32000)
D=$PWD/bench/data
trap 'rm -rf "$D"' EXIT
rm -rf "$D"; mkdir -p "$D"
cargo build --release -q
BIN=$PWD/target/release/tftf
PY=${PYTHON:-python3}
M=${MODEL:-$D/m}
[ -n "${MODEL:-}" ] || "$PY" bench/gguf_model.py "$M" "$LAYERS" "${SHAPE[@]}"
echo "model: $(du -sb "$M" | cut -f1) bytes; nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"
measure "tftf gguf $type" "$BIN" gguf -i "$M" -o "$D/tftf.gguf" --outtype "$type" --vocab-pre qwen2 --no-progress
if [ -n "${IMATRIX:-}" ]; then
    measure "tftf gguf $type imatrix" "$BIN" gguf -i "$M" -o "$D/tftf.im.gguf" --outtype "$type" \
        --vocab-pre qwen2 --imatrix "$IMATRIX" --no-progress
fi
REF='
import sys
import conversion.base as b
b.TextModel.get_vocab_base_pre = lambda self, tok: "qwen2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
import convert_hf_to_gguf as c
c.main()'
measure "convert_hf_to_gguf f32" env PYTHONPATH="$LLAMA_CPP_DIR:$LLAMA_CPP_DIR/gguf-py" "$PY" -c "$REF" \
    "$M" --outfile "$D/ref.f32.gguf" --outtype f32
measure "llama-quantize $TYPE" "$LLAMA_QUANTIZE" "$D/ref.f32.gguf" "$D/ref.gguf" "$TYPE"
if [ -n "${IMATRIX:-}" ]; then
    measure "llama-quantize $TYPE imatrix" "$LLAMA_QUANTIZE" --imatrix "$IMATRIX" "$D/ref.f32.gguf" \
        "$D/ref.im.gguf" "$TYPE"
fi
rm -f "$D/ref.f32.gguf"
same() {
PYTHONPATH="$LLAMA_CPP_DIR/gguf-py" "$PY" -c '
import sys, numpy as np
from gguf import GGUFReader
a, b = (GGUFReader(p) for p in sys.argv[1:3])
ta, tb = a.tensors, b.tensors
same = [x.name for x in ta] == [y.name for y in tb] and all(
    x.tensor_type == y.tensor_type and np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8))
    for x, y in zip(ta, tb))
print("tensors equal byte for byte:", same, len(ta))' "$@"
}
same "$D/tftf.gguf" "$D/ref.gguf"
[ -z "${IMATRIX:-}" ] || same "$D/tftf.im.gguf" "$D/ref.im.gguf"
