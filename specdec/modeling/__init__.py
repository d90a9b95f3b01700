"""The model and its kernels: the decoder (every supported family and RoPE type), its linears, attention and
quantization, the native C kernels (csrc/) and CUDA graphs, the served dtype, and model resolution (hub ids, GGUF)."""
