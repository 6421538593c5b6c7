#!/usr/bin/env bash
# BitNet b1.58 to GGUF: a checkpoint shaped as microsoft/bitnet-b1.58-2B-4T (packed ternary
# projections, BF16 embeddings; bench/bitnet_model.py) converted by `tftf gguf --outtype auto`
# (TQ1_0 projections, the rest unchanged) and `--outtype tq1_0` (llama-quantize's TQ1_0 mix):
# wall time and peak RSS (GNU time, cold cache), against `cp` of the same checkpoint (what moving
# its bytes costs on this disk). With LLAMA_CPP_DIR and a PYTHON with torch, transformers and
# sentencepiece, the reference `convert_hf_to_gguf.py --outtype tq1_0 --no-lazy` runs on the same
# model too (its lazy mode fails on packed BitNet weights; tensor names are renamed to the ones
# its tensor map knows, as it lacks transformers' attn_sub_norm/ffn_sub_norm).
# Usage: [LLAMA_CPP_DIR=DIR] [PYTHON=PY] bench/bitnet.sh [LAYERS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
LAYERS=${1:-30}
D=$PWD/bench/data
trap 'rm -rf "$D"' EXIT
rm -rf "$D"; mkdir -p "$D"
cargo build --release -q
BIN=$PWD/target/release/tftf
python3 bench/bitnet_model.py "$D/bitnet" "$LAYERS"
IN=$D/bitnet
echo "model: $(du -sb "$IN" | cut -f1) bytes, $LAYERS layers"
measure "cp -r (baseline)" cp -r "$IN" "$D/cp-copy"
rm -rf "$D/cp-copy"
for t in auto tq1_0; do
    measure "tftf gguf $t" "$BIN" gguf -i "$IN" -o "$D/tftf-$t.gguf" --outtype $t --no-progress
    ls -l "$D/tftf-$t.gguf" | awk '{print "  " $5 " bytes"}'
done
measure "tftf gguf auto 256MiB" "$BIN" gguf -i "$IN" -o "$D/tftf-small.gguf" --outtype auto \
    --no-progress --memory-budget 256MiB
cmp "$D/tftf-auto.gguf" "$D/tftf-small.gguf" && echo "  same bytes at --memory-budget 256MiB"
if [ -n "${LLAMA_CPP_DIR:-}" ]; then
    # The 0c1e570 tensor map knows the 1bitLLM sub-norm names only.
    "${PYTHON:-python3}" - "$IN" "$D/ref-in" <<'PY'
import json, os, shutil, struct, sys
src, dst = sys.argv[1:3]
os.makedirs(dst)
for f in os.listdir(src):
    if f != "model.safetensors":
        shutil.copy(os.path.join(src, f), dst)
raw = open(os.path.join(src, "model.safetensors"), "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
h = {k.replace("self_attn.attn_sub_norm", "self_attn.inner_attn_ln").replace("mlp.ffn_sub_norm", "mlp.ffn_layernorm"): v
     for k, v in h.items()}
hb = json.dumps(h).encode()
hb += b" " * (-len(hb) % 8)
with open(os.path.join(dst, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
PY
    measure "convert_hf_to_gguf tq1_0" "${PYTHON:-python3}" "$LLAMA_CPP_DIR/convert_hf_to_gguf.py" \
        "$D/ref-in" --outfile "$D/ref.gguf" --outtype tq1_0 --no-lazy
    ls -l "$D/ref.gguf" | awk '{print "  " $5 " bytes"}'
fi
