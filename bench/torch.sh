#!/usr/bin/env bash
# PyTorch inputs (issue 13): `tftf passthrough --memory-budget 256MiB` of a torch.save zip `.bin`
# and of a 2-rank PyTorch Distributed Checkpoint, each GIB GiB (default 2: one 1 GiB BF16 tensor,
# 32 MiB BF16 matrices, F32 norms and an F32 head; bench/torch_model.py, written by torch itself,
# outside the timed part), against PyTorch's own conversions in the same run:
#   .bin: torch.load(mmap=False) + safetensors.torch.save_file
#   DCP:  torch.distributed.checkpoint.format_utils.dcp_to_torch_save, and its load + save_file
# Wall time, CPU seconds and peak RSS from GNU time (cold cache, medians of RUNS); tftf's peak RSS
# also from its report, and with --dtype f16 (every byte through memory); the report's reflinked,
# in-kernel and through-memory bytes (contiguous tensors should move in the kernel);
# tftf's output compared tensor by tensor with the save_file baselines (bench/torch_check.py).
# Needs torch and safetensors importable by $PYTHON (default python3).
# Usage: bench/torch.sh [GIB] [RUNS]   (data under bench/data, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
GIB=${1:-2}
RUNS=${2:-3}
PY=${PYTHON:-python3}
D=$PWD/bench/data
trap 'rm -rf "$D"' EXIT
rm -rf "$D"; mkdir -p "$D"
cargo build --release -q
BIN=$PWD/target/release/tftf
$PY bench/torch_model.py bin "$D/model.bin" "$GIB"
$PY bench/torch_model.py dcp "$D/dcp" "$GIB" 2>&1 | grep -v -i warn || true
[ -f "$D/dcp/.metadata" ] || { echo "DCP generation failed"; exit 1; }
$BIN info -i "$D/model.bin" | grep -E "shard\(s\)|^format:" | sed 's/^/  /'
$BIN info -i "$D/dcp" | grep -E "shard\(s\)|^format:" | sed 's/^/  /'
echo "inputs: .bin $(du -sb "$D/model.bin" | cut -f1) bytes; DCP $(du -sb "$D/dcp" | cut -f1) bytes" \
    "($(ls "$D/dcp" | tr '\n' ' '))"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')," \
    "$(free -g | awk '/Mem/{print $2}') GiB; torch $($PY -c 'import torch; print(torch.__version__)'); runs: $RUNS"

# name command...: one cold run under GNU time; appends "wall cpu rss_kib" to $D/t.name.
measure() {
    local name=$1; shift
    cold
    /usr/bin/time -f "%e %U %S %M" -o "$D/time" "$@" >"$D/log" 2>&1 || { cat "$D/log"; exit 1; }
    read -r wall user sys kib <"$D/time"
    echo "$wall $(echo "$user + $sys" | bc -l) $kib" >>"$D/t.$name"
}
col() { awk -v c="$2" '{print $c}' "$D/t.$1" | median; }

for r in $(seq "$RUNS"); do
    measure tftf-bin "$BIN" passthrough -i "$D/model.bin" -o "$D/out-bin" -q --memory-budget 256MiB \
        --report "$D/bin.json"
    [ "$r" = "$RUNS" ] || rm -rf "$D/out-bin"
    measure torch-bin "$PY" bench/torch_check.py bin-st "$D/model.bin" "$D/ref-bin.safetensors"
    [ "$r" = "$RUNS" ] || rm -f "$D/ref-bin.safetensors"
    measure tftf-dcp "$BIN" passthrough -i "$D/dcp" -o "$D/out-dcp" -q --memory-budget 256MiB \
        --report "$D/dcp.json"
    [ "$r" = "$RUNS" ] || rm -rf "$D/out-dcp"
    measure torch-dcp-pt "$PY" bench/torch_check.py dcp-pt "$D/dcp" "$D/ref-dcp.pt"
    rm -f "$D/ref-dcp.pt"
    # Every byte through user memory (a cast): the budget, not the kernel, bounds the RSS.
    for i in bin dcp; do
        [ $i = bin ] && in=$D/model.bin || in=$D/dcp
        measure tftf-$i-f16 "$BIN" passthrough -i "$in" -o "$D/f16" -q --memory-budget 256MiB \
            --dtype f16 --report "$D/$i-f16.json"
        rm -rf "$D/f16"
    done
    measure torch-dcp-st "$PY" bench/torch_check.py dcp-st "$D/dcp" "$D/ref-dcp.safetensors"
    [ "$r" = "$RUNS" ] || rm -f "$D/ref-dcp.safetensors"
done

row() {  # name [baseline]
    local w c m
    w=$(col "$1" 1); c=$(col "$1" 2); m=$(col "$1" 3)
    printf '%-14s median %7.2f s wall (%s)  %7.2f s CPU  peak RSS %7.1f MiB' "$1" "$w" \
        "$(awk '{printf "%s ", $1}' "$D/t.$1" | sed 's/ $//')" "$c" "$(echo "$m / 1024" | bc -l)"
    [ -z "${2:-}" ] || printf '  %.2fx %s' "$(echo "$w / $(col "$2" 1)" | bc -l)" "$2"
    echo
}
row torch-bin; row tftf-bin torch-bin
row torch-dcp-pt; row torch-dcp-st; row tftf-dcp torch-dcp-st
row tftf-bin-f16 tftf-bin; row tftf-dcp-f16 tftf-dcp
$PY - "$D/bin.json" "$D/dcp.json" "$D/bin-f16.json" "$D/dcp-f16.json" <<'PY'
import json, sys
for name, f in zip((".bin", "DCP", ".bin --dtype f16", "DCP --dtype f16"), sys.argv[1:]):
    r = json.load(open(f)); b = r["bytes"]
    print(f"tftf {name}: report peak_rss {r['peak_rss_bytes'] / 2**20:.1f} MiB (target <= 320 MiB), "
          f"tensors {b['tensors']} bytes: reflinked {b['reflinked']}, in kernel "
          f"{b['copied_in_kernel']}, through memory {b['copied_through_memory']}, computed "
          f"{b['computed']}; reflink_unavailable: {r.get('reflink_unavailable')}")
PY
echo -n "check .bin: "; $PY bench/torch_check.py compare "$D/out-bin" "$D/ref-bin.safetensors"
echo -n "check DCP:  "; $PY bench/torch_check.py compare "$D/out-dcp" "$D/ref-dcp.safetensors"
