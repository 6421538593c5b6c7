#!/usr/bin/env bash
# GPU check: builds, runs `tftf selftest` on the GPU, then times each op on a generated ≥ 8 GiB
# checkpoint with --device cuda and --device cpu, and prints one table (GB/s of input, peak
# RSS, share of the wall time the GPU lanes were busy) plus the pinned host↔device copy
# bandwidth measured in the same run, the reference for the ≥ 80 % target.
#
# Data lives in /dev/shm when it has room (the figures are about compute, not the disk).
# Usage: bench/gpu-check.sh [GIB]          (default 8; keep the run under 8 minutes)
#        DEVICES="cpu" bench/gpu-check.sh 1   (the script's own check on a machine without a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
GIB=${1:-8}
DEVICES=${DEVICES:-cuda cpu}
# Build when cargo can (a machine without crates.io can instead carry prebuilt
# target/release/tftf and target/release/examples/gen_checkpoint along).
if command -v cargo >/dev/null; then
    cargo build --release -q --example gen_checkpoint && cargo build --release -q ||
        echo "warning: cargo build failed; using the binaries already in target/release"
fi
BIN=target/release/tftf
GEN=target/release/examples/gen_checkpoint
for b in "$BIN" "$GEN"; do
    [ -x "$b" ] || { echo "error: $b missing: build it (cargo build --release --example gen_checkpoint)"; exit 1; }
done
D=bench/data
if [ -d /dev/shm ] && [ "$(df -B1G --output=avail /dev/shm | tail -1)" -gt $((GIB * 5)) ]; then
    D=/dev/shm/tftf-gpu-check
fi
rm -rf "$D"; mkdir -p "$D"
trap 'rm -rf "$D"' EXIT

echo "== selftest"
$BIN selftest --device "${DEVICES%% *}" | tee "$D/selftest.txt" | grep -E "^(selftest|copy)|MISMATCH"
H2D=$(sed -n 's/.*host→device \([0-9.]*\) \(GiB\|MiB\)\/s.*/\1 \2/p' "$D/selftest.txt")
D2H=$(sed -n 's/.*device→host \([0-9.]*\) \(GiB\|MiB\)\/s.*/\1 \2/p' "$D/selftest.txt")

ROWS=()
# Bytes of the tensors whose names contain $2 (all with ""), as `tftf info` lists them.
bytes_of() {
    $BIN info "$1" --json --filter "$2" | python3 -c 'import json,sys; print(sum(t["bytes"] for t in json.load(sys.stdin)["tensors"]))'
}
# run OP DEVICE BYTES -- tftf arguments: BYTES is the op's input, for the throughput column.
run() {
    local op=$1 dev=$2 bytes=$3; shift 4
    rm -rf "$D/out"; sync
    local s e
    s=$(date +%s.%N)
    $BIN "$@" -o "$D/out" -q --device "$dev" --report "$D/r.json"
    e=$(date +%s.%N)
    ROWS+=("$(python3 - "$op" "$dev" "$bytes" "$s" "$e" "$D/r.json" <<'PY'
import json, sys
op, dev, size, s, e, rep = sys.argv[1:]
r = json.load(open(rep))
wall, size = float(e) - float(s), int(size)
g = r.get("gpu") or {}
share = g.get("lane_busy_seconds", 0) / (2 * wall) if g else 0
print(f"{op:<20} {dev:<5} {size/2**30:7.2f} GiB {wall:8.2f} s {size/wall/1e9:8.2f} GB/s "
      f"{r['peak_rss_bytes']/2**20:8.0f} MiB {100*share:6.1f} %  {r['device']}")
PY
)")
    rm -rf "$D/out"
}

echo "== cast f32 → bf16 ($GIB GiB)"
$GEN "$D/core" core "$GIB" >/dev/null
N=$(bytes_of "$D/core" "")
for dev in $DEVICES; do run cast "$dev" "$N" -- passthrough "$D/core" --dtype bf16; done
rm -rf "$D/core"

echo "== dequant-fp8 ($GIB GiB of E4M3)"
$GEN "$D/fp8" fp8 "$GIB" >/dev/null
N=$(bytes_of "$D/fp8" "")
for dev in $DEVICES; do run dequant-fp8 "$dev" "$N" -- dequant-fp8 "$D/fp8"; done
rm -rf "$D/fp8"

echo "== repack-fp4 ($GIB GiB DeepSeek-V4 layout: MXFP4 experts, a 2 GiB E4M3 Engram table)"
$GEN "$D/v4" v4 "$GIB" >/dev/null
N=$(bytes_of "$D/v4" "")
for dev in $DEVICES; do run repack-fp4 "$dev" "$N" -- repack-fp4 -i "$D/v4"; done
N=$(bytes_of "$D/v4" "engram")
for dev in $DEVICES; do
    run requant-e2m1 "$dev" "$N" -- run "$D/v4" --key-filter '*engram*' --repack-fp4
done
rm -rf "$D/v4"

echo "== merge-lora r=64 on every linear ($GIB GiB BF16 base)"
$GEN "$D/lora" lora-r64 "$GIB" >/dev/null
N=$(bytes_of "$D/lora/base" "")
for dev in $DEVICES; do
    run merge-lora-r64 "$dev" "$N" -- merge-lora -b "$D/lora/base" -a "$D/lora/adapter"
done
rm -rf "$D/lora"

echo
echo "pinned copy bandwidth: host→device $H2D/s, device→host $D2H/s"
printf '%-20s %-5s %11s %10s %13s %12s %8s  %s\n' op dev input wall throughput "peak RSS" "GPU busy" device
printf '%s\n' "${ROWS[@]}"
