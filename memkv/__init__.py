"""memkv: a tiered KV-cache store for multi-session LLM agents."""

__version__ = "0.1.0"
