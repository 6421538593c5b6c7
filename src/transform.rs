//! Name-level steps: `fnmatch` include/exclude globs and regex renames with Python-style
//! replacements, shared by `passthrough` and the `run` pipe.
//!
//! Globs are translated to regexes the way Python's `fnmatch.translate` does (`*` crosses dots,
//! `?`, `[seq]`, `[!seq]`, no escapes, no braces) instead of using `globset`, whose `{a,b}`
//! alternation and `**` rules would match names that the Python tool did not.

use regex::Regex;

use crate::error::{Error, Result};

#[derive(Clone, Debug)]
pub struct Glob {
    pub pattern: String,
    regex: Regex,
}

impl Glob {
    pub fn new(pattern: &str) -> Result<Glob> {
        let regex = Regex::new(&fnmatch_to_regex(pattern))
            .map_err(|e| Error::Usage(format!("invalid glob `{pattern}`: {e}")))?;
        Ok(Glob {
            pattern: pattern.to_string(),
            regex,
        })
    }

    pub fn matches(&self, name: &str) -> bool {
        self.regex.is_match(name)
    }
}

fn fnmatch_to_regex(pat: &str) -> String {
    let chars: Vec<char> = pat.chars().collect();
    let mut out = String::from("^(?s:");
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        i += 1;
        match c {
            '*' => {
                while i < chars.len() && chars[i] == '*' {
                    i += 1;
                }
                out.push_str(".*");
            }
            '?' => out.push('.'),
            '[' => {
                let mut j = i;
                if j < chars.len() && chars[j] == '!' {
                    j += 1;
                }
                if j < chars.len() && chars[j] == ']' {
                    j += 1;
                }
                while j < chars.len() && chars[j] != ']' {
                    j += 1;
                }
                if j >= chars.len() {
                    out.push_str("\\[");
                } else {
                    let mut body: String = chars[i..j].iter().collect();
                    i = j + 1;
                    let negate = body.starts_with('!');
                    if negate {
                        body.remove(0);
                    }
                    let escaped: String = body
                        .chars()
                        .flat_map(|ch| match ch {
                            '\\' | '[' | ']' | '^' | '&' | '~' => vec!['\\', ch],
                            _ => vec![ch],
                        })
                        .collect();
                    out.push('[');
                    if negate {
                        out.push('^');
                    }
                    out.push_str(&escaped);
                    out.push(']');
                }
            }
            _ => out.push_str(&regex::escape(&c.to_string())),
        }
    }
    out.push_str(")$");
    out
}

#[derive(Clone, Debug)]
pub struct Rename {
    pub pattern: String,
    pub replacement: String,
    regex: Regex,
    rust_replacement: String,
}

impl Rename {
    /// `replacement` may use Python's `\1`, `\g<1>`, `\g<name>` or Rust's `$1`, `${name}`.
    pub fn new(pattern: &str, replacement: &str) -> Result<Rename> {
        let regex = Regex::new(pattern)
            .map_err(|e| Error::Usage(format!("invalid --rename regex `{pattern}`: {e}")))?;
        let rust_replacement = python_replacement(replacement).ok_or_else(|| {
            Error::Usage(format!(
                "rename replacement `{replacement}` has `\\g<` without a closing `>`"
            ))
        })?;
        if let Some(group) = missing_group(&regex, &rust_replacement) {
            return Err(Error::Usage(format!(
                "rename replacement `{replacement}` refers to group `{group}`, which regex \
                 `{pattern}` does not have ({}); Python's re.sub refuses it too",
                groups_of(&regex)
            )));
        }
        Ok(Rename {
            pattern: pattern.into(),
            replacement: replacement.into(),
            rust_replacement,
            regex,
        })
    }

    /// Applies to every match, like Python's `re.sub`.
    pub fn apply(&self, name: &str) -> String {
        self.regex
            .replace_all(name, self.rust_replacement.as_str())
            .into_owned()
    }
}

/// The first group `replacement` (in the regex crate's `$N`, `$name`, `${name}` syntax, `$$`
/// a literal `$`) refers to that `regex` lacks. The regex crate would expand it to nothing,
/// rewriting every name silently (`model.layers.0.w` → `.layers.0.w`).
fn missing_group(regex: &Regex, replacement: &str) -> Option<String> {
    let is_name = |c: char| c == '_' || c.is_ascii_alphanumeric();
    let mut rest = replacement;
    while let Some(at) = rest.find('$') {
        rest = &rest[at + 1..];
        let name = if let Some(after) = rest.strip_prefix('$') {
            rest = after;
            continue;
        } else if let Some(braced) = rest.strip_prefix('{') {
            match braced.find('}') {
                Some(end) => {
                    rest = &braced[end + 1..];
                    &braced[..end]
                }
                None => continue,
            }
        } else {
            let end = rest.find(|c| !is_name(c)).unwrap_or(rest.len());
            let name = &rest[..end];
            rest = &rest[end..];
            name
        };
        let known = match name.parse::<usize>() {
            Ok(index) => index < regex.captures_len(),
            Err(_) => name.is_empty() || regex.capture_names().any(|n| n == Some(name)),
        };
        if !known {
            return Some(name.to_string());
        }
    }
    None
}

