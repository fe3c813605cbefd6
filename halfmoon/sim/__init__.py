"""L3: the discrete-event cluster simulator. It drives the real Conductor with simulated
prefill, decode and coupled (vLLM-like) instances; never imports torch, engine/ or serve/.

Entry points: :class:`Simulator` / :func:`simulate` (one run), :class:`SimConfig` and
:class:`ClusterSpec` (``8P8D``, ``16M``), :class:`InstanceSpec` (what the simulated
instances are built from), :func:`max_rate_within_slo` (rate sweeps), and
``halfmoon simulate`` (:mod:`halfmoon.sim.cli`). The modelling is described in
``docs/simulation.md``.
"""

from halfmoon.sim.config import DECODE_GUARDS, ClusterSpec, InstanceSpec, SimConfig
from halfmoon.sim.events import Event, EventLoop
from halfmoon.sim.network import kv_stream_tail_s
from halfmoon.sim.report import format_comparison, format_report
from halfmoon.sim.simulator import SimResult, Simulator, simulate
from halfmoon.sim.sweep import max_rate_within_slo

__all__ = [
    "DECODE_GUARDS",
    "ClusterSpec",
    "Event",
    "EventLoop",
    "InstanceSpec",
    "SimConfig",
    "SimResult",
    "Simulator",
    "format_comparison",
    "format_report",
    "kv_stream_tail_s",
    "max_rate_within_slo",
    "simulate",
]
