"""Adapters that run omnicache inside serving engines.

Each engine has one package here, and that package is the only place that
imports the engine: ``omnicache.integrations.vllm`` for vLLM 0.32 and 0.33.
Importing this package imports no engine.
"""

__all__: list[str] = []
