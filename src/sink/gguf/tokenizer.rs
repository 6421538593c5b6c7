//! Tokenizer metadata for BPE (gpt2-style, `tokenizer.json`) vocabularies, as the converter's
//! `_set_vocab_gpt2` + `gguf.SpecialVocab` write it.
//!
//! llama.cpp reimplements each pre-tokenizer by hand and picks one by `tokenizer.ggml.pre`. The
//! converter finds that name by encoding a fixed text ([`CHKTXT`], with special tokens, as
//! `AutoTokenizer.encode` does) and looking up the SHA-256 of the Python `str()` of the id
//! list in a table generated from known models ([`PRE_HASHES`]). We encode with the
//! `tokenizers` crate (the library transformers' fast tokenizers wrap), so the ids, and the
//! hash, are the same.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value as Json};
use sha2::{Digest, Sha256};

use super::kv::{Array, Metadata, Value};
pub use super::pre_hashes::{CHKTXT, PRE_HASHES};
use crate::error::{Error, Result};

/// `gguf.TokenType`.
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
}

/// Special token kinds `SpecialVocab` looks up, and the GGUF key each id goes to (`cls` has no
/// writer method in gguf-py and is skipped, as there).
const SPECIAL_TYPES: [(&str, Option<&str>); 7] = [
    ("bos", Some("tokenizer.ggml.bos_token_id")),
    ("eos", Some("tokenizer.ggml.eos_token_id")),
    ("unk", Some("tokenizer.ggml.unknown_token_id")),
    ("sep", Some("tokenizer.ggml.seperator_token_id")),
    ("pad", Some("tokenizer.ggml.padding_token_id")),
    ("cls", None),
    ("mask", Some("tokenizer.ggml.mask_token_id")),
];

pub(super) fn tok_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::GgufTokenizer {
        path: path.into(),
        msg: msg.into(),
    }
}

fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer> {
    let text = crate::sys::read_regular_to_string(path).map_err(|e| Error::io(path, e))?;
    text.parse::<tokenizers::Tokenizer>()
        .map_err(|e| tok_err(path, e.to_string()))
}

/// The converter's `chkhsh` for a `tokenizer.json`.
pub fn chkhsh(tokenizer_json: &Path) -> Result<String> {
    let tok = load_tokenizer(tokenizer_json)?;
    chkhsh_of(&tok, tokenizer_json)
}

fn chkhsh_of(tok: &tokenizers::Tokenizer, path: &Path) -> Result<String> {
    let enc = tok
        .encode(CHKTXT, true)
        .map_err(|e| tok_err(path, format!("encoding the check text: {e}")))?;
    let ids: Vec<String> = enc.get_ids().iter().map(u32::to_string).collect();
    let text = format!("[{}]", ids.join(", "));
    Ok(format!("{:x}", Sha256::digest(text.as_bytes())))
}

/// `tokenizer.ggml.pre` for a hash: the last matching entry, as the converter's chain of `if`s.
pub fn pre_for_hash(hash: &str) -> Option<&'static str> {
    PRE_HASHES
        .iter()
        .rev()
        .find(|(h, _)| *h == hash)
        .map(|(_, n)| *n)
}

/// `does_token_look_special`.
pub(super) fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

