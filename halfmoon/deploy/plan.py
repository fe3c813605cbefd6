"""The controller's bookkeeping of worker pools (no Ray import; unit-tested alone).

Workers are named ``ROLE-INDEX``; an index is never reused within a deployment, so a
worker that drains and a new one never share an instance id at the Conductor (a restarted
worker keeps its name: that is how the Conductor tells a restart from a newcomer).

Life of a worker record::

    add() -> running --plan() picks it--> draining --its process exits--> remove()
                \\--------------------- remove() (stop, or it died for good) ------/

Scaling down picks the newest running workers of the pool (highest index): the oldest
ones have the warmest prefix caches.

:meth:`Pools.to_dict` / :meth:`Pools.from_dict` are the controller's persisted record of
the pools (JSON), so that a restarted controller keeps issuing new indexes and bundles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from halfmoon.core.errors import HalfmoonError

MODE_ROLES = {"disaggregated": ("prefill", "decode"), "coupled": ("coupled",)}
RUNNING, DRAINING = "running", "draining"


@dataclass
class WorkerRecord:
    """One worker the controller started."""

    role: str
    index: int
    state: str = RUNNING
    #: Bundle of the deployment's placement group it occupies (None: outside it).
    bundle: int | None = None

    @property
    def name(self) -> str:
        """Its instance id at the Conductor, e.g. ``decode-1``."""
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class ScalePlan:
    """What reaching the target sizes takes: workers to start and workers to drain."""

    add: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()


@dataclass
class Pools:
    """Every worker of a deployment, by role, with placement-group bundles to reuse."""

    mode: str
    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    _next_index: dict[str, int] = field(default_factory=dict)
    _free_bundles: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODE_ROLES:
            raise HalfmoonError(f"unknown mode {self.mode!r}")

    @property
    def roles(self) -> tuple[str, ...]:
        """The pools of this mode."""
        return MODE_ROLES[self.mode]

    def give_bundles(self, role: str, bundles: list[int]) -> None:
        """Placement-group bundles reserved for workers of ``role``."""
        self._free_bundles.setdefault(role, []).extend(bundles)

    def add(self, role: str) -> WorkerRecord:
        """A new running worker of ``role`` (in a free bundle of its pool if any)."""
        self._check_role(role)
        index = self._next_index.get(role, 0)
        self._next_index[role] = index + 1
        free = self._free_bundles.get(role, [])
        record = WorkerRecord(role, index, bundle=free.pop(0) if free else None)
        self.workers[record.name] = record
        return record

    def adopt(self, role: str, index: int, state: str = RUNNING) -> WorkerRecord:
        """A worker found running but not in the record (outside any bundle; a known one
        is returned as it is); its index is never issued again."""
        self._check_role(role)
        self._next_index[role] = max(self._next_index.get(role, 0), index + 1)
        record = self.workers.get(f"{role}-{index}") or WorkerRecord(role, index, state=state)
        self.workers[record.name] = record
        return record

    def counts(self) -> dict[str, int]:
        """Running (not draining) workers per role."""
        out = dict.fromkeys(self.roles, 0)
        for w in self.workers.values():
            if w.state == RUNNING:
                out[w.role] += 1
        return out

    def plan(self, targets: dict[str, int]) -> ScalePlan:
        """Roles to start and names to drain so that each pool in ``targets`` reaches
        its size (pools not named stay as they are). Changes nothing."""
        add: list[str] = []
        drain: list[str] = []
        counts = self.counts()
        for role, target in targets.items():
            self._check_role(role)
            if target < 1:
                raise HalfmoonError(f"the {role} pool needs at least 1 worker, not {target}")
            have = counts[role]
            add += [role] * max(0, target - have)
            running = sorted(
                (w for w in self.workers.values() if w.role == role and w.state == RUNNING),
                key=lambda w: w.index,
            )
            drain += [w.name for w in running[target:][::-1]]
        return ScalePlan(tuple(add), tuple(drain))

    def mark_draining(self, name: str) -> WorkerRecord:
        """``name`` is leaving: no longer counted in its pool."""
        record = self._get(name)
        record.state = DRAINING
        return record

    def remove(self, name: str) -> WorkerRecord:
        """``name`` is gone; its bundle is free for the next worker of its pool."""
        record = self.workers.pop(name, None)
        if record is None:
            raise HalfmoonError(f"unknown worker {name!r}")
        if record.bundle is not None:
            self._free_bundles.setdefault(record.role, []).append(record.bundle)
        return record

    def to_dict(self) -> dict[str, Any]:
        """Everything here as JSON-ready data (:meth:`from_dict` reads it back)."""
        workers = [{"role": w.role, "index": w.index, "state": w.state, "bundle": w.bundle}
                   for w in self.workers.values()]  # fmt: skip
        return {"mode": self.mode, "workers": workers, "next_index": dict(self._next_index),
                "free_bundles": {r: list(b) for r, b in self._free_bundles.items()}}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Pools:
        """The pools :meth:`to_dict` described."""
        pools = cls(str(data["mode"]))
        for w in data["workers"]:
            record = WorkerRecord(str(w["role"]), int(w["index"]), str(w["state"]), w["bundle"])
            pools.workers[record.name] = record
        pools._next_index = {str(r): int(n) for r, n in data["next_index"].items()}
        pools._free_bundles = {str(r): [int(b) for b in bs]
                               for r, bs in data["free_bundles"].items()}  # fmt: skip
        return pools

    def check_integrity(self) -> None:
        """Names match records, indexes are below the next index, bundles held once."""
        held = [w.bundle for w in self.workers.values() if w.bundle is not None]
        free = [b for bs in self._free_bundles.values() for b in bs]
        assert len(held + free) == len(set(held + free)), "a bundle is held twice"
        for name, w in self.workers.items():
            assert name == w.name, f"record {name} is named {w.name}"
            assert w.index < self._next_index.get(w.role, 0), f"{name} index not issued"
            assert w.state in (RUNNING, DRAINING), f"{name} in state {w.state}"

    def _get(self, name: str) -> WorkerRecord:
        record = self.workers.get(name)
        if record is None:
            raise HalfmoonError(f"unknown worker {name!r}")
        return record

    def _check_role(self, role: str) -> None:
        if role not in self.roles:
            raise HalfmoonError(
                f"a {self.mode} deployment has no {role} pool (pools: {', '.join(self.roles)})"
            )
