//! SentencePiece vocabularies (`tokenizer.model`, as Llama 2, Gemma and Phi-3 ship them), as
//! the converter's `_create_vocab_sentencepiece` (and Phi-3's own copy of it) +
//! `gguf.SpecialVocab` write them: `tokenizer.ggml.model = llama`, `pre = default`, every
//! piece with its score and type, then the added tokens of `added_tokens.json` and
//! `tokenizer_config.json` (and, for Phi-3, `tokenizer.json`) over them.
//!
//! `tokenizer.model` is a `sentencepiece_model.proto` `ModelProto`; only its `pieces` (field 1:
//! `piece` string 1, `score` float 2, `type` enum 3) matter here, so the two messages below are
//! written by hand for `prost` (the maintained Rust protobuf runtime; its derive needs no
//! `protoc` or build script) and every other field is skipped as unknown. The trainer and
//! normaliser specs are llama.cpp's business at run time, not the GGUF's.

use std::collections::HashSet;
use std::path::Path;

use prost::Message;
use serde_json::Value as Json;

use super::kv::{Array, Metadata, Value};
use super::tokenizer::{looks_special, read_json, special_vocab, tok_err, token_type};
use crate::error::{Error, Result};

/// `sentencepiece_model.proto`'s `ModelProto`, pieces only.
#[derive(Clone, PartialEq, Message)]
struct ModelProto {
    #[prost(message, repeated, tag = "1")]
    pieces: Vec<PieceProto>,
}

/// `ModelProto.SentencePiece`; `type` defaults to `NORMAL` (1), `score` to 0.
#[derive(Clone, PartialEq, Message)]
struct PieceProto {
    #[prost(string, optional, tag = "1")]
    piece: Option<String>,
    #[prost(float, optional, tag = "2")]
    score: Option<f32>,
    #[prost(int32, optional, tag = "3")]
    kind: Option<i32>,
}

/// `SentencePiece.Type`: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6.
const PIECE_UNKNOWN: i32 = 2;
const PIECE_USER_DEFINED: i32 = 4;
const PIECE_BYTE: i32 = 6;

/// Which copy of the converter's SentencePiece reader an architecture takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpmRules {
    /// `TextModel._create_vocab_sentencepiece` (Llama, Mistral, Granite, Gemma 2/3): ids past
    /// `vocab_size` are dropped, `added_tokens_decoder` entries that do not look special
    /// become user-defined with `▁` read as a space.
    Converter,
    /// `Phi3MiniModel.set_vocab`: `added_tokens_decoder` and `tokenizer.json`'s
    /// `added_tokens` taken as they are (special → control, else user-defined); an id past
    /// `vocab_size` makes the reference fail, so it is refused here.
    Phi3,
}

/// One piece of `tokenizer.model`: text, score and proto type.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub text: String,
    pub score: f32,
    pub kind: i32,
}

/// The pieces of a `tokenizer.model`, in id order. A file that is not a SentencePiece model
/// (undecodable, no pieces, a piece type outside 1–6, a repeated piece, no `<unk>`: what
/// `SentencePieceProcessor.Load` also refuses) is an error naming it.
pub fn load_pieces(path: &Path) -> Result<Vec<Piece>> {
    let bytes = crate::sys::read_regular(path).map_err(|e| Error::io(path, e))?;
    let model = ModelProto::decode(bytes.as_slice())
        .map_err(|e| tok_err(path, format!("not a SentencePiece model: {e}")))?;
    if model.pieces.is_empty() {
        return Err(tok_err(path, "a SentencePiece model without pieces"));
    }
    let mut seen = HashSet::new();
    let mut pieces = Vec::with_capacity(model.pieces.len());
    for (id, p) in model.pieces.into_iter().enumerate() {
        let text = p.piece.unwrap_or_default();
        let kind = p.kind.unwrap_or(1);
        if !(1..=PIECE_BYTE).contains(&kind) {
            return Err(tok_err(
                path,
                format!("piece {id} `{text}` has the unknown type {kind}"),
            ));
        }
        if !seen.insert(text.clone()) {
            return Err(tok_err(path, format!("piece {id} `{text}` is a repeat")));
        }
        pieces.push(Piece {
            text,
            score: p.score.unwrap_or(0.0),
            kind,
        });
    }
    if !pieces.iter().any(|p| p.kind == PIECE_UNKNOWN) {
        return Err(tok_err(path, "no piece is the unknown token (`<unk>`)"));
    }
    Ok(pieces)
}

