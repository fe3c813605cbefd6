"""One ``/metrics`` for the whole cluster: the gateway asks the Conductor and every
registered worker for its metrics (``metrics_query``, all at once, each with a short
timeout), labels each process's series and merges them with its own::

    gateway ---metrics_query---> Conductor, prefill-0, decode-0, ...   (concurrently)
            <--metrics_text----  each its own registry's text, no process labels
    parse each text -> add role, worker, model_name -> merge families by name -> render once

Every sample gets ``role`` (gateway, conductor, prefill, decode, coupled), ``worker``
(the instance id; ``gateway`` and ``conductor`` for those two) and ``model_name`` (the
served model's name, as vLLM labels every series), unless it has that label already:
``halfmoon:scrape_errors{worker=...}`` keeps the name of the process that did not answer
(a dead or frozen worker is skipped, never waited on past the timeout). Families of the
same name from several processes become one family; one whose type disagrees with the
first seen is dropped (logged). ``*_created`` samples (process start times of counters
and histograms) are left out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from halfmoon.serve.gateway.backend import BackendError
from halfmoon.serve.gateway.prom import GatewayMetrics

log = logging.getLogger(__name__)
#: How long one process's answer is awaited (a local cluster answers in milliseconds).
PROCESS_TIMEOUT_S = 0.3
#: The gateway's own process labels.
GATEWAY = "gateway"


@dataclass(frozen=True)
class ProcessText:
    """One process's metrics text and the labels its series get."""

    role: str
    worker: str
    text: str


class _Merged:
    """Merged families, in the order first seen; a collector for ``generate_latest``."""

    def __init__(self) -> None:
        self.families: dict[str, Metric] = {}

    def add(self, family: Any, labels: dict[str, str]) -> None:
        """Add ``family``'s samples with ``labels`` (a sample's own labels win)."""
        merged = self.families.get(family.name)
        if merged is None:
            merged = self.families[family.name] = Metric(
                family.name, family.documentation, family.type
            )
        elif merged.type != family.type:
            log.warning("metric %s is a %s here, a %s elsewhere: dropped",
                        family.name, family.type, merged.type)  # fmt: skip
            return
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            merged.samples.append(Sample(s.name, {**labels, **s.labels}, s.value, s.timestamp))

    def collect(self) -> Iterator[Metric]:
        """Every merged family."""
        return iter(self.families.values())


def merge(processes: Iterable[ProcessText], model_name: str) -> bytes:
    """The processes' metrics as one text exposition, each sample labelled with its
    process's ``role`` and ``worker`` and with ``model_name``. A text that does not parse
    is skipped (logged)."""
    merged = _Merged()
    for p in processes:
        labels = {"role": p.role, "worker": p.worker, "model_name": model_name}
        try:
            families = list(text_string_to_metric_families(p.text))
        except ValueError as exc:
            log.warning("metrics of %s %s do not parse: %s", p.role, p.worker, exc)
            continue
        for family in families:
            if family.name.endswith("_created") and family.type == "gauge":
                continue  # a counter's or histogram's start time (see the module docstring)
            merged.add(family, labels)
    return generate_latest(merged)


async def scrape(
    backend: Any, metrics: GatewayMetrics, model_name: str, timeout_s: float = PROCESS_TIMEOUT_S
) -> bytes:
    """The cluster's merged metrics. A backend without ``metrics_texts`` (an in-process
    one) gives the gateway's own only; each process that does not answer within
    ``timeout_s`` is counted in ``halfmoon:scrape_errors`` and skipped."""
    processes: list[ProcessText] = []
    texts_of = getattr(backend, "metrics_texts", None)
    if texts_of is not None:
        try:  # each ask has its own timeout; this bounds the Conductor's ping before them
            texts, failed = await asyncio.wait_for(texts_of(timeout_s), 3 * timeout_s + 0.5)
        except (TimeoutError, BackendError):
            texts, failed = [], ["conductor"]
        for worker in failed:
            metrics.scrape_errors.labels(worker).inc()
        processes = [ProcessText(t.role, t.instance_id, t.text) for t in texts]
    own = ProcessText(GATEWAY, GATEWAY, metrics.render().decode())
    return merge([own, *processes], model_name)
