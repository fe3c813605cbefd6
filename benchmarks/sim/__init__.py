"""The simulator: its speed and the Conductor's decision latency, CPP against the number
of stages, and the experiments of docs/simulation.md."""
