"""What a restarted controller reads: its persisted record, and the live named actors.

The record is small JSON (the pools, the Conductor's endpoint, where the gateway serves),
rewritten whenever the controller changes any of it, and read back by a restarted
controller (:meth:`halfmoon.deploy.controller.Controller.recover`). It lives in the GCS
rather than in a file because the controller may come back on another node; the GCS
outlives every actor (and, with GCS fault tolerance, the head node itself). Ray Serve
keeps its own controller's checkpoint the same way. ``Controller.stop`` deletes it.

Only this module touches ``ray.experimental.internal_kv`` (an internal Ray API). The
record says what was started; the named actors (``NAME:ROLE-INDEX``, ``NAME:gateway``,
``NAME:conductor`` in the ``halfmoon`` namespace) say what still runs.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from halfmoon.deploy.options import NAMESPACE

VERSION = 1


def _key(name: str) -> str:
    return f"deployment:{name}"


def save_record(name: str, record: dict[str, Any]) -> None:
    """Store deployment ``name``'s record (replacing the previous one)."""
    from ray.experimental import internal_kv

    body = json.dumps({"version": VERSION, **record}, sort_keys=True)
    internal_kv._internal_kv_put(_key(name), body, overwrite=True, namespace=NAMESPACE)


def load_record(name: str) -> dict[str, Any] | None:
    """Deployment ``name``'s record, or None when there is none (or of another version)."""
    from ray.experimental import internal_kv

    body = internal_kv._internal_kv_get(_key(name), namespace=NAMESPACE)
    if not body:
        return None
    record = json.loads(body)
    return record if record.get("version") == VERSION else None


def delete_record(name: str) -> None:
    """Forget deployment ``name``'s record (it was stopped)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_key(name), namespace=NAMESPACE)


def remove_leftovers(name: str) -> bool:
    """End every actor of deployment ``name`` still alive, its placement group and its
    record (what outlives a controller that was killed for good: its actors are detached).
    Returns whether there was anything to end."""
    import ray

    found = False
    for full in deployment_actors(f"{name}:"):
        handle = named_actor(full)
        if handle is not None:
            ray.kill(handle, no_restart=True)
            found = True
    pg = named_placement_group(f"{name}:workers")
    if pg is not None:
        ray.util.remove_placement_group(pg)
        found = True
    delete_record(name)
    return found


def actor_was_restarted() -> bool:
    """Whether Ray restarted the actor this runs in (its constructor runs again)."""
    import ray

    with warnings.catch_warnings():  # Ray's property uses a deprecated API of its own
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def named_actor(name: str) -> Any:
    """The live actor called ``name`` in halfmoon's namespace, or None."""
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def deployment_actors(prefix: str) -> list[str]:
    """Names of the live actors in halfmoon's namespace that start with ``prefix``."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith(prefix))  # fmt: skip


def named_placement_group(name: str) -> Any:
    """The placement group called ``name``, or None."""
    from ray.util import get_placement_group

    try:
        return get_placement_group(name)
    except ValueError:
        return None


def node_alive(node_id: str) -> bool:
    """Whether the Ray node ``node_id`` is alive."""
    import ray

    return any(n.get("NodeID") == node_id and n.get("Alive") for n in ray.nodes())
