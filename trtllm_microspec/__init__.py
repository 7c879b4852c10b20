"""MicroSpec: lossless EAGLE-2 speculative decoding with a tiny dynamic draft vocabulary."""
from .llm import LLM, Result

__all__ = ["LLM", "Result"]
