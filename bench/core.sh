#!/usr/bin/env bash
# Streaming-core benchmark: passthrough vs `cp -r`, the f32->bf16 cast, and peak RSS under a
# 256 MiB budget with a 2.1 GiB tensor. Every figure comes from the same run as its baseline.
# Usage: bench/core.sh [GIB] [RUNS]   (data under bench/data, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
start 5 "$@"
generate core "$D/in"

t_cp=(); t_pt=(); t_cast=()
for r in $(seq "$RUNS"); do
    cold
    s=$(now); cp -r "$D/in" "$D/cp"; sync; e=$(now); t_cp+=("$(echo "$e - $s" | bc)"); rm -rf "$D/cp"
    cold
    s=$(now); $BIN passthrough -i "$D/in" -o "$D/pt" -q --report "$D/pt.json"; e=$(now)
    t_pt+=("$(echo "$e - $s" | bc)"); rm -rf "$D/pt"
    cold
    s=$(now); $BIN passthrough -i "$D/in" -o "$D/cast" --dtype bf16 -q --report "$D/cast.json"; e=$(now)
    t_cast+=("$(echo "$e - $s" | bc)"); rm -rf "$D/cast"
done
$BIN passthrough -i "$D/in" -o "$D/rss" --dtype bf16 -q --memory-budget 256MiB --report "$D/rss.json"
RSS=$(python3 -c "import json;print(json.load(open('$D/rss.json'))['peak_rss_bytes'])")
rm -rf "$D/rss"
$BIN passthrough -i "$D/in" -o "$D/rss2" -q --memory-budget 256MiB --report "$D/rss2.json"
RSS2=$(python3 -c "import json;print(json.load(open('$D/rss2.json'))['peak_rss_bytes'])")

CP=$(printf '%s\n' "${t_cp[@]}" | median)
PT=$(printf '%s\n' "${t_pt[@]}" | median)
CAST=$(printf '%s\n' "${t_cast[@]}" | median)
echo "input: $BYTES bytes in $(ls "$D/in" | wc -l) files; runs: $RUNS; machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB"
echo "cp -r + sync            median ${CP}s  (${t_cp[*]})  $(echo "scale=2; $BYTES/$CP/1000000000" | bc) GB/s"
echo "passthrough             median ${PT}s  (${t_pt[*]})  ratio to cp: $(echo "scale=2; $PT/$CP" | bc)"
echo "passthrough --dtype bf16 median ${CAST}s (${t_cast[*]})  input throughput vs passthrough: $(echo "scale=2; $PT/$CAST*100" | bc)%"
echo "peak RSS, --memory-budget 256MiB: cast $((RSS >> 20)) MiB, copy $((RSS2 >> 20)) MiB"
rm -rf "$D"
