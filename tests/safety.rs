//! A run owns only what it writes: inputs are never replaced or deleted whatever the paths
//! look like, `--force` removes only model files, one run writes an output at a time, and a
//! kill at any point of the commit leaves the old output or, after the next run, the new one.

mod common;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;
use sha2::{Digest, Sha256};

/// Every file of a directory (hidden ones too) with its SHA-256.
fn snapshot(dir: &Path) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_file() {
            let h = Sha256::digest(std::fs::read(&p).unwrap());
            let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
            m.insert(e.file_name().to_string_lossy().into_owned(), hex);
        }
    }
    m
}

fn hidden(dir: &Path) -> Vec<String> {
    listing(dir)
        .into_iter()
        .filter(|n| n.starts_with('.'))
        .collect()
}

#[test]
fn single_file_output_with_force_replaces_that_file_only() {
    let (d, src, _) = tmp_small_model();
    let shared = d.path().join("shared");
    // Another model's files in the folder the single file goes to.
    Model::new()
        .tensor("x", tftf::format::dtype::DType::U8, &[4], vec![1; 4])
        .indexed()
        .write(&shared);
    std::fs::rename(
        shared.join("model-00001-of-00001.safetensors"),
        shared.join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    std::fs::write(shared.join("other.safetensors"), "other model").unwrap();
    std::fs::write(shared.join("new.safetensors"), "previous output").unwrap();
    let before = snapshot(&shared);
    let out = shared.join("new.safetensors");
    passthrough_ok(&src, &out, &["--force", "-q"]);
    let after = snapshot(&shared);
    for (name, hash) in &before {
        if name != "new.safetensors" {
            assert_eq!(after.get(name), Some(hash), "{name} changed or vanished");
        }
    }
    assert_eq!(after.len(), before.len(), "{after:?}");
    assert_eq!(load_all(&out).len(), 11);
}

#[test]
fn single_file_input_into_its_own_folder_never_deletes_it() {
    let d = tmp();
    let dir = d.path().join("models");
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = Rng(3);
    let tensors = vec![rand_t(
        &mut rng,
        "w",
        tftf::format::dtype::DType::BF16,
        &[8, 8],
    )];
    write_file(&dir.join("mine.safetensors"), &tensors);
    write_file(&dir.join("sibling.safetensors"), &tensors);
    let before = snapshot(&dir);
    passthrough_ok(&dir.join("mine.safetensors"), &dir, &["--force", "-q"]);
    let after = snapshot(&dir);
    assert_eq!(
        after.get("mine.safetensors"),
        before.get("mine.safetensors")
    );
    assert_eq!(
        after.get("sibling.safetensors"),
        before.get("sibling.safetensors")
    );
    assert!(after.contains_key("model.safetensors"));

    // An input named like the output's file is refused, not replaced.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::rename(dir.join("mine.safetensors"), dir.join("model.safetensors")).unwrap();
    let before = snapshot(&dir);
    let err = usage_error(&cmd(
        "passthrough",
        &dir.join("model.safetensors"),
        &dir,
        &["--force"],
    ));
    assert_mentions(&err, &["refusing to replace", "model.safetensors"]);
    assert_eq!(snapshot(&dir), before);
}

#[test]
fn report_never_lands_on_an_input_or_an_output_file() {
    let (d, src, _) = tmp_small_model();
    let before = snapshot(&src);
    let out = d.path().join("out");
    let shard = src.join("model-00001-of-00002.safetensors");
    let err = usage_error(&cmd("passthrough", &src, &out, &["--report", s(&shard)]));
    assert_mentions(
        &err,
        &["refusing to write the report over", "model-00001-of-00002"],
    );
    assert!(!out.exists());
    // Also when the run is refused for another reason first.
    fails(&cmd(
        "passthrough",
        &src,
        &src.join("sub"),
        &["--report", s(&src.join("config.json"))],
    ));
    assert_eq!(snapshot(&src), before);
    // Not one of the output's own files either, nor an unrelated existing file.
    let err = usage_error(&cmd(
        "passthrough",
        &src,
        &out,
        &["--report", s(&out.join("config.json"))],
    ));
    assert!(err.contains("one of the output's own files"), "{err}");
    let one = d.path().join("one.safetensors");
    let err = usage_error(&cmd("passthrough", &src, &one, &["--report", s(&one)]));
    assert!(err.contains("one of the output's own files"), "{err}");
    let notes = d.path().join("notes.txt");
    std::fs::write(&notes, "keep me").unwrap();
    let err = usage_error(&cmd("passthrough", &src, &out, &["--report", s(&notes)]));
    assert!(err.contains("is not a tftf report"), "{err}");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "keep me");
    assert!(!out.exists());
    assert_eq!(snapshot(&src), before);
    // An earlier report is replaced.
    let report = d.path().join("report.json");
    for _ in 0..2 {
        passthrough_ok(&src, &out, &["--force", "-q", "--report", s(&report)]);
    }
    assert!(hidden(d.path()).is_empty(), "{:?}", hidden(d.path()));
}

