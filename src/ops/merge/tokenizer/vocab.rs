//! The output vocabulary and tokenizer files (mergekit's `build_tokenizer`), from each model's
//! `tokenizer.json` as the `tokenizers` library reads it: the model's vocabulary with the
//! added tokens over it; a token added to a tokenizer takes its existing id, else the next id
//! past both the model's vocabulary and the added tokens (`AddedVocabulary::add_tokens`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{EmbedSource, TokenRef, TokenSetting, TokenizerConfig};
use crate::ops::merge::config::TokenizerSource;

/// Names of the tensors whose first axis is the vocabulary, in the architectures mergekit
/// 0.1.5 defines (`vocabulary_axis: 0` in `_data/architectures/*.json`).
pub const VOCAB_TENSORS: &[&str] = &[
    "backbone.embeddings.weight",
    "bert.embeddings.word_embeddings.weight",
    "cls.predictions.bias",
    "cls.predictions.decoder.weight",
    "decoder.embed_tokens.weight",
    "distilbert.embeddings.word_embeddings.weight",
    "embed_out.weight",
    "embed_tokens.weight",
    "embeddings.word_embeddings.weight",
    "encoder.embed_tokens.weight",
    "gpt_neox.embed_in.weight",
    "layers.0.wte.weight",
    "lm_head.bias",
    "lm_head.decoder.weight",
    "lm_head.linear.bias",
    "lm_head.linear.weight",
    "lm_head.weight",
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "model.tok_embeddings.weight",
    "output.weight",
    "roberta.embeddings.word_embeddings.weight",
    "shared.weight",
    "transformer.embd.wte.weight",
    "transformer.embedding.word_embeddings.weight",
    "transformer.output_layer.weight",
    "transformer.word_embeddings.weight",
    "transformer.wte.weight",
    "vocab_projector.bias",
    "vocab_projector.weight",
];

/// A model's tokenizer, read from its `tokenizer.json`.
#[derive(Debug)]
struct Tokenizer {
    file: PathBuf,
    json: Map<String, Value>,
    /// The model's own vocabulary size (`Model::get_vocab_size`).
    model_size: u64,
    /// Every token's id, added tokens over the model's vocabulary.
    vocab: HashMap<String, u64>,
    /// `added_tokens`, by id.
    added: BTreeMap<u64, Value>,
    /// Each added token's settings ([`settings_key`]), to find an identical one at once.
    added_keys: HashSet<String>,
    /// Whether a token was added since it was read.
    changed: bool,
}

/// The folder a model's side files are in.
pub(crate) fn model_dir(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent().map(Path::to_path_buf).unwrap_or_default()
    }
}

