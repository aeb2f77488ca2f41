import csv
import io
import json
import math

import pytest
import torch
from rich.console import Console

from ppokit.runtime.logger import ConsoleSink, CSVSink, MetricsLogger, TensorBoardSink

torch.set_num_threads(1)

NAN = float("nan")


def _metrics(i, ret=None):
    return {
        "charts/episodic_return": 20.0 + i if ret is None else ret,
        "charts/episodic_length": 100.0 + i,
        "losses/policy_loss": -0.01 * i,
        "losses/value_loss": 0.5,
        "losses/entropy": 0.69,
        "diag/approx_kl": 0.004,
        "diag/clipfrac": 0.12,
        "diag/explained_variance": 0.8,
        "charts/learning_rate": 2.5e-4,
        "diag/epochs_run": 4,
        "perf/sps": 4100.0,
    }


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _term_console():
    return Console(file=io.StringIO(), force_terminal=True, width=120)


def _plain_console():
    return Console(file=io.StringIO(), force_terminal=False, width=120)


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    return acc


# ----------------------------------------------------------------------------------------------- CSV


def test_csv_header_rows_and_nan(tmp_path):
    path = tmp_path / "m.csv"
    with CSVSink(path) as sink:
        sink.write(128, {"charts/episodic_return": NAN, "losses/policy_loss": -0.25, "diag/epochs_run": 4})
        sink.write(256, {"charts/episodic_return": 12.5, "losses/policy_loss": 0.1, "diag/epochs_run": 3})
    rows = _rows(path)
    assert rows[0] == ["global_step", "charts/episodic_return", "losses/policy_loss", "diag/epochs_run"]
    assert rows[1] == ["128", "", "-0.25", "4"]
    assert rows[2] == ["256", "12.5", "0.1", "3"]


def test_csv_flushes_every_row(tmp_path):
    path = tmp_path / "m.csv"
    sink = CSVSink(path)
    sink.write(1, {"a": 1.0})
    # Still open: a crash right now must not lose the row.
    assert _rows(path) == [["global_step", "a"], ["1", "1.0"]]
    sink.close()
    sink.close()


def test_csv_full_precision_and_tensor_values(tmp_path):
    path = tmp_path / "m.csv"
    with CSVSink(path) as sink:
        sink.write(1, {"x": 0.1 + 0.2, "t": torch.tensor(2.5), "inf": math.inf})
    assert float(_rows(path)[1][1]) == 0.1 + 0.2
    assert _rows(path)[1][2:] == ["2.5", "inf"]


def test_csv_new_key_raises_missing_key_is_blank(tmp_path):
    path = tmp_path / "m.csv"
    with CSVSink(path) as sink:
        sink.write(1, {"a": 1.0, "b": 2.0})
        with pytest.raises(ValueError, match="not in the CSV header"):
            sink.write(2, {"a": 1.0, "c": 3.0})
        sink.write(3, {"b": 5.0})
        with pytest.raises(ValueError, match="reserved"):
            sink.write(4, {"global_step": 1.0})
    assert _rows(path) == [["global_step", "a", "b"], ["1", "1.0", "2.0"], ["3", "", "5.0"]]


def test_csv_resume_appends_without_second_header(tmp_path):
    path = tmp_path / "m.csv"
    with CSVSink(path) as sink:
        sink.write(1, {"a": 1.0, "b": 2.0})
    with CSVSink(path) as sink:
        assert sink.columns == ["global_step", "a", "b"]
        # Key order of the resumed run does not matter; the file's columns win.
        sink.write(2, {"b": 20.0, "a": 10.0})
        with pytest.raises(ValueError):
            sink.write(3, {"zzz": 1.0})
    assert _rows(path) == [["global_step", "a", "b"], ["1", "1.0", "2.0"], ["2", "10.0", "20.0"]]


