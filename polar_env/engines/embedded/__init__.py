"""The embedded CPU engine: a real Qwen3-architecture forward pass (transformers on torch CPU) with
the Qwen3.5 tokenizer and template, served in-process (``EmbeddedEngine``) or over a vLLM-shaped
HTTP API (``server``)."""
