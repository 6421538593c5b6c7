//! PyTorch checkpoint parsers against the golden fixtures in `tests/fixtures/torch/` (made by
//! real torch; see its README): every tensor read through the chunked element reader must equal
//! its `expected/model.safetensors` twin byte for byte, and hostile or damaged inputs must give
//! errors that name the file (and tensor), never a panic or an executed payload.

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use common::{assert_mentions, copy_dir};
use tftf::format::source::{Placement, SourceDesc};
use tftf::format::torch::{self, pickle};

/// `tests/fixtures/torch/<rel>` (see its README.md).
fn fixture(rel: &str) -> PathBuf {
    common::fixture(&format!("torch/{rel}"))
}

/// Reads every element of every tensor, whole and in chunks of `chunk` elements.
fn read_tensor(desc: &SourceDesc, name: &str, chunk: u64) -> Vec<u8> {
    let t = desc.tensor(name).unwrap();
    let es = t.dtype.size().unwrap() as u64;
    let n = t.elements();
    let src = desc.open().unwrap();
    let mut out = Vec::with_capacity((n * es) as usize);
    for at in (0..n).step_by(chunk as usize) {
        let c = chunk.min(n - at);
        let mut part = vec![0u8; (c * es) as usize];
        src.read_elements(t, at, c, &mut part)
            .unwrap_or_else(|e| panic!("{name} at {at}+{c}: {e}"));
        out.extend(part);
    }
    out
}

/// [`check_against`] for the fixture `input` (a case folder, or its `pytorch_model.bin`) and
/// the case's `expected/model.safetensors`.
fn check_case(input: &str) -> SourceDesc {
    let case = input.strip_suffix("/pytorch_model.bin").unwrap_or(input);
    check_against(
        &fixture(input),
        &fixture(&format!("{case}/expected/model.safetensors")),
    )
}

/// Describes `input` and checks it against `expected` (a safetensors file): same names,
/// dtypes, shapes and bytes, read whole and in odd-sized chunks.
fn check_against(input: &Path, expected: &Path) -> SourceDesc {
    let desc = torch::describe(input).unwrap_or_else(|e| panic!("{e}"));
    let bytes = std::fs::read(expected).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let want: BTreeSet<String> = st.names().into_iter().map(String::from).collect();
    let got: BTreeSet<String> = desc.tensors.iter().map(|t| t.name.clone()).collect();
    assert_eq!(got, want, "tensor names of {}", input.display());
    for (name, view) in st.tensors() {
        let t = desc.tensor(&name).unwrap();
        assert_eq!(
            t.dtype.name(),
            format!("{:?}", view.dtype()),
            "{name} dtype"
        );
        let shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
        assert_eq!(t.shape, shape, "{name} shape");
        let whole = read_tensor(&desc, &name, u64::MAX);
        assert_eq!(whole, view.data(), "{name} bytes");
        for chunk in [1, 3, 7, 13, 50] {
            assert_eq!(
                read_tensor(&desc, &name, chunk),
                view.data(),
                "{name} by {chunk}"
            );
        }
    }
    desc
}

#[test]
fn corners_zip_matches_expected() {
    let desc = check_case("bin/corners/pytorch_model.bin");
    let place = |n: &str| desc.tensor(n).unwrap().placement.clone();
    // tied names share bytes; an offset view is still a plain range inside the same storage
    assert_eq!(place("tied.a"), place("tied.b"));
    let (Placement::Contiguous { offset: a, .. }, Placement::Contiguous { offset: r, len, .. }) =
        (place("tied.a"), place("view.rows"))
    else {
        panic!("tied.a and view.rows should be plain ranges")
    };
    assert_eq!((r - a, len), (2 * 6 * 4, 3 * 6 * 4));
    assert!(matches!(
        place("view.transposed"),
        Placement::Strided { .. }
    ));
    assert!(matches!(place("view.strided"), Placement::Strided { .. }));
    assert!(desc.notes.is_empty(), "{:?}", desc.notes);
}

#[test]
fn legacy_stream_matches_expected() {
    check_case("bin/legacy/pytorch_model.bin");
}

