//! tftf's whole GPU path — cudarc's driver calls, lanes, pinned staging, kernel arguments,
//! refusal flags, downloads, the cuBLAS product — run against a fake CUDA driver and cuBLAS
//! (tests/fake_cuda) that execute the very kernels of kernels/tftf.cu compiled for the host. GPU
//! and CPU outputs must be byte-identical (LoRA: within one unit in the last place), in both the
//! copy and the unified-memory mode. What this cannot check is the real device: `tftf selftest`
//! and bench/gpu-check.sh do that where a GPU exists.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use common::{listing, load_all, s};

/// Builds libcuda.so.1 and libcublas.so from tests/fake_cuda, plus stubs for every other entry
/// point cudarc resolves (names read from the tftf binary), once per test run.
fn fake_libs() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake-cuda");
        std::fs::create_dir_all(&dir).unwrap();
        let bin = std::fs::read(env!("CARGO_BIN_EXE_tftf")).unwrap();
        let names = regex::bytes::Regex::new(r"cu(?:blas)?[A-Z][A-Za-z0-9_]*\x00").unwrap();
        let mut driver = std::collections::BTreeSet::new();
        let mut blas = std::collections::BTreeSet::new();
        for m in names.find_iter(&bin) {
            // A name starts a string: the byte before it is not part of an identifier.
            let before = m.start().checked_sub(1).map(|i| bin[i]);
            if before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_') {
                continue;
            }
            let n = String::from_utf8(m.as_bytes()[..m.len() - 1].to_vec()).unwrap();
            if n.starts_with("cublas") {
                blas.insert(n);
            } else {
                driver.insert(n);
            }
        }
        let build = |src: &str, implemented: &str, stubs: &std::collections::BTreeSet<String>, out: &str| {
            let text = std::fs::read_to_string(implemented).unwrap();
            let mut c = String::from("#include <cstdio>\nextern \"C\" {\n");
            for n in stubs {
                if !text.contains(&format!(" {n}(")) {
                    c += &format!(
                        "int {n}() {{ fprintf(stderr, \"fake CUDA: {n} is not implemented\\n\"); return 801; }}\n"
                    );
                }
            }
            c += "}\n";
            let stub = dir.join(format!("{out}.stubs.cpp"));
            std::fs::write(&stub, c).unwrap();
            let status = Command::new("g++")
                .args(["-O2", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC", "-w", src])
                .arg(&stub)
                .arg("-o")
                .arg(dir.join(out))
                .status()
                .expect("g++ runs");
            assert!(status.success(), "building {out}");
        };
        build("tests/fake_cuda/fake_cuda.cpp", "tests/fake_cuda/fake_cuda.cpp", &driver, "libcuda.so.1");
        build("tests/fake_cuda/fake_cublas.cpp", "tests/fake_cuda/fake_cublas.cpp", &blas, "libcublas.so");
        for (link, target) in [("libcuda.so", "libcuda.so.1"), ("libcublas.so.12", "libcublas.so")] {
            let _ = std::fs::remove_file(dir.join(link));
            std::os::unix::fs::symlink(target, dir.join(link)).unwrap();
        }
        dir
    })
}

fn tftf_with(fake: bool, integrated: bool, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tftf"));
    c.args(args);
    c.env_remove("LD_LIBRARY_PATH");
    if fake {
        c.env("LD_LIBRARY_PATH", fake_libs());
    }
    if integrated {
        c.env("TFTF_FAKE_CUDA_INTEGRATED", "1");
    }
    c.output().unwrap()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The demo's example checkpoints (FP8 with scales, a V4-style MXFP4/Engram model, an adapter).
fn examples() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake-gpu-examples");
        let _ = std::fs::remove_dir_all(&dir);
        ok(&tftf_with(false, false, &["demo", "--keep", s(&dir)]));
        dir
    })
}

/// Largest distance in units in the last place between two BF16/F16/F32 tensors' bytes.
fn ulps(dtype: &str, a: &[u8], b: &[u8]) -> u64 {
    let w = if dtype == "F32" { 4 } else { 2 };
    let key = |c: &[u8]| -> i64 {
        let (v, sign) = if w == 4 {
            (u32::from_le_bytes(c.try_into().unwrap()) as i64, 1i64 << 31)
        } else {
            (u16::from_le_bytes([c[0], c[1]]) as i64, 1i64 << 15)
        };
        if v & sign != 0 {
            -(v & (sign - 1))
        } else {
            v
        }
    };
    a.chunks_exact(w)
        .zip(b.chunks_exact(w))
        .map(|(x, y)| key(x).abs_diff(key(y)))
        .max()
        .unwrap_or(0)
}

