//! `--device` and `selftest` on a machine without a usable GPU (CI): `auto` falls back to the
//! CPU and says why, an explicit `cuda` is a clear error before any output exists, and the
//! selftest still checks the CPU ops. Skipped where a CUDA driver is present.

mod common;

use common::*;
use tftf::format::dtype::DType;

fn gpu_present() -> bool {
    let present = tftf::gpu::Device::open(&tftf::gpu::DeviceRequest::Auto)
        .map(|d| d.gpu.is_some())
        .unwrap_or(true);
    if present {
        eprintln!("SKIPPED: a CUDA device is present; these tests cover machines without one");
    }
    present
}

#[test]
fn auto_falls_back_to_the_cpu_and_cuda_is_refused_before_any_output() {
    if gpu_present() {
        return;
    }
    let dir = tmp();
    let model = dir.path().join("m");
    let mut rng = Rng(9);
    Model::new()
        .rand(&mut rng, "w", DType::F32, &[4, 8])
        .indexed()
        .write(&model);
    let out = dir.path().join("o");
    let report = dir.path().join("r.json");
    let r = tftf_ok(&[
        "passthrough",
        s(&model),
        "-o",
        s(&out),
        "--dtype",
        "bf16",
        "--report",
        s(&report),
    ]);
    let stdout = stdout(&r);
    assert!(
        stdout.contains("computed on the CPU (--device auto: no CUDA"),
        "{stdout}"
    );
    let rep = read_json(&report);
    assert_eq!(rep["device"], "cpu");
    assert!(rep["device_note"].as_str().unwrap().contains("CUDA"));

    let out2 = dir.path().join("o2");
    for dev in ["cuda", "cuda:3"] {
        let r = tftf(&[
            "passthrough",
            s(&model),
            "-o",
            s(&out2),
            "--dtype",
            "bf16",
            "--device",
            dev,
        ]);
        assert_eq!(r.status.code(), Some(1));
        let err = stderr(&r);
        assert!(err.contains("error: --device cuda:"), "{err}");
        assert!(err.contains("use --device cpu (or auto)"), "{err}");
        assert!(!out2.exists(), "no output after a refused device");
    }
    let r = tftf(&["passthrough", s(&model), "-o", s(&out2), "--device", "tpu"]);
    assert_eq!(r.status.code(), Some(2));
    assert!(stderr(&r).contains("--device tpu: use auto, cpu, cuda or cuda:N"));
}

#[test]
fn selftest_checks_the_cpu_ops_without_a_gpu() {
    if gpu_present() {
        return;
    }
    let r = tftf_ok(&["selftest"]);
    let out = stdout(&r);
    assert!(out.contains("no GPU (no CUDA driver"), "{out}");
    for kernel in [
        "cast",
        "dequant-fp8",
        "mxfp4→nvfp4 scales",
        "mxfp4→nvfp4 re-encode",
        "requant-e2m1",
        "merge-lora",
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(kernel) && l.ends_with("ok")),
            "{kernel}: {out}"
        );
    }
    assert!(!out.contains("MISMATCH"));
    assert!(out.contains(" 0 failed (cpu)"), "{out}");
    let r = tftf(&["selftest", "--device", "cuda"]);
    assert_eq!(r.status.code(), Some(1));
    assert!(stderr(&r).contains("no CUDA driver"));
}