#[test]
fn sharded_bin_folder_matches_expected() {
    let desc = check_case("bin/hf-sharded");
    assert_eq!(desc.files.len(), 3);
}

#[test]
fn dcp_full_model_matches_expected() {
    let dir = fixture("dcp/full-2rank");
    let desc = check_against(&dir, &fixture("dcp/full-2rank/expected/model.safetensors"));
    assert_eq!(desc.files.len(), 2);
    let Placement::Regions(r) = &desc.tensor("model.embed_tokens.weight").unwrap().placement else {
        panic!("a sharded tensor should be regions")
    };
    assert_eq!(r.len(), 2);
    // the DCP folder itself and its .metadata file are accepted too
    let inner = dir.join("pytorch_model_fsdp_0");
    assert_eq!(torch::describe(&inner).unwrap(), desc);
    assert_eq!(torch::describe(&inner.join(".metadata")).unwrap(), desc);
    assert_eq!(torch::describe(&inner.join("__1_0.distcp")).unwrap(), desc);
}

#[test]
fn dcp_lora_matches_expected() {
    check_case("dcp/lora-2rank");
}

#[test]
fn malicious_pickle_is_refused_unexecuted() {
    let path = fixture("bin/malicious/pytorch_model.bin");
    let err = torch::describe(&path).unwrap_err().to_string();
    assert!(err.contains("`posix.system`"), "{err}");
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(!Path::new("/tmp/tftf-pwned").exists());
}

fn temp_copy(bytes: &[u8], name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(name);
    std::fs::write(&p, bytes).unwrap();
    (dir, p)
}

/// `torch::describe` of an `m.pt` zip archive holding the pickle `p`.
fn describe_pt(p: &[u8]) -> tftf::error::Result<SourceDesc> {
    let (_d, path) = temp_copy(&zip_with_pickle(p), "m.pt");
    torch::describe(&path)
}

#[test]
fn truncated_archives_name_the_file() {
    let bytes = std::fs::read(fixture("bin/corners/pytorch_model.bin")).unwrap();
    for cut in [0, 3, 100, bytes.len() / 2, bytes.len() - 1] {
        let (_d, p) = temp_copy(&bytes[..cut], "pytorch_model.bin");
        let err = torch::describe(&p).unwrap_err().to_string();
        assert!(err.contains(&p.display().to_string()), "cut {cut}: {err}");
    }
    let legacy = std::fs::read(fixture("bin/legacy/pytorch_model.bin")).unwrap();
    let (_d, p) = temp_copy(&legacy[..legacy.len() - 5], "old.bin");
    let err = torch::describe(&p).unwrap_err().to_string();
    assert_mentions(&err, &["truncated", "old.bin"]);
}

fn replace_all(bytes: &mut [u8], from: &[u8], to: &[u8]) -> usize {
    assert_eq!(from.len(), to.len());
    let mut n = 0;
    for i in 0..=bytes.len() - from.len() {
        if &bytes[i..i + from.len()] == from {
            bytes[i..i + to.len()].copy_from_slice(to);
            n += 1;
        }
    }
    n
}

/// `bin/corners/pytorch_model.bin` with its `count` occurrences of `from` replaced by `to`,
/// copied to a temporary folder and described, which fails: (folder, file, error).
fn corners_patched(from: &[u8], to: &[u8], count: usize) -> (tempfile::TempDir, PathBuf, String) {
    let mut bytes = std::fs::read(fixture("bin/corners/pytorch_model.bin")).unwrap();
    assert_eq!(replace_all(&mut bytes, from, to), count);
    let (d, p) = temp_copy(&bytes, "pytorch_model.bin");
    let err = torch::describe(&p).unwrap_err().to_string();
    (d, p, err)
}

#[test]
fn missing_storage_member_names_file_and_tensor() {
    // rename member data/11 (the tied storage) in the local and central headers
    let (_d, p, err) = corners_patched(b"model/data/11", b"model/data/xx", 2);
    assert!(err.contains("`tied.a`") && err.contains("data/11"), "{err}");
    assert!(err.contains(&p.display().to_string()), "{err}");
}

