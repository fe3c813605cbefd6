"""halfmoon: a KV-cache-centric, disaggregated LLM serving system after the Mooncake paper.

Layers (import downward only): core -> workload, costmodel, metrics -> conductor, engine,
store, transfer -> sim, serve, bench. See docs/architecture.md.
"""

__version__ = "0.1.0"
