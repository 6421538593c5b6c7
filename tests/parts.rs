//! `--part K/N`, `--resume` and `tftf finalize`: parts run as separate processes, in any order
//! or at once, give the bytes of one run; killed parts rerun alone; records that disagree are
//! refused with the reason.

mod common;
use common::*;
use std::path::Path;
use std::process::Command;
use tftf::format::dtype::DType;

/// Twelve bf16 tensors over two input shards, with a config and a tokenizer.
fn model(dir: &Path) -> std::path::PathBuf {
    let mut rng = Rng(7);
    let mut m = Model::new();
    for i in 0..12 {
        if i == 6 {
            m = m.shard();
        }
        m = m.rand(
            &mut rng,
            &format!("model.layers.{i}.mlp.up_proj.weight"),
            DType::BF16,
            &[48, 64],
        );
    }
    m.config(SMALL_CONFIG)
        .file("tokenizer.json", "{\"v\": 1}")
        .write(&dir.join("in"))
}

/// Arguments every run of the test conversion shares: about eight output shards, all cast.
const ARGS: [&str; 5] = ["--max-shard-size", "14KB", "--dtype", "f32", "-q"];

fn run_args<'a>(input: &'a Path, out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["passthrough", s(input), "-o", s(out)];
    v.extend(ARGS);
    v.extend(extra);
    v
}

/// [`run_args`] without `-q`: for the runs whose stdout a test reads.
fn loud_args<'a>(input: &'a Path, out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = run_args(input, out, extra);
    v.retain(|a| *a != "-q");
    v
}

fn part(input: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    tftf(&run_args(input, out, extra))
}

/// Every file of a directory (hidden ones included) with its bytes.
fn contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let bytes = if e.path().is_dir() {
                b"<dir>".to_vec()
            } else {
                std::fs::read(e.path()).unwrap()
            };
            (name, bytes)
        })
        .collect();
    v.sort();
    v
}

fn assert_same_dirs(want: &Path, got: &Path) {
    let (a, b) = (contents(want), contents(got));
    let names = |v: &[(String, Vec<u8>)]| v.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(names(&a), names(&b));
    for ((n, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{n} differs");
    }
}

/// A temporary folder with the test model in `in/`, and the path `out` in the folder.
fn with_model(out: &str) -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let d = tmp();
    let input = model(d.path());
    let out = d.path().join(out);
    (d, input, out)
}

/// A temporary folder with the test model in `in/` and its [`reference`] run.
fn with_reference(checksums: &str) -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let d = tmp();
    let input = model(d.path());
    let single = reference(d.path(), &input, checksums);
    (d, input, single)
}

/// One run with checksums: what the parts must reproduce.
fn reference(d: &Path, input: &Path, checksums: &str) -> std::path::PathBuf {
    let out = d.join("single");
    tftf_ok(&run_args(input, &out, &[checksums]));
    assert!(listing(&out).len() >= 8, "{:?}", listing(&out));
    out
}

#[test]
fn three_parts_at_once_then_finalize_equal_one_run() {
    let (d, input, single) = with_reference("--checksums");
    let out = d.path().join("parts");
    let children: Vec<_> = ["3/3", "1/3", "2/3"]
        .iter()
        .map(|k| {
            Command::new(env!("CARGO_BIN_EXE_tftf"))
                .args(run_args(&input, &out, &["--part", k]))
                .output_async()
        })
        .collect();
    for c in children {
        ok(&c.wait_with_output().unwrap());
    }
    // No index before finalize: the directory is not yet a checkpoint a loader would open.
    assert!(!out.join("model.safetensors.index.json").exists());
    assert!(out.join(".tftf-parts").is_dir());
    let o = tftf_ok(&["finalize", s(&out)]);
    assert!(stdout(&o).contains("3 part(s)"), "{}", stdout(&o));
    assert_same_dirs(&single, &out);
    tftf_ok(&["verify", s(&out)]);
}

trait Spawn {
    fn output_async(&mut self) -> std::process::Child;
}
impl Spawn for Command {
    fn output_async(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .env("NO_COLOR", "1")
            .spawn()
            .unwrap()
    }
}

#[test]
fn the_last_part_with_finalize_completes_the_output_in_any_order() {
    let (d, input, single) = with_reference("--checksums");
    for order in [["2/3", "3/3", "1/3"], ["1/3", "3/3", "2/3"]] {
        let out = d
            .path()
            .join(format!("parts-{}", order[0].replace('/', "-")));
        for (i, k) in order.iter().enumerate() {
            let o = tftf_ok(&loud_args(&input, &out, &["--part", k, "--finalize"]));
            let last = i == order.len() - 1;
            assert_eq!(
                stdout(&o).contains("finalized"),
                last,
                "{k}: {}",
                stdout(&o)
            );
            if !last {
                assert!(stdout(&o).contains("not finalizing yet"), "{}", stdout(&o));
            }
        }
        assert_same_dirs(&single, &out);
    }
}