#[test]
fn bad_opcode_is_a_pickle_error() {
    let (_d, p, err) = corners_patched(b"\x80\x02}q\x00(", b"\x80\x02\xffq\x00(", 1);
    assert!(err.contains("unsupported opcode 0xff"), "{err}");
    assert!(err.contains(&p.display().to_string()), "{err}");
}

/// A zip of stored members, in order.
fn zip_of(members: &[(&str, &[u8])]) -> Vec<u8> {
    let mut buf = std::io::Cursor::new(Vec::new());
    let mut z = zip::ZipWriter::new(&mut buf);
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, bytes) in members {
        z.start_file(*name, opts).unwrap();
        z.write_all(bytes).unwrap();
    }
    z.finish().unwrap();
    buf.into_inner()
}

/// A torch.save-style zip holding `pickle` as `archive/data.pkl` and one 16-byte storage.
fn zip_with_pickle(pickle: &[u8]) -> Vec<u8> {
    zip_of(&[("archive/data.pkl", pickle), ("archive/data/0", &[0u8; 16])])
}

/// `{'w': _rebuild_tensor_v2(storage('0', FloatStorage), offset, size, stride, False, {})}`
fn tensor_pickle(offset: u8, size: &[u8], stride: &[u8]) -> Vec<u8> {
    let mut p = b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n(".to_vec();
    p.extend(b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ");
    p.extend([b'K', offset, b'(']);
    for d in size {
        p.extend([b'K', *d]);
    }
    p.push(b't');
    p.push(b'(');
    for s in stride {
        p.extend([b'K', *s]);
    }
    p.extend(b"t\x89}tRs.");
    p
}

/// The `_rebuild_tensor_v2(..)` expression of [`tensor_pickle`]`(0, size, stride)` alone, to
/// build other pickles around.
fn rebuild_expr(size: &[u8], stride: &[u8]) -> Vec<u8> {
    let t = tensor_pickle(0, size, stride);
    t[t.windows(5).position(|w| w == b"ctorc").unwrap()..t.len() - 2].to_vec()
}

/// `before`, the [`rebuild_expr`] of `size` and `stride`, then `after`: a pickle built around
/// one tensor.
fn around_tensor(before: &[u8], size: &[u8], stride: &[u8], after: &[u8]) -> Vec<u8> {
    [before, &rebuild_expr(size, stride), after].concat()
}

#[test]
fn handmade_archive_views_are_checked() {
    let ok = zip_with_pickle(&tensor_pickle(1, &[3], &[1]));
    let (_d, p) = temp_copy(&ok, "m.pt");
    let desc = torch::describe(&p).unwrap();
    assert!(matches!(
        desc.tensors[0].placement,
        Placement::Contiguous { len: 12, .. }
    ));
    // a view reaching past its 16-byte storage
    let err = describe_pt(&tensor_pickle(2, &[3], &[1]))
        .unwrap_err()
        .to_string();
    assert_mentions(&err, &["`w`", "reaches byte 20"]);
    // a name given twice
    let mut twice = tensor_pickle(0, &[2], &[1]);
    let body = twice[3..twice.len() - 1].to_vec(); // X..w <tensor> s
    twice.truncate(twice.len() - 1);
    twice.extend(&body);
    twice.push(b'.');
    let err = describe_pt(&twice).unwrap_err().to_string();
    assert!(err.contains("`w`: defined twice"), "{err}");
    // a rank over the cap
    let (_d, p) = temp_copy(
        &zip_with_pickle(&tensor_pickle(0, &[1; 65], &[1; 65])),
        "m.pt",
    );
    let err = torch::describe(&p).unwrap_err().to_string();
    assert!(err.contains("at most 64"), "{err}");
}

#[test]
fn compressed_storage_is_refused() {
    let mut bytes = zip_with_pickle(&tensor_pickle(0, &[4], &[1]));
    // mark every header's compression method as deflate (8): offsets stay valid
    for sig in [&b"PK\x03\x04"[..], b"PK\x01\x02"] {
        let mut i = 0;
        while let Some(at) = bytes[i..].windows(4).position(|w| w == sig) {
            let m = i + at + if sig[2] == 3 { 8 } else { 10 };
            bytes[m] = 8;
            i += at + 4;
        }
    }
    let (_d, p) = temp_copy(&bytes, "m.pt");
    let err = torch::describe(&p).unwrap_err().to_string();
    assert!(err.contains("compressed"), "{err}");
}

/// Issue #24: two members of one name. torch.load reads the first copy, the zip reader the
/// last; either way the weights would differ from torch's, so both repeats are refused.
#[test]
fn repeated_member_names_are_refused() {
    let pickle = tensor_pickle(0, &[4], &[1]);
    let (first, last) = ([1u8; 16], [2u8; 16]);
    // the writer refuses repeated names: write a stand-in name and rename it in both headers
    let mut storage_twice = zip_of(&[
        ("archive/data.pkl", &pickle),
        ("archive/data/0", &first),
        ("archive/data/Z", &last),
    ]);
    assert_eq!(replace_all(&mut storage_twice, b"data/Z", b"data/0"), 2);
    let mut pickle_twice = zip_of(&[
        ("archive/data.pkl", &pickle),
        ("archive/data/0", &first),
        ("archive/dataZpkl", &tensor_pickle(4, &[0], &[1])),
    ]);
    assert_eq!(replace_all(&mut pickle_twice, b"dataZpkl", b"data.pkl"), 2);
    for (bytes, member) in [
        (storage_twice, "archive/data/0"),
        (pickle_twice, "archive/data.pkl"),
    ] {
        let (_d, p) = temp_copy(&bytes, "m.pt");
        let err = torch::describe(&p).unwrap_err().to_string();
        assert_mentions(
            &err,
            &[
                &format!("member `{member}` appears more than once"),
                "torch.load reads the first",
            ],
        );
        assert!(err.contains(&p.display().to_string()), "{err}");
    }
}

#[test]
fn dcp_chunk_past_end_names_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("dcp/full-2rank/pytorch_model_fsdp_0"), dir.path());
    let shard = dir.path().join("__1_0.distcp");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let err = torch::describe(dir.path()).unwrap_err().to_string();
    assert_mentions(&err, &["__1_0.distcp", "past the end"]);
    assert!(err.contains("tensor `model."), "{err}");
}

