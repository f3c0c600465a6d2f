"""qatlib: reproducible quantization-aware training of LLMs with DeepSpeed ZeRO-3."""

__version__ = "0.1.0"  # the package version (pyproject.toml reads it: setuptools dynamic version)
