//! [`Report`]: what a pipeline run did, as the JSON report `--report` writes, with upstream's
//! `ok` / `summary()` view of it.

use serde_json::Value;

use crate::size::human;

/// The report of a [`crate::Pipeline`] run: the same JSON object `tftf … --report FILE` writes
/// (input, output files, tensors written, copied and computed, ops, warnings, timing).
#[derive(Debug, Clone)]
pub struct Report(Value);

impl Report {
    pub(crate) fn new(json: Value) -> Report {
        Report(json)
    }

    /// Whether the run succeeded (for a dry run: would succeed): no [`Report::problems`].
    pub fn ok(&self) -> bool {
        self.problems().is_empty()
    }

    /// What stopped the run. Only a dry run ([`crate::Writer::null`]) reports a failure here;
    /// other runs return it as the error of [`crate::Pipeline::run`].
    pub fn problems(&self) -> Vec<String> {
        match self.0["status"].as_str() {
            Some("ok") => Vec::new(),
            _ => vec![self.0["error"]
                .as_str()
                .unwrap_or("the run did not finish")
                .to_string()],
        }
    }

    /// Warnings about the input or the plan that did not stop the run.
    pub fn warnings(&self) -> Vec<String> {
        strings(&self.0["warnings"])
    }

    /// A few lines for people: what was (or would be) written, and the result.
    pub fn summary(&self) -> String {
        let r = &self.0;
        let mut lines = Vec::new();
        if r["status"] == "ok" {
            let files = r["output"]["files"].as_array().map_or(0, Vec::len);
            lines.push(format!(
                "{} {} file(s), {} tensors, {} to {}",
                if r["dry_run"] == true {
                    "would write"
                } else {
                    "wrote"
                },
                files,
                tensors_written(r),
                human(r["bytes"]["files"].as_u64().unwrap_or(0)),
                r["output"]["path"].as_str().unwrap_or_default(),
            ));
        }
        for op in r["ops"].as_array().into_iter().flatten() {
            let op_name = op["op"].as_str().unwrap_or_default();
            lines.push(format!("{op_name}: {} tensors", op["tensors"]));
        }
        lines.extend(self.warnings().iter().map(|w| format!("warning: {w}")));
        match self.problems().as_slice() {
            [] => lines.push("result: OK".into()),
            problems => {
                lines.push("result: FAILED".into());
                lines.extend(problems.iter().map(|p| format!("  {p}")));
            }
        }
        lines.join("\n")
    }

    /// The whole report, as `--report` writes it.
    pub fn json(&self) -> &Value {
        &self.0
    }
}

/// Tensors in the output: the safetensors report counts them, a GGUF report lists them per file.
fn tensors_written(r: &Value) -> u64 {
    r["tensors"]["written"].as_u64().unwrap_or_else(|| {
        let files = r["output"]["files"].as_array().into_iter().flatten();
        files.filter_map(|f| f["tensors"].as_u64()).sum()
    })
}

fn strings(v: &Value) -> Vec<String> {
    let items = v.as_array().into_iter().flatten();
    items
        .map(|w| w.as_str().map_or_else(|| w.to_string(), str::to_string))
        .collect()
}