/// The fixture folder `rel` copied without its file `gone`, described: the error.
fn describe_without(rel: &str, gone: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture(rel), dir.path());
    std::fs::remove_file(dir.path().join(gone)).unwrap();
    torch::describe(dir.path()).unwrap_err().to_string()
}

#[test]
fn dcp_missing_distcp_names_it() {
    let err = describe_without("dcp/full-2rank/pytorch_model_fsdp_0", "__0_0.distcp");
    assert!(err.contains("__0_0.distcp"), "{err}");
}

#[test]
fn sharded_index_naming_a_missing_shard_is_refused() {
    let err = describe_without("bin/hf-sharded", "pytorch_model-00002-of-00003.bin");
    assert_mentions(&err, &["pytorch_model-00002-of-00003.bin", "missing"]);
}

/// xorshift64*: a fixed-seed generator, so a failure reproduces.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Describing and reading a damaged input may fail, but never panics.
fn describe_and_read(path: &Path) {
    let Ok(desc) = torch::describe(path) else {
        return;
    };
    let Ok(src) = desc.open() else { return };
    for t in &desc.tensors {
        let Some(es) = t.dtype.size() else { continue };
        let n = t.elements();
        if n.saturating_mul(es as u64) > 1 << 24 {
            continue;
        }
        let mut out = vec![0u8; n as usize * es];
        let _ = src.read_elements(t, 0, n, &mut out);
    }
}

