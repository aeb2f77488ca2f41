import os
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch

from ppokit.runtime.checkpoint import (
    FORMAT,
    VERSION,
    CheckpointError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

torch.set_num_threads(1)


def _state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "global_step": 12288,
        "update": 6,
        "config": {"env_id": "CartPole-v1", "lr": 3e-4, "clip_coef": 0.2, "target_kl": None, "anneal": True,
                   "hidden": [64, 64], "max_grad_norm": float("inf")},
        "obs_rms": {"mean": torch.zeros(4, dtype=torch.float64), "var": torch.ones(4), "count": 1e-4},
        "param": torch.nn.Parameter(torch.ones(2)),
        "meta": (torch.float32, torch.device("cpu"), torch.Size([2, 3])),
    }


def _tmp_files(directory):
    return [p for p in os.listdir(directory) if p.endswith(".tmp")]


def test_round_trip_nested_state(tmp_path):
    state = _state()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, state)
    out = load_checkpoint(path)
    assert out["format"] == FORMAT and out["version"] == VERSION
    assert set(out) == {"format", "version", *state}
    for k, v in state["model"].items():
        assert torch.equal(out["model"][k], v)
    assert out["optimizer"]["param_groups"][0]["lr"] == 3e-4
    assert torch.equal(out["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert out["global_step"] == 12288 and out["update"] == 6
    assert out["config"] == state["config"]
    assert out["obs_rms"]["mean"].dtype == torch.float64
    assert out["meta"] == state["meta"]
    assert _tmp_files(tmp_path) == []
    # The restored model state is usable as-is.
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model.load_state_dict(out["model"])


def test_save_overwrites_and_creates_parent(tmp_path):
    path = tmp_path / "a" / "b" / "ckpt.pt"
    save_checkpoint(path, {"step": 1})
    save_checkpoint(path, {"step": 2})
    assert load_checkpoint(path)["step"] == 2
    assert _tmp_files(path.parent) == []


@pytest.mark.parametrize("exc, raised", [
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"), CheckpointError),
    (OSError(28, "No space left on device"), CheckpointError),
    (PermissionError(13, "Permission denied"), CheckpointError),
    (KeyboardInterrupt(), KeyboardInterrupt),
])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, exc, raised):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(3)})
    before = path.read_bytes()

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise exc

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(raised) as info:
        save_checkpoint(path, {"step": 2, "w": torch.zeros(3)})
    monkeypatch.undo()
    if raised is CheckpointError:
        # One line that names the file and what failed, and says the old checkpoint is intact.
        msg = str(info.value)
        assert "\n" not in msg and str(path) in msg and "previous checkpoint is unchanged" in msg
        assert str(exc).split("]")[0].strip("[") in msg or "errno" in msg
        assert info.value.__cause__ is exc
    assert path.read_bytes() == before
    assert load_checkpoint(path)["step"] == 1
    assert _tmp_files(tmp_path) == []
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_failed_replace_cleans_up(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})

    def broken_replace(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(CheckpointError, match="rename failed"):
        save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1
    assert _tmp_files(tmp_path) == []


@pytest.mark.parametrize(
    "state, where",
    [
        ({"rng": {"numpy": np.zeros(3)}}, "state['rng']['numpy'] is numpy.ndarray"),
        ({"x": [1, 2, {"y": {1, 2}}]}, "state['x'][2]['y'] is set"),
        ({"lr": np.float64(0.1)}, "state['lr'] is numpy.float64"),
        ({"fn": len}, "state['fn'] is builtin_function_or_method"),
        ({"model": torch.nn.Linear(2, 2)}, "state['model'] is torch.nn.modules.linear.Linear"),
    ],
)
def test_unloadable_types_refused_at_save(tmp_path, state, where):
    path = tmp_path / "ckpt.pt"
    with pytest.raises(CheckpointError, match="weights_only") as info:
        save_checkpoint(path, state)
    assert where in str(info.value)
    assert not path.exists() and _tmp_files(tmp_path) == []


def test_non_string_key_and_reserved_key_refused(tmp_path):
    with pytest.raises(CheckpointError, match="key"):
        save_checkpoint(tmp_path / "c.pt", {"m": {object(): 1}})
    with pytest.raises(CheckpointError, match="reserved"):
        save_checkpoint(tmp_path / "c.pt", {"version": 7})
    with pytest.raises(CheckpointError, match="dict"):
        save_checkpoint(tmp_path / "c.pt", [1, 2])


def test_cycle_refused(tmp_path):
    loop = []
    loop.append(loop)
    with pytest.raises(CheckpointError, match="cycle"):
        save_checkpoint(tmp_path / "c.pt", {"loop": loop})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_tensor_refused_at_save(tmp_path, bad):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})
    w = torch.ones(4)
    w[2] = bad
    with pytest.raises(CheckpointError, match="NaN or Inf") as info:
        save_checkpoint(path, {"step": 2, "model": OrderedDict(fc=w)})
    assert "state['model']['fc']" in str(info.value)
    assert load_checkpoint(path)["step"] == 1


