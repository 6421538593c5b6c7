//! Output formats. A sink plans where the plan's tensors go — which files, in which order, at
//! which offsets, behind which header bytes — from the plan and the input headers alone, before
//! any data moves; the pipeline's writer then only writes ranges at offsets. Extent sharing is
//! a property of the layout: a copied tensor placed at an offset congruent with its source
//! offset modulo [`CLONE_ALIGN_BYTES`] can be cloned instead of copied, whatever the format.
//!
//! `safetensors` writes shards and their index; `gguf` writes GGUF v3 for llama.cpp (its own
//! layout planner, `gguf::layout`, keeps every tensor at the 32-byte alignment llama.cpp needs).

pub mod gguf;
pub mod safetensors;

use std::path::PathBuf;

use crate::error::Result;
use crate::format::checkpoint::Checkpoint;
use crate::plan::{Plan, Recipe, Step};

pub use safetensors::Safetensors;

/// 4 KiB: the block size of XFS, ext4 and btrfs, the unit reflinks share.
pub const CLONE_ALIGN_BYTES: u64 = 4096;

pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5 << 30;

/// An output format.
pub trait Sink: Send + Sync + std::fmt::Debug {
    /// Plan steps the format itself applies after the job's own (GGUF: every tensor's name,
    /// type and transform), planned from the checkpoint's headers and small files.
    fn steps(&self, _ckpt: &Checkpoint) -> Result<Vec<Step>> {
        Ok(Vec::new())
    }
    /// Lays out `plan`'s tensors in files; the result depends only on the inputs and the
    /// arguments, never on the filesystem. `sharing`: unchanged tensors will probably share
    /// extents with the input, so a format with padding to spare may place them congruently.
    fn layout(&self, ckpt: &Checkpoint, plan: &Plan, sharing: bool) -> Result<Layout>;
    /// Whether the model's side files (config, tokenizer, …) go beside the output files.
    fn copies_side_files(&self) -> bool {
        true
    }
}

#[derive(Clone, Debug)]
pub struct OutShard {
    pub file_name: String,
    /// Serialised header including the 8-byte length prefix.
    pub header: Vec<u8>,
    /// Indices into `Plan::tensors`, in file order.
    pub tensors: Vec<usize>,
    /// Absolute file offset of each tensor in `tensors`.
    pub offsets: Vec<u64>,
    pub len: u64,
    /// Set when the shard is byte for byte a whole input shard (same header, same data), which
    /// is then cloned or copied as one range.
    pub clone_from: Option<usize>,
}

#[derive(Clone, Debug)]
pub enum OutputKind {
    Dir,
    File,
}

/// The output files of a run, as a sink planned them.
#[derive(Debug)]
pub struct Layout {
    pub kind: OutputKind,
    pub shards: Vec<OutShard>,
}

impl Layout {
    pub fn total_file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.len).sum()
    }

    /// Bytes of every file's header, held for the whole run.
    pub fn header_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.header.len() as u64).sum()
    }

    /// Untouched bytes whose input and output offsets are congruent modulo the clone alignment,
    /// block-aligned part only: what a reflink-capable filesystem can share.
    pub fn shareable_bytes(&self, ckpt: &Checkpoint, plan: &Plan) -> u64 {
        let a = CLONE_ALIGN_BYTES;
        let aligned_middle = |src: u64, len: u64| {
            let head = (a - src % a) % a;
            len.saturating_sub(head) / a * a
        };
        let mut total = 0;
        for shard in &self.shards {
            if shard.clone_from.is_some() {
                total += aligned_middle(0, shard.len);
                continue;
            }
            for (&t, &dst) in shard.tensors.iter().zip(&shard.offsets) {
                if let Recipe::Copy { src } = plan.tensors[t].recipe {
                    let Some((_, src_off)) = ckpt.tensors[src].contiguous() else {
                        continue;
                    };
                    if src_off % a == dst % a {
                        total += aligned_middle(src_off, plan.tensors[t].nbytes);
                    }
                }
            }
        }
        total
    }

    /// Whether the output has an index file besides its shards.
    pub fn has_index(&self) -> bool {
        self.shards.len() >= 2 && matches!(self.kind, OutputKind::Dir)
    }

    /// `model.safetensors.index.json` content, for directory outputs with several shards:
    /// names sorted, pretty-printed as `serde_json` would, written straight to text (a value
    /// tree of a million entries would cost ~150 MB).
    pub fn index_json(&self, plan: &Plan) -> Option<String> {
        if !self.has_index() {
            return None;
        }
        let names: Vec<(&str, &str)> = self
            .shards
            .iter()
            .flat_map(|s| {
                s.tensors
                    .iter()
                    .map(move |&t| (plan.tensors[t].name.as_str(), s.file_name.as_str()))
            })
            .collect();
        Some(index_text(names, plan.total_tensor_bytes()))
    }
}