pub(super) fn read_json(path: &Path) -> Result<Option<Json>> {
    match crate::sys::read_regular_to_string(path) {
        Ok(s) => serde_json::from_str(&s)
            .map(Some)
            .map_err(|e| tok_err(path, format!("not valid JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// `tokenizer.ggml.add_space_prefix` as `LlamaModel.set_vocab` writes it: `tokenizer_config.json`'s
/// `add_prefix_space` when the file has it and it is not null (the converter copies it, before
/// any other tokenizer KV); anything but a boolean there is refused, naming the file.
pub fn add_space_prefix(dir: &Path) -> Result<Option<bool>> {
    let path = dir.join("tokenizer_config.json");
    let Some(tc) = read_json(&path)? else {
        return Ok(None);
    };
    match tc.get("add_prefix_space") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(tok_err(
            &path,
            format!("`add_prefix_space` is {other}, not true or false"),
        )),
    }
}

/// Tokenizer KVs for the model directory `dir` (`tokenizer.json`, `tokenizer_config.json`,
/// `config.json`, `chat_template.jinja`/`.json`). `vocab_size` is `config.json`'s, when it has
/// one; `pre_override` replaces the hash lookup (`--vocab-pre`).
pub fn vocab_kvs(
    dir: &Path,
    vocab_size: Option<u64>,
    pre_override: Option<&str>,
) -> Result<Metadata> {
    let tj_path = dir.join("tokenizer.json");
    let tok = load_tokenizer(&tj_path)?;
    let pre = match pre_override {
        Some(p) => p.to_string(),
        None => {
            let hash = chkhsh_of(&tok, &tj_path)?;
            pre_for_hash(&hash)
                .ok_or(Error::GgufUnknownPreTokenizer {
                    path: tj_path.clone(),
                    hash,
                })?
                .to_string()
        }
    };

    // get_vocab_base
    let vocab = tok.get_vocab(true);
    let max_id = vocab.values().copied().max().unwrap_or(0) as u64;
    let n_vocab = vocab_size.unwrap_or(vocab.len() as u64);
    if max_id >= n_vocab {
        return Err(tok_err(
            &tj_path,
            format!("token id {max_id} is not below vocab_size {n_vocab}"),
        ));
    }
    let reverse: HashMap<u32, &str> = vocab.iter().map(|(t, &i)| (i, t.as_str())).collect();
    let added = tok.get_added_tokens_decoder();
    let mut tokens = Vec::with_capacity(n_vocab as usize);
    let mut types = Vec::with_capacity(n_vocab as usize);
    for i in 0..n_vocab as u32 {
        match (reverse.get(&i), added.get(&i)) {
            (None, _) => {
                tokens.push(format!("[PAD{i}]"));
                types.push(token_type::UNUSED);
            }
            (Some(t), Some(a)) => {
                if a.special || looks_special(t) {
                    tokens.push(t.to_string());
                    types.push(token_type::CONTROL);
                } else {
                    tokens.push(t.replace('\u{2581}', " "));
                    types.push(token_type::USER_DEFINED);
                }
            }
            (Some(t), None) => {
                tokens.push(t.to_string());
                types.push(token_type::NORMAL);
            }
        }
    }

    let mut m = Metadata::new();
    m.set("tokenizer.ggml.model", Value::String("gpt2".into()));
    m.set("tokenizer.ggml.pre", Value::String(pre));
    m.set("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)));
    m.set("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    special_vocab(dir, &tj_path, n_vocab, true, &mut m)?;
    Ok(m)
}

/// `gguf.SpecialVocab(dir, load_merges).add_to_gguf` (`tokenizer.json` may be absent).
pub(super) fn special_vocab(
    dir: &Path,
    tj_path: &Path,
    n_vocab: u64,
    load_merges: bool,
    m: &mut Metadata,
) -> Result<()> {
    let tj = read_json(tj_path)?.unwrap_or(Json::Null);
    let merges = match tj
        .pointer("/model/merges")
        .and_then(Json::as_array)
        .filter(|_| load_merges)
    {
        Some(list) if !list.is_empty() => list
            .iter()
            .map(|e| match e {
                Json::String(s) => Ok(s.clone()),
                Json::Array(pair) if pair.len() == 2 => {
                    let part = |p: &Json| {
                        p.as_str()
                            .map(|s| s.replace(' ', "\u{120}"))
                            .ok_or_else(|| tok_err(tj_path, "merge pair is not two strings"))
                    };
                    Ok(format!("{} {}", part(&pair[0])?, part(&pair[1])?))
                }
                _ => Err(tok_err(tj_path, "unknown merges format")),
            })
            .collect::<Result<Vec<_>>>()?,
        _ => Vec::new(),
    };
    let tc_path = dir.join("tokenizer_config.json");
    let tc = read_json(&tc_path)?;
    let tc_obj = tc.as_ref().and_then(Json::as_object);
    let content = |typ: &str| -> Option<String> {
        match tc_obj?.get(&format!("{typ}_token"))? {
            Json::String(s) => Some(s.clone()),
            Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
            _ => None,
        }
    };

    let mut add: Vec<(&str, bool)> = Vec::new();
    let set_add =
        |add: &mut Vec<(&'static str, bool)>, typ: &'static str, v: bool, only_default: bool| {
            match add.iter_mut().find(|(t, _)| *t == typ) {
                Some(slot) if !only_default => slot.1 = v,
                Some(_) => {}
                None => add.push((typ, v)),
            }
        };
    if let Some(pp) = tj.get("post_processor").filter(|p| !p.is_null()) {
        let list = match pp.get("processors").and_then(Json::as_array) {
            Some(l) => l.clone(),
            None => vec![pp.clone()],
        };
        let bos = content("bos");
        let eos = content("eos");
        for p in &list {
            match p.get("type").and_then(Json::as_str) {
                Some("ByteLevel") => {
                    set_add(&mut add, "bos", false, true);
                    set_add(&mut add, "eos", false, true);
                }
                Some("RobertaProcessing") => {
                    set_add(&mut add, "bos", true, false);
                    set_add(&mut add, "eos", true, false);
                    set_add(&mut add, "sep", true, false);
                }
                Some("TemplateProcessing") => {
                    let known = SpecialContents {
                        has_config: tc_obj.is_some(),
                        bos: bos.clone(),
                        cls: content("cls"),
                        eos: eos.clone(),
                        sep: content("sep"),
                    };
                    for (typ, v) in template_processing(p, &known) {
                        set_add(&mut add, typ, v, false);
                    }
                }
                _ => {}
            }
        }
    }

    let added_tokens = tj
        .get("added_tokens")
        .and_then(Json::as_array)
        .cloned()
        .unwrap_or_default();
    let mut ids: Vec<(&str, u64)> = Vec::new();
    let set_id = |ids: &mut Vec<(&'static str, u64)>, typ: &'static str, id: u64| {
        if id < n_vocab && !ids.iter().any(|(t, _)| *t == typ) {
            ids.push((typ, id));
        }
    };
    if let Some(tc) = tc_obj {
        for (typ, _) in SPECIAL_TYPES {
            if let Some(b) = tc.get(&format!("add_{typ}_token")).and_then(Json::as_bool) {
                set_add(&mut add, typ, b, true);
            }
            if let Some(c) = content(typ) {
                let id = added_tokens
                    .iter()
                    .find(|a| a.get("content").and_then(Json::as_str) == Some(&c))
                    .and_then(|a| a.get("id")?.as_u64());
                if let Some(id) = id {
                    set_id(&mut ids, typ, id);
                }
            }
        }
    }
    if let Some(Json::Object(cfg)) = read_json(&dir.join("config.json"))? {
        for (typ, _) in SPECIAL_TYPES {
            let id = cfg
                .get(&format!("{typ}_token_id"))
                .or_else(|| cfg.get("text_config")?.get(format!("{typ}_token_id")));
            if let Some(id) = id.and_then(Json::as_u64) {
                set_id(&mut ids, typ, id);
            }
        }
    }

    if !merges.is_empty() {
        m.set("tokenizer.ggml.merges", Value::Array(Array::String(merges)));
    }
    for (typ, id) in ids {
        if let Some((_, Some(key))) = SPECIAL_TYPES.iter().find(|(t, _)| *t == typ) {
            m.set(*key, Value::U32(id as u32));
        }
    }
    for (typ, v) in add {
        if matches!(typ, "bos" | "eos" | "sep") {
            m.set(format!("tokenizer.ggml.add_{typ}_token"), Value::Bool(v));
        }
    }
    if let Some(t) = chat_template(dir, tc_obj, &tc_path)? {
        set_chat_template(m, t, &tc_path)?;
    }
    Ok(())
}

/// A chat template as transformers stores it: one string, or a list of `{"name", "template"}`
/// (several templates, the one named `default` used when none is asked for).
enum ChatTemplate {
    One(String),
    Named(Vec<Json>),
}

/// gguf-py's `add_chat_template`: each named template as `tokenizer.chat_template.NAME` (the
/// name's characters other than ASCII letters and digits become `_`), their names as
/// `tokenizer.chat_templates` (in the list's order: gguf-py's comes from a set, whose order
/// varies from run to run), then `default` as `tokenizer.chat_template`. Entries without a
/// name or template are skipped as gguf-py skips them; an entry that is not such an object, or
/// two templates of one name (gguf-py fails on the duplicate key), is an error naming `path`.
fn set_chat_template(m: &mut Metadata, t: ChatTemplate, path: &Path) -> Result<()> {
    let list = match t {
        ChatTemplate::One(s) => {
            m.set("tokenizer.chat_template", Value::String(s));
            return Ok(());
        }
        ChatTemplate::Named(list) => list,
    };
    let bad = |i: usize, what: &str| {
        tok_err(
            path,
            format!("chat_template entry {i} {what}; each must be {{\"name\": string, \"template\": string}}"),
        )
    };
    let (mut default, mut names) = (None, Vec::<String>::new());
    for (i, choice) in list.iter().enumerate() {
        let Some(choice) = choice.as_object() else {
            return Err(bad(i, &format!("is {choice}")));
        };
        let name = match choice.get("name") {
            None => "",
            Some(Json::String(n)) => n.as_str(),
            Some(other) => return Err(bad(i, &format!("has the name {other}"))),
        };
        let template = match choice.get("template") {
            None | Some(Json::Null) => None,
            Some(Json::String(t)) => Some(t.clone()),
            Some(other) => return Err(bad(i, &format!("has the template {other}"))),
        };
        let name: String = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let Some(template) = template.filter(|_| !name.is_empty()) else {
            continue;
        };
        if name == "default" && default.is_none() {
            default = Some(template);
        } else if name == "default" || names.contains(&name) {
            return Err(bad(i, &format!("repeats the name `{name}`")));
        } else {
            m.set(
                format!("tokenizer.chat_template.{name}"),
                Value::String(template),
            );
            names.push(name);
        }
    }
    if !names.is_empty() {
        m.set(
            "tokenizer.chat_templates",
            Value::Array(Array::String(names)),
        );
    }
    if let Some(d) = default {
        m.set("tokenizer.chat_template", Value::String(d));
    }
    Ok(())
}

/// Special token contents from `tokenizer_config.json`.
struct SpecialContents {
    has_config: bool,
    bos: Option<String>,
    cls: Option<String>,
    eos: Option<String>,
    sep: Option<String>,
}

/// `add_{bos,eos,sep}_token` from a `TemplateProcessing` post-processor, as `SpecialVocab`
/// reads it: the single template's first and last special tokens, and the pair template's
/// middle (`A [sep] [eos] B`).
fn template_processing(p: &Json, known: &SpecialContents) -> Vec<(&'static str, bool)> {
    let special = |e: &Json| {
        e.pointer("/SpecialToken/id")
            .and_then(Json::as_str)
            .map(str::to_string)
    };
    let sequence = |e: &Json| {
        e.pointer("/Sequence/id")
            .and_then(Json::as_str)
            .map(str::to_string)
    };
    let list = |k: &str| {
        p.get(k)
            .and_then(Json::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let (single, pair) = (list("single"), list("pair"));
    let mut out = Vec::new();
    let (mut first, mut last) = (None, None);
    if single.len() > 1 {
        first = special(&single[0]);
        if let Some(f) = &first {
            let is_bos =
                !known.has_config || known.bos.as_ref() == Some(f) || known.cls.as_ref() == Some(f);
            out.push(("bos", is_bos));
        }
        last = special(single.last().unwrap());
        if let Some(l) = &last {
            out.push(("eos", !known.has_config || known.eos.as_ref() == Some(l)));
        }
    }
    if pair.is_empty() {
        return out;
    }
    let start = usize::from(first.is_some() && special(&pair[0]) == first);
    let stop = if last.is_some() && special(pair.last().unwrap()) == last {
        pair.len() - 1
    } else {
        pair.len()
    };
    let middle = pair.get(start..stop).unwrap_or_default();
    if middle.len() < 3
        || sequence(&middle[0]).as_deref() != Some("A")
        || sequence(middle.last().unwrap()).as_deref() != Some("B")
    {
        return out;
    }
    let between = &middle[1..middle.len() - 1];
    let is_sep = |e: &Json| {
        special(e).is_some_and(|s| Some(&s) == known.sep.as_ref() || Some(&s) == known.eos.as_ref())
    };
    let mut add_sep = is_sep(&between[0]) && last.is_none();
    if between.len() == 2 && is_sep(&between[1]) {
        add_sep = true;
    }
    out.push(("sep", add_sep));
    out
}

/// `SpecialVocab`'s chat template: `tokenizer_config.json`'s `chat_template` when it has the
/// key (null: none), else `chat_template.jinja` (with `additional_chat_templates/*.jinja` as
/// named ones, sorted by name), else `chat_template.json`'s. Nothing without a tokenizer config
/// (an empty one included). A value that is neither a string, a list nor null is an error
/// naming the file (gguf-py drops it with a warning, leaving a model without its template).
fn chat_template(
    dir: &Path,
    tc: Option<&Map<String, Json>>,
    tc_path: &Path,
) -> Result<Option<ChatTemplate>> {
    let Some(tc) = tc.filter(|tc| !tc.is_empty()) else {
        return Ok(None);
    };
    let of = |v: &Json, path: &Path| match v {
        Json::String(s) => Ok(Some(ChatTemplate::One(s.clone()))),
        Json::Array(a) => Ok(Some(ChatTemplate::Named(a.clone()))),
        Json::Null => Ok(None),
        other => Err(tok_err(
            path,
            format!("chat_template is {other}, neither a string nor a list of named templates"),
        )),
    };
    if let Some(v) = tc.get("chat_template") {
        return of(v, tc_path);
    }
    let jinja: PathBuf = dir.join("chat_template.jinja");
    match crate::sys::read_regular_to_string(&jinja) {
        Ok(s) => return additional_templates(dir, s).map(Some),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&jinja, e)),
        Err(_) => {}
    }
    let json = dir.join("chat_template.json");
    match read_json(&json)?
        .as_ref()
        .and_then(|j| j.get("chat_template"))
    {
        Some(v) => of(v, &json),
        None => Ok(None),
    }
}

/// `chat_template.jinja` (text `default`) with the templates of
/// `additional_chat_templates/*.jinja`, named by file stem, when there are any.
fn additional_templates(dir: &Path, default: String) -> Result<ChatTemplate> {
    let extra = dir.join("additional_chat_templates");
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&extra) {
        Ok(rd) => rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "jinja") && p.is_file())
            .collect(),
        Err(_) => Vec::new(),
    };
    if files.is_empty() {
        return Ok(ChatTemplate::One(default));
    }
    files.sort();
    let mut list = vec![serde_json::json!({"name": "default", "template": default})];
    for f in files {
        let text = crate::sys::read_regular_to_string(&f).map_err(|e| Error::io(&f, e))?;
        let name = f.file_stem().map(|s| s.to_string_lossy().into_owned());
        list.push(serde_json::json!({"name": name, "template": text}));
    }
    Ok(ChatTemplate::Named(list))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_hashes_resolve_to_the_last_entry_like_the_converter() {
        assert_eq!(
            pre_for_hash("0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f"),
            Some("jina-v2-en")
        );
        assert_eq!(pre_for_hash("00"), None);
    }

    #[test]
    fn special_looking_tokens() {
        assert!(looks_special("<|im_start|>"));
        assert!(looks_special("<｜begin▁of▁sentence｜>"));
        assert!(!looks_special("hello"));
    }
}
