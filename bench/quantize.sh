#!/usr/bin/env bash
# `tftf quantize` on the CPU: FP8_BLOCK, NVFP4A16 and W4A16 against passthrough of the same
# BF16 checkpoint ([4096, 4096] Linear weights, `gen_checkpoint fp8-as-bf16`), input GB/s and
# peak RSS under a 256 MiB budget. Every figure comes from the same run as its baseline.
# Usage: bench/quantize.sh [GIB] [RUNS]   (data under bench/data, removed at the end)
#        FORMATS="compressed-tensors modelopt" bench/quantize.sh [GIB] [RUNS]   (each --format)
#        PYTHON=/path/to/python bench/quantize.sh [LAYERS] [RUNS]   (against llm-compressor, below)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
start 2 "$@"

if [ -n "${PYTHON:-}" ]; then
    # Reference mode: `PYTHON=/path/to/python bench/quantize.sh [LAYERS] [RUNS]` (PYTHON with
    # llmcompressor, transformers, torch, safetensors). A random bf16 Llama (hidden 4096,
    # intermediate 11008, LAYERS layers, default 10 = 4.57 GB) made by quantize_reference.py;
    # `cp -r` + sync, passthrough, quantize FP8_BLOCK and NVFP4A16 (default budget, RUNS times,
    # then once with --memory-budget 1GiB), then llm-compressor's oneshot + save_pretrained of
    # each scheme (once: load, quantise, save, in one process), each under /usr/bin/time -v
    # from a cold cache; then tftf's output compared with llm-compressor's, tensor by tensor.
    LAYERS=${1:-10}
    RUNS=${2:-1}
    PY=("$PYTHON" bench/quantize_reference.py)
    "${PY[@]}" gen "$D/in" "$LAYERS"
    BYTES=$(du -sb "$D/in" | cut -f1)
    LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
    declare -A W R
    # tv KEY CMD...: wall seconds (cold cache) and max RSS (MiB) appended to W[KEY], R[KEY]
    tv() {
        local k=$1 s e; shift; cold; s=$(now)
        /usr/bin/time -v -o "$D/tv" "$@" >"$D/log" 2>&1 || { cat "$D/log" "$D/tv"; exit 1; }
        e=$(now)
        W[$k]+="$(echo "$e - $s" | bc) "
        R[$k]+="$(( $(awk -F': ' '/Maximum resident/{print $2}' "$D/tv") >> 10 )) "
    }
    for r in $(seq "$RUNS"); do
        tv cp sh -c "cp -r '$D/in' '$D/cp' && sync"; rm -rf "$D/cp"
        tv passthrough $BIN passthrough -i "$D/in" -o "$D/out" -q; rm -rf "$D/out"
        for s in FP8_BLOCK NVFP4A16; do
            rm -rf "$D/tftf-$s"
            tv $s $BIN quantize -i "$D/in" -o "$D/tftf-$s" --scheme $s -q --report "$D/report-$s.json"
        done
    done
    for s in FP8_BLOCK NVFP4A16; do
        tv "$s-1GiB" $BIN quantize -i "$D/in" -o "$D/rss" --scheme $s -q --memory-budget 1GiB \
            --report "$D/report-$s-1GiB.json"
        rm -rf "$D/rss"
    done
    COMPARE=()
    for s in FP8_BLOCK NVFP4A16; do
        tv "llmc-$s" "${PY[@]}" oneshot "$D/in" $s "$D/llmc-$s"
        COMPARE+=("$("${PY[@]}" compare "$D/tftf-$s" "$D/llmc-$s" || true)")
        rm -rf "$D/tftf-$s" "$D/llmc-$s"
    done
    echo "input: $BYTES bytes BF16 Llama ($LAYERS layers) in $(ls "$D/in" | grep -c safetensors$) files; tftf runs: $RUNS, llm-compressor: 1; machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB, CPU only; load average at the start: $LOAD0, at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "$("$PYTHON" -c 'import llmcompressor, compressed_tensors, torch, transformers as t; print("llmcompressor", llmcompressor.__version__, "compressed-tensors", compressed_tensors.__version__, "torch", torch.__version__, "transformers", t.__version__)' 2>/dev/null)"
    P=$(printf '%s\n' ${W[passthrough]} | median)
    for k in cp passthrough FP8_BLOCK NVFP4A16 FP8_BLOCK-1GiB NVFP4A16-1GiB llmc-FP8_BLOCK llmc-NVFP4A16; do
        m=$(printf '%s\n' ${W[$k]} | median)
        printf '%-16s median %7.2fs (%s) %5.2fx passthrough  peak RSS %s MiB\n' "$k" "$m" "${W[$k]% }" \
            "$(echo "scale=3; $m/$P" | bc)" "${R[$k]% }"
    done
    for s in FP8_BLOCK NVFP4A16 FP8_BLOCK-1GiB NVFP4A16-1GiB; do
        python3 -c "import json; r=json.load(open('$D/report-$s.json')); print('$s report: wall_seconds %.2f, bytes computed %d, pool_peak %d MiB, peak_rss %d MiB, ops %s' % (r['wall_seconds'], r['bytes']['computed'], r['pool_peak_bytes'] >> 20, r['peak_rss_bytes'] >> 20, [(o['op'], o['bytes_in']) for o in r['ops']]))"
    done
    printf '%s\n' "${COMPARE[@]}"
    rm -rf "$D"
    exit 0
fi

target/release/examples/gen_checkpoint "$D/in" fp8-as-bf16 "$GIB" >/dev/null
BYTES=$(du -sb "$D/in" | cut -f1)

FORMATS=${FORMATS:-compressed-tensors}
declare -A T
KEYS=(passthrough)
for f in $FORMATS; do for s in FP8_BLOCK NVFP4A16 W4A16; do KEYS+=("$s/$f"); done; done
for r in $(seq "$RUNS"); do
    T[passthrough]+="$(timed $BIN passthrough -i "$D/in" -o "$D/out" -q) "; rm -rf "$D/out"
    for k in "${KEYS[@]:1}"; do
        T[$k]+="$(timed $BIN quantize -i "$D/in" -o "$D/out" --scheme ${k%/*} --format ${k#*/} -q) "
        rm -rf "$D/out"
    done
done
echo "input: $BYTES bytes BF16 in $(ls "$D/in" | wc -l) files; runs: $RUNS; machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB; CPU only"
p=$(printf '%s\n' ${T[passthrough]} | median)
for k in "${KEYS[@]}"; do
    m=$(printf '%s\n' ${T[$k]} | median)
    printf '%-29s median %6.2fs (%s) %5.2f GB/s of input, %4.2fx passthrough\n' "$k" "$m" "${T[$k]% }" \
        "$(echo "scale=3; $BYTES/$m/1000000000" | bc)" "$(echo "scale=3; $m/$p" | bc)"
done
for f in $FORMATS; do for s in FP8_BLOCK NVFP4A16; do
    $BIN quantize -i "$D/in" -o "$D/rss" --scheme $s --format $f -q --memory-budget 256MiB --report "$D/rss.json"
    echo "peak RSS $s/$f, --memory-budget 256MiB: $(( $(python3 -c "import json;print(json.load(open('$D/rss.json'))['peak_rss_bytes'])") >> 20 )) MiB"
    rm -rf "$D/rss"
done; done
rm -rf "$D"
