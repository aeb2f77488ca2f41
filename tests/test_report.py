"""``ppokit report``: a self-contained HTML page, checked in real headless Chromium (screenshot non-blank, DOM holds
every plot, no script and no console errors). The browser test skips without Chromium (``apt-get install -y
chromium``; CI installs it and turns the skip into a failure)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from ppokit.analysis.report import CURVES, build_report
from ppokit.cli import main
from ppokit.config.ppo_config import load_preset
from ppokit.training.trainer import train

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Chromium is not installed; the report test needs a real browser. Install it with: "
                    "apt-get update && apt-get install -y chromium")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    config = load_preset("gridworld")
    config.total_timesteps = 3000
    config.tensorboard = False
    config.run_dir = str(tmp_path_factory.mktemp("report") / "run")
    return train(config, console_enabled=False).run_dir


def test_report_is_self_contained(run_dir):
    html = build_report(run_dir)
    assert "<script" not in html.lower()
    # Nothing is fetched: every src is an embedded PNG, no stylesheet links.
    srcs = re.findall(r'src="([^"]*)"', html)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    # Base64 image data can spell anything ("hTTp" lower-cased), so look for links outside the embedded images.
    text = re.sub(r'data:image/png;base64,[A-Za-z0-9+/=]*', "", html).lower()
    assert "<link" not in text and "http" not in text
    assert len(srcs) == len(CURVES) + 1  # every curve + the alert timeline
    for column, _, _ in CURVES:
        assert f'id="plot-{column.replace("/", "-")}"' in html
    assert 'id="doctor"' in html and 'id="config"' in html and "ppokit/GridWorld-v0" in html


@pytest.mark.slow
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    chromium = _chromium()
    out = tmp_path / "report.html"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    profile = tmp_path / "profile"
    shot = tmp_path / "shot.png"
    url = out.resolve().as_uri()
    r = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1280,2000",
                        f"--screenshot={shot}", "--enable-logging=stderr", "--v=0", url],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CONSOLE" not in r.stderr and "Uncaught" not in r.stderr, r.stderr[-2000:]

    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))
    assert pixels.shape[0] == 2000 and pixels.shape[1] == 1280
    flat = (pixels[..., :3] * 255).astype("uint8").reshape(-1, 3)
    distinct = {tuple(p) for p in flat[:: 97]}
    assert len(distinct) > 50, f"screenshot looks blank ({len(distinct)} distinct colours)"

    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    imgs = re.findall(r'<img[^>]*src="data:image/png;base64,', dom.stdout)
    assert len(imgs) == len(CURVES) + 1
    for column, _, _ in CURVES:
        assert f'id="plot-{column.replace("/", "-")}"' in dom.stdout
    assert "Diagnosis (ppokit doctor)" in dom.stdout