#[test]
fn input_shards_symlinked_into_the_output_are_not_overwritten() {
    let d = tmp();
    let real = d.path().join("out");
    small_model(&real);
    // The input folder holds symlinks to shards that live in the output folder.
    let src = d.path().join("in");
    std::fs::create_dir_all(&src).unwrap();
    for e in std::fs::read_dir(&real).unwrap().flatten() {
        std::os::unix::fs::symlink(e.path(), src.join(e.file_name())).unwrap();
    }
    let before = snapshot(&real);
    let err = usage_error(&cmd("passthrough", &src, &real, &["--force"]));
    assert_mentions(
        &err,
        &[
            "refusing to replace",
            s(&real.join("model-00001-of-00002.safetensors")),
        ],
    );
    assert_eq!(snapshot(&real), before);

    // A hard link to an input under a stale shard name is not deleted either.
    let out = d.path().join("out2");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::hard_link(
        real.join("model-00002-of-00002.safetensors"),
        out.join("model-00007-of-00009.safetensors"),
    )
    .unwrap();
    let err = usage_error(&cmd("passthrough", &real, &out, &["--force"]));
    assert!(err.contains("refusing to delete"), "{err}");
    assert!(out.join("model-00007-of-00009.safetensors").exists());

    // An output reached through a symlinked parent is still inside the input.
    let alias = d.path().join("alias");
    std::os::unix::fs::symlink(&real, &alias).unwrap();
    let err = fails(&cmd("passthrough", &real, &alias.join("sub"), &[]));
    assert!(err.contains("is the input or inside it"), "{err}");
}

#[test]
fn force_deletes_only_model_files_and_dry_run_lists_them() {
    let (d, src, _) = tmp_small_model();
    let out = d.path().join("out");
    passthrough_ok(&src, &out, &["-q", "--max-shard-size", "5000"]);
    let shards_before = listing(&out)
        .into_iter()
        .filter(|n| n.starts_with("model-"))
        .count();
    assert!(shards_before > 2);
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    std::fs::write(out.join("weights-v2.safetensors"), "another model").unwrap();
    let before = snapshot(&out);
    let o = passthrough_ok(&src, &out, &["--force", "--dry-run"]);
    let text = stdout(&o);
    let n = shards_before;
    let deleted: Vec<String> = (1..=n)
        .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
        .collect();
    assert_mentions(
        &text,
        &[&format!(
            "deletes (model files of the earlier output): {}\n",
            deleted.join(", ")
        )],
    );
    assert!(
        !text.contains("notes.txt") && !text.contains("weights-v2"),
        "{text}"
    );
    assert_eq!(snapshot(&out), before, "dry run changed the output");
    passthrough_ok(&src, &out, &["--force", "-q"]);
    assert_listing(
        &out,
        "config.json model-00001-of-00002.safetensors \
         model-00002-of-00002.safetensors model.safetensors.index.json \
         modeling_x.py notes.txt tokenizer.json weights-v2.safetensors",
    );
}

/// Waits until process `pid` is stopped (state `T`).
fn wait_stopped(pid: u32) {
    for _ in 0..2000 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('T'))
        {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("process {pid} never stopped");
}

