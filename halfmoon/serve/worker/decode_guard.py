"""The decode worker's TBT guard (``--decode-guard``): the simulator's decode admission
rule (:mod:`halfmoon.costmodel.decode_guard`), applied where a handed-off request would
join the engine's batch.

The guard keeps the book the estimate needs: the context tokens of every request of the
batch (prompt + tokens so far), and the requests held back (``wait``), in arrival order::

    handoff --> check() --ADMIT--> role imports it, joined()      (batch: context_tokens)
                  |--REJECT--> the client hears why; the Conductor hears it finished
                  '--WAIT----> hold() ... tick: ready() --> role imports it, joined()
                                              expired() --> the client hears why

The estimate is the step of the batch with the request in it, from the worker's own cost
profile (the one it registers with the Conductor) and, when its engine speculates, the
rows its recent steps checked per sequence (:attr:`Worker.speculation`); the SLO is the
cluster's, which the Conductor sends when it accepts the worker
(:attr:`ConductorLink.tbt_slo_s`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel.decode_guard import (
    ADMIT,
    DECODE_GUARDS,
    REJECT,
    WAIT,
    decode_guard_verdict,
    decode_step_estimate_s,
    guard_refusal,
)
from halfmoon.costmodel.profile import CostProfile
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates


@dataclass
class Held:
    """A request the ``wait`` guard holds back: its context once joined (prompt + first
    token), until when it may wait, and what the role needs to join it later."""

    request_id: str
    context_tokens: int
    deadline_s: float
    payload: Any
    since_s: float = field(default_factory=time.monotonic)

    def waited_s(self) -> float:
        """Seconds held so far."""
        return time.monotonic() - self.since_s


class DecodeGuard:
    """``mode`` (one of :data:`DECODE_GUARDS`) over the step estimates of ``profile``;
    ``tbt_slo_s()`` says the cluster's TBT SLO now (0: not known yet, nothing is held
    or refused); ``speculation()`` the engine's recent speculation rates."""

    def __init__(
        self,
        mode: str,
        profile: CostProfile | None,
        tbt_slo_s: Callable[[], float],
        speculation: Callable[[], SpeculationRates] = lambda: NO_SPECULATION,
    ) -> None:
        if mode not in DECODE_GUARDS:
            raise HalfmoonError(
                f"unknown --decode-guard {mode!r}; use one of {', '.join(DECODE_GUARDS)}"
            )
        if mode != "off" and profile is None:
            raise HalfmoonError(f"--decode-guard {mode} needs the worker's cost profile")
        self.mode = mode
        self.profile = profile
        self._tbt_slo_s = tbt_slo_s
        self._speculation = speculation
        #: Context tokens of each request in the batch.
        self.context_tokens: dict[str, int] = {}
        self.held: deque[Held] = deque()
        self.num_refused = 0
        self.num_waited = 0
        self.num_wait_expired = 0

    @classmethod
    def off(cls) -> DecodeGuard:
        """A guard that admits everything (still keeping the batch's book)."""
        return cls("off", None, lambda: 0.0)

    @property
    def tbt_slo_s(self) -> float:
        """The TBT SLO the steps are held to."""
        return self._tbt_slo_s()

    def step_estimate_s(self, joining: Sequence[int] = ()) -> float:
        """The estimated step of the batch with requests of ``joining`` context tokens
        added (the simulator's ``step_estimate_s``)."""
        assert self.profile is not None
        num = len(self.context_tokens) + len(joining)
        context = sum(self.context_tokens.values()) + sum(joining)
        return decode_step_estimate_s(
            self.profile.decode_step_s, self.profile.serving, num, context,
            speculation=self._speculation(),
        )  # fmt: skip

    def check(self, context_tokens: int) -> tuple[str, float]:
        """The verdict on a request of ``context_tokens`` whose KV is here, and the step
        estimated with it joined. ``wait`` holds it behind any request already held
        (first come, first served); a refusal is counted here."""
        if self.mode == "off":
            return ADMIT, 0.0
        if self.mode == "wait" and self.held:
            return WAIT, self.step_estimate_s((self.held[0].context_tokens,))
        # the requests held join first, so they count (none are held under ``reject``)
        joining = (*(h.context_tokens for h in self.held), context_tokens)
        step_s = self.step_estimate_s(joining)
        busy = bool(self.context_tokens or self.held)
        verdict = decode_guard_verdict(self.mode, busy=busy, step_s=step_s,
                                       tbt_slo_s=self.tbt_slo_s)  # fmt: skip
        if verdict == REJECT:
            self.num_refused += 1
        return verdict, step_s

    def hold(self, held: Held) -> None:
        """Hold a request the ``wait`` verdict kept out of the batch."""
        self.held.append(held)
        self.num_waited += 1

    def ready(self) -> Held | None:
        """The first held request, taken off the queue, if it fits in the batch now (the
        batch empty, or its step within the SLO); the role joins it (:meth:`joined`)
        before asking again."""
        if not self.held:
            return None
        step_s = self.step_estimate_s((self.held[0].context_tokens,))
        verdict = decode_guard_verdict("wait", busy=bool(self.context_tokens), step_s=step_s,
                                       tbt_slo_s=self.tbt_slo_s)  # fmt: skip
        return self.held.popleft() if verdict == ADMIT else None

    def expired(self, now_s: float | None = None) -> list[Held]:
        """The held requests past their deadline, taken off the queue."""
        now_s = time.monotonic() if now_s is None else now_s
        late = [h for h in self.held if h.deadline_s < now_s]
        if late:
            self.held = deque(h for h in self.held if h.deadline_s >= now_s)
            self.num_wait_expired += len(late)
        return late

    def joined(self, request_id: str, context_tokens: int) -> None:
        """A request entered the batch holding ``context_tokens``."""
        self.context_tokens[request_id] = context_tokens

    def advanced(self, request_id: str, num_tokens: int) -> None:
        """A request of the batch got ``num_tokens`` more tokens."""
        if request_id in self.context_tokens:
            self.context_tokens[request_id] += num_tokens

    def left(self, request_id: str) -> Held | None:
        """A request left (finished or aborted): out of the batch, or out of the held
        queue (returned, so its resources can be given back)."""
        self.context_tokens.pop(request_id, None)
        for held in self.held:
            if held.request_id == request_id:
                self.held.remove(held)
                return held
        return None

    def refusal(self, instance_id: str, step_s: float) -> str:
        """What a refused request's client reads (what the simulator records)."""
        return guard_refusal(instance_id, step_s, self.tbt_slo_s)

    def expiry(self, instance_id: str, held: Held) -> str:
        """What a request held past its deadline reads."""
        slo_ms = self.tbt_slo_s * 1e3
        return (
            f"decode instance {instance_id} held the request {held.waited_s():.0f}s, until "
            f"its handoff deadline: its batch never fit the {slo_ms:g}ms TBT SLO with it "
            f"(decode guard 'wait')"
        )

    def stats(self) -> dict[str, int]:
        """The guard's counters (a worker pong's stats)."""
        return {
            "guard_refused": self.num_refused, "guard_waited": self.num_waited,
            "guard_waiting": len(self.held), "guard_wait_expired": self.num_wait_expired,
        }  # fmt: skip
