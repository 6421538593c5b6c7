#!/usr/bin/env bash
# The Python package against upstream Python tftf 0.3.0's, same run, same model: upstream's
# README example (FP8DequantPipe(torch.bfloat16) | LoRAMergePipe(adapter) into a ShardedWriter)
# on a generated DeepSeek-V3-style FP8 checkpoint (128x128 F32 block scales) with an r=16 F32
# adapter on every weight; each run cold-cache under /usr/bin/time -v, alternating, medians
# and ratios; then a custom Python identity pipe in the same pipeline against the pure-Rust
# one (the cost of a Python pipe), and how their outputs compare.
# Usage: bench/python.sh [GIB] [RUNS]
# Environment: TFTF_PY — a python with this package installed (default: a fresh venv with
# `pip install ./python`); UPSTREAM_TORCH_SITE — site-packages holding torch, safetensors,
# click and tqdm for upstream's venv (default /tmp/ggufvenv's); UPSTREAM_REPO — a git clone
# of kallewoof/tftf (default the mirror); MEMORY_BUDGET — our run's budget (default 512 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
# Only the generator is needed (the package under test is TFTF_PY's, or built below).
GIB=${1:-1}; RUNS=${2:-3}; D=bench/data
rm -rf "$D"; mkdir -p "$D"
[ -x target/release/examples/gen_checkpoint ] || cargo build --release -q --example gen_checkpoint
S=$(mktemp -d /tmp/tftf-bench-python.XXXXXX)
trap 'rm -rf "$D" "$S"' EXIT
BUDGET=${MEMORY_BUDGET:-$((512 << 20))}
UPSTREAM_REPO=${UPSTREAM_REPO:-/work/.mirror/kallewoof+tftf/repo}
TORCH_SITE=${UPSTREAM_TORCH_SITE:-/tmp/ggufvenv/lib/python3.11/site-packages}

# Upstream's package (the 0.3.0 commit) in its own venv; torch and friends through a .pth.
mkdir -p "$S/upstream"
git -C "$UPSTREAM_REPO" archive 4363e31 | tar -x -C "$S/upstream"
python3 -m venv "$S/upvenv"
SITE=$(echo "$S"/upvenv/lib/python3*/site-packages)
echo "$TORCH_SITE" > "$SITE/torch-site.pth"
# A pure-Python package: its folder in site-packages is the install (no wheel tooling needed).
cp -r "$S/upstream/tftf" "$SITE/"
UP="$S/upvenv/bin/python"
if [ -z "${TFTF_PY:-}" ]; then
    python3 -m venv "$S/venv"
    "$S/venv/bin/pip" install -q ./python
    TFTF_PY="$S/venv/bin/python"
fi
"$UP" -c 'import tftf, torch; assert "site-packages" in tftf.__file__, tftf.__file__'
"$TFTF_PY" -c 'import tftf._core'

# The model: GIB GiB of FP8 weights, and the adapter (A [16, 4096], B [4096, 16] per weight).
target/release/examples/gen_checkpoint "$D/fp8" fp8 "$GIB" >/dev/null
mkdir -p "$D/lora"
"$UP" - "$D/fp8" "$D/lora" <<'EOF'
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
idx = json.loads((Path(sys.argv[1]) / "model.safetensors.index.json").read_text())
g = torch.Generator().manual_seed(7)
t = {}
for k in sorted(idx["weight_map"]):
    if k.endswith(".weight"):
        m = k[: -len(".weight")]
        t[f"base_model.model.{m}.lora_A.weight"] = torch.randn(16, 4096, generator=g) * 0.01
        t[f"base_model.model.{m}.lora_B.weight"] = torch.randn(4096, 16, generator=g) * 0.01
save_file(t, str(Path(sys.argv[2]) / "adapter_model.safetensors"))
(Path(sys.argv[2]) / "adapter_config.json").write_text(json.dumps({"r": 16, "lora_alpha": 32, "target_modules": ".*experts\\.\\d+"}))
EOF
# The example of upstream's README, verbatim but for the paths (and ours: the memory budget).
cat > "$S/example.py" <<'EOF'
import sys, torch
from tftf import Pipeline, ShardedSafetensorsReader, ShardedWriter, FP8DequantPipe, LoRAMergePipe, Pipe
src, lora, out, mode = sys.argv[1:5]
pipe = FP8DequantPipe(torch.bfloat16) | LoRAMergePipe(lora + "/adapter_model.safetensors")
class Identity(Pipe):
    def process(self, records):
        yield from records
