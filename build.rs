//! Embeds the CUDA kernels as PTX. With `nvcc` available (on PATH, in $CUDA_HOME/bin or
//! /usr/local/cuda/bin) the kernels are compiled fresh; the committed kernels/tftf.ptx (made by
//! scripts/gen-ptx.py with NVRTC 12.2, PTX ISA 8.2) is always embedded too, as the fallback for
//! drivers older than that nvcc. No toolkit is needed to build.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Keep in step with OPTIONS in scripts/gen-ptx.py.
const NVCC_FLAGS: &[&str] = &["-ptx", "-arch=compute_80", "--fmad=false", "-std=c++17"];

fn nvcc() -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(home) = std::env::var_os("CUDA_HOME").or_else(|| std::env::var_os("CUDA_PATH")) {
        candidates.push(Path::new(&home).join("bin/nvcc"));
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|p| p.join("nvcc")));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    candidates.into_iter().find(|p| p.is_file())
}

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    println!("cargo:rerun-if-env-changed=TFTF_NO_NVCC");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("tftf-nvcc.ptx");
    let mut fresh = String::new();
    if std::env::var_os("TFTF_NO_NVCC").is_none() {
        if let Some(nvcc) = nvcc() {
            let status = Command::new(&nvcc)
                .args(NVCC_FLAGS)
                .arg("kernels/tftf.cu")
                .arg("-o")
                .arg(&out)
                .status();
            match status {
                Ok(s) if s.success() => {
                    fresh = std::fs::read_to_string(&out).unwrap_or_default();
                }
                other => println!(
                    "cargo:warning={} failed ({other:?}); using the committed kernels/tftf.ptx",
                    nvcc.display()
                ),
            }
        }
    }
    // An empty file when nvcc is absent: the committed PTX alone is used.
    std::fs::write(&out, fresh).unwrap();
}
