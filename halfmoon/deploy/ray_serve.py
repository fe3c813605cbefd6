"""``halfmoon serve --ray``: start a deployment on a Ray cluster and serve until stopped.

This process is a Ray driver only: it creates the deployment's detached controller actor
(:mod:`halfmoon.deploy.controller`), which places the Conductor, the workers and the
gateway, prints the gateway's address, and waits. Ctrl-C / SIGTERM stops the deployment;
with ``--detach`` it returns at once and ``halfmoon cluster stop`` stops it later. While
Ray restarts the controller, the driver waits for it; it gives up only once the
controller is gone for good.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.deploy.options import NAMESPACE, DeploySpec, deploy_spec
from halfmoon.serve.launch.launcher import conductor_json, engine_json
from halfmoon.serve.runtime import SECRET_ENV, new_secret, setup_logging, stop_event_on_signals


def import_ray() -> Any:
    """Ray, or a clear error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise HalfmoonError(
            "this needs Ray: pip install 'halfmoon[ray]' (or pip install ray)"
        ) from None
    return ray


def connect(address: str) -> Any:
    """``ray.init`` as a quiet driver in the halfmoon namespace."""
    ray = import_ray()
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING",
                 log_to_driver=True, configure_logging=False)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise HalfmoonError(f"cannot reach the Ray cluster at {address!r}: {exc}") from None
    return ray


def ray_error(exc: BaseException) -> str:
    """The message of an exception raised inside an actor (without Ray's traceback)."""
    cause = getattr(exc, "cause", None)
    return str(cause) if cause is not None else str(exc).strip().splitlines()[-1]


def start_deployment(spec: DeploySpec, secret: str) -> tuple[Any, dict[str, Any]]:
    """Create the controller and start every process; returns (controller, start info)."""
    import ray

    from halfmoon.deploy.controller import Controller, controller_options

    name = spec.config.name
    try:
        ray.get_actor(name, namespace=NAMESPACE)
        raise HalfmoonError(f"deployment {name!r} is already running "
                            f"(halfmoon cluster stop --name {name})")  # fmt: skip
    except ValueError:
        pass  # no such actor: the usual case
    controller = (
        ray.remote(Controller)
        .options(**controller_options(name), runtime_env={"env_vars": {SECRET_ENV: secret}})
        .remote(spec)
    )
    try:
        info = ray.get(controller.start.remote(), timeout=spec.gateway.startup_timeout_s + 60)
    except Exception as exc:  # any failure to start: tear down what was placed, say why
        stop_deployment(controller, name)
        raise HalfmoonError(f"deployment {name!r} failed to start: {ray_error(exc)}") from None
    return controller, info


def stop_deployment(controller: Any, name: str, restart_wait_s: float = 30.0) -> None:
    """Stop every process of deployment ``name``, then its controller (waiting up to
    ``restart_wait_s`` for one being restarted); when the controller cannot do it, end
    what is left of the deployment from here."""
    import ray

    from halfmoon.deploy.record import remove_leftovers

    deadline = time.monotonic() + restart_wait_s
    while True:
        try:
            ray.get(controller.stop.remote(), timeout=60)
            break
        except ray.exceptions.RayActorError as exc:
            if isinstance(exc, ray.exceptions.ActorDiedError) or time.monotonic() > deadline:
                print(f"halfmoon: stopping: {ray_error(exc)}", flush=True)
                remove_leftovers(name)
                break
            time.sleep(1.0)  # being restarted by Ray
        except Exception as exc:  # the controller failed to stop: kill it anyway
            print(f"halfmoon: stopping: {ray_error(exc)}", flush=True)
            remove_leftovers(name)
            break
    ray.kill(controller, no_restart=True)


def run_serve_ray(args: argparse.Namespace) -> int:
    """Start the deployment, print the gateway's address, serve until interrupted."""
    log = setup_logging("serve", args.log_level)
    # Each node prepares the model and puts its directory into the document.
    spec = deploy_spec(args, engine_json(args, args.model), conductor_json(args))
    ray = connect(spec.config.address)
    stop = stop_event_on_signals()
    controller, info = start_deployment(spec, os.environ.get(SECRET_ENV) or new_secret())
    sizes = ", ".join(f"{n} {role}" for role, n in spec.sizes)
    print(f"halfmoon: serving at {info['gateway']}/v1 (Ray deployment {spec.config.name!r}: "
          f"{sizes}; Conductor {info['conductor']})", flush=True)  # fmt: skip
    if spec.config.detach:
        print(f"halfmoon: detached; stop with `halfmoon cluster stop --name {spec.config.name}`")
        return 0
    try:
        while not stop.wait(2.0):
            try:
                ray.get(controller.ping.remote(), timeout=30)
            except Exception as exc:
                try:  # Ray is restarting it (the deployment serves on meanwhile)?
                    ray.get_actor(spec.config.name, namespace=NAMESPACE)
                    log.warning("the controller does not answer (%s): waiting", ray_error(exc))
                except ValueError:  # killed for good, e.g. by `halfmoon cluster stop`
                    raise HalfmoonError(
                        f"the deployment's controller is gone ({ray_error(exc)}); what it "
                        f"started may still run: `halfmoon cluster stop --name "
                        f"{spec.config.name}` ends it"
                    ) from None
    finally:
        if stop.is_set():
            log.info("stopping deployment %s", spec.config.name)
            stop_deployment(controller, spec.config.name)
    return 0


def wait_settled(controller: Any, timeout_s: float, poll_s: float = 0.5) -> dict[str, Any]:
    """The controller's status once every running worker is registered with the Conductor
    and no worker is draining (raises after ``timeout_s``)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = ray.get(controller.status.remote(), timeout=60)
        except ray.exceptions.ActorUnavailableError:  # being restarted: ask again
            if time.monotonic() > deadline:
                raise
            time.sleep(poll_s)
            continue
        running = [w["name"] for w in status["workers"] if w["state"] == "running"]
        draining = [w["name"] for w in status["workers"] if w["state"] != "running"]
        joining = [n for n in running if n not in status["registered"]]
        if not joining and not draining:
            return status
        if time.monotonic() > deadline:
            raise HalfmoonError(f"not settled after {timeout_s:g}s: joining {joining}, "
                                f"draining {draining}")  # fmt: skip
        time.sleep(poll_s)
