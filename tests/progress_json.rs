//! `--progress json`: one JSON object per line on stderr, for build systems.

mod common;
use common::*;
use serde_json::Value;

fn lines(o: &std::process::Output) -> Vec<Value> {
    stderr(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[test]
fn json_progress_gives_start_every_file_finish_and_the_report_last() {
    let (d, src, _) = tmp_small_model();
    let out = d.path().join("out");
    let o = passthrough_ok(
        &src,
        &out,
        &[
            "--dtype",
            "bf16",
            "--progress",
            "json",
            "--progress-interval",
            "0.01",
            "-q",
        ],
    );
    assert!(stdout(&o).is_empty(), "-q keeps stdout quiet");
    let ls = lines(&o);
    assert!(ls
        .iter()
        .all(|l| l["tftf_progress"] == 1 && l["op"] == "passthrough"));
    assert_eq!(ls[0]["event"], "start");
    assert_eq!(ls[0]["bytes_done"], 0);
    let total = ls[0]["bytes_total"].as_u64().unwrap();
    assert!(total > 0);
    let written: Vec<&Value> = ls
        .iter()
        .filter(|l| l["event"] == "shard_written")
        .collect();
    let names: Vec<&str> = written
        .iter()
        .map(|l| l["shard"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
    for l in &written {
        assert_eq!(l["shard_bytes_done"], l["shard_bytes_total"], "{l}");
        assert_eq!(l["shards"], 2);
    }
    let finish = &ls[ls.len() - 2];
    assert_eq!(finish["event"], "finish");
    assert_eq!(finish["phase"], "done");
    assert_eq!(finish["bytes_done"], total);
    assert_eq!(finish["eta_seconds"], 0.0);
    let last = ls.last().unwrap();
    assert_eq!(last["event"], "report");
    assert_eq!(last["report"]["status"], "ok");
    assert_eq!(last["report"]["tensors"]["written"], 11);
}

#[test]
fn quiet_silences_default_progress_and_a_bad_mode_is_a_usage_error() {
    let (d, src, _) = tmp_small_model();
    let out = d.path().join("out");
    let o = passthrough_ok(&src, &out, &["-q"]);
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    let o = passthrough_ok(&src, &out, &["--progress", "plain", "-q", "--force"]);
    assert!(
        stderr(&o).starts_with("progress: passthrough"),
        "{}",
        stderr(&o)
    );
    let msg = usage_error(&cmd("passthrough", &src, &out, &["--progress", "loud"]));
    assert_mentions(&msg, &["--progress `loud`: use auto, plain, json or none"]);
}
