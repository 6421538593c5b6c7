pub mod safetensors;
