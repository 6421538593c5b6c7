//! Forms the README's examples promise that once failed: `repack-fp4 MODEL` (every command takes
//! the model positionally) and `validate --pipe rename:REGEX=REPL` (the pipe's name collisions).

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// The demo's checkpoints, kept in `dir`: `example/` (BF16, F32, FP8 with scales, two shards)
/// and `v4-example/` (DeepSeek-V4-style MXFP4 experts and an E4M3 Engram table).
fn demo_checkpoints(dir: &Path) -> PathBuf {
    let keep = dir.join("demo");
    tftf_ok(&["demo", "--keep", s(&keep)]);
    keep
}

#[test]
fn repack_fp4_takes_the_model_positionally_like_every_command() {
    let d = tmp();
    let v4 = demo_checkpoints(d.path()).join("v4-example");
    let by_flag = d.path().join("by-flag");
    tftf_ok(&["repack-fp4", "--src", s(&v4), "--out", s(&by_flag), "-q"]);
    let want = load_all(&by_flag);
    assert!(
        want.keys().any(|k| k.ends_with(".weight_scale_2")),
        "the repack made no NVFP4 tensor scales: {:?}",
        want.keys()
    );
    for form in [&["repack-fp4", s(&v4)][..], &["repack-fp4", "-b", s(&v4)]] {
        let out = d.path().join(format!("out-{}", form.len()));
        tftf_ok(&[form, &["-o", s(&out), "-q"]].concat());
        assert_eq!(load_all(&out), want, "{form:?}");
        assert_eq!(
            std::fs::read(out.join("config.json")).unwrap(),
            std::fs::read(by_flag.join("config.json")).unwrap(),
            "{form:?}"
        );
    }

    let both = d.path().join("both");
    let o = tftf(&["repack-fp4", s(&v4), "--src", s(&v4), "-o", s(&both)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = tftf(&["repack-fp4", "-o", s(&both)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("no input"), "{}", stderr(&o));
    assert!(!both.exists());
}

#[test]
fn validate_pipe_rename_reports_name_collisions() {
    let d = tmp();
    let model = demo_checkpoints(d.path()).join("example");

    let o = tftf_ok(&[
        "validate",
        s(&model),
        "--pipe",
        r"rename:^model\.layers\.(\d+)\.=blk.\1.",
    ]);
    assert!(stdout(&o).starts_with("ok:"), "{}", stdout(&o));

    let o = tftf(&[
        "validate",
        s(&model),
        "--pipe",
        r"rename:^model\.layers\.\d+\.=blk.",
        "--pipe",
        "dtype:bf16",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let text = stdout(&o);
    assert_mentions(
        &text,
        &[
            "`model.layers.0.self_attn.q_proj.weight`",
            "`model.layers.1.self_attn.q_proj.weight`",
            "`blk.self_attn.q_proj.weight`",
        ],
    );

    for bad in ["rename:no-replacement", r"rename:(unclosed=x"] {
        let o = tftf(&["validate", s(&model), "--pipe", bad]);
        assert_eq!(o.status.code(), Some(2), "{bad}: {}", stderr(&o));
        assert!(stderr(&o).contains(bad), "{bad}: {}", stderr(&o));
    }
}