/// Token type the converter gives a piece: `IsUnknown`, `IsControl`, `IsUnused`, `IsByte`,
/// else normal (user-defined pieces included).
fn piece_token_type(kind: i32) -> i32 {
    match kind {
        PIECE_USER_DEFINED => token_type::NORMAL,
        k => k,
    }
}

/// Tokens, scores and types as the reference builds them.
struct Vocab {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
}

impl Vocab {
    fn set(&mut self, id: usize, token: String, score: f32, ty: i32) {
        self.tokens[id] = token;
        self.scores[id] = score;
        self.types[id] = ty;
    }
}

/// Score the converter gives added tokens.
const ADDED_SCORE: f32 = -1000.0;
/// Score of ids no piece fills.
const PAD_SCORE: f32 = -10000.0;

/// Tokenizer KVs of a SentencePiece model directory. `vocab_size` is the config's (the
/// number of pieces when it has none).
pub fn spm_vocab_kvs(dir: &Path, vocab_size: Option<u64>, rules: SpmRules) -> Result<Metadata> {
    let path = dir.join("tokenizer.model");
    if !path.exists() {
        return Err(tok_err(
            &path,
            "missing: this model's GGUF vocabulary is its SentencePiece tokenizer.model",
        ));
    }
    let pieces = load_pieces(&path)?;
    let n = vocab_size.filter(|&v| v > 0).unwrap_or(pieces.len() as u64) as usize;
    if rules == SpmRules::Phi3 && pieces.len() > n {
        return Err(tok_err(
            &path,
            format!("{} pieces but vocab_size is {n}", pieces.len()),
        ));
    }
    let mut v = Vocab {
        tokens: (0..n).map(|i| format!("[PAD{i}]")).collect(),
        scores: vec![PAD_SCORE; n],
        types: vec![token_type::UNUSED; n],
    };
    for (id, p) in pieces.iter().enumerate().take(n) {
        v.set(id, p.text.clone(), p.score, piece_token_type(p.kind));
    }
    added_tokens_json(dir, n, &mut v)?;
    added_tokens_decoder(dir, n, rules, &mut v)?;
    if rules == SpmRules::Phi3 {
        tokenizer_json_added(dir, n, &mut v)?;
    }

    let mut m = Metadata::new();
    m.set("tokenizer.ggml.model", Value::String("llama".into()));
    m.set("tokenizer.ggml.pre", Value::String("default".into()));
    m.set(
        "tokenizer.ggml.tokens",
        Value::Array(Array::String(v.tokens)),
    );
    m.set("tokenizer.ggml.scores", Value::Array(Array::F32(v.scores)));
    m.set(
        "tokenizer.ggml.token_type",
        Value::Array(Array::I32(v.types)),
    );
    special_vocab(dir, &dir.join("tokenizer.json"), n as u64, false, &mut m)?;
    Ok(m)
}

/// An added token's id as a vocabulary index: ids at or past `n` are skipped (`Ok(None)`)
/// unless `strict`, where the reference would fail on them; a negative or non-integer id
/// (Python would index from the end, or fail) is refused.
fn token_index(
    path: &Path,
    what: &str,
    id: &Json,
    n: usize,
    strict: bool,
) -> Result<Option<usize>> {
    let i = id
        .as_u64()
        .or_else(|| id.as_str().and_then(|s| s.parse().ok()))
        .ok_or_else(|| tok_err(path, format!("{what} has the id {id}, not a token id")))?;
    match usize::try_from(i).ok().filter(|&i| i < n) {
        Some(i) => Ok(Some(i)),
        None if strict => Err(tok_err(
            path,
            format!("{what} has the id {i}, past vocab_size {n}"),
        )),
        None => Ok(None),
    }
}

