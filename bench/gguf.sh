#!/usr/bin/env bash
# `tftf gguf` benchmark: a Qwen3-shaped BF16 checkpoint (LAYERS layers, default 32: ~4.5 GB in
# three shards with 8-byte-padded headers, as the safetensors library writes them), converted to
# bf16 (--outtype auto) and q8_0: wall time and peak RSS (GNU time, cold cache), checked with
# gguf-py (bench/gguf_check.py). On a loop-mounted reflink XFS image (root): shared fraction and
# the disk space the bf16 output adds. With LLAMA_CPP_DIR pointing at llama.cpp (e.g. the
# llama-cpp-python 0.3.36 sdist's vendor/llama.cpp) and torch + transformers importable, the
# reference convert_hf_to_gguf.py runs in the same script on the same model, same outtypes, and
# its output is compared tensor for tensor.
# PYTHON (default python3) runs the reference; it needs torch, transformers, numpy,
# sentencepiece (e.g. /tmp/dqvenv/bin/python). `cp` of the same checkpoint is the baseline:
# what moving these bytes costs on this disk. NO_XFS=1 skips the XFS part (it needs about 2.5
# times the model's size on disk more).
# Wall times on a shared machine depend on its load; CPU seconds (user + sys) less so.
# Usage: [LLAMA_CPP_DIR=DIR] [PYTHON=PY] [NO_XFS=1] bench/gguf.sh [LAYERS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
LAYERS=${1:-32}
D=$PWD/bench/data
M=$D/xfs
cleanup() { umount "$M" 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT
rm -rf "$D"; mkdir -p "$D"
cargo build --release -q
BIN=$PWD/target/release/tftf
python3 bench/gguf_model.py "$D/Qwen3-bench" "$LAYERS"
IN=$D/Qwen3-bench
echo "model: $(du -sb "$IN" | cut -f1) bytes, $LAYERS layers"

PY=${PYTHON:-python3}
measure "cp -r (baseline)" cp -r "$IN" "$D/cp-copy"
rm -rf "$D/cp-copy"

for t in auto q8_0; do
    measure "tftf gguf $t" "$BIN" gguf -i "$IN" -o "$D/tftf-$t.gguf" --outtype $t --vocab-pre qwen2 \
        --no-progress --report "$D/tftf-$t.json"
    python3 bench/gguf_check.py "$IN" "$D/tftf-$t.gguf" | sed 's/^/  /'
done
measure "tftf gguf q8_0 256MiB" "$BIN" gguf -i "$IN" -o "$D/tftf-q8-small.gguf" --outtype q8_0 \
    --vocab-pre qwen2 --no-progress --memory-budget 256MiB
rm -f "$D/tftf-q8-small.gguf"

# The fixture tokenizer's pre-tokenizer hash is in no table of the reference's; it is told
# `qwen2` as tftf is (bench/gguf_reference.py does the same), which changes one string KV and
# nothing it spends time on.
REF='
import sys
import conversion.base as b
b.TextModel.get_vocab_base_pre = lambda self, tok: "qwen2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
import convert_hf_to_gguf as c
c.main()'
if [ -n "${LLAMA_CPP_DIR:-}" ] && "$PY" -c "import torch, transformers" 2>/dev/null; then
    for t in bf16 q8_0; do
        ours=$D/tftf-$([ $t = bf16 ] && echo auto || echo $t).gguf
        measure "convert_hf_to_gguf $t" env PYTHONPATH="$LLAMA_CPP_DIR:$LLAMA_CPP_DIR/gguf-py" "$PY" \
            -c "$REF" "$IN" --outfile "$D/ref-$t.gguf" --outtype $t
        python3 bench/gguf_check.py "$IN" "$ours" "$D/ref-$t.gguf" | sed 's/^/  /'
        rm -f "$D/ref-$t.gguf"
    done
else
    echo "reference: skipped (set LLAMA_CPP_DIR, and PYTHON to one with torch + transformers)"
fi
rm -f "$D"/tftf-*.gguf

# Extent sharing on XFS.
if [ -z "${NO_XFS:-}" ] && [ "$(id -u)" = 0 ] && command -v mkfs.xfs >/dev/null; then
    mkdir -p "$M"
    truncate -s $(( $(du -sb "$IN" | cut -f1) * 5 / 2 / 1073741824 + 4 ))G "$D/xfs.img"
    mkfs.xfs -q -m reflink=1 "$D/xfs.img"
    mount -o loop "$D/xfs.img" "$M"
    cp -r "$IN" "$M/in"
    sync
    before=$(df -B1 --output=used "$M" | tail -1)
    measure "tftf gguf auto (XFS)" "$BIN" gguf -i "$M/in" -o "$M/out.gguf" --vocab-pre qwen2 \
        --no-progress --report "$D/xfs.json"
    sync
    after=$(df -B1 --output=used "$M" | tail -1)
    python3 - "$D/xfs.json" "$((after - before))" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); b = r["bytes"]
print(f"  XFS: {b['files']} bytes written, {b['copied_unchanged']} copied unchanged, "
      f"{b['congruent']} at congruent offsets (shared fraction {r['shared_fraction']:.3f}), "
      f"{b['reflinked']} reflinked; disk added {int(sys.argv[2])} bytes "
      f"({int(sys.argv[2]) / b['files']:.1%} of the file)")
PY
    python3 bench/gguf_check.py "$M/in" "$M/out.gguf" | sed 's/^/  /'
else
    echo "XFS: skipped (NO_XFS set, or no root or xfsprogs)"
fi
