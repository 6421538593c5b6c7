#!/usr/bin/env bash
# A merge written as GGUF (issue 27 §5): three synthetic Llama-shaped BF16 models of SIZE_MB MB
# each (bench/merge_model.py, with the repository's GGUF tokenizer fixture beside them), merged
# and written as a GGUF of OUTTYPE:
#   - in one pass: `tftf run --merge CONFIG --gguf --outtype OUTTYPE` (no merged copy on disk);
#   - in two steps: `tftf merge CONFIG m/`, then `tftf gguf -i m/ --outtype OUTTYPE`;
#   - for q8_0 (the one type llama.cpp's converter writes besides floats), when LLAMA_CPP_DIR is
#     set: `mergekit-yaml CONFIG m/`, then `convert_hf_to_gguf.py m/ --outtype q8_0`, the route
#     a mergekit user takes today (from VENV, which needs torch and transformers too).
# `cat` of the inputs is the floor. Each command runs RUNS times from a cold cache (as root)
# under GNU time; prints a Markdown table (median wall, largest peak RSS, the merged copy the
# route writes), checks that the one-pass and two-step files are equal byte for byte (both
# named m.gguf; the merge fits one file), and the ratios.
#
# Usage: [LLAMA_CPP_DIR=DIR] bench/merge_gguf.sh [SIZE_MB] [RUNS] [OUTTYPE] [VENV] [BUDGET]
#   SIZE_MB  size of each model in MB (default 1000)
#   RUNS     runs per command; the table gives the median (default 1)
#   OUTTYPE  the GGUF type (default q8_0; q4_k_m etc. have no reference route here)
#   VENV     mergekit 0.1.5 + numpy (+ torch, transformers for the converter) (default /tmp/mkvenv)
#   BUDGET   tftf's --memory-budget (default 512MiB)
# METHODS (environment): merge methods, of linear ties (default: both).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
. bench/merge_lib.sh
OUTTYPE=${3:-q8_0}
merge_setup merge_gguf "${1:-}" "${2:-}" "${4:-}" "${5:-}"
MKOUT=1 # each route's command writes into $D/out
merge_inputs tests/fixtures/gguf/tokenizer/tokenizer.json tests/fixtures/gguf/tokenizer/tokenizer_config.json >/dev/null
# The fixture tokenizer's pre-tokenizer is in no table of the converter's: it is told
# `llama-bpe`, as tftf is, which changes one string and nothing it spends time on.
REF='
import sys
import conversion.base as b
b.TextModel.get_vocab_base_pre = lambda self, tok: "llama-bpe"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
import convert_hf_to_gguf as c
c.main()'
GG=(--outtype "$OUTTYPE" --vocab-pre llama-bpe -q --memory-budget "$BUDGET")

# `row NAME COMMAND...`: RUNS cold runs (`runs`; the route's files in $D/out, emptied before
# each); a table row with the median wall time, the largest peak RSS and the merged copy the
# route left beside the GGUF; WALL (s) is left for the ratios.
row() {
    runs "$@"
    [ -n "$WALL" ] || return 0
    cells "$1"
    printf ' %.0f MB |\n' "$(echo "$(du -sb --exclude='*.gguf' "$D/out" | cut -f1) / 1000000" | bc -l)"
}

echo "inputs: 3 models of $((INPUTS / 3)) bytes BF16 ($SIZE_MB MB asked); GGUF $OUTTYPE; runs: $RUNS; $(nproc) cores; load before: $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%F)"
echo "tftf $($BIN --version | cut -d' ' -f2), --memory-budget $BUDGET"
echo
echo "| command | median wall (runs) | vs cat | peak RSS | merged copy on disk |"
echo "|---|---|---|---|---|"
row '`cat` of the three inputs (floor)' sh -c "cat $D/m0/* $D/m1/* $D/m2/* >/dev/null"
RATIOS=()
for method in ${METHODS:-linear ties}; do
    row "tftf one pass: \`run --merge $method.yml --gguf\`" \
        "$BIN" run -o "$D/out/m.gguf" --merge "$D/$method.yml" --gguf "${GG[@]}"
    one=$WALL
    cp "$D/out/m.gguf" "$D/one.gguf"
    row "tftf two steps: \`merge\`, then \`gguf\`" sh -c \
        "'$BIN' merge '$D/$method.yml' '$D/out/m' -q --memory-budget $BUDGET && '$BIN' gguf -i '$D/out/m' -o '$D/out/m.gguf' ${GG[*]}"
    two=$WALL
    if cmp -s "$D/one.gguf" "$D/out/m.gguf"; then
        RATIOS+=("$method: the one-pass and two-step files are equal byte for byte")
    else
        RATIOS+=("$method: the one-pass and two-step files DIFFER")
    fi
    RATIOS+=("$(printf '%s: two steps / one pass: wall %.2f' "$method" "$(echo "$two / $one" | bc -l)")")
    if [ "$OUTTYPE" = q8_0 ] && [ -n "${LLAMA_CPP_DIR:-}" ]; then
        row "mergekit-yaml, then \`convert_hf_to_gguf.py --outtype q8_0\`" sh -c \
            "'$VENV/bin/mergekit-yaml' '$D/$method.yml' '$D/out/m' --lazy-unpickle && PYTHONPATH='$LLAMA_CPP_DIR:$LLAMA_CPP_DIR/gguf-py' '$VENV/bin/python' -c '$REF' '$D/out/m' --outfile '$D/out/m.gguf' --outtype q8_0"
        [ -n "$WALL" ] && RATIOS+=("$(printf '%s: mergekit + converter / tftf one pass: wall %.2f' "$method" "$(echo "$WALL / $one" | bc -l)")")
    fi
    rm -f "$D/one.gguf"
done
rm -rf "$D/out"
merge_footer
