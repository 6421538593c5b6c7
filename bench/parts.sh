#!/usr/bin/env bash
# `--part 1/2` + `--part 2/2` + `finalize` against one run of the same conversion (f32 -> bf16
# cast, so every byte is computed), on one machine: the parts run one after the other (the
# overhead of splitting: records, checksums, finalize) and at once (two jobs sharing the cores
# and the disk). Same run for every figure; cold cache before each.
# Usage: bench/parts.sh [GIB] [RUNS]   (data under bench/data, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
start 2 "$@"
generate core "$D/in"
ARGS=(--dtype bf16 --max-shard-size 256MiB -q)

t_one=(); t_seq=(); t_par=(); t_fin=()
for r in $(seq "$RUNS"); do
    cold
    s=$(now); $BIN passthrough -i "$D/in" -o "$D/one" "${ARGS[@]}" --checksums; e=$(now)
    t_one+=("$(echo "$e - $s" | bc)")
    cold
    s=$(now)
    $BIN passthrough -i "$D/in" -o "$D/seq" "${ARGS[@]}" --part 1/2
    $BIN passthrough -i "$D/in" -o "$D/seq" "${ARGS[@]}" --part 2/2
    f=$(now); $BIN finalize "$D/seq" -q; e=$(now)
    t_seq+=("$(echo "$e - $s" | bc)"); t_fin+=("$(echo "$e - $f" | bc)")
    diff -r "$D/one" "$D/seq" >/dev/null || { echo "parts differ from one run"; exit 1; }
    cold
    s=$(now)
    $BIN passthrough -i "$D/in" -o "$D/par" "${ARGS[@]}" --part 1/2 --finalize &
    $BIN passthrough -i "$D/in" -o "$D/par" "${ARGS[@]}" --part 2/2 --finalize &
    wait
    e=$(now)
    t_par+=("$(echo "$e - $s" | bc)")
    diff -r "$D/one" "$D/par" >/dev/null || { echo "parallel parts differ from one run"; exit 1; }
    rm -rf "$D/one" "$D/seq" "$D/par"
done
ONE=$(printf '%s\n' "${t_one[@]}" | median)
SEQ=$(printf '%s\n' "${t_seq[@]}" | median)
PAR=$(printf '%s\n' "${t_par[@]}" | median)
FIN=$(printf '%s\n' "${t_fin[@]}" | median)
echo "input: $BYTES bytes in $(ls "$D/in" | wc -l) files; runs: $RUNS; machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB"
echo "one run --checksums             median ${ONE}s (${t_one[*]})"
echo "part 1/2, part 2/2, finalize    median ${SEQ}s (${t_seq[*]})  ratio to one run: $(echo "scale=2; $SEQ/$ONE" | bc); finalize alone median ${FIN}s"
echo "both parts at once (--finalize) median ${PAR}s (${t_par[*]})  ratio to one run: $(echo "scale=2; $PAR/$ONE" | bc)"
echo "outputs byte-identical to the one run: yes"
rm -rf "$D"
