#!/usr/bin/env bash
# LoRA merge benchmark: a BF16 base (`core-bf16` layout) with an r=16 F32 adapter on every
# *_proj matrix, merge-lora against passthrough of the same base; peak RSS under 256 MiB.
# Usage: bench/lora.sh [GIB] [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
EXAMPLES=kernel_speed start 4 "$@"
trap 'rm -rf "$D"' EXIT
target/release/examples/gen_checkpoint "$D/m" lora "$GIB" >/dev/null
t_pt=(); t_m=()
for r in $(seq "$RUNS"); do
    t_pt+=("$(timed $BIN passthrough -i "$D/m/base" -o "$D/out" -q)"); rm -rf "$D/out"
    t_m+=("$(timed $BIN merge-lora -b "$D/m/base" -a "$D/m/adapter" -o "$D/out" -q)"); rm -rf "$D/out"
done
$BIN merge-lora -b "$D/m/base" -a "$D/m/adapter" -o "$D/out" -q --memory-budget 256MiB --report "$D/rss.json"; rm -rf "$D/out"
RSS=$(python3 -c "import json;print(json.load(open('$D/rss.json'))['peak_rss_bytes'])")
PT=$(printf '%s\n' "${t_pt[@]}" | median); M=$(printf '%s\n' "${t_m[@]}" | median)
echo "base: $(du -sb "$D/m/base" | cut -f1) bytes BF16; adapter $(du -sb "$D/m/adapter" | cut -f1) bytes; runs: $RUNS; $(nproc) cores"
echo "passthrough (baseline)  median ${PT}s (${t_pt[*]})"
echo "merge-lora r=16         median ${M}s (${t_m[*]})  ratio: $(echo "scale=2; $M/$PT" | bc)"
echo "peak RSS, --memory-budget 256MiB: $((RSS >> 20)) MiB"
target/release/examples/kernel_speed | grep -i lora