def test_integer_tensors_and_shared_objects_allowed(tmp_path):
    shared = torch.arange(3)
    save_checkpoint(tmp_path / "c.pt", {"a": shared, "b": [shared, shared], "bits": torch.tensor([True, False])})
    out = load_checkpoint(tmp_path / "c.pt")
    assert torch.equal(out["b"][1], torch.arange(3))


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="not a file"):
        load_checkpoint(tmp_path)


def test_random_bytes_and_empty_file(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(CheckpointError, match="truncated, corrupt") as info:
        load_checkpoint(path)
    assert info.value.__cause__ is not None
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="truncated, corrupt"):
        load_checkpoint(path)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.95])
def test_truncated_checkpoint(tmp_path, fraction):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state())
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.__cause__ is not None


def test_foreign_checkpoint(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    with pytest.raises(CheckpointError, match="not a ppokit checkpoint"):
        load_checkpoint(path)
    torch.save([torch.ones(1)], path)
    with pytest.raises(CheckpointError, match="not a ppokit checkpoint"):
        load_checkpoint(path)


def test_newer_or_invalid_version(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"format": FORMAT, "version": VERSION + 1}, path)
    with pytest.raises(CheckpointError, match="newer ppokit"):
        load_checkpoint(path)
    torch.save({"format": FORMAT, "version": "1"}, path)
    with pytest.raises(CheckpointError, match="invalid checkpoint version"):
        load_checkpoint(path)


class _Payload:
    """Unpickling this would create a marker file: stands in for arbitrary code execution."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_object_refused_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "version": VERSION, "model": _Payload(marker)}, path)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="pickled Python objects") as info:
        load_checkpoint(path)
    assert info.value.__cause__ is not None
    assert not marker.exists()


def test_map_location(tmp_path):
    save_checkpoint(tmp_path / "c.pt", {"w": torch.ones(2)})
    out = load_checkpoint(tmp_path / "c.pt", map_location=torch.device("cpu"))
    assert out["w"].device.type == "cpu"


def _draw():
    return (
        [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        np.random.rand(3).tolist() + [np.random.randn()],
        torch.rand(3).tolist() + torch.randn(1).tolist(),
    )


def test_rng_state_round_trip_through_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    # A pending cached gaussian is part of the state, so leave one behind in python and numpy.
    random.gauss(0, 1)
    np.random.randn()
    save_checkpoint(tmp_path / "c.pt", {"rng": rng_state()})
    expected = _draw()

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draw() != expected
    set_rng_state(load_checkpoint(tmp_path / "c.pt")["rng"])
    got = _draw()
    assert got[0] == expected[0]
    assert got[1] == expected[1]
    assert got[2] == expected[2]


def test_rng_state_in_memory_and_partial():
    state = rng_state()
    expected = _draw()
    set_rng_state(state)
    assert _draw() == expected
    state = rng_state()
    a = random.random()
    t = torch.rand(4)
    set_rng_state({"python": state["python"]})
    assert random.random() == a
    assert not torch.equal(torch.rand(4), t)  # sections not given are left alone, so torch is not rewound


def test_malformed_rng_state():
    with pytest.raises(CheckpointError, match="malformed RNG state"):
        set_rng_state({"numpy": {"keys": torch.zeros(3)}})
