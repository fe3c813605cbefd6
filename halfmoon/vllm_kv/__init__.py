"""halfmoon's KV connector for vLLM (#19 item 2): vLLM loads
:class:`~halfmoon.vllm_kv.connector.HalfmoonConnector` by module path (see
:func:`halfmoon.serve.vllm.pd.kv_transfer_config`), and its prefill instances stream each
layer's KV over halfmoon's transfer engine to the decode instance the Conductor chose, save
full blocks to halfmoon's block store, and pull a cached prefix from a peer's store
instead of recomputing it. It imports vLLM and torch, so it runs inside vLLM's process
only; nothing else in halfmoon imports it (docs/vllm.md, "The KV connector")."""