#[test]
fn a_part_killed_mid_way_reruns_alone_with_or_without_resume() {
    let (d, input, single) = with_reference("--checksums");
    for resume in [false, true] {
        let out = d.path().join(format!("parts-{resume}"));
        ok(&part(&input, &out, &["--part", "1/2"]));
        // Killed (SIGKILL) right after committing its second shard, before recording it.
        let o = Command::new(env!("CARGO_BIN_EXE_tftf"))
            .args(run_args(&input, &out, &["--part", "2/2"]))
            .env("TFTF_TEST_CRASH_AT", "part-shard:2")
            .output()
            .unwrap();
        assert_eq!(o.status.code(), None, "killed by a signal");
        let e = fails(&["finalize", s(&out)]);
        assert!(e.contains("part 2/2 has not finished"), "{e}");
        // recover keeps what the parts did and says what is left to do.
        let o = tftf_ok(&["recover", s(&out)]);
        assert_mentions(
            &stdout(&o),
            &[
                "not finalized: part 2/2 has not finished (killed? rerun it with --resume)",
                "when every part is done, run `tftf finalize",
            ],
        );
        assert!(out.join(".tftf-parts/part-00002-of-00002.json").exists());
        let extra: &[&str] = if resume {
            &["--part", "2/2", "--resume"]
        } else {
            &["--part", "2/2"]
        };
        let o = tftf_ok(&loud_args(&input, &out, extra));
        // With --resume the first shard, committed and recorded, is kept; the second (on
        // disk but unrecorded) is written again.
        let kept = if resume { "(1 kept" } else { "(0 kept" };
        assert!(stdout(&o).contains(kept), "{}", stdout(&o));
        tftf_ok(&["finalize", s(&out), "-q"]);
        assert_same_dirs(&single, &out);
    }
}

#[test]
fn resume_alone_continues_a_killed_run_and_finalizes_it() {
    let (d, input, single) = with_reference("--checksums");
    let out = d.path().join("out");
    let o = Command::new(env!("CARGO_BIN_EXE_tftf"))
        .args(run_args(&input, &out, &["--resume"]))
        .env("TFTF_TEST_CRASH_AT", "part-shard:4")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), None);
    // A killed run is not a checkpoint: no index, no config.
    assert!(!out.join("model.safetensors.index.json").exists());
    assert!(!out.join("config.json").exists());
    // A plain run refuses to clean up after it.
    let e = fails(&run_args(&input, &out, &["--force"]));
    assert!(e.contains("unfinished partitioned run"), "{e}");
    // Changed arguments: refused, saying which.
    let mut changed = run_args(&input, &out, &["--resume"]);
    let at = changed.iter().position(|a| *a == "f32").unwrap();
    changed[at] = "f16";
    let e = fails(&changed);
    assert_mentions(
        &e,
        &["cannot resume part 1/1", "the arguments differ (dtype)"],
    );
    // A shard modified after its commit is written again, not kept.
    let first_shard = listing(&out)
        .into_iter()
        .find(|n| n.ends_with(".safetensors"))
        .unwrap();
    let victim = out.join(first_shard);
    let mut bytes = std::fs::read(&victim).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&victim, &bytes).unwrap();
    let o = tftf_ok(&loud_args(&input, &out, &["--resume"]));
    assert!(stdout(&o).contains("(2 kept"), "{}", stdout(&o));
    assert!(stdout(&o).contains("finalized"), "{}", stdout(&o));
    assert_same_dirs(&single, &out);
}

#[test]
fn parts_with_different_arguments_or_inputs_are_refused() {
    let (_d, input, out) = with_model("out");
    ok(&part(&input, &out, &["--part", "1/2"]));
    let mut other = run_args(&input, &out, &["--part", "2/2"]);
    let at = other.iter().position(|a| *a == "f32").unwrap();
    other[at] = "bf16";
    let e = fails(&other);
    assert_mentions(
        &e,
        &[
            "part 1/2",
            "was run with different arguments or inputs",
            "dtype",
        ],
    );
    // Another part count.
    let e = fails(&run_args(&input, &out, &["--part", "2/3"]));
    assert!(e.contains("a run in 2 parts"), "{e}");
    // Touched input: a different mtime is a different input.
    let shard = input.join("model-00001-of-00002.safetensors");
    let f = std::fs::File::options().write(true).open(&shard).unwrap();
    f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(3600))
        .unwrap();
    let e = fails(&run_args(&input, &out, &["--part", "2/2"]));
    assert!(e.contains("the input files differ"), "{e}");
    // --force discards the other run's records; the old part must then run again.
    ok(&part(&input, &out, &["--part", "2/2", "--force"]));
    let e = fails(&["finalize", s(&out)]);
    assert!(e.contains("part 1/2 has not run"), "{e}");
    ok(&part(&input, &out, &["--part", "1/2"]));
    tftf_ok(&["finalize", s(&out), "-q"]);
    tftf_ok(&["verify", s(&out)]);
}

