"""TensorBoard's event file cannot be written (a full disk): the run ends with one line naming TensorBoard, its
directory and the reason, after saving its checkpoint, and TensorBoard's writer thread prints no traceback.

Two real ENOSPC failures: a 16 KiB tmpfs mounted over the run's ``tb`` directory in a private mount namespace
(``unshare -m``: needs root and util-linux; the mount is gone when the process ends, nobody else sees it), and,
anywhere, the event file replaced mid-run by a symlink to ``/dev/full``, where every write fails with ENOSPC
(TensorBoard's local file system appends by reopening the file for each record).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ppokit.cli import main
from ppokit.runtime.checkpoint import load_checkpoint
from ppokit.runtime.logger import SinkError, TensorBoardSink
from ppokit.training.trainer import CHECKPOINT_NAME

TRAIN = ["train", "--env", "CartPole-v1", "--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2",
         "--update-epochs", "1", "--total-timesteps", "19968", "--quiet"]  # 312 whole batches: no rounding note


def _can_mount_privately() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=60)
    return probe.returncode == 0


@pytest.mark.slow  # a training subprocess: seconds; CI runs it
@pytest.mark.allow_skip  # needs root for a private mount namespace; the /dev/full test below runs anywhere
def test_a_full_disk_under_tensorboard_is_one_line_and_the_run_saves(tmp_path):
    if not _can_mount_privately():
        pytest.skip("needs root and unshare -m to mount a small tmpfs in a private mount namespace")
    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    script = (f"mount -t tmpfs -o size=16k tmpfs {run / 'tb'} && head -c 12288 /dev/zero > {run / 'tb' / 'fill'}; "
              f"exec {sys.executable} -m ppokit {' '.join(TRAIN)} --run-dir {run}")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"})
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 1, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"error: TensorBoard could not write its event file in {run / 'tb'}: No space left "
                               "on device (errno 28 ENOSPC; the disk is full); saved the checkpoint of update ")
    saved = load_checkpoint(run / CHECKPOINT_NAME)
    assert saved["update"] >= 1 and saved["global_step"] == saved["update"] * 64
    # Outside the namespace the tmpfs is gone (tb/ is an empty directory again): the run continues.
    assert main(["train", "--resume", str(run), "--total-timesteps", str(saved["global_step"] + 128), "--quiet"]) == 0
    assert load_checkpoint(run / CHECKPOINT_NAME)["global_step"] == saved["global_step"] + 128


# Run in its own interpreter: pytest replaces threading.excepthook during a test, which would hide the writer
# thread's traceback this test is about.
DEV_FULL_RUN = """
import os, sys, warnings
warnings.simplefilter("ignore")
from ppokit.config.ppo_config import PPOConfig
from ppokit.runtime.logger import SinkError
from ppokit.training.trainer import train

def fill_after_first_update(info):
    if info.update == 1:
        (event_file,) = (info.run_dir / "tb").glob("events.out.tfevents.*")
        # Swapped in by one rename: TensorBoard's writer thread reopens the file for each record, and would
        # recreate it between an unlink and a symlink.
        link = event_file.with_name("full.link")
        link.symlink_to("/dev/full")
        os.replace(link, event_file)

cfg = PPOConfig(env_id="CartPole-v1", num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1,
                total_timesteps=64 * 40, run_dir=sys.argv[1])
try:
    train(cfg, console_enabled=False, callbacks=[fill_after_first_update])
except SinkError as exc:
    print(f"SinkError: {exc}")
    sys.exit(1)
"""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_an_event_file_that_cannot_be_written_ends_the_run_after_saving(tmp_path):
    proc = subprocess.run([sys.executable, "-c", DEV_FULL_RUN, str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith("SinkError: TensorBoard could not write its event file in ") and "errno 28 ENOSPC" in line
    saved = load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME)
    assert saved["update"] >= 2  # the update whose events failed was saved (or, failing at close, the last)
    assert f"saved the checkpoint of update {saved['update']}" in line


def test_a_tensorboard_directory_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(SinkError, match=r"TensorBoard could not write its event file in .*file/tb: "):
        TensorBoardSink(tmp_path / "file" / "tb")


def test_other_threads_still_report_their_errors(tmp_path):
    """Only TensorBoard's writer threads are quiet: any other thread's uncaught error is printed as before."""
    code = ("import sys, threading; from ppokit.runtime.logger import TensorBoardSink; TensorBoardSink(sys.argv[1]).close()\n"
            "def boom(): raise RuntimeError('a thread of someone else')\n"
            "t = threading.Thread(target=boom); t.start(); t.join()")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tb")], capture_output=True, text=True,
                          timeout=300)
    assert "Exception in thread" in proc.stderr and "RuntimeError: a thread of someone else" in proc.stderr
