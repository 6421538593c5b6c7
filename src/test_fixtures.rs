//! Golden data of the unit tests, read from `tests/fixtures/` in the repository (see its
//! README for what made each file), so a bare clone tests itself.

use std::path::PathBuf;

/// `tests/fixtures/<rel>`; panics naming the path when it is missing, rather than letting a
/// test fail on some later, vaguer read.
pub(crate) fn fixture(rel: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel);
    assert!(
        path.exists(),
        "test fixture `{}` is missing (it is part of the repository: restore it with git)",
        path.display()
    );
    path
}

/// `scalars/scalars.json`: ml_dtypes' encodings and decodings of FP8, FP4, BF16 and F16.
pub(crate) fn scalars() -> serde_json::Value {
    let path = fixture("scalars/scalars.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read test fixture `{}`: {e}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("test fixture `{}` is not JSON: {e}", path.display()))
}