/// `added_tokens.json`: `{"token": id}`, each user-defined.
fn added_tokens_json(dir: &Path, n: usize, v: &mut Vocab) -> Result<()> {
    let path = dir.join("added_tokens.json");
    let Some(json) = read_json(&path)? else {
        return Ok(());
    };
    let obj = json
        .as_object()
        .ok_or_else(|| tok_err(&path, "not a JSON object of token → id"))?;
    for (token, id) in obj {
        if !id.is_u64() {
            return Err(tok_err(&path, format!("`{token}` has the id {id}")));
        }
        if let Some(i) = token_index(&path, &format!("`{token}`"), id, n, false)? {
            v.set(i, token.clone(), ADDED_SCORE, token_type::USER_DEFINED);
        }
    }
    Ok(())
}

/// `tokenizer_config.json`'s `added_tokens_decoder`: `{"id": {"content", "special"}}`.
fn added_tokens_decoder(dir: &Path, n: usize, rules: SpmRules, v: &mut Vocab) -> Result<()> {
    let path = dir.join("tokenizer_config.json");
    let Some(tc) = read_json(&path)? else {
        return Ok(());
    };
    let Some(decoder) = tc.get("added_tokens_decoder").filter(|d| !d.is_null()) else {
        return Ok(());
    };
    let decoder = decoder
        .as_object()
        .ok_or_else(|| tok_err(&path, "`added_tokens_decoder` is not an object"))?;
    for (id, data) in decoder {
        let what = format!("added_tokens_decoder entry {id}");
        let strict = rules == SpmRules::Phi3;
        let Some(i) = token_index(&path, &what, &Json::from(id.as_str()), n, strict)? else {
            continue;
        };
        let content = added_content(&path, &what, data)?;
        let special = data.get("special").and_then(Json::as_bool) == Some(true);
        let (token, ty) = match rules {
            SpmRules::Converter if special || looks_special(content) => {
                (content.to_string(), token_type::CONTROL)
            }
            SpmRules::Converter => (content.replace('\u{2581}', " "), token_type::USER_DEFINED),
            SpmRules::Phi3 if special => (content.to_string(), token_type::CONTROL),
            SpmRules::Phi3 => (content.to_string(), token_type::USER_DEFINED),
        };
        v.set(i, token, ADDED_SCORE, ty);
    }
    Ok(())
}

fn added_content<'a>(path: &Path, what: &str, data: &'a Json) -> Result<&'a str> {
    data.get("content")
        .and_then(Json::as_str)
        .ok_or_else(|| tok_err(path, format!("{what} has no `content` string")))
}

