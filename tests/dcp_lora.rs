//! LoRA adapters from FSDP training runs saved as PyTorch Distributed Checkpoints: the merge
//! equals PEFT's `merge_and_unload` of the same weights (fixture made by real torch + PEFT).

mod common;
use common::*;
use std::path::{Path, PathBuf};

fn case(rel: &str) -> PathBuf {
    fixture(&format!("torch/dcp/lora-2rank/{rel}"))
}

/// Every tensor of `out` equals PEFT's merge within 1e-6 (f32), and nothing is missing.
fn assert_peft_merge(out: &Path) {
    let want = load_all(&case("merged-by-peft/model.safetensors"));
    let got = load_all(out);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, (dtype, shape, data)) in &want {
        let (gd, gs, gdata) = &got[name];
        assert_eq!((gd, gs), (dtype, shape), "{name}");
        assert_eq!(dtype, "F32", "{name}");
        for (k, (g, w)) in f32s_of(gdata).iter().zip(f32s_of(data)).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{name}[{k}]: {g} vs PEFT {w}"
            );
        }
    }
}

/// A training output as axolotl/accelerate leave it: `adapter_config.json` at the top,
/// `checkpoint-N/` folders, the model DCP beside an optimizer one in the latest.
fn training_dir(root: &Path) -> PathBuf {
    let train = root.join("train");
    copy_dir(
        &case("pytorch_model_fsdp_0"),
        &train.join("checkpoint-10/pytorch_model_fsdp_0"),
    );
    copy_dir(
        &case("pytorch_model_fsdp_0"),
        &train.join("checkpoint-60/pytorch_model_fsdp_0"),
    );
    // An optimizer DCP that sorts first must not be taken for the model.
    copy_dir(
        &case("pytorch_model_fsdp_0"),
        &train.join("checkpoint-60/optimizer_0"),
    );
    std::fs::copy(
        case("adapter_config.json"),
        train.join("adapter_config.json"),
    )
    .unwrap();
    train
}

#[test]
fn merge_dcp_lora_equals_peft_merge() {
    let (_d, out) = tmp_out();
    tftf_ok(&[
        "merge-dcp-lora",
        "-b",
        s(&case("base")),
        "-c",
        s(&case("pytorch_model_fsdp_0")),
        "-o",
        s(&out),
        "-q",
    ]);
    assert_peft_merge(&out);
}

#[test]
fn a_training_directory_uses_the_latest_checkpoint_and_says_so() {
    let d = tmp();
    let train = training_dir(d.path());
    let base = case("base");
    for (k, args) in [
        vec!["merge-dcp-lora", "-c", s(&train)],
        vec!["merge-lora", "-a", s(&train)],
    ]
    .into_iter()
    .enumerate()
    {
        let out = d.path().join(format!("out{k}"));
        let mut all = args.clone();
        all.extend(["-b", s(&base), "-o", s(&out)]);
        let o = tftf_ok(&all);
        let err = stderr(&o);
        assert_mentions(&err, &["using the latest training checkpoint, checkpoint-60 (PyTorch DCP pytorch_model_fsdp_0)"]);
        assert_peft_merge(&out);
    }
    // The run grammar, as upstream writes it.
    let out = d.path().join("out-run");
    tftf_ok(&cmd(
        "run",
        &case("base"),
        &out,
        &["--merge-lora", "--adapter", s(&train), "-q"],
    ));
    assert_peft_merge(&out);
}

#[test]
fn a_dcp_adapter_without_its_config_is_refused_before_any_output() {
    let d = tmp();
    let dcp = d.path().join("ckpt/pytorch_model_fsdp_0");
    copy_dir(&case("pytorch_model_fsdp_0"), &dcp);
    let out = d.path().join("out");
    let msg = fails(&[
        "merge-dcp-lora",
        "-b",
        s(&case("base")),
        "-c",
        s(&dcp),
        "-o",
        s(&out),
    ]);
    assert_refused(&msg, &["adapter_config.json not found"], &out);
}
