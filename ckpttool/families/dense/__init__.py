"""Dense decoders: Llama, Mistral, Qwen2, Qwen3 (GQA attention, SwiGLU MLP)."""
