//! The CUDA backend: device selection and the kernels' host-side descriptions.

pub mod params;
