"""vLLM behind halfmoon's engine boundary (#19; docs/vllm.md).

- :mod:`~halfmoon.serve.vllm.kv_events`: vLLM's KV-cache event batches decoded into frozen
  records, and :class:`~halfmoon.serve.vllm.kv_events.HashTranslator`, which turns them
  into halfmoon's ``BlockStored`` / ``BlockEvicted`` keyed by halfmoon's chained hash;
- :mod:`~halfmoon.serve.vllm.subscriber`: one ZeroMQ subscriber per vLLM instance, with
  sequence-gap detection and replay.

Nothing here imports vLLM: the bytes on the wire are the interface.
"""
