//! PEFT's own merges in `tests/fixtures/peft/` (see its README.txt): a case is `base/`,
//! `adapter/` and PEFT's `merged/`.

use std::path::{Path, PathBuf};

use super::{assert_same_tensors, fixture, load_all, read_json};

/// The fixture case `tests/fixtures/peft/<name>`.
pub fn peft_case(name: &str) -> PathBuf {
    fixture(&format!("peft/{name}"))
}

/// The values of `bytes` of the safetensors dtype `dtype` (F32 or BF16) as f32.
pub fn floats(dtype: &str, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        "F32" => super::f32s_of(bytes),
        "BF16" => bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
        d => panic!("unexpected dtype {d}"),
    }
}

/// Compares the merge `out` of the case `name` with PEFT's `merged/`: the same tensor names,
/// dtypes and shapes; f32 within 1e-6 (relative above 1), bf16 within one ulp; tensors PEFT
/// left alone bit-identical. Returns the names PEFT changed.
pub fn assert_matches_peft(name: &str, out: &Path) -> Vec<String> {
    let dir = peft_case(name);
    let got = load_all(out);
    let want = load_all(&dir.join("merged/model.safetensors"));
    let base = load_all(&dir.join("base/model.safetensors"));
    let mut changed = Vec::new();
    assert_same_tensors(name, &got, &want, |t, dt, gbytes, bytes| {
        if bytes == base[t].2 {
            assert_eq!(
                gbytes, bytes,
                "{name}: `{t}` PEFT left alone must be bit-identical"
            );
            return;
        }
        changed.push(t.to_string());
        for (i, (x, y)) in floats(dt, gbytes).iter().zip(floats(dt, bytes)).enumerate() {
            if dt == "BF16" {
                let ulps = (x.to_bits() as i64 - y.to_bits() as i64).abs();
                assert!(ulps <= 1 << 16, "{name}: `{t}`[{i}] {x} vs PEFT {y}");
            } else {
                assert!(
                    (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                    "{name}: `{t}`[{i}] {x} vs PEFT {y}"
                );
            }
        }
    });
    changed
}

/// The `merge-lora` entry of the `--report` file `report`.
pub fn merge_lora_report(report: &Path) -> serde_json::Value {
    read_json(report)["tensor_reports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["op"] == "merge-lora")
        .unwrap()
        .clone()
}

/// Asserts the `merge-lora` report entry `lora` of case `name` lists no unmatched pair.
pub fn assert_all_matched(name: &str, lora: &serde_json::Value) {
    assert_eq!(
        lora["unmatched"].as_array().unwrap().len(),
        0,
        "{name}: {lora}"
    );
}

/// Copies the adapter weights (`adapter/adapter_model.safetensors`) of the case folder
/// `case` into the folder `to` (created), without their adapter_config.json; returns `to`.
pub fn copy_adapter_weights(case: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    let name = "adapter_model.safetensors";
    std::fs::copy(case.join("adapter").join(name), to.join(name)).unwrap();
    to.to_path_buf()
}
