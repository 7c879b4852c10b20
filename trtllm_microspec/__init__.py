"""MicroSpec: lossless EAGLE-2 speculative decoding with a tiny dynamic draft vocabulary."""
__all__ = ["LLM", "Result"]


def __getattr__(name: str):
    """LLM and Result are imported on first use: `microspec` parses its arguments and handles Ctrl-C before torch
    loads (an interrupt during the import would otherwise end in a traceback)."""
    if name in __all__:
        from . import llm
        return getattr(llm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
