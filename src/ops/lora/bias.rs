//! PEFT's `lora_bias`: an adapter trained (or extracted) with `lora_bias: true` carries a bias
//! for `lora_B` (`<module>.lora_B.bias`, `[out]`), and PEFT's merge adds it to the layer's
//! bias as `bias + lora_B.bias * scaling` — the product rounded to f32 (the adapter's dtype
//! once PEFT has loaded it), the sum in f32 (f64 for an f64 bias) and rounded once to the
//! output dtype. A layer without a bias cannot take one (PEFT raises), which the plan refuses.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::cast::{f64_to_f32_odd, to_f32, write_as, RoundedBase};
use crate::ops::Op;
use crate::plan::{Derive, Entry};

/// `dst(base + s · lora_bias)` over the whole bias vector, one unit.
#[derive(Debug)]
pub struct LoraBiasAdd {
    pub len: u64,
    /// Produces the base bias as f32 when an earlier step rounds it (a cast); `None` reads it.
    pub base_op: Option<Arc<dyn Op>>,
    pub base_inputs: usize,
    pub base_dtype: DType,
    pub bias_dtype: DType,
    pub scale: f32,
    pub dst: DType,
}

impl LoraBiasAdd {
    fn base_f64(&self, inputs: &[&[u8]]) -> Option<Vec<f64>> {
        match (&self.base_op, self.base_dtype) {
            (None, DType::F64) => Some(
                inputs[0]
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
            _ => None,
        }
    }

    fn base_f32(&self, inputs: &[&[u8]]) -> Result<Vec<f32>, String> {
        match &self.base_op {
            None => Ok(to_f32(self.base_dtype, inputs[0])),
            Some(op) => {
                let mut bytes = vec![0u8; self.len as usize * 4];
                op.compute(0..1, &inputs[..self.base_inputs], &mut bytes)?;
                Ok(bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect())
            }
        }
    }
}

impl Op for LoraBiasAdd {
    fn name(&self) -> &'static str {
        "merge-lora-bias"
    }
    fn units(&self) -> u64 {
        1
    }
    fn out_unit_bytes(&self) -> u64 {
        self.len * self.dst.bits() / 8
    }
    fn in_unit_bytes(&self) -> u64 {
        self.len * (self.base_dtype.bits() + self.bias_dtype.bits()) / 8
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let mut v = match &self.base_op {
            Some(op) => op.input_ranges(units),
            None => std::iter::once(0..self.len * self.base_dtype.bits() / 8).collect(),
        };
        v.push(0..self.len * self.bias_dtype.bits() / 8);
        v
    }
    fn compute(&self, _units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let lora = to_f32(self.bias_dtype, inputs[self.base_inputs]);
        // PEFT: `lora_B.bias * scaling` in f32, then added to the bias; two roundings, no FMA.
        let product = lora.iter().map(|&b| b * self.scale);
        match self.base_f64(inputs) {
            Some(base) if self.dst == DType::F64 => {
                for ((o, w), p) in out.chunks_exact_mut(8).zip(base).zip(product) {
                    o.copy_from_slice(&(w + p as f64).to_le_bytes());
                }
            }
            Some(base) => write_as(
                self.dst,
                base.into_iter()
                    .zip(product)
                    .map(|(w, p)| f64_to_f32_odd(w + p as f64)),
                out,
            ),
            None => {
                let base = self.base_f32(inputs)?;
                write_as(
                    self.dst,
                    base.into_iter().zip(product).map(|(w, p)| w + p),
                    out,
                )
            }
        }
        Ok(())
    }
}

/// The plan-time side of [`LoraBiasAdd`]: the base bias (tensor `base`, or what `prev`
/// computes from it) and the adapter's `lora_B.bias` (tensor `bias`).
#[derive(Debug)]
pub(super) struct BiasDerive {
    pub prev: Option<Arc<dyn Derive>>,
    pub base: usize,
    pub base_dtype: DType,
    pub bias: usize,
    pub bias_dtype: DType,
    pub len: u64,
    pub scale: f32,
}

impl Derive for BiasDerive {
    fn inputs(&self) -> Vec<usize> {
        let mut v = self
            .prev
            .as_ref()
            .map_or_else(|| vec![self.base], |p| p.inputs());
        v.push(self.bias);
        v
    }
    fn build(&self, dst: DType) -> Arc<dyn Op> {
        Arc::new(LoraBiasAdd {
            len: self.len,
            base_inputs: self.prev.as_ref().map_or(1, |p| p.inputs().len()),
            base_op: self.prev.as_ref().map(|p| p.build(DType::F32)),
            base_dtype: self.base_dtype,
            bias_dtype: self.bias_dtype,
            scale: self.scale,
            dst,
        })
    }
}

