//! Tensor transforms `convert_hf_to_gguf.py` applies, as pure functions the pipeline can run
//! on row chunks.
//!
//! Every transform here only moves elements, so it commutes with an elementwise cast: run it
//! on the checkpoint's bytes (any element size) and cast or quantise the result, row by row.
//! Row maps (`*_source_row`) say which source row an output row comes from, so a reader can
//! serve any output row range; the DeepSeek `k_b` transpose is the one transform that is not
//! a row map and works one head (`qk_nope + v` source rows) at a time.

use std::f64::consts::PI;

/// Llama-class Q/K rotary permutation (`LlamaModel.permute`): rows are viewed as
/// `[n_head, 2, rows / n_head / 2]` and the last two axes swapped, turning HF's half-split
/// rotary layout into ggml's interleaved one. Use `n_head` for `q_proj` and `n_kv_head` for
/// `k_proj` (weights and biases alike). Returns the source row of output row `out_row`.
pub fn qk_permute_source_row(out_row: u64, rows: u64, n_head: u64) -> u64 {
    let half = rows / n_head / 2;
    let h = out_row / (2 * half);
    let rem = out_row % (2 * half);
    let (i, j) = (rem / 2, rem % 2);
    h * 2 * half + j * half + i
}

/// Whether `rows` splits into `n_head` heads of an even size, as the permutation needs.
pub fn qk_permute_fits(rows: u64, n_head: u64) -> bool {
    n_head > 0 && rows.is_multiple_of(2 * n_head)
}

/// gpt-oss `gate_up_proj`: rows interleaved per expert, even rows gate and odd rows up. Output
/// row `out_row` of the `half` part (0 gate, 1 up), `rows_out_per_expert` rows per expert
/// (every row of all experts counted in order), comes from this source row.
pub fn interleaved_source_row(out_row: u64, rows_out_per_expert: u64, half: u64) -> u64 {
    let (e, i) = (out_row / rows_out_per_expert, out_row % rows_out_per_expert);
    e * 2 * rows_out_per_expert + 2 * i + half
}

/// Fused `gate_up_proj` `[E, 2 * ff, n]` split by halves (Qwen MoE, transformers' packed
/// experts): gate is the first `ff` rows of each expert, up the second.
pub fn halves_source_row(out_row: u64, rows_out_per_expert: u64, half: u64) -> u64 {
    let (e, i) = (out_row / rows_out_per_expert, out_row % rows_out_per_expert);
    e * 2 * rows_out_per_expert + half * rows_out_per_expert + i
}

/// DeepSeek MLA `kv_b_proj` `[n_head * (nope + v), lora]` → `attn_v_b` `[n_head, v, lora]`:
/// source row of output row `out_row`.
pub fn kv_b_v_source_row(out_row: u64, nope: u64, v: u64) -> u64 {
    let (h, i) = (out_row / v, out_row % v);
    h * (nope + v) + nope + i
}

/// DeepSeek MLA `attn_k_b` `[n_head, lora, nope]` for one head: `head` is that head's
/// `nope + v` source rows of `lora` elements (`elem` bytes each); `out` receives the first
/// `nope` rows transposed, `lora` rows of `nope` elements.
pub fn kv_b_k_transpose_head(head: &[u8], nope: usize, lora: usize, elem: usize, out: &mut [u8]) {
    assert!(head.len() >= nope * lora * elem, "kv_b head too short");
    assert_eq!(out.len(), nope * lora * elem, "attn_k_b head size");
    for n in 0..nope {
        for l in 0..lora {
            let s = (n * lora + l) * elem;
            let d = (l * nope + n) * elem;
            out[d..d + elem].copy_from_slice(&head[s..s + elem]);
        }
    }
}

/// Llama 4 experts (`Llama4Model.modify_tensors`: `transpose(-1, -2)`, then `gate_up` split in
/// halves): element `j` of output row `out_row` of a `[E, width, rows]` tensor made of columns
/// `first_col..first_col + width` of each `[rows, cols]` expert comes from this source element.
pub fn expert_column_source(
    out_row: u64,
    j: u64,
    rows: u64,
    cols: u64,
    first_col: u64,
    width: u64,
) -> u64 {
    let (e, i) = (out_row / width, out_row % width);
    (e * rows + j) * cols + first_col + i
}

/// The source elements `[start, end)` that output rows `out_rows` of an
/// [`expert_column_source`] tensor read: from the first row's column in its expert's first row
/// to the last row's column in its expert's last row.
pub fn expert_column_span(
    out_rows: std::ops::Range<u64>,
    rows: u64,
    cols: u64,
    first_col: u64,
    width: u64,
) -> std::ops::Range<u64> {
    if out_rows.is_empty() {
        return 0..0;
    }
    let last = out_rows.end - 1;
    let at = |r: u64, j: u64| expert_column_source(r, j, rows, cols, first_col, width);
    at(out_rows.start, 0)..at(last, rows - 1) + 1
}

/// Gathers output rows `[first, first + count)` from `src` (whole source tensor, `row_bytes`
/// per row) through a row map.
pub fn gather_rows(
    src: &[u8],
    row_bytes: usize,
    first: u64,
    count: u64,
    source_row: impl Fn(u64) -> u64,
    out: &mut [u8],
) {
    assert_eq!(out.len(), count as usize * row_bytes, "gather output size");
    for (k, dst) in out.chunks_exact_mut(row_bytes).enumerate() {
        let s = source_row(first + k as u64) as usize * row_bytes;
        dst.copy_from_slice(&src[s..s + row_bytes]);
    }
}

