#!/bin/sh
# Regenerates the corpus cases that are tftf outputs rather than inputs (see README.md):
# `checksums`, `parts-unfinalized` and `finalize-killed`, from the `lora` case's model.
# Run from the repository root after `cargo build --release`.
set -eu
tftf=${TFTF:-target/release/tftf}
corpus=tests/fuzz-corpus
src=$corpus/lora/model
args="--max-shard-size 200 --dtype f32 -q"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$src"/* "$tmp/"
# Side files whose names SHA256SUMS must escape, and one that is not UTF-8 (Latin-1 é).
printf 'odd name\n' > "$tmp/back\\slash.txt"
printf 'latin-1\n' > "$tmp/$(printf 'tok\351n.txt')"
rm -rf "$corpus/checksums" "$corpus/parts-unfinalized" "$corpus/finalize-killed"
# shellcheck disable=SC2086
"$tftf" passthrough -i "$tmp" -o "$corpus/checksums/model" $args --checksums
for k in 1/2 2/2; do
    # shellcheck disable=SC2086
    "$tftf" passthrough -i "$tmp" -o "$corpus/parts-unfinalized/model" $args --part "$k"
done
cp -a "$corpus/parts-unfinalized" "$corpus/finalize-killed"
# Killed (SIGKILL) after renaming its second file into place: a journal, records, temporaries.
TFTF_TEST_CRASH_AT=rename:2 "$tftf" finalize "$corpus/finalize-killed/model" -q || true
test -f "$corpus/finalize-killed/model/.tftf-commit.json"
