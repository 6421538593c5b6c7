#!/usr/bin/env bash
# Model merging benchmark (issue 27): three synthetic Llama-shaped BF16 models of SIZE_MB MB each
# (bench/merge_model.py), merged by `tftf merge` and by mergekit's `mergekit-yaml` from the same
# configs, in the same run: `linear` and `task_arithmetic` (elementwise: the issue's "within
# 1.5x of reading all inputs once") and `model_stock` (whole-tensor statistics: one tensor per
# model held at a time) and `ties` (a whole-tensor magnitude threshold per model).
# `cat` of all inputs (reading them once) and `cp -r` of them are the floor. Every command runs
# RUNS times from a cold cache (as root) under GNU time: wall seconds and peak RSS. Prints one
# Markdown table in bench/RESULTS.md's form, then per method mergekit's wall time and peak RSS
# over tftf's.
#
# mergekit runs with its defaults (CPU, its default thread count) plus `--lazy-unpickle`, the
# option its README recommends for low memory (it only changes how `.bin` inputs load; these
# are safetensors). Both tools run with `--no-copy-tokenizer` (the models have no tokenizer).
# tftf runs with `--memory-budget BUDGET`.
#
# Usage: bench/merge.sh [SIZE_MB] [RUNS] [VENV] [BUDGET]
#   SIZE_MB  size of each model in MB (default 1000: the issue's three 1 GB models)
#   RUNS     runs per command; the table gives the median (default 1)
#   VENV     a virtual environment with mergekit 0.1.5 and numpy (default /tmp/mkvenv:
#            python3 -m venv /tmp/mkvenv && /tmp/mkvenv/bin/pip install mergekit==0.1.5)
#   BUDGET   tftf's --memory-budget (default 512MiB)
# METHODS (environment): the methods to run, of linear task_arithmetic ties model_stock
# (the default: all four) multislerp karcher arcee_fusion.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
SIZE_MB=${1:-1000}
RUNS=${2:-1}
VENV=${3:-/tmp/mkvenv}
BUDGET=${4:-512MiB}
D=${BENCH_DIR:-bench/data/merge}
[ -x "$VENV/bin/mergekit-yaml" ] || { echo "no mergekit-yaml in $VENV/bin" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "needs GNU time (/usr/bin/time)" >&2; exit 2; }
rm -rf "$D"; mkdir -p "$D"
trap 'rm -rf "$D"' EXIT
cargo build --release -q
# A copy, so rebuilding the tree while the benchmark runs cannot change what it measures.
BIN=$D/tftf
cp target/release/tftf "$BIN"
for k in 0 1 2; do "$VENV/bin/python" bench/merge_model.py "$D/m$k" "$SIZE_MB" "$k"; done
INPUTS=$(du -sb "$D"/m0 "$D"/m1 "$D"/m2 | awk '{s += $1} END {printf "%.0f", s}')

cat >"$D/linear.yml" <<EOF
merge_method: linear
dtype: bfloat16
models:
  - model: $D/m0
    parameters: {weight: 0.5}
  - model: $D/m1
    parameters: {weight: 0.3}
  - model: $D/m2
    parameters: {weight: 0.2}
EOF
cat >"$D/task_arithmetic.yml" <<EOF
merge_method: task_arithmetic
base_model: $D/m0
dtype: bfloat16
models:
  - model: $D/m1
    parameters: {weight: 0.5}
  - model: $D/m2
    parameters: {weight: 0.5}
EOF
cat >"$D/ties.yml" <<EOF
merge_method: ties
base_model: $D/m0
dtype: bfloat16
models:
  - model: $D/m1
    parameters: {weight: 0.5, density: 0.5}
  - model: $D/m2
    parameters: {weight: 0.5, density: 0.5}
EOF
cat >"$D/multislerp.yml" <<EOF
merge_method: multislerp
base_model: $D/m0
dtype: bfloat16
models:
  - model: $D/m1
    parameters: {weight: 0.6}
  - model: $D/m2
    parameters: {weight: 0.4}
EOF
cat >"$D/karcher.yml" <<EOF
merge_method: karcher
dtype: bfloat16
models:
  - model: $D/m0
  - model: $D/m1
  - model: $D/m2
EOF
cat >"$D/arcee_fusion.yml" <<EOF
merge_method: arcee_fusion
base_model: $D/m0
dtype: bfloat16
models:
  - model: $D/m0
  - model: $D/m1
EOF
cat >"$D/model_stock.yml" <<EOF
merge_method: model_stock
base_model: $D/m0
dtype: bfloat16
models:
  - model: $D/m1
  - model: $D/m2
EOF

# `row NAME COMMAND...`: RUNS cold runs of COMMAND (its output directory $D/out removed after
# each); prints a table row with the median wall time and the largest peak RSS, or why it
# failed (the command's last log line). Leaves them in WALL (s) and RSS (KiB), empty after a
# failure.
FLOOR=
row() {
    local name=$1; shift
    local walls=() rss=0 r wall user sys kib
    WALL= RSS=
    for r in $(seq "$RUNS"); do
        rm -rf "$D/out"; cold
        if ! /usr/bin/time -f "%e %U %S %M" -o "$D/time" "$@" >"$D/log" 2>&1; then
            printf '| %s | failed: %s | | |\n' "$name" "$(tail -n 1 "$D/log" | tr '|' '/')"
            rm -rf "$D/out"; return
        fi
        read -r wall user sys kib <"$D/time"
        walls+=("$wall"); [ "$kib" -gt "$rss" ] && rss=$kib
    done
    rm -rf "$D/out"
    WALL=$(printf '%s\n' "${walls[@]}" | median); RSS=$rss
    [ -n "$FLOOR" ] || FLOOR=$WALL
    printf '| %s | %.2f s (%s) | %.2f | %.0f MiB |\n' "$name" "$WALL" "${walls[*]}" \
        "$(echo "$WALL / $FLOOR" | bc -l)" "$(echo "$RSS / 1024" | bc -l)"
}

echo "inputs: 3 models of $((INPUTS / 3)) bytes BF16 ($SIZE_MB MB asked); runs: $RUNS; $(nproc) cores; load before: $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%F)"
echo "tftf $($BIN --version | cut -d' ' -f2), --memory-budget $BUDGET; mergekit $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("mergekit"))') from $VENV"
echo
echo "| command | median wall (runs) | vs cat | peak RSS |"
echo "|---|---|---|---|"
row '`cat` of the three inputs (floor)' sh -c "cat $D/m0/* $D/m1/* $D/m2/* >/dev/null"
row '`cp -r` of the three inputs' sh -c "mkdir -p $D/out && cp -r $D/m0 $D/m1 $D/m2 $D/out && sync"
RATIOS=()
for method in ${METHODS:-linear task_arithmetic ties model_stock}; do
    row "\`tftf merge\` $method" "$BIN" merge "$D/$method.yml" "$D/out" -q \
        --memory-budget "$BUDGET" --no-copy-tokenizer
    tw=$WALL tr=$RSS
    row "\`mergekit-yaml\` $method" "$VENV/bin/mergekit-yaml" "$D/$method.yml" "$D/out" \
        --lazy-unpickle --no-copy-tokenizer
    if [ -n "$tw" ] && [ -n "$WALL" ]; then
        RATIOS+=("$(printf '%s: mergekit / tftf: wall %.2f, peak RSS %.2f' "$method" \
            "$(echo "$WALL / $tw" | bc -l)" "$(echo "$RSS / $tr" | bc -l)")")
    fi
done
echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in "${RATIOS[@]}"; do echo "$r"; done
