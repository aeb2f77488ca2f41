"""Ctrl-C at any moment of ``ppokit train``'s start-up (the package's imports, torch's, building the envs) exits
130 with no traceback; after start-up the trainer's own handler finishes the update, saves and exits 130 too.

Each case is a real ``python -m ppokit train`` (or the console script) sent a real SIGINT. The delay counts from
the moment ppokit's first module (``ppokit.runtime.interrupts``, imported first by the package, which installs the
handler as it loads) is loaded, which ``-X importtime``
reports on stderr. Before it only the interpreter has run (``site`` and its ``.pth`` files, ``runpy``, the check
of the script's path), and CPython reports an interrupt there itself (measured: "Fatal Python error:
init_import_site", "Could not import runpy module", and for the console script a traceback after which CPython
runs the script anyway), which no code in ppokit can reach.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ppokit.runtime.interrupts import started_as_command

TRAIN = ["train", "--env", "CartPole-v1", "--total-timesteps", "100000000", "--quiet", "--no-tensorboard"]
# Seconds after ppokit.runtime.interrupts is loaded: inside the package's imports (gymnasium, numpy), the parser, torch's and gymnasium's imports,
# building the envs, and (the last ones, on a loaded machine too) the training loop.
DELAYS = [0.0, 0.01, 0.03, 0.06, 0.1, 0.15, 0.25, 0.4, 0.6, 0.9, 1.2, 1.5]


def _default_sigint() -> None:
    # A child inherits an ignored SIGINT (a suite started in the background by a non-interactive shell has it
    # ignored, as POSIX says for `cmd &`), and Python then leaves it ignored: each child starts as a terminal would
    # start it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(cmd: list[str], delay: float, cwd: Path) -> tuple[int, str]:
    """Start ``cmd`` under ``-X importtime``, send SIGINT ``delay`` s after ppokit.runtime.interrupts is loaded; (exit code,
    stderr without the import-time lines)."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", *cmd], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=_default_sigint)
    started = threading.Event()
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            if line.startswith("import time:"):
                if line.rsplit("|", 1)[-1].strip() == "ppokit.runtime.interrupts":
                    started.set()
            else:
                lines.append(line)
        started.set()  # the process ended before: do not wait forever

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(120), "ppokit did not start"
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(30)
    return rc, "".join(lines)


@pytest.mark.slow  # a dozen processes that import torch: ~40 s; CI runs it
def test_ctrl_c_at_any_moment_of_start_up_exits_130_without_a_traceback(tmp_path):
    outcomes = []
    for i, delay in enumerate(DELAYS):
        rc, err = _interrupt(["-m", "ppokit", *TRAIN, "--run-dir", f"r{i}"], delay, tmp_path)
        outcomes.append((delay, rc, err))
    bad = [(d, rc, err[-600:]) for d, rc, err in outcomes if rc != 130 or "Traceback" in err
           or "KeyboardInterrupt" in err]
    assert not bad, bad


@pytest.mark.slow
def test_the_console_script_exits_130_too(tmp_path):
    script = shutil.which("ppokit")
    if script is None:
        pytest.skip("no ppokit console script on PATH (pip install -e . makes one)")
    for i, delay in enumerate([0.0, 0.05, 0.3]):
        rc, err = _interrupt([script, *TRAIN, "--run-dir", f"r{i}"], delay, tmp_path)
        assert rc == 130 and "Traceback" not in err, (delay, rc, err[-600:])


@pytest.mark.parametrize("orig_argv, expected", [
    (["python3", "-m", "ppokit", "train"], True),
    (["python3", "-X", "importtime", "-m", "ppokit.cli", "eval"], True),
    (["python3", "-u", "-mppokit", "train"], True),
    (["/usr/bin/python3", "/usr/local/bin/ppokit", "train"], True),
    (["python3", "-m", "pytest", "-q"], False),
    (["python3", "-c", "import ppokit"], False),
    (["python3", "my_script.py", "-m", "ppokit"], False),
    (["python3", "-m", "ppokitten"], False),
    (["python3"], False),
])
def test_only_ppokits_own_command_line_defers_ctrl_c(orig_argv, expected):
    """A program that imports ppokit keeps its SIGINT handling; only ppokit's command line changes it."""
    assert started_as_command(orig_argv) is expected


def test_importing_ppokit_leaves_sigint_alone(tmp_path):
    code = ("import signal, ppokit, ppokit.cli; "
            "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=120, preexec_fn=_default_sigint)