#[test]
fn finalize_names_missing_damaged_and_changed_records() {
    let (_d, input, out) = with_model("out");
    let e = fails(&["finalize", s(&out)]);
    assert!(e.contains("nothing to finalize"), "{e}");
    ok(&part(&input, &out, &["--part", "1/3"]));
    ok(&part(&input, &out, &["--part", "3/3"]));
    let e = fails(&["finalize", s(&out)]);
    assert!(e.contains("part 2/3 has not run"), "{e}");
    ok(&part(&input, &out, &["--part", "2/3"]));
    // A running part (a live lock) stops finalize.
    let lock = out.join(".tftf-parts/part-00002-of-00003.lock");
    std::fs::write(&lock, "host another-node pid 1 started 0\n").unwrap();
    let e = fails(&["finalize", s(&out)]);
    assert!(
        e.contains("part 2/3 is still running (host another-node, pid 1"),
        "{e}"
    );
    // And recover, which would remove the running part's temporaries.
    std::fs::write(
        out.join(".model-00002-of-00008.safetensors.tftf-1.tmp"),
        "x",
    )
    .unwrap();
    let e = fails(&["recover", s(&out)]);
    assert_mentions(&e, &["part 2/3 is still running", "wait for it"]);
    assert!(out
        .join(".model-00002-of-00008.safetensors.tftf-1.tmp")
        .exists());
    std::fs::remove_file(&lock).unwrap();
    // A shard that lost bytes after its part recorded it.
    let rec = read_json(&out.join(".tftf-parts/shard-00000.json"));
    let name = rec["name"].as_str().unwrap().to_string();
    let shard = out.join(&name);
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 1]).unwrap();
    let e = fails(&["finalize", s(&out)]);
    assert_mentions(&e, &[&name, "rerun part", "with --resume"]);
    std::fs::write(&shard, &bytes).unwrap();
    // A damaged record.
    let hdr = out.join(".tftf-parts/part-00003-of-00003.json");
    let good = std::fs::read(&hdr).unwrap();
    std::fs::write(&hdr, b"{\"tftf_part\": 1, \"part\": ").unwrap();
    let e = fails(&["finalize", s(&out)]);
    assert_mentions(&e, &["part-00003-of-00003.json: damaged part record"]);
    std::fs::write(&hdr, &good).unwrap();
    // A byte changed inside a shard after its commit (same size): finalize trusts the record,
    // and verify names the tensor.
    let mut changed = bytes.clone();
    let at = changed.len() - 3;
    changed[at] ^= 0x40;
    std::fs::write(&shard, &changed).unwrap();
    tftf_ok(&["finalize", s(&out), "-q"]);
    assert!(!out.join(".tftf-parts").exists());
    let o = tftf(&["verify", s(&out)]);
    assert_eq!(o.status.code(), Some(1));
    assert_mentions(&stdout(&o), &[&format!("{name}: tensor `")]);
}

#[test]
fn checksums_off_gives_the_plain_output() {
    let (d, input, single) = with_reference("--checksums=off");
    let out = d.path().join("out");
    for k in ["2/2", "1/2"] {
        ok(&part(&input, &out, &["--part", k, "--checksums=off"]));
    }
    tftf_ok(&["finalize", s(&out), "-q"]);
    assert_same_dirs(&single, &out);
    assert!(!out.join("SHA256SUMS").exists());
}

#[test]
fn part_flags_are_checked() {
    let (d, input, out) = with_model("x.safetensors");
    let e = usage_error(&run_args(&input, &out, &["--part", "1/2"]));
    assert!(e.contains("give a directory as -o"), "{e}");
    let out = d.path().join("out");
    for bad in ["0/2", "3/2", "2"] {
        let e = usage_error(&run_args(&input, &out, &["--part", bad]));
        assert!(e.contains("give K/N"), "{e}");
    }
    let e = usage_error(&run_args(&input, &out, &["--finalize"]));
    assert!(e.contains("--finalize goes with --part"), "{e}");
    let e = usage_error(&run_args(&input, &out, &["--checksums=maybe"]));
    assert!(e.contains("--checksums=off"), "{e}");
    // A dry run says which shards the part writes and creates nothing.
    let o = tftf_ok(&loud_args(&input, &out, &["--part", "2/3", "--dry-run"]));
    assert!(stdout(&o).contains("part 2/3: writes"), "{}", stdout(&o));
    assert!(!out.exists());
    // A non-empty directory that is not this run's is refused before anything is written.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let e = fails(&run_args(&input, &out, &["--part", "1/2"]));
    assert!(e.contains("notes.txt"), "{e}");
    assert_eq!(listing(&out), vec!["notes.txt".to_string()]);
}

