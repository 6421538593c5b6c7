//! `--checksums` writes SHA256SUMS and tftf-manifest.json; `tftf verify` re-checks them and
//! names the first tensor that changed.

mod common;
use common::*;
use sha2::{Digest, Sha256};
use std::os::unix::fs::FileExt;

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn sums_match_sha256sum_and_verify_names_a_changed_tensor() {
    let (d, src, _) = tmp_small_model();
    std::fs::write(src.join("config.json"), SMALL_CONFIG).unwrap();
    let out = d.path().join("out");
    passthrough_ok(&src, &out, &["--checksums", "-q"]);
    // SHA256SUMS lists every file written, each with its real SHA-256.
    let sums = std::fs::read_to_string(out.join("SHA256SUMS")).unwrap();
    let mut listed: Vec<&str> = Vec::new();
    for line in sums.lines() {
        let (h, name) = line.split_once("  ").unwrap();
        assert_eq!(
            h,
            hex(&Sha256::digest(std::fs::read(out.join(name)).unwrap())),
            "{name}"
        );
        listed.push(name);
    }
    listed.sort();
    let mut files = listing(&out);
    files.retain(|f| f != "SHA256SUMS" && f != "tftf-manifest.json");
    assert_eq!(listed, files);
    let o = tftf_ok(&["verify", s(&out)]);
    assert_mentions(&stdout(&o), &["match tftf-manifest.json"]);

    // Change one byte inside one tensor: verify names the file and that tensor, exit 1.
    let m = read_json(&out.join("tftf-manifest.json"));
    let f = &m["files"][1];
    let t = &f["tensors"][2];
    let path = out.join(f["name"].as_str().unwrap());
    let at = t["offset"].as_u64().unwrap() + t["len"].as_u64().unwrap() / 2;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut b = [0u8];
    file.read_exact_at(&mut b, at).unwrap();
    file.write_all_at(&[b[0] ^ 1], at).unwrap();
    let o = tftf(&["verify", s(&out)]);
    assert_eq!(o.status.code(), Some(1));
    let want = format!(
        "{}: tensor `{}` (bytes {}..{}) differs from the manifest",
        f["name"].as_str().unwrap(),
        t["name"].as_str().unwrap(),
        t["offset"],
        t["offset"].as_u64().unwrap() + t["len"].as_u64().unwrap()
    );
    assert!(stdout(&o).contains(&want), "{}", stdout(&o));
}

#[test]
fn verify_without_a_manifest_and_checksums_into_a_file_are_refused() {
    let (d, src, _) = tmp_small_model();
    let msg = fails(&["verify", s(&src)]);
    assert!(
        msg.contains("no tftf-manifest.json; write the checkpoint with --checksums to make one"),
        "{msg}"
    );
    let out = d.path().join("one.safetensors");
    let msg = usage_error(&cmd("passthrough", &src, &out, &["--checksums"]));
    assert_refused(&msg, &["give a directory as -o"], &out);
}

#[test]
fn a_later_run_without_checksums_removes_the_stale_sums() {
    let (d, src, _) = tmp_small_model();
    let out = d.path().join("out");
    passthrough_ok(&src, &out, &["--checksums", "-q"]);
    assert!(out.join("SHA256SUMS").exists());
    passthrough_ok(&src, &out, &["--dtype", "bf16", "--force", "-q"]);
    assert!(
        !out.join("SHA256SUMS").exists(),
        "sums of the old bytes would lie"
    );
    assert!(!out.join("tftf-manifest.json").exists());
}