impl Tokenizer {
    fn read(model: &Path) -> Result<Tokenizer, String> {
        let file = model_dir(model).join("tokenizer.json");
        let text = std::fs::read_to_string(&file).map_err(|e| {
            format!(
                "the tokenizer of model {} cannot be read ({}: {e}); a merged vocabulary needs each model's tokenizer.json",
                model.display(),
                file.display()
            )
        })?;
        let bad = |what: &str| format!("{}: {what}", file.display());
        let json: Map<String, Value> =
            serde_json::from_str(&text).map_err(|e| bad(&format!("not a tokenizer: {e}")))?;
        let m = json
            .get("model")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("no `model`"))?;
        let mut vocab: HashMap<String, u64> = HashMap::new();
        match (m.get("type").and_then(Value::as_str), m.get("vocab")) {
            (Some("BPE" | "WordLevel" | "WordPiece") | None, Some(Value::Object(v))) => {
                for (tok, id) in v {
                    let id = id
                        .as_u64()
                        .ok_or_else(|| bad(&format!("token {tok:?} has no id")))?;
                    vocab.insert(tok.clone(), id);
                }
            }
            (Some("Unigram") | None, Some(Value::Array(v))) => {
                for (id, e) in v.iter().enumerate() {
                    let tok = e
                        .get(0)
                        .and_then(Value::as_str)
                        .ok_or_else(|| bad("a Unigram piece is not [text, score]"))?;
                    vocab.entry(tok.to_string()).or_insert(id as u64);
                }
            }
            (t, _) => {
                return Err(bad(&format!(
                "tokenizer model `{}` is not one tftf reads (BPE, WordLevel, WordPiece, Unigram)",
                t.unwrap_or("(no type)")
            )))
            }
        }
        let model_size = vocab.len() as u64;
        let mut added = BTreeMap::new();
        for e in json
            .get("added_tokens")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let (Some(id), Some(content)) = (
                e.get("id").and_then(Value::as_u64),
                e.get("content").and_then(Value::as_str),
            ) else {
                return Err(bad("an added token without `id` or `content`"));
            };
            vocab.insert(content.to_string(), id);
            added.insert(id, e.clone());
        }
        let added_keys = added.values().map(settings_key).collect();
        Ok(Tokenizer {
            file,
            json,
            model_size,
            vocab,
            added,
            added_keys,
            changed: false,
        })
    }

    /// Tokens by id, each once (its id in `vocab`).
    fn by_id(&self) -> Vec<(&str, u64)> {
        let mut v: Vec<(&str, u64)> = self.vocab.iter().map(|(t, &i)| (t.as_str(), i)).collect();
        v.sort_unstable_by(|a, b| (a.1, a.0).cmp(&(b.1, b.0)));
        v
    }

    /// `tokenizers`' `add_tokens` for one token: an identical entry is kept; otherwise the
    /// token takes its existing id or the next free one, with `entry`'s settings. Constant
    /// time per token (`tokenizers` scans every added token: quadratic for a large union).
    fn add(&mut self, content: &str, mut entry: Value) {
        if content.is_empty() || !self.added_keys.insert(settings_key(&entry)) {
            return;
        }
        let id = self.vocab.get(content).copied().unwrap_or_else(|| {
            let next = self.added.keys().next_back().map_or(0, |m| m + 1);
            next.max(self.model_size)
        });
        if let Some(o) = entry.as_object_mut() {
            let mut with_id = Map::new();
            with_id.insert("id".into(), Value::from(id));
            with_id.extend(
                o.iter()
                    .filter(|(k, _)| *k != "id")
                    .map(|(k, v)| (k.clone(), v.clone())),
            );
            *o = with_id;
        }
        self.vocab.insert(content.to_string(), id);
        if let Some(old) = self.added.insert(id, entry) {
            // The token's earlier settings, replaced (as `tokenizers` replaces them).
            self.added_keys.remove(&settings_key(&old));
        }
        self.changed = true;
    }

    /// The `tokenizer.json` text with the added tokens as they now are (in `added_tokens`'
    /// place, else last), serialised from the values held: no copy of a large vocabulary.
    fn to_json(&self) -> String {
        serde_json::to_string_pretty(&TokenizerJson(self)).expect("JSON values serialise")
    }
}

/// A [`Tokenizer`]'s JSON with its current `added_tokens`.
struct TokenizerJson<'a>(&'a Tokenizer);

impl serde::Serialize for TokenizerJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let t = self.0;
        let has = t.json.contains_key("added_tokens");
        let mut m = s.serialize_map(Some(t.json.len() + usize::from(!has)))?;
        for (k, v) in &t.json {
            if k == "added_tokens" {
                m.serialize_entry(k, &AddedTokens(&t.added))?;
            } else {
                m.serialize_entry(k, v)?;
            }
        }
        if !has {
            m.serialize_entry("added_tokens", &AddedTokens(&t.added))?;
        }
        m.end()
    }
}

/// `added_tokens` by id, as a JSON array.
struct AddedTokens<'a>(&'a BTreeMap<u64, Value>);

impl serde::Serialize for AddedTokens<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.values())
    }
}

/// An added token's entry without its id (`AddedToken`'s fields, which its equality
/// compares), as text with the fields in name order.
fn settings_key(e: &Value) -> String {
    let fields: BTreeMap<&String, &Value> = e
        .as_object()
        .map(|o| o.iter().filter(|(k, _)| *k != "id").collect())
        .unwrap_or_default();
    serde_json::to_string(&fields).expect("JSON values serialise")
}

/// A token added by text alone (`add_tokens("tok")`): a normal, not special, token.
fn plain(content: &str) -> Value {
    serde_json::json!({
        "id": 0,
        "content": content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": true,
        "special": false,
    })
}

