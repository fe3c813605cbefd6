"""KV transfers between instances: NIC reservations and the layer-wise overlap formula.

Each instance has one :class:`Nic` (the sum of its GPUs' RDMA NICs). A transfer reserves
the sender's and the receiver's NIC for ``bytes / bandwidth`` seconds, first come first
served: it starts when both are free and the data is ready. This is a conservative
store-and-forward view of contention (no fair sharing), the same one the Conductor's
link books use (:mod:`halfmoon.conductor.links`).

Prefill-to-decode KV is streamed layer by layer while the prefill computes, so only part
of it is left when the compute ends; :func:`kv_stream_tail_s` gives that tail, and only
the tail is reserved on the NICs (the streamed part runs at the compute's pace, a small
share of the link; its contention is not modelled).
"""

from __future__ import annotations

from halfmoon.conductor.links import Link, reserve_transfer

__all__ = ["Nic", "kv_stream_tail_s", "reserve_transfer"]


#: An instance's NIC: the Conductor's link model (one definition for both).
Nic = Link


def kv_stream_tail_s(
    compute_s: float, cached_xfer_s: float, new_xfer_s: float, num_layers: int
) -> float:
    """Seconds after the prefill compute ends until the decode instance holds all the KV.

    The cached prefix's KV (``cached_xfer_s`` of link time) is ready when the compute
    starts; the new tokens' KV is produced one layer at a time, ``new_xfer_s / L`` of link
    time every ``compute_s / L`` seconds (``L = num_layers``). The link sends whatever is
    ready, so the stream ends at the latest of "everything from chunk k on, once chunk k is
    ready", over the chunks (prefix = 0, layers 1..L). That is linear in k, so only the
    ends matter::

        end = max(cached + new,              # link-bound from the start
                  compute/L + new,           # link-bound from the first layer on
                  compute + new/L)           # the last layer's share after compute
        tail = end - compute   (>= new/L: the last layer always adds its share)

    With a fast link the tail is the last layer's share; with a slow one it is the excess
    of transfer over compute.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    end_s = max(
        cached_xfer_s + new_xfer_s,
        compute_s / num_layers + new_xfer_s,
        compute_s + new_xfer_s / num_layers,
    )
    return max(0.0, end_s - compute_s)
