"""The conftest switch PPOKIT_REQUIRE_ALL: on a fresh machine a test whose optional extra is missing skips with its
reason; in CI (the variable set) the same skip is a failure, so CI cannot silently stop running a test."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")
CUDA_ONLY_EXTRAS = {"vllm"}  # extras CI cannot install (CUDA wheels only)

SUITE = """
import pytest

def test_runs():
    pass

def test_needs_missing_extra():
    pytest.importorskip("ppokit_no_such_module_xyz", reason="needs pip install -e '.[nothing]'")

@pytest.fixture
def tool():
    pytest.skip("frobnicator is not installed")

def test_needs_tool(tool):
    pass

@pytest.mark.allow_skip
def test_needs_hardware():
    pytest.skip("no GPU")

@pytest.mark.xfail(reason="known bug", strict=True)
def test_known_bug():
    assert False
"""

MODULE_SKIP = """
import pytest
pytest.importorskip("ppokit_no_such_module_xyz", reason="needs pip install -e '.[nothing]'")

def test_never_collected():
    pass
"""


@pytest.fixture
def suite(pytester):
    # The real conftest, so the test exercises the hook CI uses, not a copy of it.
    pytester.makeconftest(CONFTEST.read_text(encoding="utf-8"))
    pytester.makepyfile(test_suite=SUITE, test_module_skip=MODULE_SKIP)
    return pytester


def test_without_the_variable_missing_extras_skip_with_their_reason(suite, monkeypatch):
    monkeypatch.delenv("PPOKIT_REQUIRE_ALL", raising=False)
    result = suite.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=4, xfailed=1)
    # fnmatch: "[[]" is a literal "[".
    result.stdout.fnmatch_lines(["*needs pip install -e '.[[]nothing]'*", "*frobnicator is not installed*"])


@pytest.mark.parametrize("value", ["1", "yes"])
def test_with_the_variable_every_skip_fails_except_allow_skip(suite, monkeypatch, value):
    monkeypatch.setenv("PPOKIT_REQUIRE_ALL", value)
    result = suite.runpytest()
    # The skipping test fails, the fixture's skip is a setup error, the module-level skip becomes one failing item
    # (not a collection error, which would stop the session); allow_skip still skips, the strict xfail stays one.
    result.assert_outcomes(passed=1, failed=2, skipped=1, xfailed=1, errors=1)
    result.stdout.fnmatch_lines(["FAILED test_module_skip.py::module_skipped*",
                                 "FAILED test_suite.py::test_needs_missing_extra*",
                                 "ERROR test_suite.py::test_needs_tool*"])
    result.stdout.fnmatch_lines(["*PPOKIT_REQUIRE_ALL=1*: needs pip install -e '.[[]nothing]'"])
    assert result.ret != 0


def test_zero_means_off(suite, monkeypatch):
    monkeypatch.setenv("PPOKIT_REQUIRE_ALL", "0")
    suite.runpytest().assert_outcomes(passed=1, skipped=4, xfailed=1)


def test_a_parametrized_envpool_case_skips_without_envpool_and_fails_under_the_variable(pytester, monkeypatch):
    # The real hook, with the optional module swapped for one that is surely absent (envpool may be installed here).
    text = CONFTEST.read_text(encoding="utf-8")
    assert '("envpool", "envpool")}' in text
    pytester.makeconftest(text.replace('("envpool", "envpool")}', '("ppokit_no_such_module_xyz", "envpool")}'))
    pytester.makepyfile(test_modes="""
import pytest

@pytest.mark.parametrize("vector_mode", ["sync", "envpool"])
def test_mode(vector_mode):
    pass
""")
    monkeypatch.delenv("PPOKIT_REQUIRE_ALL", raising=False)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*vector_mode=envpool needs pip install -e '.[[]envpool]'*"])
    monkeypatch.setenv("PPOKIT_REQUIRE_ALL", "1")
    pytester.runpytest().assert_outcomes(passed=1, errors=1)  # a skip marker acts in setup: an error


def test_ci_installs_every_extra_sets_the_variable_and_runs_the_readme_command():
    import re

    import tomllib

    root = CONFTEST.parents[1]
    ci = (root / ".ci" / "run").read_text(encoding="utf-8")
    extras = set(tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
                 ["optional-dependencies"])
    installed = re.search(r'pip install -q -e "\.\[([a-z0-9,_-]+)\]"', ci)
    # vllm ships CUDA wheels only; CI is a CPU machine, and the vllm tests are hardware tests (allow_skip).
    assert installed and set(installed.group(1).split(",")) == extras - CUDA_ONLY_EXTRAS
    assert "export PPOKIT_REQUIRE_ALL=1" in ci and "apt-get install -y -qq chromium" in ci
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert "python3 -m pytest -q\n" in ci and "```bash\npython3 -m pytest -q\n```" in readme