/// Phi-3: `tokenizer.json`'s `added_tokens`, as `added_tokens_decoder`.
fn tokenizer_json_added(dir: &Path, n: usize, v: &mut Vocab) -> Result<()> {
    let path = dir.join("tokenizer.json");
    let Some(tj) = read_json(&path)? else {
        return Ok(());
    };
    let list = tj
        .get("added_tokens")
        .and_then(Json::as_array)
        .cloned()
        .unwrap_or_default();
    for (k, data) in list.iter().enumerate() {
        let what = format!("added_tokens entry {k}");
        let id = data.get("id").unwrap_or(&Json::Null);
        let i = token_index(&path, &what, id, n, true)?.expect("strict");
        let content = added_content(&path, &what, data)?;
        let special = data.get("special").and_then(Json::as_bool) == Some(true);
        let ty = if special {
            token_type::CONTROL
        } else {
            token_type::USER_DEFINED
        };
        v.set(i, content.to_string(), ADDED_SCORE, ty);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(pieces: &[(&str, f32, i32)]) -> Vec<u8> {
        ModelProto {
            pieces: pieces
                .iter()
                .map(|(t, s, k)| PieceProto {
                    piece: Some(t.to_string()),
                    score: Some(*s),
                    kind: Some(*k),
                })
                .collect(),
        }
        .encode_to_vec()
    }

    fn write(dir: &Path, pieces: &[(&str, f32, i32)]) -> std::path::PathBuf {
        let p = dir.join("tokenizer.model");
        std::fs::write(&p, encode(pieces)).unwrap();
        p
    }

    #[test]
    fn pieces_keep_scores_and_user_defined_pieces_are_normal_tokens() {
        let d = tempfile::tempdir().unwrap();
        let pieces = [
            ("<unk>", 0.0, 2),
            ("<s>", 0.0, 3),
            ("<0x41>", 0.0, 6),
            ("<mine>", 0.0, 4),
            ("\u{2581}a", -1.5, 1),
        ];
        write(d.path(), &pieces);
        let m = spm_vocab_kvs(d.path(), Some(7), SpmRules::Converter).unwrap();
        let Some(Value::Array(Array::String(tokens))) = m.get("tokenizer.ggml.tokens") else {
            panic!("no tokens")
        };
        assert_eq!(
            tokens,
            &[
                "<unk>",
                "<s>",
                "<0x41>",
                "<mine>",
                "\u{2581}a",
                "[PAD5]",
                "[PAD6]"
            ]
        );
        let Some(Value::Array(Array::I32(types))) = m.get("tokenizer.ggml.token_type") else {
            panic!("no types")
        };
        assert_eq!(types, &[2, 3, 6, 1, 1, 5, 5]);
        let Some(Value::Array(Array::F32(scores))) = m.get("tokenizer.ggml.scores") else {
            panic!("no scores")
        };
        assert_eq!(scores, &[0.0, 0.0, 0.0, 0.0, -1.5, -10000.0, -10000.0]);
    }

    #[test]
    fn added_tokens_json_and_decoder_override_pieces_past_vocab_size_skipped() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            &[("<unk>", 0.0, 2), ("a", -1.0, 1), ("b", -2.0, 1)],
        );
        std::fs::write(
            d.path().join("added_tokens.json"),
            r#"{"<x>": 1, "<far>": 9}"#,
        )
        .unwrap();
        std::fs::write(
            d.path().join("tokenizer_config.json"),
            r#"{"added_tokens_decoder": {"2": {"content": "\u2581\u2581", "special": false},
                "0": {"content": "<unk>", "special": true}}}"#,
        )
        .unwrap();
        let m = spm_vocab_kvs(d.path(), None, SpmRules::Converter).unwrap();
        let Some(Value::Array(Array::String(tokens))) = m.get("tokenizer.ggml.tokens") else {
            panic!()
        };
        assert_eq!(tokens, &["<unk>", "<x>", "  "]);
        let Some(Value::Array(Array::I32(types))) = m.get("tokenizer.ggml.token_type") else {
            panic!()
        };
        assert_eq!(types, &[3, 4, 4]);
        // Phi-3's reader fails on an id past the vocabulary, so it is refused by name.
        std::fs::write(
            d.path().join("tokenizer_config.json"),
            r#"{"added_tokens_decoder": {"5": {"content": "<y>", "special": true}}}"#,
        )
        .unwrap();
        let err = spm_vocab_kvs(d.path(), None, SpmRules::Phi3)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tokenizer_config.json")
                && err.contains("added_tokens_decoder entry 5 has the id 5, past vocab_size 3"),
            "{err}"
        );
    }

    #[test]
    fn files_that_are_not_sentencepiece_models_are_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("tokenizer.model");
        for (bytes, want) in [
            (b"\x0a\xff\xff".to_vec(), "not a SentencePiece model"),
            (Vec::new(), "without pieces"),
            (
                encode(&[("<unk>", 0.0, 2), ("a", 0.0, 9)]),
                "piece 1 `a` has the unknown type 9",
            ),
            (
                encode(&[("<unk>", 0.0, 2), ("a", 0.0, 1), ("a", 0.0, 1)]),
                "piece 2 `a` is a repeat",
            ),
            (encode(&[("a", 0.0, 1)]), "no piece is the unknown token"),
        ] {
            std::fs::write(&p, bytes).unwrap();
            let err = load_pieces(&p).unwrap_err().to_string();
            assert!(
                err.contains("tokenizer.model") && err.contains(want),
                "{err}"
            );
        }
        std::fs::remove_file(&p).unwrap();
        let err = spm_vocab_kvs(d.path(), None, SpmRules::Converter)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tokenizer.model") && err.contains("missing"),
            "{err}"
        );
    }
}
