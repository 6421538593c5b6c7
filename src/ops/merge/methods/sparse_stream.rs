//! The generalized task arithmetic methods ([`super::sparse`]) a chunk at a time, for tensors
//! bigger than one chunk: the magnitude cuts of TIES and breadcrumbs are found by
//! `RadixCut`'s three passes, the L1 rescale by one more pass of running sums, and each
//! chunk then keeps and combines exactly the elements the whole-tensor function would.

use super::sparse::{Generalized, Setup, FAMILY};
use super::sparsify::{
    della, della_rows, rank_key, CutPass, L1Norms, RadixCut, Selection, Sparsify, Survivors,
    TaskVector,
};
use super::survey::{check_finite, Blend, BlendKind, Chunk, Setting, Survey};
use super::uniform;

/// Method `FAMILY[K]`'s [`Survey`] of one tensor, for tensors merged a chunk at a time.
pub fn survey<const K: usize>(s: &Setting) -> Result<Box<dyn Survey>, String> {
    Ok(Box::new(SparseSurvey::new(&FAMILY[K], s)?))
}

/// The longest row whose DELLA draws a GPU blend makes: each element there finds its rank by
/// counting its row (work of the row's length per element), where the CPU sorts the row once.
pub const DELLA_GPU_ROW: usize = 1 << 16;

/// What one model keeps, as a chunk can decide it.
#[derive(Clone, Debug)]
enum Keep {
    All,
    Nothing,
    /// Ranks in `[low, high)`: not below `low`, below `high`.
    Ranked {
        low: RadixCut,
        high: RadixCut,
    },
    Random,
    Della,
}

/// The work of one pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Cut(CutPass),
    Norms,
}

/// One tensor of a generalized method, streamed.
#[derive(Debug)]
pub struct SparseSurvey {
    setup: Setup,
    shape: Vec<usize>,
    seed: u64,
    keep: Vec<Keep>,
    norms: Vec<L1Norms>,
    scales: Vec<f64>,
    stages: Vec<Stage>,
}

impl SparseSurvey {
    pub fn new(how: &Generalized, s: &Setting) -> Result<SparseSurvey, String> {
        let setup = Setup::new(how, s.models.iter(), s.global)?;
        let len: usize = s.shape.iter().product();
        let keep: Vec<Keep> = (setup.sparsify.iter())
            .map(|s| match s.selection(len) {
                Selection::All => Keep::All,
                Selection::Nothing => Keep::Nothing,
                Selection::Ranks(low, high) => Keep::Ranked {
                    low: RadixCut::new(low, len),
                    high: RadixCut::new(high, len),
                },
                Selection::Random => Keep::Random,
                Selection::Della => Keep::Della,
            })
            .collect();
        let mut stages = Vec::new();
        let cuts = keep.iter().any(
            |k| matches!(k, Keep::Ranked { low, high } if low.searching() || high.searching()),
        );
        if cuts {
            stages.extend([CutPass::High, CutPass::Low, CutPass::Ties].map(Stage::Cut));
        }
        let rescale = setup.sparsify.iter().any(|s| s.rescale);
        if rescale && keep.iter().any(|k| !matches!(k, Keep::All | Keep::Nothing)) {
            stages.push(Stage::Norms);
        }
        Ok(SparseSurvey {
            norms: vec![L1Norms::default(); keep.len()],
            scales: vec![1.0; keep.len()],
            setup,
            shape: s.shape.to_vec(),
            seed: s.seed,
            keep,
            stages,
        })
    }

    /// Which elements of model `i`'s chunk `tv`, from element `start`, survive (indices
    /// relative to the chunk), before rescaling.
    fn survivors(&self, i: usize, tv: TaskVector, start: usize) -> Result<Survivors, String> {
        let len = tv.base.len();
        let sparsify: &Sparsify = &self.setup.sparsify[i];
        Ok(match &self.keep[i] {
            Keep::All => Survivors::all(),
            Keep::Nothing => Survivors::from_predicate(len, |_| false),
            Keep::Ranked { low, high } => Survivors::from_predicate(len, |j| {
                let key = rank_key(tv.at(j).abs());
                !low.below(key, start + j) && high.below(key, start + j)
            }),
            Keep::Random => Survivors::from_predicate(len, |j| {
                uniform(self.seed, i as u64, (start + j) as u64) < sparsify.density
            }),
            Keep::Della => della(tv, &self.shape, sparsify, self.seed, i as u64, start)
                .map_err(|e| format!("models[{i}]: {e}"))?,
        })
    }
}

