//! `--device` and `selftest` on a machine without a usable GPU (CI): `auto` falls back to the
//! CPU and says why, an explicit `cuda` is a clear error before any output exists, and the
//! selftest still checks the CPU ops. Skipped where a CUDA driver is present.

mod common;

use common::{tftf as run_tftf, Rng};
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
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    let mut rng = Rng(9);
    common::write_sharded(
        &model,
        &[vec![common::rand_t(&mut rng, "w", DType::F32, &[4, 8])]],
    );
    let out = dir.path().join("o");
    let report = dir.path().join("r.json");
    let r = run_tftf(&[
        "passthrough",
        model.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--dtype",
        "bf16",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(
        stdout.contains("computed on the CPU (--device auto: no CUDA"),
        "{stdout}"
    );
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(rep["device"], "cpu");
    assert!(rep["device_note"].as_str().unwrap().contains("CUDA"));

    let out2 = dir.path().join("o2");
    for dev in ["cuda", "cuda:3"] {
        let r = run_tftf(&[
            "passthrough",
            model.to_str().unwrap(),
            "-o",
            out2.to_str().unwrap(),
            "--dtype",
            "bf16",
            "--device",
            dev,
        ]);
        assert_eq!(r.status.code(), Some(1));
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(err.contains("error: --device cuda:"), "{err}");
        assert!(err.contains("use --device cpu (or auto)"), "{err}");
        assert!(!out2.exists(), "no output after a refused device");
    }
    let r = run_tftf(&[
        "passthrough",
        model.to_str().unwrap(),
        "-o",
        out2.to_str().unwrap(),
        "--device",
        "tpu",
    ]);
    assert_eq!(r.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("--device tpu: use auto, cpu, cuda or cuda:N")
    );
}

#[test]
fn selftest_checks_the_cpu_ops_without_a_gpu() {
    if gpu_present() {
        return;
    }
    let r = run_tftf(&["selftest"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let out = String::from_utf8_lossy(&r.stdout);
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
    let r = run_tftf(&["selftest", "--device", "cuda"]);
    assert_eq!(r.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&r.stderr).contains("no CUDA driver"));
}