#[test]
fn a_second_run_on_the_same_output_fails_at_once_naming_the_first() {
    let (d, src, _) = tmp_small_model();
    let out = d.path().join("out");
    let mut first = Command::new(env!("CARGO_BIN_EXE_tftf"))
        .args(cmd("passthrough", &src, &out, &["-q"]))
        .env("TFTF_TEST_STOP_AT", "written")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_stopped(first.id());
    for force in [false, true] {
        let mut args = cmd("passthrough", &src, &out, &[]);
        if force {
            args.push("--force");
        }
        let err = fails(&args);
        assert_mentions(
            &err,
            &[&format!(
                "is being written by another tftf run (pid {})",
                first.id()
            )],
        );
    }
    // The holder's temporaries were left alone, and it finishes normally.
    let cont = Command::new("kill")
        .args(["-CONT", &first.id().to_string()])
        .status()
        .unwrap();
    assert!(cont.success());
    let status = first.wait().unwrap();
    assert!(status.success());
    assert_eq!(load_all(&out).len(), 11);
    assert!(hidden(&out).is_empty(), "{:?}", hidden(&out));
}

/// Output of a clean run of `args` into a fresh directory, for comparison.
fn reference(src: &Path, d: &Path, args: &[&str]) -> BTreeMap<String, String> {
    let out = d.join("reference");
    let mut a = cmd("passthrough", src, &out, &["-q"]);
    a.extend_from_slice(args);
    tftf_ok(&a);
    snapshot(&out)
}

fn visible(snap: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    snap.iter()
        .filter(|(k, _)| !k.starts_with('.'))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[test]
fn a_kill_at_any_commit_point_leaves_the_old_output_or_the_new_one() {
    let (d, src, _) = tmp_small_model();
    let old_args = ["--max-shard-size", "5000"];
    let new_args = ["--dtype", "bf16"];
    let old = visible(&reference(&src, &d.path().join("old"), &old_args));
    let new = visible(&reference(&src, &d.path().join("new"), &new_args));
    assert_ne!(old, new);
    let n_old = old.keys().filter(|k| k.starts_with("model-")).count();
    for (point, journalled) in [
        ("tmp:1", false),
        ("tmp:4", false),
        ("written", false),
        ("journal", true),
        ("rename:1", true),
        ("rename:5", true),
        ("delete:1", true),
        (&*format!("delete:{n_old}"), true),
        ("applied", true),
    ] {
        for finish_with_recover in [false, true] {
            let out = d.path().join(format!("out-{point}-{finish_with_recover}"));
            let mut a = cmd("passthrough", &src, &out, &["-q"]);
            a.extend_from_slice(&old_args);
            tftf_ok(&a);
            let mut a = cmd("passthrough", &src, &out, &["-q", "--force"]);
            a.extend_from_slice(&new_args);
            let killed = Command::new(env!("CARGO_BIN_EXE_tftf"))
                .args(&a)
                .env("TFTF_TEST_CRASH_AT", point)
                .output()
                .unwrap();
            assert_eq!(killed.status.signal(), Some(9), "{point}: not killed");
            let after_kill = snapshot(&out);
            if journalled {
                assert!(after_kill.contains_key(".tftf-commit.json"), "{point}");
                // Readers are told the output is half committed instead of loading a mix.
                let err = fails(&["info", s(&out)]);
                assert!(err.contains(&format!("tftf recover {}", s(&out))), "{err}");
            } else {
                assert_eq!(visible(&after_kill), old, "{point}: old output changed");
                assert!(
                    after_kill.keys().any(|k| k.ends_with(".tmp")),
                    "{point}: {after_kill:?}"
                );
            }
            if finish_with_recover {
                tftf_ok(&["recover", s(&out)]);
                let expect = if journalled { &new } else { &old };
                assert_eq!(&snapshot(&out), expect, "{point}: after recover");
            } else {
                // The next run cleans up and commits.
                tftf_ok(&a);
                assert_eq!(snapshot(&out), new, "{point}: after the rerun");
            }
        }
    }
}

#[test]
fn temporaries_of_a_killed_first_run_do_not_block_the_next() {
    let (d, src, _) = tmp_small_model();
    let out = d.path().join("out");
    let a = cmd("passthrough", &src, &out, &["-q"]);
    let killed = Command::new(env!("CARGO_BIN_EXE_tftf"))
        .args(a)
        .env("TFTF_TEST_CRASH_AT", "written")
        .output()
        .unwrap();
    assert_eq!(killed.status.signal(), Some(9));
    let left: Vec<String> = hidden(&out);
    assert!(left.iter().any(|n| n.ends_with(".tmp")), "{left:?}");
    // No --force needed: nothing but the killed run's temporaries is there.
    let o = passthrough_ok(&src, &out, &[]);
    assert_mentions(&stderr(&o), &["temporary file(s) left by a killed run"]);
    assert!(hidden(&out).is_empty(), "{:?}", hidden(&out));
    assert_eq!(load_all(&out).len(), 11);
}

#[test]
fn not_empty_error_names_what_is_there() {
    let (d, src, _) = tmp_small_model();
    let out: PathBuf = d.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let err = fails(&cmd("passthrough", &src, &out, &[]));
    assert!(
        err.contains("is not empty (it holds `notes.txt`); pass --force"),
        "{err}"
    );
}

#[test]
fn output_through_a_bind_mount_of_the_input_is_refused() {
    let (d, src, _) = tmp_small_model();
    let alias = d.path().join("alias");
    std::fs::create_dir_all(&alias).unwrap();
    let mounted = Command::new("mount")
        .args(["--bind", s(&src), s(&alias)])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|st| st.success());
    if !mounted {
        eprintln!("SKIPPED: bind mounts need root (mount --bind failed)");
        return;
    }
    let before = snapshot(&src);
    let inside = fails(&cmd("passthrough", &src, &alias.join("sub"), &[]));
    let same = fails(&cmd("passthrough", &src, &alias, &["--force"]));
    let _ = Command::new("umount").arg(&alias).status();
    assert!(inside.contains("is the input or inside it"), "{inside}");
    assert!(same.contains("is the input or inside it"), "{same}");
    assert_eq!(snapshot(&src), before);
    assert!(!src.join("sub").exists());
}