impl Survey for SparseSurvey {
    fn passes(&self) -> usize {
        self.stages.len()
    }

    fn granule(&self) -> usize {
        (self.setup.sparsify.first()).map_or(1, |s| s.granule(&self.shape))
    }

    fn observe(&mut self, pass: usize, chunk: &Chunk) -> Result<(), String> {
        let (start, base, models) = (chunk.start, chunk.base, chunk.models);
        if pass == 0 {
            check_finite(start, base, models)?;
        }
        let stage = self.stages[pass];
        for (i, model) in models.iter().enumerate() {
            let tv = TaskVector { model, base };
            match (stage, &mut self.keep[i]) {
                (Stage::Cut(pass), Keep::Ranked { low, high }) => {
                    for j in 0..base.len() {
                        let key = rank_key(tv.at(j).abs());
                        low.see(pass, key, start + j);
                        high.see(pass, key, start + j);
                    }
                }
                (Stage::Norms, _) => {
                    let kept = self.survivors(i, tv, start)?;
                    self.norms[i].add(tv, &kept);
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn end_pass(&mut self, pass: usize) -> Result<(), String> {
        match self.stages[pass] {
            Stage::Cut(pass) => {
                for keep in &mut self.keep {
                    if let Keep::Ranked { low, high } = keep {
                        low.end(pass);
                        high.end(pass);
                    }
                }
            }
            Stage::Norms => {
                for (i, norms) in self.norms.iter().enumerate() {
                    if self.setup.sparsify[i].rescale {
                        self.scales[i] = norms.scale();
                    }
                }
            }
        }
        Ok(())
    }

    /// Without passes the merge itself refuses non-finite values, on the CPU; so does DELLA
    /// with rows longer than [`DELLA_GPU_ROW`].
    fn blend(&self) -> Option<Blend> {
        if self.stages.is_empty() {
            return None;
        }
        let setup = &self.setup;
        let total: f64 = setup.weights.iter().sum();
        let linear_divisor = if total.abs() < 1e-8 { 1.0 } else { total };
        let flag = |b: bool| f64::from(u8::from(b));
        let mut coefs = vec![
            (self.seed & 0xFFFF_FFFF) as f64,
            (self.seed >> 32) as f64,
            flag(setup.consensus),
            flag(setup.normalize),
            setup.lambda,
            linear_divisor,
        ];
        // Positions stay below 2^53: a limit past them compares the same clamped there.
        let position = |limit: usize| limit.min(1 << 53) as f64;
        for (i, keep) in self.keep.iter().enumerate() {
            let how = match keep {
                Keep::All => [0.0; 5],
                Keep::Nothing => [1.0, 0.0, 0.0, 0.0, 0.0],
                Keep::Ranked { low, high } => {
                    let ((lk, ll), (hk, hl)) = (low.cut(), high.cut());
                    [2.0, lk as f64, position(ll), hk as f64, position(hl)]
                }
                Keep::Random => [3.0, 0.0, setup.sparsify[i].density, 0.0, 0.0],
                Keep::Della => {
                    // Each element counts the elements ranking below it in its row.
                    let (row, inner) = della_rows(&self.shape);
                    if row > DELLA_GPU_ROW {
                        return None;
                    }
                    let how = &setup.sparsify[i];
                    [4.0, how.epsilon, how.density, row as f64, inner as f64]
                }
            };
            coefs.extend(how);
            coefs.extend([self.scales[i], setup.weights[i]]);
        }
        Some(Blend {
            kind: BlendKind::Sparse,
            coefs,
        })
    }

    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String> {
        let (start, base, models) = (chunk.start, chunk.base, chunk.models);
        if self.stages.is_empty() {
            check_finite(start, base, models)?;
        }
        let mut kept = Vec::with_capacity(models.len());
        for (i, model) in models.iter().enumerate() {
            let mut survivors = self.survivors(i, TaskVector { model, base }, start)?;
            survivors.scale = self.scales[i];
            kept.push(survivors);
        }
        self.setup.combine(base, models, &kept, out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::sparse;
    use super::super::survey::testing::{chunked, Case};
    use super::super::survey::SurveyFn;
    use super::*;
    use crate::ops::merge::methods::Params;
    use crate::ops::merge::spec::WholeTensorFn;

    use sparse::whole;

    const METHODS: [(WholeTensorFn, SurveyFn); 7] = [
        (whole::<0>, survey::<0>),
        (whole::<1>, survey::<1>),
        (whole::<2>, survey::<2>),
        (whole::<3>, survey::<3>),
        (whole::<4>, survey::<4>),
        (whole::<5>, survey::<5>),
        (whole::<6>, survey::<6>),
    ];

    /// Tie-heavy values: multiples of 1/4, and values whose `f32` keys share their high half
    /// (1 + k·2⁻²⁰), so both radix passes and the tie pass decide.
    fn values(trial: u64, model: u64, len: usize) -> Vec<f32> {
        (0..len)
            .map(|j| {
                let u = uniform(trial, model, j as u64);
                if u < 0.5 {
                    ((u * 32.0).floor() - 8.0) as f32 * 0.25
                } else {
                    1.0 + ((u * 64.0).floor() as f32) * 2f32.powi(-20)
                }
            })
            .collect()
    }

    #[test]
    fn every_chunking_merges_the_bytes_the_whole_tensor_does() {
        for trial in 0..24u64 {
            let (rows, cols) = (3 + trial as usize % 4, 7 + trial as usize % 5);
            let len = rows * cols;
            let base: Vec<f32> = values(trial, 99, len).iter().map(|v| v * 0.5).collect();
            let models: Vec<Vec<f32>> = (0..3).map(|m| values(trial, m, len)).collect();
            let params: Vec<Params> = (0..3)
                .map(|m| {
                    let u = |k| uniform(trial, 50 + m, k);
                    Params::default()
                        .with("weight", (u(0) * 2.0 - 0.5).round() / 2.0 + 0.25)
                        .with(
                            "density",
                            [0.0, 0.1, 0.3, 0.5, 0.9, 1.0][(u(1) * 6.0) as usize],
                        )
                        .with("gamma", [0.0, 0.05, 0.2][(u(2) * 3.0) as usize])
                        .with("epsilon", 0.05)
                })
                .collect();
            let global = Params::default()
                .with("rescale", (trial % 2) as f64)
                .with("normalize", (trial / 2 % 2) as f64)
                .with("lambda", if trial % 3 == 0 { 0.75 } else { 1.0 });
            for (m, &(whole, make)) in METHODS.iter().enumerate() {
                let case = Case {
                    whole,
                    make,
                    base: &base,
                    models: &models,
                    params: &params,
                    global: &global,
                    shape: &[rows, cols],
                    seed: trial,
                };
                case.compare(&format!("trial {trial}, method {m}"));
            }
        }
    }

    #[test]
    fn radix_cuts_pick_the_ranks_a_full_sort_does() {
        for trial in 0..100u64 {
            let len = 1 + (uniform(trial, 0, 0) * 60.0) as usize;
            let keys: Vec<u32> = (0..len)
                .map(|j| {
                    let u = uniform(trial, 1, j as u64);
                    ((u * 3.0).floor() as u32) << 16 | (uniform(trial, 2, j as u64) * 4.0) as u32
                })
                .collect();
            let mut order: Vec<usize> = (0..len).collect();
            order.sort_by_key(|&j| (keys[j], j));
            for rank in [0, len / 3, len / 2, len - 1, len] {
                let mut cut = RadixCut::new(rank, len);
                for pass in [CutPass::High, CutPass::Low, CutPass::Ties] {
                    for (j, &k) in keys.iter().enumerate() {
                        cut.see(pass, k, j);
                    }
                    cut.end(pass);
                }
                let below: Vec<bool> = (0..len).map(|j| cut.below(keys[j], j)).collect();
                let want: Vec<bool> = (0..len).map(|j| order[..rank].contains(&j)).collect();
                assert_eq!(below, want, "{keys:?}, rank {rank}");
            }
        }
    }

    #[test]
    fn a_non_finite_value_is_refused_in_the_first_pass_with_its_element() {
        let base = vec![0f32; 8];
        let mut model = vec![1f32; 8];
        model[6] = f32::INFINITY;
        let params = [Params::default().with("weight", 1.0).with("density", 0.5)];
        let setting = |global| Setting {
            global,
            models: &params,
            shape: &[8],
            seed: 0,
        };
        let none = Params::default();
        let ties = survey::<0>(&setting(&none)).unwrap();
        assert_eq!(
            chunked(ties, &base, &[&model], 3, 1).unwrap_err(),
            "models[0] has a non-finite value (inf) at element 6"
        );
        // DARE without rescale makes no pass: each chunk checks its own elements.
        let unscaled = Params::default().with("rescale", 0.0);
        let dare = survey::<3>(&setting(&unscaled)).unwrap();
        assert_eq!(dare.passes(), 0);
        assert_eq!(
            chunked(dare, &base, &[&model], 3, 1).unwrap_err(),
            "models[0] has a non-finite value (inf) at element 6"
        );
    }
}