#[test]
fn mutated_fixtures_never_panic() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for rel in [
        "bin/corners/pytorch_model.bin",
        "bin/legacy/pytorch_model.bin",
        "dcp/full-2rank/pytorch_model_fsdp_0/.metadata",
        "dcp/full-2rank/pytorch_model_fsdp_0/__1_0.distcp",
        "dcp/grid-synthetic/.metadata",
        "dcp/grid-synthetic/__1_0.distcp",
    ] {
        let src = fixture(rel);
        let dir = tempfile::tempdir().unwrap();
        let target = if rel.starts_with("dcp") {
            copy_dir(src.parent().unwrap(), dir.path());
            dir.path().join(src.file_name().unwrap())
        } else {
            dir.path().join("m.bin")
        };
        let original = std::fs::read(&src).unwrap();
        for _ in 0..300 {
            let mut bytes = original.clone();
            for _ in 0..1 + rng.below(8) {
                let at = rng.below(bytes.len());
                bytes[at] = match rng.below(4) {
                    0 => 0xff,
                    1 => 0,
                    _ => rng.next() as u8,
                };
            }
            if rng.below(8) == 0 {
                bytes.truncate(rng.below(bytes.len()));
            }
            std::fs::write(&target, &bytes).unwrap();
            describe_and_read(&target);
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
    #[test]
    fn unpickle_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
        let mut p = b"\x80\x02".to_vec();
        p.extend(bytes);
        let _ = pickle::unpickle(&p);
    }
}

#[test]
fn deeply_nested_pickle_drops_without_overflow() {
    // a million lists, each appended into the next: [[[[…]]]]
    let mut p = b"\x80\x02]".to_vec();
    p.extend(std::iter::repeat_n(b']', 1_000_000));
    p.extend(std::iter::repeat_n(b'a', 1_000_000));
    p.push(b'.');
    let (v, _) = pickle::unpickle(&p).unwrap();
    assert_eq!(v.kind(), "list");
    drop(v);
}

#[test]
fn member_count_over_the_cap_is_refused() {
    let mut bytes = std::fs::read(fixture("bin/corners/pytorch_model.bin")).unwrap();
    let z64 = bytes.windows(4).rposition(|w| w == b"PK\x06\x06").unwrap();
    bytes[z64 + 32..z64 + 40].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let (_d, p) = temp_copy(&bytes, "pytorch_model.bin");
    let err = torch::describe(&p).unwrap_err().to_string();
    assert!(err.contains("announces 1099511627776 members"), "{err}");
}

#[test]
fn nested_dicts_flatten_and_non_tensors_are_noted() {
    // {'outer': {'w': <tensor>}, 'step': 7}
    let p = around_tensor(
        b"\x80\x02}(X\x05\x00\x00\x00outer}X\x01\x00\x00\x00w",
        &[2],
        &[1],
        b"sX\x04\x00\x00\x00stepK\x07u.",
    );
    let desc = describe_pt(&p).unwrap();
    let names: Vec<&str> = desc.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["outer.w"]);
    assert_eq!(desc.notes, ["`step` (int) skipped: not a tensor"]);
}

/// `dcp/grid-synthetic` (made by `make_grid_dcp.py`): an N-d chunk grid with a transposed
/// chunk, a whole-tensor chunk, a 0-d tensor, a bytes entry and optimizer state.
#[test]
fn dcp_chunk_grid_reads_row_major() {
    let desc = torch::describe(&fixture("dcp/grid-synthetic")).unwrap();
    let names: BTreeSet<&str> = desc.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, BTreeSet::from(["grid", "vec", "scalar"]));
    assert_eq!(
        desc.notes,
        [
            "`model.extra` (bytes) skipped: not a tensor",
            "`optim.state.vec.exp_avg` skipped: optimizer state"
        ]
    );
    let grid = desc.tensor("grid").unwrap();
    assert_eq!(grid.shape, [5, 7]);
    let Placement::Regions(regions) = &grid.placement else {
        panic!("grid should be regions")
    };
    assert!(matches!(regions[3].placement, Placement::Strided { .. }));
    assert!(matches!(
        desc.tensor("vec").unwrap().placement,
        Placement::Contiguous { .. }
    ));
    for (name, n) in [("grid", 35), ("vec", 6), ("scalar", 1)] {
        let want: Vec<u8> = (0..n).flat_map(|v| (v as f32).to_le_bytes()).collect();
        for chunk in [1, 2, 4, 5, 6, 9, 35] {
            assert_eq!(read_tensor(&desc, name, chunk), want, "{name} by {chunk}");
        }
    }
}

