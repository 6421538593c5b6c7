//! GPTQ (AutoGPTQ / GPTQModel / optimum checkpoints) → BF16/F16/F32, as llama.cpp's
//! `convert_hf_to_gguf.py` (`dequant_gptq`) and GPTQModel's `dequantize_weight` decode it.
//!
//! Layout, `b` ∈ {2, 4, 8} bits, `p = 32 / b` codes per word, low bits first:
//! - `qweight` `I32 [in/p, out]`: code `(i, o)` at bits `(i % p)·b …` of word `[i / p][o]`
//!   (packed along the *input* dimension, so the output is this matrix transposed);
//! - `qzeros` `I32 [G, out/p]`: zero `(g, o)` at bits `(o % p)·b …` of word `[g][o / p]`;
//!   the original (v1, `checkpoint_format: gptq`) format stores `zero - 1`, so the decoder adds
//!   1 back; `gptq_v2` stores the zero itself;
//! - `scales` `F16 [G, out]`; `g_idx` `I32 [in]`: the group of input row `i` (a permutation of
//!   `i / group_size` under act-order, `desc_act: true`); without `g_idx`, `i / group_size`.
//!
//! `W[o][i] = f32(scales[g][o]) · f32(q(i, o) - zero(g, o))` with `g = g_idx[i]`: a b-bit
//! difference times an F16 scale is exact in f32, so the one rounding is the final cast, as in
//! llama.cpp (which returns f32 and casts later).
//!
//! A unit is the whole tensor: each output row gathers one column of every packed row, so no
//! smaller piece of output has contiguous inputs. GPTQ matrices are small next to the memory
//! budget (a 28672 × 8192 4-bit matrix is 117 MiB packed, 448 MiB as BF16).

use std::ops::Range;
use std::sync::Arc;

use super::kernel::GptqParams;
use crate::format::dtype::DType;
use crate::ops::cast::{bf16_to_f32, f16_to_f32, store_f32};
use crate::ops::kernel::{kernel_dtype, Kernel};
use crate::ops::Op;
use crate::plan::{op_name_and_kernel, DeferredDst, Derive, Entry};

#[derive(Clone, Debug)]
pub struct DequantGptq {
    /// Output `[out, in]`.
    pub rows: u64,
    pub cols: u64,
    pub bits: u32,
    /// Scale/zero groups.
    pub groups: u64,
    pub scale_dtype: DType,
    /// Whether zeros are stored minus one (v1 format).
    pub zero_offset: bool,
    /// Elements per group when there is no `g_idx` (the fourth input).
    pub group_size: Option<u64>,
    pub dst: DType,
}

impl DequantGptq {
    fn per_word(&self) -> u64 {
        32 / self.bits as u64
    }
    fn scale_bytes(&self) -> u64 {
        self.scale_dtype.bits() / 8
    }
    fn input_bytes(&self) -> [u64; 4] {
        let p = self.per_word();
        [
            4 * self.cols / p * self.rows,
            4 * self.groups * self.rows / p,
            self.scale_bytes() * self.groups * self.rows,
            if self.group_size.is_some() {
                0
            } else {
                4 * self.cols
            },
        ]
    }
}

fn word(bytes: &[u8], k: usize) -> u32 {
    u32::from_le_bytes(bytes[4 * k..4 * k + 4].try_into().unwrap())
}

