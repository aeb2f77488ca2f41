"""Shared test setup: one CPU thread (the CI box has two cores shared by several jobs), a headless backend, and
the CI switch that turns skipped tests into failures.

Tests that need an optional extra (envpool, stable-baselines3, ...) or a system tool (Chromium) skip with the
reason when it is absent, so the README's ``pip install -e ".[test]"`` + ``python3 -m pytest -q`` passes on a fresh
machine. CI installs everything and sets ``PPOKIT_REQUIRE_ALL=1``: then every skip is reported as a failure, so a
missing extra there cannot hide a test. A test that may legitimately skip even in CI (hardware CI does not have,
e.g. a GPU) carries ``@pytest.mark.allow_skip``.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402  (after the environment so matplotlib, if imported later, sees MPLBACKEND)

torch.set_num_threads(1)

# pytester runs a tiny suite in-process to check the hook below (tests/test_optional.py).
pytest_plugins = ["pytester"]

REQUIRE_ALL_VAR = "PPOKIT_REQUIRE_ALL"


def _require_all() -> bool:
    return os.environ.get(REQUIRE_ALL_VAR, "") not in ("", "0")


def _skip_reason(longrepr) -> str:
    # A skip's longrepr is (path, lineno, "Skipped: reason"); keep only the reason.
    text = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def _as_failure(report, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"{what} skipped, but {REQUIRE_ALL_VAR}=1 (CI installs every extra and system tool) "
                       f"turns skips into failures: {_skip_reason(report.longrepr)}")


# Parametrized values that need an optional package: (parameter, value) -> (module, extra).
_OPTIONAL_PARAMS = {("vector_mode", "envpool"): ("envpool", "envpool")}


def pytest_collection_modifyitems(config, items):
    # A test parametrized over vector modes runs its envpool case only where the envpool extra is installed.
    import importlib.util

    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        for (name, value), (module, extra) in _OPTIONAL_PARAMS.items():
            if params.get(name) == value and importlib.util.find_spec(module) is None:
                item.add_marker(pytest.mark.skip(reason=f"{name}={value} needs pip install -e '.[{extra}]'"))


def pytest_configure(config):
    config.addinivalue_line("markers", "allow_skip: this test may skip even under PPOKIT_REQUIRE_ALL=1 (hardware)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # xfail also reports as skipped; it is an expected failure, not a missing dependency.
    if (report.skipped and not hasattr(report, "wasxfail") and _require_all()
            and item.get_closest_marker("allow_skip") is None):
        _as_failure(report, "test")


class _SkippedModule(pytest.Item):
    """Stands in for a module skipped at import under PPOKIT_REQUIRE_ALL=1: one failing test with the reason.

    A failed collection report would be an error that interrupts the whole session; a failing item keeps the rest
    of the suite running and counts as one failure."""

    def __init__(self, *, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self) -> None:
        pytest.fail(self.reason, pytrace=False)

    def reportinfo(self):
        return self.path, 0, self.name


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module-level pytest.importorskip skips the whole module at collection time.
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _require_all() and isinstance(collector, pytest.Module):
        reason = (f"module skipped, but {REQUIRE_ALL_VAR}=1 (CI installs every extra and system tool) turns skips "
                  f"into failures: {_skip_reason(report.longrepr)}")
        item = _SkippedModule.from_parent(collector, name="module_skipped", reason=reason)
        outcome.force_result(pytest.CollectReport(collector.nodeid, "passed", None, [item]))


@pytest.fixture
def counted_gridworld():
    """``(env_id, made)``: a registered GridWorld whose constructions append their kwargs to ``made``, so a test
    can see whether (and how often) a command built an environment; unregistered afterwards."""
    import gymnasium as gym

    from ppokit.envs import GridWorldEnv

    made: list[dict] = []

    class CountedGrid(GridWorldEnv):
        def __init__(self, **kw):
            made.append(kw)
            super().__init__(**kw)

    env_id = "ppokit_test/CountedGrid-v0"
    gym.register(env_id, entry_point=CountedGrid, max_episode_steps=50)
    try:
        gym.make(env_id).close()  # control: building this env is seen
        assert len(made) == 1
        yield env_id, made
    finally:
        gym.registry.pop(env_id, None)
