//! `general.size_label`: the parameter class the converter writes (`8B`, `8x1.2M`), from the
//! output tensors' shapes exactly as gguf-py's `GGUFWriter.get_total_parameter_count` counts
//! them and `gguf.utility.size_label` prints them.
//!
//! A tensor whose name holds `_exps.` with three or more dimensions is per expert: its expert
//! count is its outermost dimension (the second innermost for a bias) and it adds `size / E` to
//! the expert parameters; every other tensor is shared. A mixture of experts is labelled
//! `{E}x{shared + expert}` with `E` the mean expert count, anything else by its total.

use super::recipe::OutputTensor;

/// The label for a model made of `outputs`, or `None` for a model without parameters (the
/// converter then writes no label).
pub fn size_label(outputs: &[OutputTensor]) -> Option<String> {
    let (mut total, mut shared, mut expert) = (0u64, 0u64, 0u64);
    let (mut expert_sum, mut expert_tensors) = (0u64, 0u64);
    for t in outputs {
        let size: u64 = t.shape.iter().product();
        total += size;
        let n = t.shape.len();
        if t.name.contains("_exps.") && n >= 3 {
            let count = t.shape[if t.name.contains(".bias") {
                n - 2
            } else {
                n - 3
            }];
            expert += size.checked_div(count).unwrap_or(0);
            expert_sum += count;
            expert_tensors += 1;
        } else {
            shared += size;
        }
    }
    if total == 0 {
        return None;
    }
    Some(match expert_sum.checked_div(expert_tensors) {
        Some(count) if count > 0 => format!("{count}x{}", rounded(shared + expert)),
        _ => rounded(total),
    })
}

/// `model_weight_count_rounded_notation(n, min_digits=2)`: scaled by a multiply (as Python's
/// `n * 1e-9`), at least two significant digits before the decimal point or after it.
fn rounded(n: u64) -> String {
    let x = n as f64;
    let (scaled, suffix) = if x > 1e12 {
        (x * 1e-12, "T")
    } else if x > 1e9 {
        (x * 1e-9, "B")
    } else if x > 1e6 {
        (x * 1e-6, "M")
    } else {
        (x * 1e-3, "K")
    };
    // `len(str(round(scaled)).lstrip('0'))`: the digits of the rounded integer (none for 0).
    let whole = scaled.round_ties_even() as u64;
    let digits = if whole == 0 {
        0
    } else {
        whole.to_string().len()
    };
    let fix = 2usize.saturating_sub(digits);
    format!("{scaled:.fix$}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gguf::tensor::Recipe;
    use crate::ops::gguf::GgmlType;

    fn t(name: &str, shape: &[u64]) -> OutputTensor {
        OutputTensor::new(
            name,
            shape.to_vec(),
            GgmlType::F32,
            Recipe::Values(Vec::new()),
            None,
        )
    }

    #[test]
    fn rounding_keeps_two_significant_digits_as_gguf_py_does() {
        // Values printed by gguf.utility.model_weight_count_rounded_notation.
        for (n, want) in [
            (0, "0.00K"),
            (512, "0.5K"),
            (9_500, "10K"),
            (99_500, "100K"),
            (1_000_000, "1000K"),
            (1_000_001, "1.0M"),
            (212_032, "212K"),
            (8_030_261_248, "8.0B"),
            (70_553_706_496, "71B"),
            (671_026_419_200, "671B"),
            (1_026_000_000_000, "1.0T"),
        ] {
            assert_eq!(rounded(n), want, "{n}");
        }
    }

    #[test]
    fn experts_are_counted_once_and_labelled_by_their_count() {
        // 8 experts of 3 × (4 × 16) weights and 2 × 4 biases; 100 shared parameters.
        let outs = [
            t("token_embd.weight", &[10, 10]),
            t("blk.0.ffn_gate_exps.weight", &[8, 4, 16]),
            t("blk.0.ffn_up_exps.weight", &[8, 4, 16]),
            t("blk.0.ffn_down_exps.weight", &[8, 16, 4]),
            t("blk.0.ffn_gate_exps.bias", &[8, 4]),
        ];
        // The bias is 2-D: shared. Experts: 3 × 64 = 192; shared 100 + 32 = 132.
        assert_eq!(size_label(&outs).unwrap(), "8x0.32K");
        assert_eq!(size_label(&outs[..1]).unwrap(), "0.10K");
        assert_eq!(size_label(&[]), None);
    }
}