/// The output vocabulary, each model's rows in it, and the output tokenizer files.
#[derive(Debug)]
pub struct MergedVocab {
    /// Tokens by output id.
    pub tokens: Vec<String>,
    /// Rows of the output's vocabulary tensors (`tokens` padded to `pad_to_multiple_of`).
    pub rows: u64,
    /// Per model: each output token's row in that model, `None` where it lacks the token.
    pub perms: HashMap<PathBuf, Vec<Option<u64>>>,
    /// Per model a `kind: model_token` source names by text: its own vocabulary.
    pub originals: HashMap<PathBuf, HashMap<String, u64>>,
    /// `tokenizer.tokens`, by token.
    pub settings: HashMap<String, TokenSetting>,
    /// Files written beside the model: `tokenizer.json`, `tokenizer_config.json`, …
    pub files: Vec<(String, String)>,
    /// Whether every token of the donor keeps its id (not so for another model's tokenizer).
    pub donor_ids_kept: bool,
}

/// `vocab_size` from a model's `config.json` (or its `text_config`), as mergekit reads it.
pub(crate) fn config_vocab_size(cfg: Option<&Map<String, Value>>) -> Option<u64> {
    let cfg = cfg?;
    cfg.get("vocab_size")
        .and_then(Value::as_u64)
        .or_else(|| cfg.get("text_config")?.get("vocab_size")?.as_u64())
}

/// Sets `vocab_size` in an output `config.json` (in `text_config` when only that has it);
/// returns the change, if any.
pub fn set_vocab_size(cfg: &mut Map<String, Value>, rows: u64) -> Option<String> {
    let nested = !cfg.contains_key("vocab_size")
        && cfg
            .get("text_config")
            .and_then(|t| t.get("vocab_size"))
            .is_some();
    let (target, label) = match cfg.get_mut("text_config").and_then(Value::as_object_mut) {
        Some(t) if nested => (t, "text_config.vocab_size"),
        _ => (cfg, "vocab_size"),
    };
    let new = Value::from(rows);
    match target.insert("vocab_size".into(), new.clone()) {
        Some(o) if o == new => None,
        o => Some(format!(
            "config.json: {label} {} -> {rows}",
            o.map_or_else(|| "(none)".to_string(), |v| v.to_string())
        )),
    }
}

impl MergedVocab {
    /// Builds the output vocabulary from `models` (path and `config.json`, the donor first,
    /// then in the config's order), with `chat_template` for the tokenizer files.
    pub fn build(
        cfg: &TokenizerConfig,
        models: &[(PathBuf, Option<&Map<String, Value>>)],
        chat_template: Option<&str>,
    ) -> Result<MergedVocab, String> {
        let mut toks = Vec::new();
        let mut rows = Vec::new();
        for (path, config) in models {
            let t = Tokenizer::read(path)?;
            rows.push(config_vocab_size(*config).unwrap_or(t.vocab.len() as u64));
            toks.push(t);
        }
        let (donor, donor_rows) = (&toks[0], rows[0]);
        let (mut out, out_dir) = match &cfg.source {
            TokenizerSource::Model(p) => (Tokenizer::read(p)?, model_dir(p)),
            TokenizerSource::Base | TokenizerSource::Union => {
                if let Some((t, id)) = donor.by_id().into_iter().find(|&(_, i)| i >= donor_rows) {
                    return Err(format!(
                        "the tokenizer of {} has token {t:?} at id {id}, past the model's {donor_rows} embedding rows (config.json `vocab_size`); mergekit strips such tokens from BPE tokenizers, tftf does not: remove them from its tokenizer.json",
                        models[0].0.display()
                    ));
                }
                (Tokenizer::read(&models[0].0)?, model_dir(&models[0].0))
            }
        };
        if cfg.source == TokenizerSource::Union {
            union(&mut out, &toks, &rows);
        }
        for (tok, _) in &cfg.tokens {
            if !out.vocab.contains_key(tok) {
                out.add(tok, plain(tok));
            }
        }
        let mut tokens = vec![String::new(); out.vocab.len()];
        for (t, &id) in &out.vocab {
            match tokens.get_mut(id as usize) {
                Some(slot) if slot.is_empty() => *slot = t.clone(),
                _ => {
                    return Err(format!(
                        "{}: token ids are not 0..{} without gaps (token {t:?} has id {id}); mergekit would index past its embedding rows",
                        out.file.display(),
                        out.vocab.len()
                    ))
                }
            }
        }
        let n = tokens.len() as u64;
        let rows_out = match cfg.pad_to_multiple_of {
            Some(m) if !n.is_multiple_of(m) => (n / m + 1) * m,
            _ => n,
        };
        let mut perms = HashMap::new();
        let mut originals = HashMap::new();
        let named: HashSet<&PathBuf> = cfg
            .tokens
            .iter()
            .filter_map(|(_, s)| match &s.source {
                Some(EmbedSource::ModelToken {
                    model,
                    token: TokenRef::Text(_),
                }) => Some(model),
                _ => None,
            })
            .collect();
        for (((path, _), t), &r) in models.iter().zip(&toks).zip(&rows) {
            let p = tokens
                .iter()
                .map(|tok| t.vocab.get(tok).copied().filter(|&i| i < r))
                .collect();
            perms.insert(path.clone(), p);
            if named.contains(path) {
                originals.insert(path.clone(), t.vocab.clone());
            }
        }
        let files = files(&out, &out_dir, chat_template)?;
        Ok(MergedVocab {
            tokens,
            rows: rows_out,
            perms,
            originals,
            settings: cfg.tokens.iter().cloned().collect(),
            files,
            donor_ids_kept: !matches!(cfg.source, TokenizerSource::Model(_)),
        })
    }
}

