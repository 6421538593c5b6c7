//! `Pipeline::records`: a pipeline's tensors handed out in memory, in order, with the bytes a
//! writing run of the same pipeline writes.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use tftf::{DType, Pipe, Pipeline, Reader, Writer};

/// Every record (name, dtype, shape, bytes), in the order the iterator gave them; with
/// `recycle`, each record's in-memory file goes back to the stream once read, so later records
/// are computed into files that held earlier (differently sized) tensors.
fn all_records(
    input: &Path,
    pipe: Pipe,
    threads: usize,
    recycle: bool,
) -> Vec<(String, String, Vec<usize>, Vec<u8>)> {
    let records = Pipeline::new(Reader::from_path(input), pipe, Writer::null())
        .threads(threads)
        .memory_budget(32 << 20)
        .records()
        .unwrap();
    let announced: Vec<String> = records.tensors().iter().map(|t| t.0.clone()).collect();
    let got: Vec<_> = records
        .map(|r| {
            let r = r.unwrap();
            let shape = r.shape.iter().map(|&d| d as usize).collect();
            let got = (
                r.name.clone(),
                r.dtype.name().to_string(),
                shape,
                r.to_vec().unwrap(),
            );
            if recycle {
                r.recycle();
            }
            got
        })
        .collect();
    let names: Vec<String> = got.iter().map(|r| r.0.clone()).collect();
    assert_eq!(names, announced, "records come in the announced order");
    got
}

/// The records equal the tensors of `Pipeline::run` into one file, in the file's order.
fn assert_records_equal_written(input: &Path, pipe: impl Fn() -> Pipe) {
    let dir = tmp();
    let out = dir.path().join("out.safetensors");
    let report = Pipeline::new(Reader::from_path(input), pipe(), Writer::file(&out))
        .run()
        .unwrap();
    assert!(report.ok());
    let written = load_tensors(&out, false);
    for (threads, recycle) in [(1, false), (2, false), (1, true), (2, true)] {
        let got = all_records(input, pipe(), threads, recycle);
        assert_eq!(got.len(), written.len());
        for (name, dtype, shape, bytes) in &got {
            let (wd, ws, wb) = &written[name];
            assert_eq!((dtype, shape), (wd, ws), "{name}");
            assert!(
                bytes == wb,
                "{name}: bytes differ from the written file's ({threads} threads, recycle {recycle})"
            );
        }
    }
}

/// A [`tmp`] folder with the demo's example model in `model/`: (folder, `model/`).
fn tmp_example() -> (tempfile::TempDir, PathBuf) {
    let dir = tmp();
    let model = dir.path().join("model");
    tftf::commands::demo::make_example(&model).unwrap();
    (dir, model)
}

#[test]
fn fp8_dequant_and_lora_merge_records_equal_the_written_file() {
    let (dir, model) = tmp_example();
    let adapter = dir.path().join("adapter");
    tftf::commands::demo::make_example_adapter(&adapter).unwrap();
    let lora = adapter.join("adapter_model.safetensors");
    assert_records_equal_written(&model, || {
        Pipe::fp8_dequant(DType::BF16) | Pipe::lora_merge(&lora)
    });
}

#[test]
fn records_of_an_op_with_extra_outputs_come_in_plan_order() {
    // Each quantised weight brings its scale tensors: they are computed together and handed
    // out in their own places.
    let (dir, model) = tmp_example();
    let bf16 = dir.path().join("bf16.safetensors");
    Pipeline::new(
        Reader::from_path(&model),
        Pipe::fp8_dequant(DType::BF16),
        Writer::file(&bf16),
    )
    .run()
    .unwrap();
    assert_records_equal_written(&bf16, || {
        Pipe::quantize("FP8_DYNAMIC", "compressed-tensors")
    });
}

#[test]
fn a_pipe_that_cannot_apply_is_refused_before_any_record() {
    let (_dir, model, _) = tmp_small_model();
    let missing = model.join("no-such-adapter.safetensors");
    let err = Pipeline::new(
        Reader::from_path(&model),
        Pipe::lora_merge(&missing),
        Writer::null(),
    )
    .records()
    .err()
    .expect("refused");
    assert!(
        err.to_string().contains("no-such-adapter.safetensors"),
        "{err}"
    );
}

#[test]
fn a_truncated_shard_ends_the_records_with_an_error_naming_it() {
    let (dir, model) = tmp_example();
    let shard = model.join("model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    let records = Pipeline::new(
        Reader::from_path(&model),
        Pipe::fp8_dequant(DType::BF16),
        Writer::null(),
    )
    .records();
    // A shard cut after its header is found when it is opened or when its bytes are read:
    // either way the error names it and nothing is written.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 1000)
        .unwrap();
    let err = match records {
        Err(e) => e.to_string(),
        Ok(records) => records
            .filter_map(|r| r.err())
            .map(|e| e.to_string())
            .next()
            .expect("an error"),
    };
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
    assert_only_the_model(dir.path());
}

#[test]
fn dropping_the_records_early_stops_the_stream() {
    let (dir, model) = tmp_example();
    let mut records = Pipeline::new(
        Reader::from_path(&model),
        Pipe::fp8_dequant(DType::F32),
        Writer::null(),
    )
    .records()
    .unwrap();
    let total = records.tensors().len();
    assert!(total > 2);
    let first = records.next().unwrap().unwrap();
    assert_eq!(first.to_vec().unwrap().len() as u64, first.nbytes);
    drop(records);
    assert_only_the_model(dir.path());
}

/// Nothing was written beside the model's folder.
fn assert_only_the_model(dir: &Path) {
    let names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["model"]);
}
