//! The fake CUDA driver (tests/fake_cuda) the GPU path runs against in CI: built once per test
//! binary, and tftf run with it in place of the real libcuda.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// Builds libcuda.so.1 from tests/fake_cuda, plus stubs for every other driver entry point
/// cudarc resolves (names read from the tftf binary), once per test run.
pub fn fake_libs() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| build_fake("fake-cuda", None))
}

/// Builds the fake driver into `CARGO_TARGET_TMPDIR/name`, without entry point `omit` if given.
pub fn build_fake(name: &str, omit: Option<&str>) -> PathBuf {
    {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let bin = std::fs::read(env!("CARGO_BIN_EXE_tftf")).unwrap();
        let names = regex::bytes::Regex::new(r"cu[A-Z][A-Za-z0-9_]*\x00").unwrap();
        let mut driver = std::collections::BTreeSet::new();
        for m in names.find_iter(&bin) {
            // A name starts a string: the byte before it is not part of an identifier.
            let before = m.start().checked_sub(1).map(|i| bin[i]);
            if before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_') {
                continue;
            }
            driver.insert(String::from_utf8(m.as_bytes()[..m.len() - 1].to_vec()).unwrap());
        }
        let src = "tests/fake_cuda/fake_cuda.cpp";
        let implemented = std::fs::read_to_string(src).unwrap();
        let mut c = String::from("#include <cstdio>\nextern \"C\" {\n");
        for n in driver
            .iter()
            .filter(|n| !implemented.contains(&format!(" {n}(")) && Some(n.as_str()) != omit)
        {
            c += &format!(
                "int {n}() {{ fprintf(stderr, \"fake CUDA: {n} is not implemented\\n\"); return 801; }}\n"
            );
        }
        c += "}\n";
        let stubs = dir.join("stubs.cpp");
        std::fs::write(&stubs, c).unwrap();
        let status = Command::new("g++")
            .args([
                "-O2",
                "-std=c++17",
                "-ffp-contract=off",
                "-shared",
                "-fPIC",
                "-w",
                src,
            ])
            .arg(&stubs)
            .arg("-o")
            .arg(dir.join("libcuda.so.1"))
            .status()
            .expect("g++ runs");
        assert!(status.success(), "building the fake libcuda.so.1");
        let _ = std::fs::remove_file(dir.join("libcuda.so"));
        std::os::unix::fs::symlink("libcuda.so.1", dir.join("libcuda.so")).unwrap();
        dir
    }
}

/// Runs tftf, the fake driver appending each kernel it launches to `log`.
pub fn tftf_logged(
    libs: Option<&Path>,
    integrated: bool,
    log: Option<&Path>,
    args: &[&str],
) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tftf"));
    c.args(args);
    if let Some(log) = log {
        c.env("TFTF_FAKE_CUDA_LOG", log);
    }
    c.env_remove("LD_LIBRARY_PATH");
    if let Some(libs) = libs {
        c.env("LD_LIBRARY_PATH", libs);
    }
    if integrated {
        c.env("TFTF_FAKE_CUDA_INTEGRATED", "1");
    }
    c.output().unwrap()
}