/// `dcp/many-chunks` (also `make_grid_dcp.py`): a [4, 6] tensor in 24 one-element chunks
/// alternating between two files, read back in row-major order.
#[test]
fn dcp_one_element_chunks_read_row_major() {
    let desc = torch::describe(&fixture("dcp/many-chunks")).unwrap();
    let want: Vec<u8> = (0..24).flat_map(|v| (v as f32).to_le_bytes()).collect();
    for chunk in [1, 5, 24] {
        assert_eq!(read_tensor(&desc, "cells", chunk), want, "by {chunk}");
    }
}

#[test]
fn bin_folder_without_index_reads_every_shard() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("bin/hf-sharded"), dir.path());
    std::fs::remove_file(dir.path().join(torch::BIN_INDEX_NAME)).unwrap();
    check_against(
        dir.path(),
        &fixture("bin/hf-sharded/expected/model.safetensors"),
    );
    // a tensor in two shards is ambiguous
    std::fs::copy(
        dir.path().join("pytorch_model-00001-of-00003.bin"),
        dir.path().join("pytorch_model-extra.bin"),
    )
    .unwrap();
    let err = torch::describe(dir.path()).unwrap_err().to_string();
    assert_mentions(&err, &["defined twice", "pytorch_model-extra.bin"]);
}

#[test]
fn dcp_chunks_through_storage_extensions_are_refused() {
    let err = torch::describe(&fixture("dcp/transformed"))
        .unwrap_err()
        .to_string();
    assert_mentions(&err, &["stream.zstd", "`model.grid`"]);
    assert!(err.contains(".metadata"), "{err}");
}

/// Issue #24: a plain `torch.distributed.checkpoint.save` of a model whose own names start with
/// `model.` keeps them (no accelerate wrapper in `planner_data`), and `optimus_head.weight` is a
/// tensor, not optimizer state.
#[test]
fn plain_dcp_keeps_model_prefix_and_optimus_head() {
    let desc = check_case("dcp/plain-hf");
    assert!(desc.tensor("model.embed_tokens.weight").is_some());
    assert!(desc.tensor("optimus_head.weight").is_some());
    assert_eq!(desc.notes, Vec::<String>::new());
}

/// Issue #24: accelerate's `{"model": …}` wrapper is dropped, the real Adam state under `optim`
/// (int parameter ids in its paths) is skipped, and `optimus_head.weight` stays.
#[test]
fn wrapped_dcp_drops_the_wrapper_and_the_optimizer_by_structure() {
    let desc = check_case("dcp/wrapped-optim");
    assert!(desc.tensor("optimus_head.weight").is_some());
    assert!(desc
        .notes
        .iter()
        .any(|n| n == "`optim.state.0.exp_avg` skipped: optimizer state"));
    assert!(
        desc.notes
            .iter()
            .all(|n| n.starts_with("`optim.") && n.contains("skipped")),
        "{:?}",
        desc.notes
    );
}