/// Runs `args` with `-o OUT --device DEV` on the CPU and on the fake GPU (copying and unified
/// memory); returns the CPU and GPU outputs' tensors after checking the report's device.
fn cpu_vs_gpu(name: &str, args: &[&str]) -> Vec<(String, String, Vec<u8>, Vec<u8>)> {
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fake-gpu-{name}"));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let run = |dev: &str, fake: bool, integrated: bool, out: &str| {
        let out = work.join(out);
        let report = work.join(format!("{dev}-{integrated}.json"));
        let mut a: Vec<&str> = args.to_vec();
        a.extend([
            "-o",
            s(&out),
            "--device",
            dev,
            "--report",
            s(&report),
            "--threads",
            "3",
        ]);
        ok(&tftf_with(fake, integrated, &a));
        let rep: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        (load_all(&out), rep)
    };
    let (cpu, rep_cpu) = run("cpu", true, false, "cpu");
    assert_eq!(rep_cpu["device"], "cpu");
    let mut pairs = Vec::new();
    for integrated in [false, true] {
        let (gpu, rep) = run(
            "cuda",
            true,
            integrated,
            if integrated { "unified" } else { "gpu" },
        );
        let dev = rep["device"].as_str().unwrap();
        assert!(
            dev.starts_with("cuda:0 (tftf fake CUDA device, sm_90"),
            "{dev}"
        );
        assert_eq!(dev.contains("unified memory"), integrated, "{dev}");
        assert!(
            rep["gpu"]["chunks"].as_u64().unwrap() > 0,
            "{name}: nothing ran on the GPU"
        );
        assert_eq!(rep["gpu"]["ptx"], "committed");
        assert_eq!(
            cpu.keys().collect::<Vec<_>>(),
            gpu.keys().collect::<Vec<_>>(),
            "{name}: same tensors"
        );
        for (k, (dt, shape, bytes)) in &cpu {
            let (gdt, gshape, gbytes) = &gpu[k];
            assert_eq!((dt, shape), (gdt, gshape), "{name}: {k}");
            pairs.push((k.clone(), dt.clone(), bytes.clone(), gbytes.clone()));
        }
        // Unified memory: the kernels used the staging directly and no file differs.
        assert_eq!(
            listing(&work.join("cpu")),
            listing(&work.join(if integrated { "unified" } else { "gpu" }))
        );
    }
    pairs
}

fn assert_identical(name: &str, pairs: &[(String, String, Vec<u8>, Vec<u8>)]) {
    for (k, _, a, b) in pairs {
        assert!(a == b, "{name}: {k} differs between CPU and GPU");
    }
}

#[test]
fn cast_dequant_and_fp4_repack_are_byte_identical_on_the_gpu_path() {
    let ex = examples();
    let pairs = cpu_vs_gpu(
        "cast",
        &[
            "passthrough",
            s(&ex.join("example")),
            "--dtype",
            "f16",
            "--memory-budget",
            "16MiB",
        ],
    );
    assert_identical("cast", &pairs);
    let pairs = cpu_vs_gpu(
        "dequant",
        &["dequant-fp8", s(&ex.join("example")), "--dtype", "f32"],
    );
    assert_identical("dequant", &pairs);
    let pairs = cpu_vs_gpu("repack", &["repack-fp4", "-i", s(&ex.join("v4-example"))]);
    assert_identical("repack", &pairs);
}

#[test]
fn lora_merge_on_the_gpu_path_is_within_one_ulp() {
    let ex = examples();
    let pairs = cpu_vs_gpu(
        "lora",
        &[
            "merge-lora",
            "-b",
            s(&ex.join("dequantized")),
            "-a",
            s(&ex.join("adapter")),
        ],
    );
    let mut merged = 0;
    for (k, dt, a, b) in &pairs {
        let d = ulps(dt, a, b);
        assert!(d <= 1, "{k}: {d} ulps between CPU and GPU");
        merged += (a != b) as usize;
    }
    let _ = merged;
}

#[test]
fn selftest_passes_on_the_fake_device_and_refused_values_are_named() {
    let out = ok(&tftf_with(true, false, &["selftest", "--device", "cuda"]));
    assert!(
        out.contains("selftest: cuda:0 (tftf fake CUDA device, sm_90) against the CPU ops"),
        "{out}"
    );
    assert!(out.contains("copy bandwidth (pinned, 256 MiB)"), "{out}");
    assert!(out.contains(" 0 failed (cuda:0"), "{out}");
    let out = ok(&tftf_with(true, true, &["selftest", "-q"]));
    assert!(out.contains(" 0 failed (cuda:0"), "{out}");

    // An FP8 NaN code: the kernel raises its flag, the CPU op names the element, no output.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.safetensors");
    let mut codes = vec![0x38u8; 64];
    codes[37] = 0x7F;
    common::write_file(
        &model,
        &[
            common::t(
                "w.weight",
                tftf::format::dtype::DType::F8_E4M3,
                &[8, 8],
                codes,
            ),
            common::t(
                "w.weight_scale_inv",
                tftf::format::dtype::DType::F32,
                &[1, 1],
                1f32.to_le_bytes().to_vec(),
            ),
        ],
    );
    let out = dir.path().join("o");
    for (fake, dev) in [(false, "cpu"), (true, "cuda")] {
        let r = tftf_with(
            fake,
            false,
            &["dequant-fp8", s(&model), "-o", s(&out), "--device", dev],
        );
        assert_eq!(r.status.code(), Some(1));
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(
            err.contains("w.weight") && err.contains("non-finite F8_E4M3 code 0x7f at [4, 5]"),
            "{dev}: {err}"
        );
        assert!(!out.exists(), "{dev}: nothing left behind");
    }
}
