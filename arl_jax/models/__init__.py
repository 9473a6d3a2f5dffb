"""The flax.nnx decoder (Llama/Qwen: RMSNorm, RoPE, GQA, SwiGLU, value head),
its KV caches (dense and paged) and attention kernels, LoRA adapters, sharded
init, Hugging Face and GGUF import and export.

Layer 2: may import `core` and `sharding`.
"""
