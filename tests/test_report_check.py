"""``python -m bench.report.build --check OUT`` (what ``nox -s gpu`` runs after the smoke pipeline): it passes only on a
report.json with a measured speed-up of the searched configuration, on the kind of device asked for."""

from __future__ import annotations

import json

import pytest

from bench.report.build import ReportError, check_report, main


def _write(tmp_path, device="cuda:0", searched_speedup=1.7):
    configs = [{"config": "plain", "engine": "own", "searched": False, "tokens_per_s": 500.0, "speedup_vs_plain": 1.0},
               {"config": "searched", "engine": "own", "searched": True, "tokens_per_s": 850.0, "questions": 20,
                "speedup_vs_plain": searched_speedup, "speedup_vs_plain_ci": [1.6, 1.8] if searched_speedup else None}]
    machine = {"device": device, **({"gpu": "NVIDIA H100"} if device.startswith("cuda") else {"cpu_model": "a CPU"})}
    (tmp_path / "report.json").write_text(json.dumps({"schema": "medusa-report/1", "machine": machine,
                                                      "configs": configs}))
    return tmp_path


def test_a_measured_searched_speedup_on_the_device_passes(tmp_path, capsys):
    out = _write(tmp_path)
    line = check_report(out, "cuda")
    assert "1.70x (1.60-1.80)" in line and "NVIDIA H100" in line and "20 questions" in line
    assert main(["--check", str(out), "--device", "cuda"]) == 0


@pytest.mark.parametrize("device,speedup,why", [("cpu", 1.7, "measured on cpu, not cuda"),
                                                ("cuda:0", None, "no measured speed-up")])
def test_anything_else_fails_in_one_line(tmp_path, capsys, device, speedup, why):
    out = _write(tmp_path, device, speedup)
    with pytest.raises(ReportError, match=why):
        check_report(out, "cuda")
    assert main(["--check", str(out), "--device", "cuda"]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(ReportError, match="no report.json"):
        check_report(tmp_path / "elsewhere")
