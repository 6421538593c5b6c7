#!/usr/bin/env bash
# GPU check, one call on a lent GPU machine: builds (the CUDA backend is always compiled in:
# cudarc loads the driver at run time, so there is no cargo feature to turn on), runs the GPU
# path's tests against the fake driver and `tftf selftest` on the real GPU, then times each op
# on a generated ≥ 8 GiB checkpoint with --device cpu and --device cuda and prints one table
# (GB/s of input, peak RSS, share of the wall time the GPU lanes were busy, bytes copied by DMA
# straight from registered pool buffers, whether the output equals the CPU's byte for byte)
# plus the pinned host↔device copy bandwidth measured in the same run, the reference for the
# ≥ 80 % target. The cast and the FP8 dequantisation also run with pool-buffer registration off
# (TFTF_NO_HOST_REGISTER=1: chunks go through the pinned staging) and with --io-threads 1
# (auto is one reader and one writer per four cores, 1 to 4), to compare with the default.
#
# Data lives in /dev/shm when it has room (the figures are about compute, not the disk).
# Usage: bench/gpu-check.sh [GIB]          (default 8; keep the run under 8 minutes)
#        SKIP_TESTS=1 bench/gpu-check.sh   (no cargo tests: prebuilt binaries, no toolchain)
#        OPS="cast dequant" bench/gpu-check.sh 4   (a subset of: cast dequant repack lora quantize gguf merge)
#        DEVICES="cpu" bench/gpu-check.sh 1   (the script's own check on a machine without a GPU)
#        GGUF_TYPES="q4_k_m" OPS=gguf bench/gpu-check.sh 4   (the gguf types to time)
set -euo pipefail
cd "$(dirname "$0")/.."
GIB=${1:-8}
DEVICES=${DEVICES:-cuda cpu}
OPS=${OPS:-cast dequant repack lora quantize gguf merge}
want() { [[ " $OPS " == *" $1 "* ]]; }
# Build when cargo can (a machine without crates.io can instead carry prebuilt
# target/release/tftf and target/release/examples/gen_checkpoint along).
if command -v cargo >/dev/null; then
    cargo build --release -q --example gen_checkpoint && cargo build --release -q ||
        echo "warning: cargo build failed; using the binaries already in target/release"