/// `groups 0–2, named head` for the error above.
fn groups_of(regex: &Regex) -> String {
    let last = regex.captures_len() - 1;
    let numbered = if last == 0 {
        "only group 0, the whole match".to_string()
    } else {
        format!("groups 0–{last}")
    };
    let names: Vec<&str> = regex.capture_names().flatten().collect();
    if names.is_empty() {
        numbered
    } else {
        format!("{numbered}, named {}", names.join(", "))
    }
}

/// The regex crate's form of a Python replacement; `None` for an unterminated `\g<`.
fn python_replacement(repl: &str) -> Option<String> {
    let chars: Vec<char> = repl.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\\' && i + 1 < chars.len() {
            let n = chars[i + 1];
            if n.is_ascii_digit() {
                let mut j = i + 1;
                while j < chars.len() && chars[j].is_ascii_digit() && j < i + 3 {
                    j += 1;
                }
                let group: String = chars[i + 1..j].iter().collect();
                out.push_str(&format!("${{{group}}}"));
                i = j;
                continue;
            }
            if n == 'g' && chars.get(i + 2) == Some(&'<') {
                let end = chars[i + 3..].iter().position(|&ch| ch == '>')?;
                let group: String = chars[i + 3..i + 3 + end].iter().collect();
                out.push_str(&format!("${{{group}}}"));
                i += 4 + end;
                continue;
            }
            if n == '\\' {
                out.push('\\');
                i += 2;
                continue;
            }
        }
        out.push(c);
        i += 1;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnmatch_semantics() {
        let g = Glob::new("model.layers.*.mlp.*").unwrap();
        assert!(g.matches("model.layers.0.mlp.up_proj.weight"));
        assert!(!g.matches("model.layers.0.self_attn.q_proj.weight"));
        assert!(Glob::new("*.weight").unwrap().matches("a.b.c.weight"));
        assert!(Glob::new("layer.?.w").unwrap().matches("layer.7.w"));
        assert!(Glob::new("l[0-2].w").unwrap().matches("l1.w"));
        assert!(!Glob::new("l[!0-2].w").unwrap().matches("l1.w"));
        assert!(Glob::new("a{b,c}").unwrap().matches("a{b,c}"));
        assert!(Glob::new("x[").unwrap().matches("x["));
        assert!(!Glob::new("weight").unwrap().matches("a.weight"));
    }

    #[test]
    fn python_style_replacements() {
        let r = Rename::new(r"^model\.layers\.(\d+)\.", r"blk.\1.").unwrap();
        assert_eq!(r.apply("model.layers.12.attn.w"), "blk.12.attn.w");
        let r = Rename::new(r"(?P<head>lm)_head", r"\g<head>.out").unwrap();
        assert_eq!(r.apply("lm_head.weight"), "lm.out.weight");
        let r = Rename::new(r"(a)", r"\g<1>1").unwrap();
        assert_eq!(r.apply("xa"), "xa1");
        let r = Rename::new("_proj", "").unwrap();
        assert_eq!(r.apply("q_proj.k_proj"), "q.k");
        let r = Rename::new(r"(?P<n>\d+)", "$$${n}$").unwrap();
        assert_eq!(r.apply("l7"), "l$7$");
    }

    /// Issue #24 item 2: a reference to a group the regex lacks is refused, naming the group,
    /// whatever the syntax; Python's `re.sub` raises for each of these.
    #[test]
    fn references_to_missing_groups_are_refused() {
        for (pattern, replacement, group) in [
            (r"^model\.", r"\g<prefix>", "prefix"),
            (r"^(model)\.", r"\2.", "2"),
            (r"^(?P<head>model)\.", r"\g<hed>.", "hed"),
            (r"^model\.", "${name}", "name"),
            (r"^(model)\.", "$1a", "1a"),
            (r"^model\.", "x$1", "1"),
        ] {
            let err = Rename::new(pattern, replacement).unwrap_err();
            assert_eq!(err.exit_code(), 2);
            let text = err.to_string();
            assert!(
                text.contains(&format!("group `{group}`")) && text.contains(pattern),
                "{pattern} {replacement}: {text}"
            );
        }
        let text = Rename::new(r"(?P<head>lm)_(x)", r"\g<nope>")
            .unwrap_err()
            .to_string();
        assert!(text.contains("groups 0–2, named head"), "{text}");
        let text = Rename::new("a", r"\g<1").unwrap_err().to_string();
        assert!(text.contains("without a closing `>`"), "{text}");
    }
}
