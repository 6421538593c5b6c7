#!/usr/bin/env bash
# FP8 block dequantisation benchmark: dequant-fp8 of a DeepSeek-V3-style checkpoint (128x128
# F32 scales, and a variant with E8M0 scales) against `passthrough --dtype bf16` producing the
# same output bytes from a BF16 input of the same shapes; peak RSS under a 256 MiB budget.
# Usage: bench/dequant.sh [GIB_OF_FP8] [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
EXAMPLES=kernel_speed start 4 "$@"
for l in fp8 fp8-e8m0 fp8-as-bf16; do target/release/examples/gen_checkpoint "$D/$l" "$l" "$GIB" >/dev/null; done
t_f32=(); t_e8=(); t_base=()
for r in $(seq "$RUNS"); do
    t_f32+=("$(timed $BIN dequant-fp8 -i "$D/fp8" -o "$D/out" -q)"); rm -rf "$D/out"
    t_e8+=("$(timed $BIN dequant-fp8 -i "$D/fp8-e8m0" -o "$D/out" -q)"); rm -rf "$D/out"
    t_base+=("$(timed $BIN passthrough -i "$D/fp8-as-bf16" -o "$D/out" --dtype bf16 -q)"); rm -rf "$D/out"
done
$BIN dequant-fp8 -i "$D/fp8" -o "$D/out" -q --memory-budget 256MiB --report "$D/rss.json"; rm -rf "$D/out"
RSS=$(python3 -c "import json;print(json.load(open('$D/rss.json'))['peak_rss_bytes'])")
F32=$(printf '%s\n' "${t_f32[@]}" | median)
E8=$(printf '%s\n' "${t_e8[@]}" | median)
BASE=$(printf '%s\n' "${t_base[@]}" | median)
echo "input: $(du -sb "$D/fp8" | cut -f1) bytes of FP8 -> $(du -sb "$D/fp8-as-bf16" | cut -f1) bytes of BF16; runs: $RUNS; $(nproc) cores"
echo "passthrough --dtype bf16 (bf16 in)  median ${BASE}s (${t_base[*]})"
echo "dequant-fp8, F32 scales            median ${F32}s (${t_f32[*]})  ratio: $(echo "scale=2; $F32/$BASE" | bc)"
echo "dequant-fp8, E8M0 scales           median ${E8}s (${t_e8[*]})  ratio: $(echo "scale=2; $E8/$BASE" | bc)"
echo "peak RSS, --memory-budget 256MiB: $((RSS >> 20)) MiB"
target/release/examples/kernel_speed | grep dequant
rm -rf "$D"