#[test]
fn a_part_refuses_a_directory_with_an_interrupted_plain_commit() {
    let (_d, input, out) = with_model("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join(".tftf-commit.json"), "{}").unwrap();
    let e = fails(&run_args(&input, &out, &["--part", "1/2"]));
    assert_mentions(
        &e,
        &["holds a commit a killed run left half done", "tftf recover"],
    );
    // Nothing written: no parts directory, no shard.
    assert_eq!(listing(&out), vec![".tftf-commit.json".to_string()]);
}

/// Files under `dir`, recursively.
fn file_count(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| match e.path().is_dir() {
            true => file_count(&e.path()),
            false => 1,
        })
        .sum()
}

/// Issue #24 item 11: a SIGKILL at any step of finalize (writing, the journalled commit, the
/// removal of `.tftf-parts`) leaves a directory that `tftf recover`, `tftf finalize` or a
/// `--force` run turns into the single run's output, with nothing of the parts left behind.
#[test]
fn a_kill_at_any_step_of_finalize_is_finished_by_recover_finalize_or_force() {
    use std::os::unix::process::ExitStatusExt;
    let (d, input, single) = with_reference("--checksums");
    let parted = d.path().join("parted");
    for k in ["1/2", "2/2"] {
        ok(&part(&input, &parted, &["--part", k]));
    }
    // Part records and staged side files, and finalize's lock.
    let bookkeeping = file_count(&parted.join(".tftf-parts")) + 1;
    let last_unrecord = format!("unrecord:{bookkeeping}");
    // Index, config, tokenizer, sums, manifest.
    let points = [
        ("tmp:1", false),
        ("tmp:5", false),
        ("written", false),
        ("journal", true),
        ("rename:1", true),
        ("rename:5", true),
        ("delete:1", true),
        ("retire", true),
        ("unrecord:1", true),
        (last_unrecord.as_str(), true),
        ("applied", true),
    ];
    for (point, journalled) in points {
        for finish in ["recover", "finalize", "force"] {
            let out = d.path().join(format!("out-{point}-{finish}"));
            let cp = Command::new("cp")
                .args(["-a", s(&parted), s(&out)])
                .status();
            assert!(cp.unwrap().success());
            // An earlier output's shard, which the commit deletes.
            std::fs::write(out.join("model.safetensors"), b"old").unwrap();
            let killed = Command::new(env!("CARGO_BIN_EXE_tftf"))
                .args(["finalize", s(&out), "--force", "-q"])
                .env("TFTF_TEST_CRASH_AT", point)
                .output()
                .unwrap();
            assert_eq!(killed.status.signal(), Some(9), "{point}: not killed");
            assert_eq!(
                out.join(".tftf-commit.json").exists(),
                journalled,
                "{point}"
            );
            if journalled {
                let e = fails(&["info", s(&out)]);
                assert!(e.contains(&format!("tftf recover {}", s(&out))), "{e}");
            }
            match (finish, journalled) {
                ("recover", _) => {
                    let o = tftf_ok(&["recover", s(&out)]);
                    if !journalled {
                        assert_mentions(
                            &stdout(&o),
                            &[
                                "removed",
                                "not finalized: every part is done",
                                "tftf finalize",
                            ],
                        );
                        assert!(listing(&out).iter().all(|n| !n.ends_with(".tmp")));
                        tftf_ok(&["finalize", s(&out), "--force", "-q"]);
                    }
                }
                ("force", true) => {
                    tftf_ok(&run_args(&input, &out, &["--checksums", "--force"]));
                }
                ("force", false) => {
                    let e = fails(&run_args(&input, &out, &["--checksums", "--force"]));
                    assert_mentions(&e, &["unfinished partitioned run", "tftf finalize"]);
                    assert!(!e.contains("remove the directory"), "{e}");
                    tftf_ok(&["finalize", s(&out), "--force", "-q"]);
                }
                _ => {
                    tftf_ok(&["finalize", s(&out), "--force", "-q"]);
                }
            }
            assert_same_dirs(&single, &out);
            tftf_ok(&["verify", s(&out)]);
        }
    }
}
