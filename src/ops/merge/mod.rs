//! Model merging (`tftf merge`): mergekit's merge methods applied tensor by tensor across N
//! source checkpoints. `methods` holds the arithmetic of each method on one tensor's values.

pub mod adapt;
pub mod config;
pub mod layers;
pub mod methods;
pub mod op;
mod quantised;
pub mod resolve;
pub mod spec;
pub mod step;
pub mod tokenizer;

pub use config::MergeConfig;
pub use step::MergeStep;
