//! Merge methods' messages as the user reads them: the models named as the config names them.

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
