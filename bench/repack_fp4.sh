#!/usr/bin/env bash
# FP4 repack benchmark on a synthetic DeepSeek-V4-style checkpoint (`v4` layout: MXFP4 experts,
# one 2 GiB E4M3 Engram table, FP8 attention, BF16 embeddings): the expert transcode against a
# passthrough of the same bytes, Engram requant throughput, and peak RSS under a 256 MiB budget.
# Usage: bench/repack_fp4.sh [GIB] [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
EXAMPLES=kernel_speed start 4 "$@"
trap 'rm -rf "$D"' EXIT
generate v4 "$D/in"
ENGRAM_SHARD=$(python3 -c "import json;m=json.load(open('$D/in/model.safetensors.index.json'))['weight_map'];print(','.join(sorted({m['layers.0.engram.embed.weight'], m['layers.0.engram.embed.scale']})))")
ENGRAM_BYTES=$((524288 * 4096 + 524288 * 128))
t_pt=(); t_exp=(); t_eng=(); t_all=()
for r in $(seq "$RUNS"); do
    t_pt+=("$(timed $BIN passthrough -i "$D/in" -o "$D/out" -q)"); rm -rf "$D/out"
    t_exp+=("$(timed $BIN repack-fp4 -i "$D/in" -o "$D/out" -q --engram keep)"); rm -rf "$D/out"
    t_eng+=("$(timed $BIN repack-fp4 -i "$D/in" -o "$D/out" -q --experts keep --shard-list "$ENGRAM_SHARD")"); rm -rf "$D/out"
    t_all+=("$(timed $BIN repack-fp4 -i "$D/in" -o "$D/out" -q)"); rm -rf "$D/out"
done
$BIN repack-fp4 -i "$D/in" -o "$D/out" -q --memory-budget 256MiB --report "$D/rss.json"; rm -rf "$D/out"
RSS=$(python3 -c "import json;print(json.load(open('$D/rss.json'))['peak_rss_bytes'])")
Q=$(python3 -c "import json;r=[x for x in json.load(open('$D/rss.json'))['tensor_reports'] if x.get('op')=='requant-e2m1'][0];print('mean row cosine %.5f, min %.5f, relative MSE %.5f' % (r['mean_row_cosine'], r['min_row_cosine'], r['relative_mse']))")
PT=$(printf '%s\n' "${t_pt[@]}" | median); EXP=$(printf '%s\n' "${t_exp[@]}" | median)
ENG=$(printf '%s\n' "${t_eng[@]}" | median); ALL=$(printf '%s\n' "${t_all[@]}" | median)
echo "input: $BYTES bytes (v4 layout); runs: $RUNS; $(nproc) cores"
echo "passthrough (baseline)                 median ${PT}s (${t_pt[*]})"
echo "repack-fp4 --engram keep (experts)     median ${EXP}s (${t_exp[*]})  ratio: $(echo "scale=2; $EXP/$PT" | bc)"
echo "repack-fp4 --experts keep, Engram shards median ${ENG}s (${t_eng[*]})  $(echo "scale=3; $ENGRAM_BYTES/$ENG/1000000000" | bc) GB/s of E4M3 input"
echo "repack-fp4 (both)                      median ${ALL}s (${t_all[*]})"
echo "peak RSS, --memory-budget 256MiB: $((RSS >> 20)) MiB; Engram quality: $Q"
target/release/examples/kernel_speed | grep -i engram || true
