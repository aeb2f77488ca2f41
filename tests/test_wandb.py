"""``--track``: the W&B sink logs every update's metrics; offline (WANDB_MODE=offline) it writes the W&B run into
RUN_DIR/wandb without a network; without wandb, --track is refused in one line naming the extra."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import time
from pathlib import Path

import pytest

from ppokit.config.ppo_config import ConfigError, PPOConfig


def _config(tmp_path, **kw) -> PPOConfig:
    base = dict(env_id="CartPole-v1", num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1,
                total_timesteps=2 * 32 * 3, seed=1, tensorboard=False, log_every=1000, run_dir=str(tmp_path / "run"),
                track=True, wandb_project="ppokit-test")
    base.update(kw)
    return PPOConfig(**base)


def _records(path: Path):
    """The protobuf records of a ``.wandb`` file: a 7-byte ':W&B' header, then LevelDB-log blocks of 32 KiB whose
    chunks (4-byte CRC, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last) carry the records."""
    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            buf = chunk
        elif kind in (3, 4):
            buf += chunk
        if kind in (1, 4):
            yield buf


def _history(path: Path) -> list[dict]:
    """The history rows of a finished offline run (waiting for W&B's service, which writes the file after
    ``finish()`` returns, to write its exit record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + 30
    while True:
        recs = []
        try:
            for raw in _records(path):
                rec = pb.Record()
                rec.ParseFromString(raw)
                recs.append(rec)
        except Exception:  # noqa: BLE001 - a record being written: read again
            recs = []
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    rows = []
    for rec in recs:
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def test_offline_run_writes_a_wandb_run_with_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs pip install -e '.[wandb]'")
    from ppokit.core import schema as S
    from ppokit.training.trainer import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    run = train(_config(tmp_path), console_enabled=False)
    runs = list((run.run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run.run_dir / "wandb").iterdir())
    history = [h for h in _history(next(runs[0].glob("run-*.wandb"))) if S.POLICY_LOSS in h]
    # One history row per update, at its env step, holding the finite values logged to metrics.csv.
    assert [h["global_step"] for h in history] == [64, 128, 192]
    for h, m in zip(history, run.metrics):
        for key in (S.POLICY_LOSS, S.APPROX_KL, S.EXPLAINED_VARIANCE, S.LEARNING_RATE, S.SPS):
            assert h[key] == m[key], key
        assert all(math.isfinite(v) for v in h.values() if isinstance(v, float))
        assert set(m) <= set(h) | {k for k, v in m.items() if math.isnan(v)}


def test_sink_leaves_non_finite_values_out(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs pip install -e '.[wandb]'")
    from ppokit.runtime.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    sink = WandbSink(tmp_path / "run", {"seed": 1}, "ppokit-test")
    sink.write(10, {"charts/episodic_return": float("nan"), "diag/approx_kl": 0.5, "diag/x": float("inf")})
    sink.alert(10, "warn", "kl_spike")
    sink.close()
    sink.close()  # idempotent
    path = next((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = _history(path)
    assert {"global_step": 10, "diag/approx_kl": 0.5}.items() <= rows[0].items()
    assert not any("charts/episodic_return" in r or "diag/x" in r for r in rows)  # a gap, not a number
    assert any(r.get("alerts/kl_spike") == 1.0 and r["global_step"] == 10 for r in rows)


def test_track_without_wandb_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    from ppokit.cli import main
    from ppokit.training.trainer import train

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"'track'.*pip install 'ppokit\[wandb\]'"):
        train(_config(tmp_path), console_enabled=False)
    assert not (tmp_path / "run").exists()  # refused before the run dir is claimed
    rc = main(["train", "--env", "CartPole-v1", "--preset", "cartpole", "--track", "--total-timesteps", "256",
               "--run-dir", str(tmp_path / "cli"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "config field 'track'" in err and "pip install 'ppokit[wandb]'" in err and err.count("error:") == 1
