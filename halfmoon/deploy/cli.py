"""``halfmoon cluster scale|status|stop``: talk to a running Ray deployment's controller;
and ``halfmoon serve --ray``, which starts one."""

from __future__ import annotations

import argparse
import json
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.deploy.options import NAMESPACE, add_ray_options
from halfmoon.serve.launch.launcher import check_shape, run_serve


def _controller(args: argparse.Namespace) -> Any:
    from halfmoon.deploy.ray_serve import connect

    ray = connect(args.address)
    try:
        return ray.get_actor(args.name, namespace=NAMESPACE)
    except ValueError:
        raise HalfmoonError(f"no deployment named {args.name!r} on this Ray cluster") from None


def scale_targets(args: argparse.Namespace) -> dict[str, int]:
    """{role: size} from ``--prefill`` / ``--decode`` / ``--instances``."""
    named = {"prefill": args.prefill, "decode": args.decode, "coupled": args.instances}
    targets = {role: n for role, n in named.items() if n is not None}
    if not targets:
        raise HalfmoonError("name at least one pool size: --prefill, --decode or --instances")
    return targets


def run_scale(args: argparse.Namespace) -> int:
    """Resize pools; with ``--wait``, until the new workers joined and the removed left."""
    import ray

    from halfmoon.deploy.ray_serve import wait_settled

    targets = scale_targets(args)
    controller = _controller(args)
    reply = ray.get(controller.scale.remote(targets), timeout=120)
    if "error" in reply:
        raise HalfmoonError(reply["error"])
    if args.wait:
        reply["status"] = wait_settled(controller, args.wait)
    print(json.dumps(reply, indent=2))
    return 0


def run_status(args: argparse.Namespace) -> int:
    """Print the controller's view of the deployment as JSON."""
    import ray

    print(json.dumps(ray.get(_controller(args).status.remote(), timeout=120), indent=2))
    return 0


def run_stop(args: argparse.Namespace) -> int:
    """Stop every process of the deployment and its controller (or, when the controller
    was killed for good, whatever of the deployment still runs: its actors are detached)."""
    from halfmoon.deploy.ray_serve import stop_deployment
    from halfmoon.deploy.record import remove_leftovers

    try:
        controller = _controller(args)
    except HalfmoonError:
        if not remove_leftovers(args.name):
            raise
        print(f"halfmoon: deployment {args.name!r} had no controller; ended what was left")
        return 0
    stop_deployment(controller, args.name)
    print(f"halfmoon: stopped deployment {args.name!r}")
    return 0


def run_serve_or_ray(args: argparse.Namespace) -> int:
    """``halfmoon serve``: Ray places the processes with ``--ray``, else the launcher does."""
    if args.ray is None:
        return run_serve(args)
    check_shape(args)
    from halfmoon.deploy.ray_serve import run_serve_ray

    return run_serve_ray(args)


def register(subparsers: Any) -> None:
    """Add ``--ray`` to ``halfmoon serve`` (registered before: halfmoon.cli's order) and
    add ``halfmoon cluster``. deploy/ sits above serve/, so it extends serve's command, never
    the other way round (tests/test_layering.py)."""
    serve = subparsers.choices["serve"]
    add_ray_options(serve)
    serve.set_defaults(func=run_serve_or_ray)
    p = subparsers.add_parser(
        "cluster", help="scale, inspect or stop a running Ray deployment (serve --ray)",
        description="Talk to the controller of a deployment started by `halfmoon serve --ray`.",
    )  # fmt: skip
    sub = p.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    for action, func, text in (
        ("scale", run_scale, "resize pools: new workers join, removed ones drain first"),
        ("status", run_status, "print the deployment's workers, nodes and states (JSON)"),
        ("stop", run_stop, "stop the deployment"),
    ):
        q = sub.add_parser(action, help=text, description=text)
        q.add_argument("--address", default="auto", help="Ray cluster address (default auto)")
        q.add_argument("--name", default="halfmoon", help="deployment name (--deployment-name)")
        q.set_defaults(func=func)
        if action == "scale":
            q.add_argument("--prefill", type=int, default=None, help="prefill workers")
            q.add_argument("--decode", type=int, default=None, help="decode workers")
            q.add_argument("--instances", type=int, default=None, help="coupled workers")
            q.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                           help="wait up to SECONDS for joins and drains to finish")  # fmt: skip