/// mergekit's `build_union_tokenizer`: every model's tokens below its row count, in model
/// order, then by id; tokens the donor lacks added as plain tokens, then every model's added
/// tokens with their settings (the first model's where they differ).
fn union(out: &mut Tokenizer, toks: &[Tokenizer], rows: &[u64]) {
    let mut seen: HashMap<&str, ()> = HashMap::new();
    let mut order: Vec<&str> = Vec::new();
    let mut added: Vec<(&str, &Value)> = Vec::new();
    let mut added_seen: HashMap<&str, ()> = HashMap::new();
    for (t, &r) in toks.iter().zip(rows) {
        for (tok, id) in t.by_id() {
            if id < r && seen.insert(tok, ()).is_none() {
                order.push(tok);
            }
        }
        for (id, e) in &t.added {
            let content = e.get("content").and_then(Value::as_str).unwrap_or("");
            if *id < r && added_seen.insert(content, ()).is_none() {
                added.push((content, e));
            }
        }
    }
    let donor_vocab = toks[0].vocab.clone();
    for tok in order {
        if !added_seen.contains_key(tok) && !donor_vocab.contains_key(tok) {
            out.add(tok, plain(tok));
        }
    }
    for (content, e) in added {
        out.add(content, e.clone());
    }
}

/// The tokenizer files of the output: `tokenizer.json` (the source's bytes when unchanged),
/// the source's `tokenizer_config.json` and `special_tokens_map.json`, and the chat template
/// (the config's, else the source's `chat_template.jinja`).
fn files(
    out: &Tokenizer,
    dir: &Path,
    chat_template: Option<&str>,
) -> Result<Vec<(String, String)>, String> {
    let read = |name: &str| -> Result<Option<String>, String> {
        let p = dir.join(name);
        match std::fs::read_to_string(&p) {
            Ok(t) => Ok(Some(t)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", p.display())),
        }
    };
    let mut files = Vec::new();
    let json = match read("tokenizer.json")? {
        Some(t) if !out.changed => t,
        _ => out.to_json(),
    };
    files.push(("tokenizer.json".to_string(), json));
    if let Some(mut t) = read("tokenizer_config.json")? {
        if chat_template.is_some() {
            if let Ok(Value::Object(mut m)) = serde_json::from_str::<Value>(&t) {
                if m.remove("chat_template").is_some() {
                    t = serde_json::to_string_pretty(&m).expect("JSON values serialise");
                }
            }
        }
        files.push(("tokenizer_config.json".to_string(), t));
    }
    if let Some(t) = read("special_tokens_map.json")? {
        files.push(("special_tokens_map.json".to_string(), t));
    }
    match chat_template {
        Some(t) => files.push(("chat_template.jinja".to_string(), t.to_string())),
        None => {
            if let Some(t) = read("chat_template.jinja")? {
                files.push(("chat_template.jinja".to_string(), t));
            }
        }
    }
    Ok(files)
}
