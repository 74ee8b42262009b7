"""The Qwen3.5 chat format: tokenizer, chat template and output parser.

Shared by the embedded engine and by engine clients that render prompts themselves (SGLang /generate).
The template is ours, written to reproduce the behaviour of the published Qwen3.5 template, including
the parts that break append-only prefixes; ``TemplateQuirks`` switches them off for tests.
"""