fi
echo "== $(date -u +%FT%TZ) $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
if [ "${SKIP_TESTS:-0}" != 1 ] && command -v cargo >/dev/null; then
    echo "== tests: the GPU path against the fake driver, kernels compiled for the host, --io-threads"
    # The summaries only; a failure prints the failing test's output and stops the script.
    if ! cargo test --release -q --test fake_gpu --test kernels --test io_threads >"${TMPDIR:-/tmp}/gpu-check-tests.log" 2>&1; then
        tail -60 "${TMPDIR:-/tmp}/gpu-check-tests.log"
        echo "error: tests failed (full log: ${TMPDIR:-/tmp}/gpu-check-tests.log)"
        exit 1
    fi
    grep -E "^test result" "${TMPDIR:-/tmp}/gpu-check-tests.log"
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
# run OP VARIANT DEVICE BYTES -- tftf arguments. BYTES is the op's input, for the throughput
# column. VARIANT: default, noreg (TFTF_NO_HOST_REGISTER=1) or io1 (--io-threads 1). The first
# run of an op (the CPU's, when DEVICES has cpu) is kept in $D/ref and every later one is
# compared with it byte for byte.
run() {
    local op=$1 variant=$2 dev=$3 bytes=$4; shift 5
    local envs=() extra=()
    case $variant in
        default) ;;
        noreg) envs=(TFTF_NO_HOST_REGISTER=1) ;;
        io1) extra=(--io-threads 1) ;;
        *) echo "error: unknown variant $variant"; exit 1 ;;
    esac
    rm -rf "$D/out"; sync
    local s e same=ref
    s=$(date +%s.%N)
    env ${envs[@]+"${envs[@]}"} "$BIN" "$@" ${extra[@]+"${extra[@]}"} -o "$D/out" -q \
        --device "$dev" --report "$D/r.json"
    e=$(date +%s.%N)
    # The output is a folder, or a file (gguf).
    if [ -e "$D/ref" ]; then
        if diff -rq "$D/ref" "$D/out" >/dev/null; then same=same; else same=DIFFERENT; FAILED=1; fi
    fi
    ROWS+=("$(python3 - "$op" "$variant" "$dev" "$bytes" "$s" "$e" "$D/r.json" "$same" <<'PY'
import json, sys
op, variant, dev, size, s, e, rep, same = sys.argv[1:]
r = json.load(open(rep))
wall, size = float(e) - float(s), int(size)
g = r.get("gpu") or {}
share = g.get("lane_busy_seconds", 0) / (2 * wall) if g else 0
direct = g.get("direct_dma_bytes", 0) / 2**30 if g else 0
print(f"{op:<20} {variant:<7} {dev:<5} {size/2**30:7.2f} GiB {wall:8.2f} s {size/wall/1e9:8.2f} GB/s "
      f"{r['peak_rss_bytes']/2**20:8.0f} MiB {100*share:6.1f} % {direct:8.2f} GiB "
      f"{r.get('io_threads')!s:>3} {same:<9} {r['device']}"
      + (f" (not registered: {g['host_register_failed']})" if g.get("host_register_failed") else ""))
PY
)")
    if [ -e "$D/ref" ]; then rm -rf "$D/out"; else mv "$D/out" "$D/ref"; fi
}
# each OP BYTES -- tftf arguments: every device once, then (with cuda) the comparison variants.
each() {
    local op=$1 bytes=$2; shift 3
    rm -rf "$D/ref"
    for dev in $DEVICES; do run "$op" default "$dev" "$bytes" -- "$@"; done
    if [[ " $DEVICES " == *" cuda "* ]] && [ "${VARIANTS:-1}" = 1 ]; then
        run "$op" noreg cuda "$bytes" -- "$@"
        run "$op" io1 cuda "$bytes" -- "$@"
    fi
    rm -rf "$D/ref"
}
FAILED=0

if want cast; then
    echo "== cast f32 → bf16 ($GIB GiB)"
    $GEN "$D/core" core "$GIB" >/dev/null
    N=$(bytes_of "$D/core" "")
    each cast "$N" -- passthrough "$D/core" --dtype bf16
    rm -rf "$D/core"
fi

if want dequant; then
    echo "== dequant-fp8 ($GIB GiB of E4M3)"
    $GEN "$D/fp8" fp8 "$GIB" >/dev/null
    N=$(bytes_of "$D/fp8" "")
    each dequant-fp8 "$N" -- dequant-fp8 "$D/fp8"
    rm -rf "$D/fp8"
fi

if want repack; then
    echo "== repack-fp4 ($GIB GiB DeepSeek-V4 layout: MXFP4 experts, a 2 GiB E4M3 Engram table)"
    $GEN "$D/v4" v4 "$GIB" >/dev/null
    N=$(bytes_of "$D/v4" "")
    VARIANTS=0 each repack-fp4 "$N" -- repack-fp4 -i "$D/v4"
    N=$(bytes_of "$D/v4" "engram")
    VARIANTS=0 each requant-e2m1 "$N" -- run "$D/v4" --key-filter '*engram*' --repack-fp4
    rm -rf "$D/v4"
fi

if want lora; then
    echo "== merge-lora r=64 on every linear ($GIB GiB BF16 base)"
    $GEN "$D/lora" lora-r64 "$GIB" >/dev/null
    N=$(bytes_of "$D/lora/base" "")
    VARIANTS=0 each merge-lora-r64 "$N" -- merge-lora -b "$D/lora/base" -a "$D/lora/adapter"
    rm -rf "$D/lora"
fi

