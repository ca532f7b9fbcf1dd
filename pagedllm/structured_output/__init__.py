"""Structured output: grammar-constrained decoding (JSON schema, JSON, regex, choice, Lark)."""