/// Index text for (tensor, file) pairs totalling `total_size` tensor bytes.
pub fn index_text(mut names: Vec<(&str, &str)>, total_size: u64) -> String {
    names.sort();
    let quoted = |s: &str| serde_json::to_string(s).expect("a string");
    let mut out = format!(
        "{{\n  \"metadata\": {{\n    \"total_size\": {total_size}\n  }},\n  \"weight_map\": {{"
    );
    for (k, (t, f)) in names.iter().enumerate() {
        let sep = if k == 0 { "" } else { "," };
        out.push_str(&format!("{sep}\n    {}: {}", quoted(t), quoted(f)));
    }
    out.push_str(if names.is_empty() {
        "}\n}\n"
    } else {
        "\n  }\n}\n"
    });
    out
}

/// Where the output goes, as the user wrote it.
pub fn output_kind_for(path: &std::path::Path) -> OutputKind {
    if path.extension().is_some_and(|e| e == "safetensors") {
        OutputKind::File
    } else {
        OutputKind::Dir
    }
}

/// Directory that will hold the output files.
pub fn output_dir(path: &std::path::Path, kind: &OutputKind) -> PathBuf {
    match kind {
        OutputKind::Dir => path.to_path_buf(),
        OutputKind::File => match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dtype::DType;
    use crate::plan::{PlanNotes, PlannedTensor};
    use serde_json::{Map, Value};

    /// The index as `serde_json` pretty-prints the equivalent object, the reference for
    /// [`Layout::index_json`].
    fn index_json_via_value(names: &[(&str, &str)], total: u64) -> String {
        let mut names = names.to_vec();
        names.sort();
        let mut map = Map::new();
        for (t, f) in names {
            map.insert(t.into(), Value::from(f));
        }
        let mut meta = Map::new();
        meta.insert("total_size".into(), Value::from(total));
        let mut root = Map::new();
        root.insert("metadata".into(), Value::Object(meta));
        root.insert("weight_map".into(), Value::Object(map));
        let mut s = serde_json::to_string_pretty(&Value::Object(root)).expect("plain JSON");
        s.push('\n');
        s
    }

    fn planned(name: &str) -> PlannedTensor {
        PlannedTensor {
            name: name.into(),
            source_index: 0,
            dtype: DType::U8,
            shape: vec![3],
            nbytes: 3,
            recipe: Recipe::Copy { src: 0 },
        }
    }

    #[test]
    fn index_json_is_what_serde_json_pretty_prints() {
        let names = ["b", "a \"q\" \\ \u{1}é", "c"];
        let shard = |file: &str, tensors: Vec<usize>| OutShard {
            file_name: file.into(),
            header: Vec::new(),
            offsets: vec![0; tensors.len()],
            tensors,
            len: 0,
            clone_from: None,
        };
        let plan = Plan {
            tensors: names.iter().map(|n| planned(n)).collect(),
            dropped: Vec::new(),
            renamed: 0,
            config: None,
            config_changes: Vec::new(),
            notes: PlanNotes::default(),
            nothing_to_do: None,
            dropped_side_files: Vec::new(),
            generated_files: Vec::new(),
        };
        let want = index_json_via_value(&[("b", "s1"), ("c", "s1"), (names[1], "s\"2")], 9);
        let layout = Layout {
            kind: OutputKind::Dir,
            shards: vec![shard("s1", vec![0, 2]), shard("s\"2", vec![1])],
        };
        assert_eq!(layout.index_json(&plan).unwrap(), want);
    }
}