/// Issue #24: `float4_e2m1fn_x2` reads as `F4` with the element shape the safetensors package
/// writes (a row slice included), and `nn.Parameter`s are their tensors.
#[test]
fn packed_fp4_and_parameters_read_as_safetensors_writes_them() {
    let path = fixture("bin/fp4-params/pytorch_model.bin");
    let desc = torch::describe(&path).unwrap();
    let file = std::fs::read(&path).unwrap();
    let bytes = std::fs::read(fixture("bin/fp4-params/expected/model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(desc.tensors.len(), st.len());
    for (name, view) in st.tensors() {
        let t = desc.tensor(&name).unwrap();
        assert_eq!(t.dtype.name(), format!("{:?}", view.dtype()), "{name}");
        let shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
        assert_eq!(t.shape, shape, "{name}");
        let Placement::Contiguous { offset, len, .. } = t.placement else {
            panic!("{name}: {:?}", t.placement)
        };
        assert_eq!(
            &file[offset as usize..(offset + len) as usize],
            view.data(),
            "{name}"
        );
    }
    let fp4 = desc.tensor("fp4.rows").unwrap();
    assert_eq!((fp4.dtype.name(), &fp4.shape[..]), ("F4", &[2, 12][..]));
}

/// Issue #24: a complex128 tensor is an unsupported dtype, named with its file and tensor, not
/// a pickle that "could run code".
#[test]
fn complex128_is_an_unsupported_dtype() {
    let path = fixture("bin/complex128/pytorch_model.bin");
    let err = torch::describe(&path).unwrap_err().to_string();
    assert_mentions(&err, &["`freqs`", "unsupported dtype complex128"]);
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(!err.contains("code"), "{err}");
}

/// Issue #24: `torch.nn.Parameter(tensor, requires_grad)` called directly (REDUCE or NEWOBJ), as
/// `torch.load(weights_only=True)` accepts it, is the tensor; without a tensor it is refused.
#[test]
fn parameter_calls_are_tensors() {
    for call in [&b"R"[..], b"\x81"] {
        let p = around_tensor(
            b"\x80\x02}X\x01\x00\x00\x00wctorch.nn.parameter\nParameter\n(",
            &[4],
            &[1],
            &[&b"\x88t"[..], call, b"s."].concat(),
        );
        let desc = describe_pt(&p).unwrap();
        assert_eq!(desc.tensors.len(), 1, "{:?}", desc.notes);
        assert_eq!(
            (desc.tensors[0].name.as_str(), &desc.tensors[0].shape[..]),
            ("w", &[4][..])
        );
    }
    let p = b"\x80\x02}X\x01\x00\x00\x00wctorch.nn.parameter\nParameter\n)Rs.";
    let err = describe_pt(p).unwrap_err().to_string();
    assert!(err.contains("parameter rebuilt without a tensor"), "{err}");
}

/// Issue #24: a pickle that shares one dict through its memo under two keys, level upon level,
/// fans 20 KiB out to 2^24 names of 24 KB each. It is refused once the names pass what a
/// safetensors header may hold, in bounded time and within 1 GiB of data (`RLIMIT_DATA`).
#[test]
fn memo_shared_dicts_are_refused_within_a_header_budget() {
    let mut p = around_tensor(b"\x80\x02", &[4], &[1], b"q\x00");
    let key = |c: u8| {
        let mut k = vec![b'X'];
        k.extend(1000u32.to_le_bytes());
        k.extend(std::iter::repeat_n(b'k', 999));
        k.push(c);
        k
    };
    for level in 1..=24u8 {
        p.extend(b"}(");
        for c in [b'a', b'b'] {
            p.extend(key(c));
            p.extend([b'h', level - 1]);
        }
        p.extend([b'u', b'q', level]);
    }
    p.push(b'.');
    let (_d, path) = temp_copy(&zip_with_pickle(&p), "pytorch_model.bin");
    let started = std::time::Instant::now();
    let mut info = std::process::Command::new(env!("CARGO_BIN_EXE_tftf"));
    info.args(["info", path.to_str().unwrap()]);
    // SAFETY: setrlimit is async-signal-safe and touches no memory of the parent.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut info, || {
            // 1 GiB of data: the names alone would take gigabytes
            let limit = libc::rlimit {
                rlim_cur: 1 << 30,
                rlim_max: 1 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_DATA, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        })
    };
    let out = info.output().unwrap();
    assert_mentions(
        &String::from_utf8_lossy(&out.stderr),
        &[
            "names add up to more than 100000000 bytes",
            "pytorch_model.bin",
        ],
    );
    assert!(started.elapsed().as_secs() < 20, "{:?}", started.elapsed());
}

/// Writes pickles of DCP metadata for tests: objects as `GLOBAL; NEWOBJ(); BUILD(dict)`, the
/// way `pickle` writes the dataclasses.
struct Pickler(Vec<u8>);

