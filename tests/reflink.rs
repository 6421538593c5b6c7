//! Extent sharing on a reflink-capable filesystem (an XFS image made with `mkfs.xfs -m
//! reflink=1` and loop-mounted, which needs root and xfsprogs) and the fallback elsewhere.
//! Where the mount is impossible the XFS tests print why they were skipped.

mod common;

use std::path::Path;
use std::process::Command;

use common::xfs::xfs_with_filefrag_or_skip;
use common::*;
use tftf::format::dtype::DType;

/// Bytes of `file` in extents flagged shared (`filefrag -v`, FIEMAP underneath).
fn shared_bytes(file: &Path) -> u64 {
    let o = Command::new("filefrag")
        .arg("-v")
        .arg("-b4096")
        .arg(file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    text.lines()
        .filter(|l| l.contains("shared"))
        .filter_map(|l| l.split(':').nth(3)?.trim().parse::<u64>().ok())
        .sum::<u64>()
        * 4096
}

/// Two shards of 1-4 MiB tensors, some with sizes that are not multiples of 4 KiB.
fn model(dir: &Path) -> Vec<T> {
    let mut rng = Rng(31);
    let (bf16, f32) = (DType::BF16, DType::F32);
    let mut model = Model::new();
    for (k, (name, dtype, shape)) in [
        ("model.embed.weight", bf16, &[1024u64, 1024][..]),
        ("model.layers.0.norm.weight", f32, &[1000]),
        ("model.layers.0.mlp.weight", bf16, &[2048, 1024]),
        ("model.layers.0.attn.weight", f32, &[512, 1024]),
        // The second shard.
        ("model.layers.1.mlp.weight", bf16, &[2048, 1024]),
        ("model.layers.1.norm.weight", f32, &[1024]),
        ("model.layers.1.attn.weight", f32, &[512, 1024]),
        ("lm_head.weight", bf16, &[1024, 1024]),
    ]
    .into_iter()
    .enumerate()
    {
        if k == 4 {
            model = model.shard();
        }
        model = model.rand(&mut rng, name, dtype, shape);
    }
    let model = model.config("{}");
    model.write(dir);
    model.all()
}

fn untouched_shared_fraction(out: &Path, r: &serde_json::Value) -> f64 {
    let shared: u64 = listing(out)
        .iter()
        .filter(|n| n.ends_with(".safetensors"))
        .map(|n| shared_bytes(&out.join(n)))
        .sum();
    let copied = r["bytes"]["tensors"].as_u64().unwrap() - r["bytes"]["computed"].as_u64().unwrap();
    shared.min(copied) as f64 / copied as f64
}

#[test]
fn passthrough_rename_and_cast_share_untouched_extents_on_xfs() {
    let Some(xfs) =
        xfs_with_filefrag_or_skip("passthrough_rename_and_cast_share_untouched_extents_on_xfs")
    else {
        return;
    };
    let src = xfs.mnt.join("in");
    let tensors = model(&src);
    for (name, extra) in [
        ("plain", vec![]),
        ("renamed", vec!["--rename", r"^model\.", ""]),
        ("cast", vec!["--dtype", "bf16"]),
        (
            "repacked",
            vec!["--max-shard-size", "6MiB", "--exclude", "*.norm.weight"],
        ),
    ] {
        let out = xfs.mnt.join(name);
        let rep = xfs.mnt.join(format!("{name}.json"));
        let mut args = cmd("passthrough", &src, &out, &["-q", "--report", s(&rep)]);
        args.extend(extra);
        tftf_ok(&args);
        let r = read_json(&rep);
        let frac = untouched_shared_fraction(&out, &r);
        assert!(
            frac >= 0.99,
            "{name}: only {:.2}% of untouched bytes share extents: {r}",
            frac * 100.0
        );
        assert!(r["bytes"]["reflinked"].as_u64().unwrap() > 0, "{name}: {r}");
        assert!(r["reflink_unavailable"].is_null(), "{name}: {r}");
        // Sharing never changes content.
        let got = load_all(&out);
        for (tname, dtype, _, data) in &tensors {
            let key = if name == "renamed" {
                tname.trim_start_matches("model.").to_string()
            } else {
                tname.clone()
            };
            if let Some((gd, _, gdata)) = got.get(&key) {
                if gd == dtype.name() {
                    assert_eq!(gdata, data, "{name}: {key}");
                }
            }
        }
    }
    // Side files are shared too.
    assert_eq!(
        std::fs::read(xfs.mnt.join("plain/config.json")).unwrap(),
        b"{}"
    );
}

#[test]
fn no_reflink_copies_on_xfs() {
    let Some(xfs) = xfs_with_filefrag_or_skip("no_reflink_copies_on_xfs") else {
        return;
    };
    let src = xfs.mnt.join("in");
    model(&src);
    let out = xfs.mnt.join("out");
    let rep = xfs.mnt.join("r.json");
    passthrough_ok(&src, &out, &["-q", "--no-reflink", "--report", s(&rep)]);
    let r = read_json(&rep);
    assert_eq!(r["bytes"]["reflinked"], 0);
    assert_eq!(r["bytes"]["copied_in_kernel"], 0);
    // Both shards are whole copies of the input's, headers included.
    assert_eq!(r["bytes"]["copied_through_memory"], r["bytes"]["files"]);
    assert!(untouched_shared_fraction(&out, &r) < 0.01);
}

#[test]
fn fallback_on_a_filesystem_without_reflink_copies_in_the_kernel_and_says_so() {
    let d = tmp();
    let fs = tftf::sys::filesystem_name(d.path());
    if tftf::sys::can_reflink(fs) {
        println!(
            "SKIPPED fallback test: the temporary directory is on {fs}, which can share extents"
        );
        return;
    }
    let src = d.path().join("in");
    let tensors = model(&src);
    let out = d.path().join("out");
    let rep = d.path().join("r.json");
    let o = passthrough_ok(
        &src,
        &out,
        &["--report", s(&rep), "--rename", "^model", "m", "-v"],
    );
    let r = read_json(&rep);
    assert_eq!(r["bytes"]["reflinked"], 0);
    assert_eq!(r["bytes"]["copied_in_kernel"], r["bytes"]["tensors"]);
    assert!(
        r["reflink_unavailable"].as_str().unwrap().contains(fs),
        "{r}"
    );
    assert!(
        stderr(&o).contains(&format!(
            "info: untouched tensors were copied; the output filesystem ({fs}) cannot share extents with the input\n"
        )),
        "{}",
        stderr(&o)
    );
    let dry = stdout(&passthrough(&src, &d.path().join("x"), &["--dry-run"]));
    assert_mentions(
        &dry,
        &[&format!(
            "the output filesystem ({fs}) cannot share extents"
        )],
    );
    assert_eq!(load_all(&out).len(), tensors.len());
}