impl Op for DequantGptq {
    op_name_and_kernel!("dequant-gptq", |op| Kernel::DequantGptq(GptqParams {
        rows: op.rows,
        cols: op.cols,
        groups: op.groups,
        group_size: op.group_size.unwrap_or(0),
        bits: op.bits as i32,
        scale_dtype: kernel_dtype(op.scale_dtype),
        dst: kernel_dtype(op.dst),
        zero_offset: op.zero_offset as i32,
    }));
    fn units(&self) -> u64 {
        1
    }
    fn out_unit_bytes(&self) -> u64 {
        self.rows * self.cols * (self.dst.bits() / 8)
    }
    fn in_unit_bytes(&self) -> u64 {
        self.input_bytes().iter().sum()
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let all = self.input_bytes();
        let n = if self.group_size.is_some() { 3 } else { 4 };
        all[..n]
            .iter()
            .map(|&b| if units.is_empty() { 0..0 } else { 0..b })
            .collect()
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        if units.is_empty() {
            return Ok(());
        }
        let (rows, cols, groups) = (self.rows as usize, self.cols as usize, self.groups as usize);
        let (b, p) = (self.bits, self.per_word() as usize);
        let mask = (1u32 << b) - 1;
        let g_of: Vec<usize> = match self.group_size {
            Some(gs) => (0..cols).map(|i| i / gs as usize).collect(),
            None => {
                let mut v = Vec::with_capacity(cols);
                for i in 0..cols {
                    let g = word(inputs[3], i) as i32;
                    if g < 0 || g as usize >= groups {
                        return Err(format!(
                            "g_idx[{i}] is {g}, outside the {groups} groups of the scales"
                        ));
                    }
                    v.push(g as usize);
                }
                v
            }
        };
        let sb = self.scale_bytes() as usize;
        let scale = |g: usize, o: usize| -> f32 {
            let c = &inputs[2][(g * rows + o) * sb..(g * rows + o + 1) * sb];
            match self.scale_dtype {
                DType::F16 => f16_to_f32(u16::from_le_bytes([c[0], c[1]])),
                DType::BF16 => bf16_to_f32(u16::from_le_bytes([c[0], c[1]])),
                _ => f32::from_le_bytes(c.try_into().unwrap()),
            }
        };
        let size = (self.dst.bits() / 8) as usize;
        let mut scales = vec![0f32; groups];
        let mut zeros = vec![0i32; groups];
        for o in 0..rows {
            for g in 0..groups {
                scales[g] = scale(g, o);
                let z = word(inputs[1], g * (rows / p) + o / p) >> ((o % p) as u32 * b) & mask;
                zeros[g] = z as i32 + self.zero_offset as i32;
            }
            let row = &mut out[o * cols * size..(o + 1) * cols * size];
            for (i, &g) in g_of.iter().enumerate() {
                let q = word(inputs[0], (i / p) * rows + o) >> ((i % p) as u32 * b) & mask;
                let v = scales[g] * (q as i32 - zeros[g]) as f32;
                store_f32(self.dst, row, i, v);
            }
        }
        Ok(())
    }
}

crate::plan::set_dst_field!(DequantGptq);

/// What `quantization_config` says about a GPTQ checkpoint.
#[derive(Clone, Copy, Debug)]
pub struct GptqConfig<'a> {
    pub bits: Option<u64>,
    /// -1 (or absent): one group per row.
    pub group_size: Option<i64>,
    pub checkpoint_format: Option<&'a str>,
}

/// A bound weight and its output shape, or the tensor at fault and why.
pub type GptqBinding<'a> = std::result::Result<(Arc<dyn Derive>, Vec<u64>), (&'a Entry, String)>;