/// MoE expert stacking (`torch.stack(experts, 0)`): expert `e`'s `[out, in]` bytes land at
/// `e * per_expert_bytes` in the `[E, out, in]` output, in expert-id order.
pub fn stacked_expert_offset(expert: u64, per_expert_bytes: u64) -> u64 {
    expert * per_expert_bytes
}

/// Llama-3 `rope_scaling` (`rope_type: llama3`) → the `rope_freqs.weight` F32 tensor
/// (`LlamaModel.generate_extra_tensors`), in the f32 arithmetic torch does it in: scalar ÷
/// tensor is `reciprocal(tensor) × scalar`, comparisons in f32.
pub fn llama3_rope_freqs(
    rope_theta: f64,
    head_dim: u64,
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    old_context_len: f64,
) -> Vec<f32> {
    let dim = head_dim as f32;
    let low_wavelen = (old_context_len / low_freq_factor) as f32;
    let high_wavelen = (old_context_len / high_freq_factor) as f32;
    (0..head_dim)
        .step_by(2)
        .map(|i| {
            let freq = 1.0f32 / (rope_theta as f32).powf(i as f32 / dim);
            let wavelen = (1.0 / freq) * (2.0 * PI) as f32;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor as f32
            } else {
                let smooth = ((1.0 / wavelen) * old_context_len as f32 - low_freq_factor as f32)
                    / (high_freq_factor - low_freq_factor) as f32;
                1.0 / ((1.0 - smooth) / factor as f32 + smooth)
            }
        })
        .collect()
}

/// BitNet's `weight_quant` divisor (`1 / mean|w|`, the mean clamped to at least `1e-5`) of a
/// tensor of `n` elements whose magnitudes sum to `sum_abs`. The reference takes torch's f32
/// mean; this one is summed in f64 in element order and rounded once, so it is the same for
/// any chunking and thread count (the two can differ in the mean's last bit).
pub fn bitnet_iscale(sum_abs: f64, n: u64) -> f32 {
    let mean = (sum_abs / n.max(1) as f64) as f32;
    1.0 / mean.max(1e-5)
}

/// `weight_quant` of `x` with divisor `iscale`: `round(x · iscale)` clamped to `[-1, 1]`, over
/// `iscale`, in f32 (ties to even, as `torch.round`). The reference widens BF16/F16 sources to
/// f32 before, so the result stays f32 until the output type rounds it.
pub fn bitnet_ternarise(x: f32, iscale: f32) -> f32 {
    (x * iscale).round_ties_even().clamp(-1.0, 1.0) / iscale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qk_permutation_interleaves_the_two_halves_of_each_head() {
        // 2 heads of 4 rows: head rows [a0 a1 b0 b1] become [a0 b0 a1 b1].
        let map: Vec<u64> = (0..8).map(|r| qk_permute_source_row(r, 8, 2)).collect();
        assert_eq!(map, [0, 2, 1, 3, 4, 6, 5, 7]);
        assert!(qk_permute_fits(8, 2));
        assert!(!qk_permute_fits(6, 2));
    }

    #[test]
    fn gate_up_splits_pick_even_odd_or_halves_per_expert() {
        let gate: Vec<u64> = (0..4).map(|r| interleaved_source_row(r, 2, 0)).collect();
        let up: Vec<u64> = (0..4).map(|r| interleaved_source_row(r, 2, 1)).collect();
        assert_eq!(gate, [0, 2, 4, 6]);
        assert_eq!(up, [1, 3, 5, 7]);
        let up: Vec<u64> = (0..4).map(|r| halves_source_row(r, 2, 1)).collect();
        assert_eq!(up, [2, 3, 6, 7]);
    }

    #[test]
    fn expert_columns_transpose_each_expert_and_take_its_half() {
        // 2 experts of 3 rows × 4 columns (elements numbered in order); the second half of the
        // columns (2 and 3) transposed: expert 0 column 2 is elements 2, 6, 10.
        let out: Vec<Vec<u64>> = (0..4)
            .map(|r| {
                (0..3)
                    .map(|j| expert_column_source(r, j, 3, 4, 2, 2))
                    .collect()
            })
            .collect();
        assert_eq!(out, [[2, 6, 10], [3, 7, 11], [14, 18, 22], [15, 19, 23]]);
        assert_eq!(expert_column_span(1..3, 3, 4, 2, 2), 3..23);
        assert_eq!(expert_column_span(2..2, 3, 4, 2, 2), 0..0);
    }

    #[test]
    fn kv_b_split_takes_v_after_nope_and_transposes_k() {
        let v: Vec<u64> = (0..4).map(|r| kv_b_v_source_row(r, 3, 2)).collect();
        assert_eq!(v, [3, 4, 8, 9]);
        let head: Vec<u8> = (0..10).collect(); // nope 2 rows × lora 3, then v rows
        let mut out = [0u8; 6];
        kv_b_k_transpose_head(&head, 2, 3, 1, &mut out);
        assert_eq!(out, [0, 3, 1, 4, 2, 5]);
    }
}