/// Binds `lora_B.bias` (adapter tensor `bias`, for a module whose delta has `out` rows and
/// is merged with `scale`) to the base's `{module}.bias`; refused when adapter_config.json
/// does not set `lora_bias`, when the base layer has no bias (PEFT raises there too), or on a
/// shape or dtype that cannot be added.
#[allow(clippy::too_many_arguments)]
pub(super) fn bind(
    module: &str,
    bias: usize,
    out: u64,
    scale: f32,
    lora_bias: bool,
    index: &HashMap<String, usize>,
    entries: &mut [Entry],
    ckpt: &Checkpoint,
) -> Result<(), String> {
    let info = &ckpt.tensors[bias].info;
    let name = &info.name;
    if !lora_bias {
        return Err(format!(
            "`{name}` is a LoRA bias, but adapter_config.json does not set `lora_bias: true` (PEFT would not load it); set it if the adapter was trained or extracted with a bias"
        ));
    }
    let target = format!("{module}.bias");
    let Some(&wi) = index.get(&target) else {
        return Err(format!(
            "`{name}`: the base has no `{target}` to add the LoRA bias to (PEFT refuses to merge `lora_bias` into a layer without a bias)"
        ));
    };
    if info.shape != [out] || entries[wi].shape != [out] {
        return Err(format!(
            "`{name}` {:?} cannot be added to `{target}` {:?}: both must be [{out}], the layer's outputs",
            info.shape, entries[wi].shape
        ));
    }
    let float = |d: DType| matches!(d, DType::F32 | DType::BF16 | DType::F16 | DType::F64);
    if !float(info.dtype) {
        return Err(format!(
            "`{name}`: adapter dtype {} is not a float",
            info.dtype
        ));
    }
    // A bias an earlier cast step rounded is merged rounded, as the weights are.
    if let Some(r) = RoundedBase::of(&entries[wi], ckpt) {
        entries[wi].derive = Some(Arc::new(r));
    }
    let base_dtype = ckpt.tensors[entries[wi].source].info.dtype;
    let prev = entries[wi].derive.clone();
    let whole = prev
        .as_ref()
        .is_none_or(|p| p.build(DType::F32).units() == 1);
    if !float(base_dtype) || !whole {
        return Err(format!(
            "`{target}` is {base_dtype}{}; the LoRA bias `{name}` can only be added to a float bias",
            if whole { "" } else { ", computed by an earlier step" }
        ));
    }
    entries[wi].derive = Some(Arc::new(BiasDerive {
        prev,
        base: entries[wi].source,
        base_dtype,
        bias,
        bias_dtype: info.dtype,
        len: out,
        scale,
    }));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::cast::{bf16_to_f32, f32_to_bf16};

    fn op(base_dtype: DType, dst: DType, len: u64, scale: f32) -> LoraBiasAdd {
        LoraBiasAdd {
            len,
            base_op: None,
            base_inputs: 1,
            base_dtype,
            bias_dtype: DType::F32,
            scale,
            dst,
        }
    }

    #[test]
    fn adds_the_scaled_bias_product_then_sum_rounded_once() {
        // 1 + 2^-24·s with s = 3: the f32 product is exact, the f32 sum rounds to nearest even,
        // bf16 rounds that once more from f32 (PEFT: `(bias + b*s).to(bf16)`).
        let base = [1.0f32, -2.5, 0.0];
        let lora = [2f32.powi(-24), 0.1, -0.0];
        let s = 3.0f32;
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (wb, lb) = (bytes(&base), bytes(&lora));
        let o = op(DType::F32, DType::F32, 3, s);
        assert_eq!(o.input_ranges(0..1), vec![0..12, 0..12]);
        let mut out = vec![0u8; 12];
        o.compute(0..1, &[&wb, &lb], &mut out).unwrap();
        let got = to_f32(DType::F32, &out);
        // 1 + 3·2^-24 = 1 + 2^-23 + 2^-24 → ties to even at 1 + 2^-22.
        assert_eq!(got[0].to_bits(), (1.0f32 + 2f32.powi(-22)).to_bits());
        assert_eq!(got[1].to_bits(), (-2.5f32 + 0.1f32 * 3.0f32).to_bits());
        assert_eq!(got[2].to_bits(), 0.0f32.to_bits());
        // BF16 base and output: the f32 sum, rounded once.
        let wbf: Vec<u8> = base
            .iter()
            .flat_map(|&x| f32_to_bf16(x).to_le_bytes())
            .collect();
        let o = op(DType::BF16, DType::BF16, 3, s);
        let mut out = vec![0u8; 6];
        o.compute(0..1, &[&wbf, &lb], &mut out).unwrap();
        let want: Vec<u8> = base
            .iter()
            .zip(&lora)
            .flat_map(|(&w, &l)| f32_to_bf16(bf16_to_f32(f32_to_bf16(w)) + l * s).to_le_bytes())
            .collect();
        assert_eq!(out, want);
    }

    #[test]
    fn an_f64_bias_sums_in_f64() {
        let base = [1.0f64 + 2f64.powi(-40)];
        let wb: Vec<u8> = base.iter().flat_map(|x| x.to_le_bytes()).collect();
        let lb = 0.5f32.to_le_bytes();
        let o = op(DType::F64, DType::F64, 1, 2.0);
        let mut out = vec![0u8; 8];
        o.compute(0..1, &[&wb, &lb], &mut out).unwrap();
        assert_eq!(
            f64::from_le_bytes(out[..8].try_into().unwrap()),
            base[0] + 1.0
        );
    }
}
