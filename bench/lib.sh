# Helpers shared by the benchmark scripts (sourced, not run).
now() { date +%s.%N; }
# Cold cache before every timed command (root only), so no run profits from the previous one.
cold() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
# Prints the seconds a command took, from a cold cache.
timed() { cold; local s; s=$(now); "$@"; echo "$(now) - $s" | bc; }
