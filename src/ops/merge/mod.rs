//! Model merging (`tftf merge`): mergekit's merge methods applied tensor by tensor across N
//! source checkpoints. `methods` holds the arithmetic of each method on one tensor's values.

pub mod methods;
