"""The demo application: a small multimodal model served through the prefix cache.

Not part of the library's API: it is the ``omnicache`` command and the
reference integration. One idea per module, from the bottom up:

- `omnicache.demo.wav`: writing 16-bit PCM WAV files (`omnicache.media` reads them).
- `omnicache.demo.workloads`: request traces, synthetic or read from JSONL.
- `omnicache.demo.config`: the model's sizes and the cache's geometry.
- `omnicache.demo.processor`: prompts to token ids and annotated tokens.
- `omnicache.demo.model`: the small transformer.
- `omnicache.demo.engine`: `ServingEngine`, the reference integration of
  the reference engine (`omnicache.reference`: `PrefixCache`, `BlockPool`)
  and `TensorStore`.
- `omnicache.demo.oracle`: the run loop, checked against a full recompute.
- `omnicache.demo.plot`: the ``--plot`` figure (matplotlib, the ``plot`` extra).
- `omnicache.demo.tiny_models`: tiny random-weight models for a live vLLM
  engine (transformers, imported when one is built).
- `omnicache.demo.cli`: the ``omnicache`` command (``python -m omnicache``);
  it sits above `omnicache.integrations` and, for ``--engine vllm``, runs
  `omnicache.demo.live`.
"""
