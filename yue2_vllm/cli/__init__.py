"""The `yue2-vllm` command: one module per command (`generate`, `batch`, `doctor`, `tools`), the shared
set-up (`setup`) and the parser (`main`). Importing it imports no torch: `yue2-vllm --help` stays fast.
"""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