if want quantize; then
    echo "== quantize ($GIB GiB BF16): FP8_BLOCK, NVFP4A16 as compressed-tensors and ModelOpt"
    $GEN "$D/bf16" fp8-as-bf16 "$GIB" >/dev/null
    N=$(bytes_of "$D/bf16" "")
    for f in compressed-tensors modelopt; do
        for s in FP8_BLOCK NVFP4A16; do
            VARIANTS=0 each "$s/${f%%-*}" "$N" -- quantize -i "$D/bf16" --scheme $s --format $f
        done
    done
    rm -rf "$D/bf16"
fi

if want gguf; then
    # A Qwen3-shaped BF16 model of about GIB GiB (1.2 GiB of embeddings, ~100 MB a layer).
    LAYERS=$(( (GIB * 1073741824 - 1244000000) / 100000000 )); [ "$LAYERS" -ge 1 ] || LAYERS=1
    echo "== gguf Q4_K_M, IQ4_XS, Q5_0, IQ3_S ($LAYERS-layer Qwen3-shaped BF16 model)"
    if python3 bench/gguf_model.py "$D/gguf" "$LAYERS" >/dev/null; then
        N=$(bytes_of "$D/gguf" "")
        for t in ${GGUF_TYPES:-q4_k_m iq4_xs q5_0 iq3_s}; do
            VARIANTS=0 each "gguf-$t" "$N" -- gguf -i "$D/gguf" --outtype $t --vocab-pre qwen2
        done
    else
        echo "skipped: bench/gguf_model.py needs python3 with numpy"
    fi
    rm -rf "$D/gguf"
fi

if want merge; then
    echo "== merge linear and task_arithmetic (three references to one $GIB GiB BF16 model)"
    $GEN "$D/m" fp8-as-bf16 "$GIB" >/dev/null
    B=$(bytes_of "$D/m" "")
    printf 'merge_method: linear\nmodels:\n' >"$D/linear.yml"
    printf 'merge_method: task_arithmetic\nbase_model: %s\nmodels:\n' "$D/m" >"$D/task.yml"
    for w in 0.5 0.3 0.2; do
        printf '  - model: %s\n    parameters: {weight: %s}\n' "$D/m" $w | tee -a "$D/linear.yml" >>"$D/task.yml"
    done
    VARIANTS=0 each merge-linear $((3 * B)) -- merge "$D/linear.yml"
    VARIANTS=0 each merge-task $((4 * B)) -- merge "$D/task.yml"
    echo "== merge ties and della_linear (a base and two other $GIB GiB BF16 models)"
    GEN_SEED=1 $GEN "$D/m1" fp8-as-bf16 "$GIB" >/dev/null
    GEN_SEED=2 $GEN "$D/m2" fp8-as-bf16 "$GIB" >/dev/null
    # `method:extra`: DELLA also takes an epsilon, TIES none.
    for spec in ties: della_linear:', epsilon: 0.1'; do
        method=${spec%%:*} extra=${spec#*:}
        printf 'merge_method: %s\nbase_model: %s\nmodels:\n' $method "$D/m" >"$D/$method.yml"
        printf '  - model: %s\n    parameters: {weight: 0.6, density: 0.4%s}\n  - model: %s\n    parameters: {weight: 0.5, density: 0.7%s}\n' \
            "$D/m1" "$extra" "$D/m2" "$extra" >>"$D/$method.yml"
    done
    VARIANTS=0 each merge-ties $((3 * B)) -- merge "$D/ties.yml"
    VARIANTS=0 each merge-della $((3 * B)) -- merge "$D/della_linear.yml"
    rm -rf "$D/m" "$D/m1" "$D/m2"
fi

echo
echo "pinned copy bandwidth: host→device $H2D/s, device→host $D2H/s"
printf '%-20s %-7s %-5s %11s %10s %13s %12s %8s %12s %3s %-9s %s\n' op variant dev input wall \
    throughput "peak RSS" "GPU busy" "direct DMA" io "vs first" device
printf '%s\n' "${ROWS[@]}"
if [ "$FAILED" != 0 ]; then
    echo "error: an output differs from the first run's (the CPU's) — see the 'vs first' column"
    exit 1
fi