/// Binds a GPTQ weight: the bit width from the shapes (checked against `bits`), the groups
/// from `scales`, `g_idx` or else `group_size`. Errors name the tensor at fault.
pub fn bind<'a>(
    declared: GptqConfig,
    w: &'a Entry,
    s: &'a Entry,
    z: &'a Entry,
    gidx: Option<&'a Entry>,
) -> GptqBinding<'a> {
    let two = |e: &Entry| <[u64; 2]>::try_from(&e.shape[..]).unwrap_or_default();
    let ([packed, out], [groups, s_out], [z_groups, z_words]) = (two(w), two(s), two(z));
    if packed == 0 || out == 0 || groups == 0 || z_words == 0 || out % z_words != 0 {
        return Err((
            w,
            format!(
                "GPTQ needs qweight [in/p, out], qzeros [G, out/p], scales [G, out]; got {:?}, {:?}, {:?}",
                w.shape, z.shape, s.shape
            ),
        ));
    }
    let per_word = out / z_words;
    let bits = match per_word {
        16 => 2,
        8 => 4,
        4 => 8,
        _ => {
            return Err((
                z,
                format!("{per_word} zeros per word is not a 2-, 4- or 8-bit GPTQ packing"),
            ))
        }
    };
    if let Some(b) = declared.bits.filter(|&b| b != bits) {
        return Err((
            w,
            format!("packed as {bits}-bit codes but config.json says bits {b}"),
        ));
    }
    if s_out != out || z_groups != groups {
        return Err((
            s,
            format!(
                "scales {:?} and qzeros {:?} do not fit qweight {:?} ({groups} groups of {out} outputs)",
                s.shape, z.shape, w.shape
            ),
        ));
    }
    if z.dtype != DType::I32 {
        return Err((z, format!("qzeros must be I32, not {}", z.dtype)));
    }
    if !matches!(s.dtype, DType::F16 | DType::BF16 | DType::F32) {
        return Err((
            s,
            format!("scales must be F16, BF16 or F32, not {}", s.dtype),
        ));
    }
    let cols = packed * per_word;
    let mut inputs = vec![w.source, z.source, s.source];
    let group_size = match gidx {
        Some(g) => {
            if g.dtype != DType::I32 || g.shape != [cols] {
                return Err((
                    g,
                    format!("g_idx must be I32 [{cols}], not {} {:?}", g.dtype, g.shape),
                ));
            }
            inputs.push(g.source);
            None
        }
        None => {
            let gs = match declared.group_size {
                Some(gs) if gs > 0 => gs as u64,
                _ => cols.div_ceil(groups),
            };
            if cols.div_ceil(gs) != groups {
                return Err((
                    s,
                    format!("{groups} groups do not fit {cols} inputs in groups of {gs}, and there is no g_idx"),
                ));
            }
            Some(gs)
        }
    };
    // Only gptq_v2 stores the zeros themselves; v1 (the default) stores zero - 1.
    let zero_offset = declared.checkpoint_format != Some("gptq_v2");
    let d = DeferredDst {
        inputs,
        op: DequantGptq {
            rows: out,
            cols,
            bits: bits as u32,
            groups,
            scale_dtype: s.dtype,
            zero_offset,
            group_size,
            // set by `build`
            dst: DType::F32,
        },
    };
    Ok((Arc::new(d), vec![out, cols]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::cast::f32_to_f16;

    /// A 4-bit [8, 8] matrix in one group: qweight [1, 8], qzeros [1, 1], scales F16 [1, 8].
    #[test]
    fn codes_are_packed_along_the_input_dimension_and_v1_zeros_are_one_less() {
        let code = |o: u32, i: u32| (o * 3 + i * 5) % 16;
        let zero = |o: u32| o + 4;
        let qweight: Vec<u8> = (0..8)
            .flat_map(|o| {
                (0..8)
                    .fold(0u32, |w, i| w | code(o, i) << (4 * i))
                    .to_le_bytes()
            })
            .collect();
        let qzeros = (0..8)
            .fold(0u32, |w, o| w | (zero(o) - 1) << (4 * o))
            .to_le_bytes();
        let scale = |o: u32| 0.25 * (o + 1) as f32;
        let scales: Vec<u8> = (0..8)
            .flat_map(|o| f32_to_f16(scale(o)).to_le_bytes())
            .collect();
        let op = DequantGptq {
            rows: 8,
            cols: 8,
            bits: 4,
            groups: 1,
            scale_dtype: DType::F16,
            zero_offset: true,
            group_size: Some(8),
            dst: DType::F32,
        };
        let mut out = vec![0u8; 8 * 8 * 4];
        op.compute(0..1, &[&qweight, &qzeros, &scales], &mut out)
            .unwrap();
        let got: Vec<f32> = out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let want: Vec<f32> = (0..8)
            .flat_map(|o| {
                (0..8).map(move |i| scale(o) * (code(o, i) as i32 - zero(o) as i32) as f32)
            })
            .collect();
        assert_eq!(got, want);
    }
}
