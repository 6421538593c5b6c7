#!/usr/bin/env bash
# Reflink benchmark (root: loop-mounts an XFS image made with reflink=1): passthrough and rename
# of a synthetic checkpoint against `cp -r --reflink=never`, with the share of untouched bytes
# in shared extents (FIEMAP via filefrag) and the disk space each output adds.
# Usage: bench/reflink.sh [GIB] [RUNS] [EXTRA_LAYOUT]  (EXTRA_LAYOUT: a gen_checkpoint layout
# converted with `repack-fp4` too, when that command exists)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
GIB=${1:-5}
RUNS=${2:-3}
D=bench/data
M=$D/xfs
mkdir -p "$D" "$M"
cleanup() { umount "$M" 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT
truncate -s $(( (GIB * 4 + 8) ))G "$D/xfs.img"
mkfs.xfs -q -m reflink=1 "$D/xfs.img"
mount -o loop "$D/xfs.img" "$M"
cargo build --release -q --example gen_checkpoint
cargo build --release -q
BIN=target/release/tftf
target/release/examples/gen_checkpoint "$M/in" core "$GIB" >/dev/null
BYTES=$(du -sb "$M/in" | cut -f1)
used() { sync; df -B1 --output=used "$M" | tail -1; }
shared_pct() { # percent of the output's safetensors bytes in shared extents
    local total=0 shared=0 f
    for f in "$1"/*.safetensors; do
        total=$((total + $(stat -c %s "$f")))
        shared=$((shared + $(filefrag -v -b4096 "$f" | awk -F: '/shared/ {s += $4} END {printf "%.0f\n", s * 4096}')))
    done
    echo "scale=2; 100 * $shared / $total" | bc
}
t_cp=(); t_pt=(); t_rn=()
for r in $(seq "$RUNS"); do
    cold; s=$(now); cp -r --reflink=never "$M/in" "$M/cp"; sync; t_cp+=("$(echo "$(now) - $s" | bc)"); rm -rf "$M/cp"
    cold; s=$(now); $BIN passthrough -i "$M/in" -o "$M/pt" -q; sync; t_pt+=("$(echo "$(now) - $s" | bc)"); rm -rf "$M/pt"
    cold; s=$(now); $BIN passthrough -i "$M/in" -o "$M/rn" -q --rename '^model\.' ''; sync; t_rn+=("$(echo "$(now) - $s" | bc)"); rm -rf "$M/rn"
done
u0=$(used); $BIN passthrough -i "$M/in" -o "$M/pt" -q; u1=$(used); SH_PT=$(shared_pct "$M/pt")
$BIN passthrough -i "$M/in" -o "$M/rn" -q --rename '^model\.' ''; u2=$(used); SH_RN=$(shared_pct "$M/rn")
CP=$(printf '%s\n' "${t_cp[@]}" | median); PT=$(printf '%s\n' "${t_pt[@]}" | median); RN=$(printf '%s\n' "${t_rn[@]}" | median)
echo "XFS (reflink=1) loop image; input $BYTES bytes; runs: $RUNS; $(nproc) cores"
echo "cp -r --reflink=never + sync  median ${CP}s (${t_cp[*]})"
echo "passthrough                   median ${PT}s (${t_pt[*]})  $(echo "scale=2; 100*$PT/$CP" | bc)% of cp; shared ${SH_PT}%; disk added $(( (u1 - u0) >> 10 )) KiB ($(echo "scale=3; 100*($u1-$u0)/$BYTES" | bc)% of input)"
echo "passthrough --rename          median ${RN}s (${t_rn[*]})  $(echo "scale=2; 100*$RN/$CP" | bc)% of cp; shared ${SH_RN}%; disk added $(( (u2 - u1) >> 10 )) KiB ($(echo "scale=3; 100*($u2-$u1)/$BYTES" | bc)% of input)"
if [ -n "${3:-}" ] && $BIN repack-fp4 --help >/dev/null 2>&1; then
    target/release/examples/gen_checkpoint "$M/fp4in" "$3" "$GIB" >/dev/null
    FB=$(du -sb "$M/fp4in" | cut -f1)
    cold; s=$(now); cp -r --reflink=never "$M/fp4in" "$M/cp"; sync; TC=$(echo "$(now) - $s" | bc); rm -rf "$M/cp"
    u3=$(used); cold; s=$(now); $BIN repack-fp4 --src "$M/fp4in" --out "$M/fp4" -q --report "$D/fp4.json"; sync; TF=$(echo "$(now) - $s" | bc); u4=$(used)
    echo "repack-fp4 ($3, $FB bytes)   ${TF}s vs cp ${TC}s; untouched bytes shared: $(python3 -c "import json;b=json.load(open('$D/fp4.json'))['bytes'];c=b['tensors']-b['computed'];print(round(100*b['reflinked']/c,2) if c else 0)")% (report); disk added $(( (u4 - u3) >> 20 )) MiB"
fi
