#!/usr/bin/env bash
# `tftf quantize` output in transformers: for every scheme, tftf's output and llm-compressor's
# (oneshot + save_pretrained(save_compressed=True)) of the same small random BF16 Llama, both
# loaded with AutoModelForCausalLM.from_pretrained on the CPU and run on the same token batch;
# logits compared with each other (expected equal) and with the BF16 model's (the quantisation
# error). Also `--format fp8-native` against transformers' own FineGrainedFP8 quantisation.
# Usage: PYTHON=/path/to/python bench/quantize_logits.sh [LAYERS]
#   PYTHON: llmcompressor, transformers, compressed-tensors, accelerate, torch, safetensors.
#   LAYERS: decoder layers of the model (default 2; hidden 512, see quantize_logits.py).
# Data under bench/data, removed at the end. Exit status 1 if any load failed or logits differ.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
: "${PYTHON:?set PYTHON to a python with llmcompressor, transformers, compressed-tensors, accelerate}"
LAYERS=${1:-2}
D=bench/data
rm -rf "$D"; mkdir -p "$D"
cargo build --release -q
BIN=target/release/tftf
PY=("$PYTHON" bench/quantize_logits.py)
REF=("$PYTHON" bench/quantize_reference.py)
START=$(now)
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)

"${PY[@]}" gen "$D/in" "$LAYERS"
BYTES=$(du -sb "$D/in" | cut -f1)
OUT=() STATUS=0
# run NAME OURS LIB: byte comparison, then the logits line
run() {
    OUT+=("$("${REF[@]}" compare "$2" "$3" || true)")
    local r
    r=$("${PY[@]}" logits "$D/in" "$1" "$2" "$3" 2>"$D/log-$1") || { STATUS=1; cat "$D/log-$1" >&2; }
    OUT+=("$r")
    case $r in *DIFFERENT*|*FAILED*) STATUS=1 ;; esac
}
for s in FP8_DYNAMIC FP8_BLOCK W8A16 W4A16 NVFP4A16 MXFP4A16 MXFP8A16; do
    $BIN quantize -i "$D/in" -o "$D/tftf-$s" --scheme "$s" -q
    "${REF[@]}" oneshot "$D/in" "$s" "$D/llmc-$s" >"$D/log-oneshot-$s" 2>&1 || { cat "$D/log-oneshot-$s"; exit 1; }
    run "$s" "$D/tftf-$s" "$D/llmc-$s"
    rm -rf "$D/tftf-$s" "$D/llmc-$s"
done
$BIN quantize -i "$D/in" -o "$D/tftf-native" --scheme FP8_BLOCK --format fp8-native -q
OUT+=("$("${PY[@]}" fp8native "$D/in" "$D/hf-native" 2>"$D/log-fp8native" | grep '^fp8native' || true)")
run FP8_BLOCK-fp8-native "$D/tftf-native" "$D/hf-native"

echo "input: $BYTES bytes BF16 Llama ($LAYERS layers, hidden 512, intermediate 1536, vocab 4096); machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB, CPU only; load average at the start: $LOAD0, at the end: $(cut -d' ' -f1-3 /proc/loadavg); $(echo "$(now) - $START" | bc | cut -d. -f1) s in all"
"$PYTHON" -c 'import llmcompressor, compressed_tensors, torch, accelerate, transformers as t; print("llmcompressor", llmcompressor.__version__, "compressed-tensors", compressed_tensors.__version__, "torch", torch.__version__, "transformers", t.__version__, "accelerate", accelerate.__version__)' 2>/dev/null | tail -1
printf '%s\n' "${OUT[@]}"
rm -rf "$D"
exit $STATUS
