#!/usr/bin/env bash
# `tftf quantize` on the CPU: FP8_BLOCK, NVFP4A16 and W4A16 against passthrough of the same
# BF16 checkpoint ([4096, 4096] Linear weights, `gen_checkpoint fp8-as-bf16`), input GB/s and
# peak RSS under a 256 MiB budget. Every figure comes from the same run as its baseline.
# Usage: bench/quantize.sh [GIB] [RUNS]   (data under bench/data, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
GIB=${1:-2}
RUNS=${2:-3}
D=bench/data
rm -rf "$D"; mkdir -p "$D"
cargo build --release -q --example gen_checkpoint
cargo build --release -q
BIN=target/release/tftf
target/release/examples/gen_checkpoint "$D/in" fp8-as-bf16 "$GIB" >/dev/null
BYTES=$(du -sb "$D/in" | cut -f1)

declare -A T
for r in $(seq "$RUNS"); do
    T[passthrough]+="$(timed $BIN passthrough -i "$D/in" -o "$D/out" -q) "; rm -rf "$D/out"
    for s in FP8_BLOCK NVFP4A16 W4A16; do
        T[$s]+="$(timed $BIN quantize -i "$D/in" -o "$D/out" --scheme $s -q) "; rm -rf "$D/out"
    done
done
echo "input: $BYTES bytes BF16 in $(ls "$D/in" | wc -l) files; runs: $RUNS; machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB; CPU only"
for k in passthrough FP8_BLOCK NVFP4A16 W4A16; do
    m=$(printf '%s\n' ${T[$k]} | median)
    printf '%-12s median %6.2fs (%s) %5.2f GB/s of input\n' "$k" "$m" "${T[$k]% }" "$(echo "scale=3; $BYTES/$m/1000000000" | bc)"
done
for s in FP8_BLOCK NVFP4A16; do
    $BIN quantize -i "$D/in" -o "$D/rss" --scheme $s -q --memory-budget 256MiB --report "$D/rss.json"
    echo "peak RSS $s, --memory-budget 256MiB: $(( $(python3 -c "import json;print(json.load(open('$D/rss.json'))['peak_rss_bytes'])") >> 20 )) MiB"
    rm -rf "$D/rss"
done
rm -rf "$D"