#[test]
fn a_run_failing_mid_stream_leaves_no_file_and_no_directory_it_created() {
    use tftf::format::dtype::DType;
    let (d, src) = tmp_in();
    Model::new()
        .tensor("w.weight", DType::F8_E4M3, &[2, 2], vec![0x38, 0x7F, 0, 0])
        .tensor(
            "w.weight_scale_inv",
            DType::F32,
            &[1, 1],
            1f32.to_le_bytes().to_vec(),
        )
        .write(&src);
    let out = d.path().join("a/b/out");
    let err = fails(&cmd("dequant-fp8", &src, &out, &[]));
    assert!(err.contains("w.weight") && err.contains("NaN"), "{err}");
    assert!(
        !d.path().join("a").exists(),
        "created directories left behind"
    );
    // In an existing directory, only the run's own files go.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    fails(&cmd("dequant-fp8", &src, &out, &["--force"]));
    assert_eq!(listing(&out), ["notes.txt"]);
}

#[test]
fn recover_refuses_what_it_cannot_finish_and_changes_nothing() {
    let d = tmp();
    let file = d.path().join("model.safetensors");
    std::fs::write(&file, "not a directory").unwrap();
    let err = usage_error(&["recover", s(&file)]);
    assert_eq!(err, format!("error: {} is not a directory\n", s(&file)));

    // A journal that names a file outside the directory is damaged, not followed.
    let out = d.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("model.safetensors"), "kept").unwrap();
    std::fs::write(
        out.join(".tftf-commit.json"),
        r#"{"tftf_commit": 1, "pid": 7, "renames": [], "deletes": ["../model.safetensors"]}"#,
    )
    .unwrap();
    let before = snapshot(&out);
    let err = fails(&["recover", s(&out)]);
    assert_mentions(
        &err,
        &["interrupted-commit journal is damaged (an entry is not a file name in this directory)"],
    );
    assert_eq!(snapshot(&out), before);
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "not a directory");
}