def test_csv_resume_after_crash_mid_row(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("global_step,a\n1,1.0\n2,2.")
    with CSVSink(path) as sink:
        sink.write(3, {"a": 3.0})
    assert _rows(path)[-1] == ["3", "3.0"]


def test_csv_refuses_foreign_file(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("time,value\n1,2\n")
    with pytest.raises(ValueError, match="not a ppokit metrics CSV"):
        CSVSink(path)


# ----------------------------------------------------------------------------------------- TensorBoard


def test_tensorboard_scalars_read_back(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(100, {"charts/episodic_return": NAN, "losses/policy_loss": -0.5})
    sink.write(200, {"charts/episodic_return": 10.0, "losses/policy_loss": -0.25})
    sink.write(300, {"charts/episodic_return": 12.0, "losses/policy_loss": math.inf})
    sink.text(300, "notes/run", "hello")
    sink.close()
    sink.close()
    acc = _scalars(tmp_path / "tb")
    ret = [(e.step, e.value) for e in acc.Scalars("charts/episodic_return")]
    loss = [(e.step, e.value) for e in acc.Scalars("losses/policy_loss")]
    assert ret == [(200, 10.0), (300, 12.0)]
    assert loss == [(100, -0.5), (200, -0.25)]
    assert "notes/run/text_summary" in acc.Tags()["tensors"]


# -------------------------------------------------------------------------------------------- console


def test_console_terminal_shows_bar_and_table():
    console = _term_console()
    sink = ConsoleSink(10_000, log_every=2, console=console)
    assert sink.live
    for i in range(1, 5):
        sink.write(i * 1000, _metrics(i))
    sink.close()
    out = console.file.getvalue()
    assert "━" in out
    assert "40%" in out
    for header in ("return", "length", "policy loss", "value loss", "entropy", "approx KL", "clipfrac",
                   "expl. var", "lr", "epochs", "SPS"):
        assert header in out, header
    assert "update 4" in out
    assert "4,100" in out


def test_console_not_a_terminal_prints_plain_progress_line():
    console = _plain_console()
    sink = ConsoleSink(100_000, log_every=3, console=console)
    assert not sink.live
    for i in range(1, 4):
        sink.write(i * 4096, {"charts/episodic_return": 23.1, "perf/sps": 4100.0, "diag/approx_kl": 0.004})
    out = console.file.getvalue()
    assert "update 3 step 12,288 return 23.1 kl 0.004 clipfrac - ev - sps 4,100" in out
    assert "\x1b[" not in out  # no escape codes in a pipe
    assert "━" not in out.splitlines()[0]
    sink.write(5 * 4096, {"charts/episodic_return": NAN, "perf/sps": 4000.0, "diag/approx_kl": 0.01})
    sink.close()
    # close() reports where the run stopped; a NaN return keeps the last finite one.
    assert out != console.file.getvalue()
    assert console.file.getvalue().rstrip().endswith("update 4 step 20,480 return 23.1 kl 0.01 clipfrac - ev - sps 4,000")


def test_console_default_console_under_capsys(capsys, monkeypatch):
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    sink = ConsoleSink(1000, log_every=1)
    sink.write(500, {"charts/episodic_return": 1.5})
    sink.alert(500, "warning", "kl_spike", "approx_kl 0.3")
    sink.close()
    out = capsys.readouterr().out
    assert "update 1 step 500 return 1.5" in out
    assert "WARNING step 500 kl_spike: approx_kl 0.3" in out


def test_console_alert_and_markup_escaping():
    console = _term_console()
    sink = ConsoleSink(1000, console=console)
    sink.alert(10, "error", "nan_loss", "loss became [nan] at [bold]epoch 2")
    sink.alert(11, "warn", "kl_high", "approx_kl 0.03")
    sink.alert(12, "alert", "kl_spike", "approx_kl 0.3")
    sink.close()
    out = console.file.getvalue()
    assert "ERROR" in out and "nan_loss" in out
    assert "\x1b[33mWARN\x1b[0m" in out  # yellow
    assert "\x1b[1;31mALERT\x1b[0m" in out  # bold red
    assert "[nan]" in out and "[bold]epoch 2" in out


def test_console_disabled_is_silent():
    console = _term_console()
    sink = ConsoleSink(1000, log_every=1, console=console, enabled=False)
    sink.write(10, _metrics(1))
    sink.alert(10, "warning", "x", "y")
    sink.close()
    assert console.file.getvalue() == ""


def test_console_rejects_bad_arguments():
    with pytest.raises(ValueError):
        ConsoleSink(0)
    with pytest.raises(ValueError):
        ConsoleSink(100, log_every=0)


# ------------------------------------------------------------------------------------ MetricsLogger


def test_metrics_logger_fan_out_and_alerts(tmp_path):
    console = _term_console()
    with MetricsLogger(tmp_path, total_timesteps=4000, log_every=2, console_obj=console) as logger:
        for i in range(1, 5):
            logger.log(i * 1000, _metrics(i, ret=NAN if i == 2 else None))
        rec = logger.alert(3000, "warning", "kl_spike", "approx_kl 0.2 > 0.05",
                           data={"approx_kl": torch.tensor(0.2), "ratio": [1.0, NAN]})
        logger.alert(4000, "ERROR", "nan_loss", "loss is NaN")
        logger.summary({"final return": "24.0", "SPS": "4,100"})
    assert rec["level"] == "warning" and rec["step"] == 3000

    rows = _rows(tmp_path / "metrics.csv")
    assert rows[0][:2] == ["global_step", "charts/episodic_return"]
    assert len(rows) == 5 and rows[2][1] == ""

    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    parsed = [json.loads(line) for line in lines]
    assert [a["name"] for a in parsed] == ["kl_spike", "nan_loss"]
    assert set(parsed[0]) == {"step", "level", "name", "message", "data", "time"}
    assert parsed[0]["data"]["approx_kl"] == pytest.approx(0.2)
    assert parsed[0]["data"]["ratio"] == [1.0, "nan"]
    assert parsed[1]["level"] == "error"
    assert logger.alerts == parsed

    acc = _scalars(tmp_path / "tb")
    assert [e.step for e in acc.Scalars("charts/episodic_return")] == [1000, 3000, 4000]
    assert [e.value for e in acc.Scalars("perf/sps")] == [4100.0] * 4
    assert {"alerts/kl_spike/text_summary", "alerts/nan_loss/text_summary"} <= set(acc.Tags()["tensors"])
    text_events = acc.Tensors("alerts/kl_spike/text_summary")
    assert text_events[0].step == 3000
    assert b"approx_kl 0.2 > 0.05" in text_events[0].tensor_proto.string_val[0]

    out = console.file.getvalue()
    assert "━" in out and "approx KL" in out
    assert "kl_spike" in out and "run summary" in out and "final return" in out
    assert "2 (1 warning, 1 error)" in out
    logger.close()


def test_metrics_logger_resume_and_options(tmp_path):
    console = _plain_console()
    with MetricsLogger(tmp_path, 100, tensorboard=False, console=False, console_obj=console) as logger:
        logger.log(10, {"a": 1.0})
        logger.alert(10, "info", "note", "hi")
        logger.summary({"x": "y"})
    with MetricsLogger(tmp_path, 100, tensorboard=False, console=False, console_obj=console) as logger:
        logger.log(20, {"a": 2.0})
        logger.alert(20, "info", "note", "again")
        assert len(logger.alerts) == 1  # in-memory list is per session; the file keeps the whole history
    assert _rows(tmp_path / "metrics.csv") == [["global_step", "a"], ["10", "1.0"], ["20", "2.0"]]
    assert len((tmp_path / "alerts.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "tb").exists()
    assert console.file.getvalue() == ""


def test_csv_resume_of_an_older_run_extends_its_header_once(tmp_path):
    # A run written before a column existed (e.g. diag/approx_kl_after) resumes: the header grows, old rows get
    # empty cells, and after that first row the key set is fixed again.
    path = tmp_path / "m.csv"
    with CSVSink(path) as sink:
        sink.write(1, {"a": 1.0})
    with CSVSink(path) as sink:
        sink.write(2, {"a": 2.0, "new": 3.0})
        with pytest.raises(ValueError, match="not in the CSV header"):
            sink.write(3, {"a": 1.0, "other": 3.0})
    assert _rows(path) == [["global_step", "a", "new"], ["1", "1.0", ""], ["2", "2.0", "3.0"]]
    assert not list(tmp_path.glob(".*.tmp"))
