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
# (the default: all four) multislerp karcher arcee_fusion della della_linear dare_ties
# breadcrumbs_ties sce slerp nearswap ram.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
. bench/merge_lib.sh
merge_setup merge "$@"
[ -x "$VENV/bin/mergekit-yaml" ] || { echo "no mergekit-yaml in $VENV/bin" >&2; exit 2; }
merge_inputs

# `row NAME COMMAND...`: RUNS cold runs of COMMAND (`runs`; its output directory $D/out removed
# after each); prints a table row with the median wall time and the largest peak RSS, or why it
# failed. Leaves them in WALL (s) and RSS (KiB), empty after a failure.
row() {
    runs "$@"
    rm -rf "$D/out"
    [ -z "$WALL" ] || { cells "$1"; echo; }
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
merge_footer