impl Pickler {
    fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend(bytes);
        self
    }

    fn str(&mut self, s: &str) -> &mut Self {
        self.0.push(b'X');
        self.0.extend((s.len() as u32).to_le_bytes());
        self.raw(s.as_bytes())
    }

    fn int(&mut self, v: u64) -> &mut Self {
        self.0.push(b'J');
        self.raw(&i32::try_from(v).unwrap().to_le_bytes())
    }

    fn ints(&mut self, v: &[u64]) -> &mut Self {
        self.0.push(b'(');
        for x in v {
            self.int(*x);
        }
        self.raw(b"t")
    }

    /// An instance of `module.class` whose state dict `fields` writes as key, value, ….
    fn object(&mut self, module: &str, class: &str, fields: impl FnOnce(&mut Self)) -> &mut Self {
        self.raw(format!("c{module}\n{class}\n").as_bytes());
        self.raw(b")\x81}(");
        fields(self);
        self.raw(b"ub")
    }
}

/// A DCP folder holding one F32 tensor `w` of `shape` whose element values are their row-major
/// indices, saved as one-element chunks, each in its own torch.save archive.
fn one_element_chunks_dcp(dir: &Path, shape: [u64; 2]) {
    const MD: &str = "torch.distributed.checkpoint.metadata";
    let chunk_pickle = around_tensor(b"\x80\x02", &[1, 1], &[1, 1], b".");
    let cells: Vec<[u64; 2]> = (0..shape[0])
        .flat_map(|i| (0..shape[1]).map(move |j| [i, j]))
        .collect();
    let mut distcp = Vec::new();
    let mut at = Vec::with_capacity(cells.len());
    for (n, _) in cells.iter().enumerate() {
        let archive = zip_of(&[
            ("archive/data.pkl", &chunk_pickle),
            ("archive/data/0", &(n as f32).to_le_bytes()),
        ]);
        at.push((distcp.len() as u64, archive.len() as u64));
        distcp.extend(archive);
    }
    std::fs::write(dir.join("__0_0.distcp"), distcp).unwrap();
    let mut p = Pickler(b"\x80\x02".to_vec());
    p.object(MD, "Metadata", |p| {
        p.str("state_dict_metadata").raw(b"}(").str("w");
        p.object(MD, "TensorStorageMetadata", |p| {
            p.str("properties").object(MD, "TensorProperties", |p| {
                p.str("dtype").raw(b"ctorch\nfloat32\n");
            });
            p.str("size").ints(&shape).str("chunks").raw(b"](");
            for c in &cells {
                p.object(MD, "ChunkStorageMetadata", |p| {
                    p.str("offsets").ints(c).str("sizes").ints(&[1, 1]);
                });
            }
            p.raw(b"e");
        });
        p.raw(b"u").str("storage_data").raw(b"}(");
        for (c, (offset, length)) in cells.iter().zip(&at) {
            p.object(MD, "MetadataIndex", |p| {
                p.str("fqn").str("w").str("offset").ints(c);
            });
            p.object(
                "torch.distributed.checkpoint.filesystem",
                "_StorageInfo",
                |p| {
                    p.str("relative_path").str("__0_0.distcp");
                    p.str("offset").int(*offset).str("length").int(*length);
                },
            );
        }
        p.raw(b"u");
    });
    p.raw(b".");
    std::fs::write(dir.join(".metadata"), &p.0).unwrap();
}

/// Issue #24: 10^5 one-element chunks (a [250, 400] grid, each chunk its own archive) are
/// described and read back in seconds: the chunks are checked and found through the grid their
/// boundaries cut, not pairwise (65,536 such chunks took over a minute).
#[test]
fn a_hundred_thousand_chunks_assemble_in_seconds() {
    let dir = tempfile::tempdir().unwrap();
    one_element_chunks_dcp(dir.path(), [250, 400]);
    let started = std::time::Instant::now();
    let desc = torch::describe(dir.path()).unwrap();
    let described = started.elapsed();
    let want: Vec<u8> = (0..100_000)
        .flat_map(|v| (v as f32).to_le_bytes())
        .collect();
    assert_eq!(read_tensor(&desc, "w", 100_000), want);
    assert_eq!(read_tensor(&desc, "w", 4_099)[..], want[..]);
    let elapsed = started.elapsed();
    eprintln!(
        "described in {described:?}, read in {:?}",
        elapsed - described
    );
    assert!(elapsed.as_secs() < 20, "{elapsed:?}");
}
