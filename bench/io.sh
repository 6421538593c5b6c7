#!/usr/bin/env bash
# I/O threads benchmark, tmpfs to tmpfs (memory-speed storage, where one reader or writer
# thread can be the limit): passthrough and the f32→bf16 cast with --io-threads 1, auto and 4,
# against `cp -r` of the same bytes and memcpy, all measured in the same run, runs interleaved.
# Wall time and peak RSS from /usr/bin/time; medians of RUNS.
# No cache dropping: tmpfs pages are the data.
# Usage: bench/io.sh [GIB] [RUNS] [DIR]   (default 3 GiB, 3 runs, /dev/shm/tftf-io; removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
GIB=${1:-3}
RUNS=${2:-3}
D=${3:-/dev/shm/tftf-io}
command -v /usr/bin/time >/dev/null || { echo "error: /usr/bin/time (GNU time) is needed"; exit 1; }
cargo build --release -q --example gen_checkpoint --example kernel_speed
cargo build --release -q
BIN=$PWD/target/release/tftf
rm -rf "$D"; mkdir -p "$D"
trap 'rm -rf "$D"' EXIT
target/release/examples/gen_checkpoint "$D/in" core "$GIB" >/dev/null
BYTES=$(du -sb "$D/in" | cut -f1)
AUTO=$($BIN passthrough -i "$D/in" -o "$D/probe" -q --report "$D/probe.json" &&
    python3 -c "import json;print(json.load(open('$D/probe.json'))['io_threads'])")
rm -rf "$D/probe"

# t NAME CMD...: runs CMD, appends "wall maxrss_kib" to $D/NAME.t, removes $D/out.
t() {
    local name=$1; shift
    /usr/bin/time -f "%e %M" -o "$D/time" "$@"
    cat "$D/time" >>"$D/$name.t"
    rm -rf "$D/out"
}
for _ in $(seq "$RUNS"); do
    t cp cp -r "$D/in" "$D/out"
    t pt1 "$BIN" passthrough -i "$D/in" -o "$D/out" -q --io-threads 1
    t ptA "$BIN" passthrough -i "$D/in" -o "$D/out" -q
    t cast1 "$BIN" passthrough -i "$D/in" -o "$D/out" -q --dtype bf16 --io-threads 1
    t castA "$BIN" passthrough -i "$D/in" -o "$D/out" -q --dtype bf16
    t pt4 "$BIN" passthrough -i "$D/in" -o "$D/out" -q --io-threads 4
    t cast4 "$BIN" passthrough -i "$D/in" -o "$D/out" -q --dtype bf16 --io-threads 4
done
wall() { cut -d' ' -f1 "$D/$1.t" | median; }
all() { cut -d' ' -f1 "$D/$1.t" | tr '\n' ' '; }
rss() { cut -d' ' -f2 "$D/$1.t" | median | awk '{printf "%d", $1/1024}'; }
CP=$(wall cp)
echo "input: $BYTES bytes in $(ls "$D/in" | wc -l) files on $(df --output=fstype "$D" | tail -1); runs: $RUNS; machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB; auto = --io-threads $AUTO"
target/release/examples/kernel_speed memcpy | grep memcpy
printf '%-34s %9s %9s %10s %9s  %s\n' command median "GB/s in" "vs cp" "peak RSS" runs
for n in cp pt1 ptA pt4 cast1 castA cast4; do
    case $n in
        cp) label="cp -r (baseline)" ;;
        pt1) label="passthrough --io-threads 1" ;;
        ptA) label="passthrough (auto: $AUTO)" ;;
        cast1) label="--dtype bf16 --io-threads 1" ;;
        castA) label="--dtype bf16 (auto: $AUTO)" ;;
        pt4) label="passthrough --io-threads 4" ;;
        cast4) label="--dtype bf16 --io-threads 4" ;;
    esac
    w=$(wall $n)
    printf '%-34s %8.2fs %9.2f %9.2fx %6s MiB  %s\n' "$label" "$w" \
        "$(echo "$BYTES/$w/1000000000" | bc -l)" "$(echo "$w/$CP" | bc -l)" "$(rss $n)" "$(all $n)"
done
ratio() { printf '%.2f' "$(echo "$(wall "$1")/$(wall "$2")" | bc -l)"; }
echo "speed-up over --io-threads 1: auto passthrough $(ratio pt1 ptA)x, cast $(ratio cast1 castA)x; 4 threads passthrough $(ratio pt1 pt4)x, cast $(ratio cast1 cast4)x"
