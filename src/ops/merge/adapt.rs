//! Small adapters giving every whole-tensor method under `methods/` the engine's one
//! signature ([`WholeTensorFn`]): `(base, models, global, shape, seed, out)`, `base` empty when
//! the tensor has none. The methods themselves keep the arguments they need; only these
//! wrappers drop the rest (a deterministic method never sees the seed).

use super::methods::{karcher, misc, model_stock, slerp, ModelTensor, Params};

/// `Some(base)`, or `None` for a tensor merged without one (the engine passes it empty).
fn optional_base(base: &[f32]) -> Option<&[f32]> {
    (!base.is_empty()).then_some(base)
}

/// Wraps `$call`, an expression of `base, models, global, shape, seed, out`, as a
/// [`super::spec::WholeTensorFn`].
macro_rules! adapter {
    ($(#[$doc:meta])* $name:ident, |$base:ident, $models:ident, $global:ident, $shape:ident, $seed:ident, $out:ident| $call:expr) => {
        $(#[$doc])*
        pub fn $name(
            $base: &[f32],
            $models: &[ModelTensor],
            $global: &Params,
            $shape: &[usize],
            $seed: u64,
            $out: &mut [f32],
        ) -> Result<(), String> {
            $call
        }
    };
}

adapter!(slerp, |b, m, g, _s, _r, o| slerp::slerp(b, m, g, o));
adapter!(nuslerp, |b, m, g, s, _r, o| slerp::nuslerp(
    optional_base(b),
    m,
    g,
    s,
    o
));
adapter!(multislerp, |b, m, g, _s, _r, o| slerp::multislerp(
    optional_base(b),
    m,
    g,
    o
));
adapter!(
    /// karcher ignores the base policy: the engine hands every input in model order.
    karcher,
    |_b, m, g, _s, _r, o| karcher::karcher(m, g, o)
);
adapter!(model_stock, |b, m, g, s, _r, o| model_stock::model_stock(
    b, m, g, s, o
));
adapter!(nearswap, |b, m, g, _s, _r, o| misc::nearswap(b, m, g, o));
adapter!(arcee_fusion, |b, m, _g, s, r, o| misc::arcee_fusion(
    b, m, s, r, o
));
adapter!(ram, |b, m, g, _s, _r, o| misc::ram(b, m, g, o));
adapter!(ramplus_tl, |b, m, g, _s, _r, o| misc::ramplus_tl(
    b, m, g, o
));

/// A method's message with `models[i]` and `model i` (the index among the models it was
/// handed) replaced by that model's name, as the user wrote it in the config.
pub fn name_models(msg: &str, names: &[String]) -> String {
    let mut msg = msg.to_string();
    for (i, name) in names.iter().enumerate().rev() {
        msg = msg.replace(&format!("models[{i}]"), &format!("`{name}`"));
        for end in [" ", ",", ":", ")"] {
            msg = msg.replace(&format!("model {i}{end}"), &format!("model `{name}`{end}"));
        }
        if let Some(head) = msg.strip_suffix(&format!("model {i}")) {
            msg = format!("{head}model `{name}`");
        }
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_indices_become_the_models_names() {
        let names = ["m/a".to_string(), "m/b".to_string()];
        assert_eq!(
            name_models("models[1] has a NaN; models[0]: missing", &names),
            "`m/b` has a NaN; `m/a`: missing"
        );
        assert_eq!(
            name_models("missing parameter `weight` for model 1", &names),
            "missing parameter `weight` for model `m/b`"
        );
        assert_eq!(name_models("models[12] x", &names), "models[12] x");
    }
}
