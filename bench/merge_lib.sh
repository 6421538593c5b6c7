# Helpers shared by the merge benchmarks, bench/merge.sh and bench/merge_gguf.sh (sourced after
# bench/lib.sh, not run).

# `merge_setup NAME [SIZE_MB] [RUNS] [VENV] [BUDGET]`: the scripts' common arguments, with their
# defaults (1000 MB models, 1 run, /tmp/mkvenv, 512MiB); D is BENCH_DIR or bench/data/NAME.
merge_setup() {
    SIZE_MB=${2:-1000} RUNS=${3:-1} VENV=${4:-/tmp/mkvenv} BUDGET=${5:-512MiB}
    D=${BENCH_DIR:-bench/data/$1}
    FLOOR=
}

# `merge_inputs [FILE...]`: empties D (removed again on exit), copies the release tftf to BIN (so
# rebuilding the tree while the benchmark runs cannot change what it measures), writes three
# synthetic models $D/m0 $D/m1 $D/m2 (bench/merge_model.py, which prints a line for each) with
# the FILEs copied beside each, and a config per method (merge_configs). INPUTS: their bytes.
merge_inputs() {
    [ -x /usr/bin/time ] || { echo "needs GNU time (/usr/bin/time)" >&2; exit 2; }
    rm -rf "$D"; mkdir -p "$D"
    trap 'rm -rf "$D"' EXIT
    cargo build --release -q
    BIN=$D/tftf
    cp target/release/tftf "$BIN"
    local k
    for k in 0 1 2; do
        "$VENV/bin/python" bench/merge_model.py "$D/m$k" "$SIZE_MB" "$k"
        [ $# -eq 0 ] || cp "$@" "$D/m$k/"
    done
    INPUTS=$(du -sb "$D"/m0 "$D"/m1 "$D"/m2 | awk '{s += $1} END {printf "%.0f", s}')
    merge_configs
}

# `merge_config METHOD BASE MODEL...`: $D/METHOD.yml, mergekit's config (which tftf reads too)
# of a bfloat16 merge by METHOD of the models MODEL (m0, m1 or m2; `mK=PARAMETERS` gives the
# model the inline parameters `{PARAMETERS}`), with the base model BASE unless it is empty, and
# the global parameter GLOBAL (`name: value`) where it is set.
merge_config() {
    local method=$1 base=$2 m
    shift 2
    {
        echo "merge_method: $method"
        [ -z "$base" ] || echo "base_model: $D/$base"
        echo "dtype: bfloat16"
        [ -z "${GLOBAL:-}" ] || printf 'parameters:\n  %s\n' "$GLOBAL"
        echo "models:"
        for m; do
            echo "  - model: $D/${m%%=*}"
            [ "$m" = "${m%%=*}" ] || echo "    parameters: {${m#*=}}"
        done
    } >"$D/$method.yml"
}

# The configs of every method the scripts can run (METHODS).
merge_configs() {
    merge_config linear '' 'm0=weight: 0.5' 'm1=weight: 0.3' 'm2=weight: 0.2'
    merge_config task_arithmetic m0 'm1=weight: 0.5' 'm2=weight: 0.5'
    merge_config ties m0 'm1=weight: 0.5, density: 0.5' 'm2=weight: 0.5, density: 0.5'
    merge_config multislerp m0 'm1=weight: 0.6' 'm2=weight: 0.4'
    merge_config karcher '' m0 m1 m2
    merge_config arcee_fusion m0 m0 m1
    merge_config model_stock m0 m1 m2
    merge_config della m0 'm1=weight: 0.5, density: 0.5, epsilon: 0.1' \
        'm2=weight: 0.5, density: 0.5, epsilon: 0.1'
    merge_config della_linear m0 'm1=weight: 0.5, density: 0.5, epsilon: 0.1' \
        'm2=weight: 0.5, density: 0.5, epsilon: 0.1'
    merge_config dare_ties m0 'm1=weight: 0.5, density: 0.5' 'm2=weight: 0.5, density: 0.5'
    merge_config breadcrumbs_ties m0 'm1=weight: 0.5, density: 0.5, gamma: 0.01' \
        'm2=weight: 0.5, density: 0.5, gamma: 0.01'
    GLOBAL='select_topk: 0.5' merge_config sce m0 m1 m2
    GLOBAL='t: 0.5' merge_config slerp m0 m0 m1
    GLOBAL='t: 0.001' merge_config nearswap m0 m0 m1
    merge_config ram m0 m0 m1 m2
}

# `runs NAME COMMAND...`: RUNS cold runs of COMMAND under GNU time, its output folder $D/out
# removed before each (and made again where MKOUT is set). Leaves WALL (the median wall
# seconds), WALLS (each run's) and RSS (the largest peak RSS, KiB), and FLOOR (the first
# measured WALL); after a failure, prints the table row that says why (the command's last log
# line) and leaves WALL and RSS empty.
runs() {
    local name=$1 r wall user sys kib
    shift
    WALL= RSS=0 WALLS=()
    for r in $(seq "$RUNS"); do
        rm -rf "$D/out"; [ -z "${MKOUT:-}" ] || mkdir -p "$D/out"; cold
        if ! /usr/bin/time -f "%e %U %S %M" -o "$D/time" "$@" >"$D/log" 2>&1; then
            printf '| %s | failed: %s | | |\n' "$name" "$(tail -n 1 "$D/log" | tr '|' '/')"
            RSS=
            return 0
        fi
        read -r wall user sys kib <"$D/time"
        WALLS+=("$wall"); [ "$kib" -gt "$RSS" ] && RSS=$kib
    done
    WALL=$(printf '%s\n' "${WALLS[@]}" | median)
    [ -n "$FLOOR" ] || FLOOR=$WALL
}

# `cells NAME`: the first cells of the table row of what `runs` measured, with no line end:
# name, median wall (each run's), the ratio to FLOOR, peak RSS.
cells() {
    printf '| %s | %.2f s (%s) | %.2f | %.0f MiB |' "$1" "$WALL" "${WALLS[*]}" \
        "$(echo "$WALL / $FLOOR" | bc -l)" "$(echo "$RSS / 1024" | bc -l)"
}

# The lines after the table: the load, then the ratios collected in RATIOS.
merge_footer() {
    echo
    echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
    local r
    for r in "${RATIOS[@]}"; do echo "$r"; done
}
