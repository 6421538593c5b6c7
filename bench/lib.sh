# Helpers shared by the benchmark scripts (sourced, not run).
now() { date +%s.%N; }
# Cold cache before every timed command (root only), so no run profits from the previous one.
cold() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
# Prints the seconds a command took, from a cold cache.
timed() { cold; local s; s=$(now); "$@"; echo "$(now) - $s" | bc; }
# The usual start of a benchmark on generated data: `start DEFAULT_GIB "$@"` sets GIB and RUNS
# from the script's arguments (defaults DEFAULT_GIB and 3), empties D=bench/data, builds tftf
# (BIN) and the example programs gen_checkpoint and those named in EXAMPLES.
start() {
    GIB=${2:-$1}
    RUNS=${3:-3}
    D=bench/data
    rm -rf "$D"; mkdir -p "$D"
    local ex args=()
    for ex in gen_checkpoint ${EXAMPLES:-}; do args+=(--example "$ex"); done
    cargo build --release -q "${args[@]}"
    cargo build --release -q
    BIN=target/release/tftf
}
# `generate LAYOUT DIR`: a gen_checkpoint checkpoint of GIB GiB in DIR; BYTES is its size.
generate() {
    target/release/examples/gen_checkpoint "$2" "$1" "$GIB" >/dev/null
    BYTES=$(du -sb "$2" | cut -f1)
}
# `measure NAME COMMAND...` (D set): one cold run under GNU time; prints wall seconds and peak RSS.
measure() {
    local name=$1; shift
    cold
    /usr/bin/time -f "%e %U %S %M" -o "$D/time.$name" "$@" >"$D/log.$name" 2>&1 || { cat "$D/log.$name"; exit 1; }
    read -r wall user sys kib <"$D/time.$name"
    printf '%-28s %8.2f s wall %8.2f s CPU  peak RSS %7.1f MiB\n' "$name" "$wall" \
        "$(echo "$user + $sys" | bc -l)" "$(echo "$kib / 1024" | bc -l)"
}
