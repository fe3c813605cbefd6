"""halfmoon's benchmarks: scripts that measure the system, grouped by family, and their
recorded results (``benchmarks/results/``). Not part of the installed package.

- ``benchmarks.micro``: engine speed (block hashing, engine vs transformers / vLLM);
- ``benchmarks.dataplane``: transfer engine and block store vs Mooncake, loopback ceiling;
- ``benchmarks.sim``: simulator speed and the simulator experiments of docs/simulation.md;
- ``benchmarks.eval``: live evaluation against running ``halfmoon serve`` clusters.

Every entry point runs from the repository root as ``python -m benchmarks.<family>.<name>``;
benchmarks/README.md lists them with the docs section holding their results.
"""
