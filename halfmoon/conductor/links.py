"""Network links: when each instance's link is next free, first come first served.

One model serves both sides. The simulator books every transfer it runs on the sender's
and the receiver's :class:`Link` (:func:`reserve_transfer`); the Conductor, with
``link_backlog`` on, books on a :class:`LinkBook` the transfers it *plans* (prefix
fetches, the prefill-to-decode KV hand-off, hot-spot replications; for a CPP group each
member's share of a fetch and each stage's hand-off) and prices a fetch by the wait for
both links, so on a congested network a fetch costs what it waits for
instead of looking free.

The view is store-and-forward (no fair sharing): a transfer starts when both links are
free and its data is ready, and holds both for ``bytes / bandwidth`` seconds. Booked
ahead of time, it is conservative: a transfer planned for later also blocks the gap
before it, which stands in for the delay a new transfer would cause the ones already
planned.
"""

from __future__ import annotations

from collections.abc import Sequence


class Link:
    """An instance's network interface, busy until ``free_at_s``."""

    __slots__ = ("free_at_s",)

    def __init__(self) -> None:
        self.free_at_s = 0.0


def reserve_transfer(ready_s: float, duration_s: float, sender: Link, receiver: Link) -> float:
    """Book a transfer of ``duration_s`` that may start at ``ready_s`` on both links;
    returns when it ends."""
    start_s = max(ready_s, sender.free_at_s, receiver.free_at_s)
    end_s = start_s + duration_s
    if sender is not receiver:  # a local "transfer" occupies no link
        sender.free_at_s = end_s
        receiver.free_at_s = end_s
    return end_s


class LinkBook:
    """The Conductor's links, one per instance id, created on first use."""

    def __init__(self) -> None:
        self._links: dict[str, Link] = {}

    def link(self, instance_id: str) -> Link:
        """``instance_id``'s link."""
        link = self._links.get(instance_id)
        if link is None:
            link = self._links[instance_id] = Link()
        return link

    def free_at_s(self, instance_id: str) -> float:
        """When ``instance_id``'s link is next free (0: never booked)."""
        link = self._links.get(instance_id)
        return 0.0 if link is None else link.free_at_s

    def wait_s(self, ready_s: float, sender: str, receiver: str) -> float:
        """Seconds a transfer ready at ``ready_s`` waits for both links."""
        if sender == receiver:
            return 0.0
        return max(0.0, max(self.free_at_s(sender), self.free_at_s(receiver)) - ready_s)

    def reserve(self, ready_s: float, duration_s: float, sender: str, receiver: str) -> float:
        """Book a transfer (:func:`reserve_transfer`); nothing for no time or no link."""
        if duration_s <= 0.0 or sender == receiver:
            return ready_s
        return reserve_transfer(ready_s, duration_s, self.link(sender), self.link(receiver))

    def fan_out_s(
        self,
        ready_s: float,
        sender: str,
        transfers: Sequence[tuple[str, float]],
        book: bool = False,
    ) -> float:
        """Seconds from ``ready_s`` until ``sender`` has sent each ``(receiver,
        duration_s)``, one after another over its one link, as :meth:`reserve` would
        place them in that order (a CPP group's members fetching their shares of a prefix
        from one source); ``book``: reserve them too."""
        sender_free_s = self.free_at_s(sender)
        end_s = ready_s
        for receiver, duration_s in transfers:
            if duration_s <= 0.0 or receiver == sender:
                continue
            start_s = max(ready_s, sender_free_s, self.free_at_s(receiver))
            sender_free_s = end_s = start_s + duration_s
            if book:
                self.reserve(ready_s, duration_s, sender, receiver)
        return end_s - ready_s

    def forget(self, instance_id: str) -> None:
        """Drop a removed instance's link."""
        self._links.pop(instance_id, None)

    def state(self, now_s: float) -> dict[str, float]:
        """Seconds of booked backlog per instance (0 for an idle link), for stats."""
        return {iid: max(0.0, link.free_at_s - now_s) for iid, link in self._links.items()}
