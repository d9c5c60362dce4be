"""radixserve: an SGLang-style LLM serving engine.

Installed, every module lives under this one name (`radixserve.scheduler`, `radixserve.client`,
...): pyproject.toml maps the repository root to this package, so the folders stay where they are.
"""
