"""The data plane: halfmoon's transfer engine and block store against Mooncake's (run
from its own venv), and the loopback-tcp ceiling under both (docs/benchmarks.md)."""