extra = {} if mode == "upstream" else {"memory_budget": int(sys.argv[5])}
if mode == "identity":
    pipe = pipe | Identity()
p = Pipeline(reader=ShardedSafetensorsReader.from_path(src), pipe=pipe, writer=ShardedWriter(out), **extra)
assert mode == "upstream" or p.runs_in_rust() == (mode == "rust")
p.run(show_progress=False)
EOF
# `measure NAME PYTHON MODE`: one cold-cache run; appends "seconds peak_rss_kib" to $S/NAME.
measure() {
    cold
    /usr/bin/time -v -o "$S/time" "$2" "$S/example.py" "$D/fp8" "$D/lora" "$D/out-$1" "$3" "$BUDGET"
    awk -F': ' '/Elapsed/ {n=split($2,t,":"); s=(n==3 ? t[1]*3600+t[2]*60+t[3] : t[1]*60+t[2])}
                /Maximum resident/ {r=$2} END {print s, r}' "$S/time" >> "$S/t-$1"
    echo "$1 run: $(tail -1 "$S/t-$1") (seconds, peak RSS KiB); load $(cut -d' ' -f1 /proc/loadavg)"
}
for r in $(seq "$RUNS"); do
    measure upstream "$UP" upstream
    rm -rf "$D/out-upstream"
    measure rust "$TFTF_PY" rust
    measure identity "$TFTF_PY" identity
    # The same tensors; their bytes compared, once (the mixed pipeline runs the built-in pipes per
    # record: dequantised to BF16, then merged, where the Rust job merges before rounding).
    [ "$r" != 1 ] || "$UP" - "$D/out-rust" "$D/out-identity" <<'EOF'
import sys, torch
from pathlib import Path
from safetensors import safe_open
n = same = diff_elems = total = 0
worst = 0.0
for fa in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with safe_open(str(fa), "pt") as x, safe_open(str(Path(sys.argv[2]) / fa.name), "pt") as y:
        assert sorted(x.keys()) == sorted(y.keys()), fa.name
        for k in x.keys():
            a, b = x.get_tensor(k), y.get_tensor(k)
            assert a.dtype == b.dtype and a.shape == b.shape, k
            n += 1
            same += torch.equal(a, b)
            d = a.float() != b.float()
            diff_elems += int(d.sum())
            total += a.numel()
            worst = max(worst, float((a.float() - b.float()).abs().max()))
print(f"identity vs built-in output: {same} of {n} tensors byte-identical; {diff_elems} of {total} values differ, max |delta| {worst}")
EOF
    rm -rf "$D/out-rust" "$D/out-identity"
done
med() { awk "{print \$$2}" "$S/t-$1" | median; }
U=$(med upstream 1); R=$(med rust 1); I=$(med identity 1)
echo "model: $(du -sb "$D/fp8" | cut -f1) bytes FP8 + $(du -sb "$D/lora" | cut -f1) bytes adapter -> BF16; runs: $RUNS; $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "upstream Python tftf 0.3.0    median ${U}s ($(cut -d' ' -f1 "$S/t-upstream" | xargs))  peak RSS $(( $(med upstream 2) >> 10 )) MiB"
echo "tftf-rs, built-in pipes       median ${R}s ($(cut -d' ' -f1 "$S/t-rust" | xargs))  peak RSS $(( $(med rust 2) >> 10 )) MiB  (memory_budget $((BUDGET >> 20)) MiB)  speed-up: $(echo "scale=1; $U/$R" | bc)x"
echo "tftf-rs, + Python identity    median ${I}s ($(cut -d' ' -f1 "$S/t-identity" | xargs))  peak RSS $(( $(med identity 2) >> 10 )) MiB  vs built-in only: $(echo "scale=2; $I/$R" | bc)x"
"$TFTF_PY" -c 'import sys; print(sys.version.split()[0])' | sed 's/^/python /'
