//! Names and paths as they are printed: tensor names and file names come from untrusted
//! headers and directories, so a message never carries their raw control characters (a `\r`
//! or an escape sequence would rewrite the terminal line) or undecodable bytes. Control
//! characters are written as Rust escapes (`\n`, `\u{1b}`), bytes that are not UTF-8 as `\xNN`;
//! everything else, non-ASCII letters included, is printed as it is.

use std::borrow::Cow;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// A tensor name (or any string from an input) safe to print.
pub fn name(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    push_escaped(&mut out, s);
    Cow::Owned(out)
}

/// A path safe to print: control characters escaped, non-UTF-8 bytes as `\xNN`.
pub fn path(p: &Path) -> PathShown<'_> {
    PathShown(p)
}

pub struct PathShown<'a>(&'a Path);

impl fmt::Display for PathShown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&bytes(self.0.as_os_str().as_bytes()))
    }
}

/// A file name or other byte string safe to print.
pub fn bytes(b: &[u8]) -> Cow<'_, str> {
    match std::str::from_utf8(b) {
        Ok(s) => name(s),
        Err(_) => {
            let mut out = String::with_capacity(b.len() + 8);
            for chunk in b.utf8_chunks() {
                push_escaped(&mut out, chunk.valid());
                for byte in chunk.invalid() {
                    out.push_str(&format!("\\x{byte:02x}"));
                }
            }
            Cow::Owned(out)
        }
    }
}

fn push_escaped(out: &mut String, s: &str) {
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
}

/// The input's warnings and notes on stderr (notes only without `quiet`), escaped.
pub fn print_input_notes(ckpt: &crate::Checkpoint, quiet: bool) {
    for w in &ckpt.warnings {
        errln!("warning: {}: {}", path(&ckpt.input), name(w));
    }
    if !quiet {
        for n in &ckpt.notes {
            errln!("note: {}: {}", path(&ckpt.input), name(n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn control_characters_and_bad_bytes_are_escaped() {
        assert!(matches!(name("model.layers.0.weight"), Cow::Borrowed(_)));
        assert_eq!(name("a\nb\r\u{1b}[2Jc\t"), "a\\nb\\r\\u{1b}[2Jc\\t");
        assert_eq!(name("größe.gewicht"), "größe.gewicht");
        let p = Path::new(OsStr::from_bytes(b"/m/shard-\xff\x01.safetensors"));
        assert_eq!(path(p).to_string(), "/m/shard-\\xff\\u{1}.safetensors");
    }
}
