"""The device check runs on the CPU as it will on a lent GPU (``DEVICE=cpu benchmarks/device_check.sh
--quick``), so that a GPU session's first run is not the script's first run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_device_check_runs_on_the_cpu(tiny_model_dir, tmp_path):
    data = tmp_path / "bench.jsonl"
    rows = [{"question_id": f"{cat}{i}", "category": cat, "turns": [f"{cat} question {i}: say hello"]}
            for cat in ("qa", "math_reasoning") for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "DEVICE": "cpu", "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    proc = subprocess.run([str(ROOT / "benchmarks" / "device_check.sh"), "--quick", "--model", str(tiny_model_dir),
                           "--parts", "shapes,kernels,embedded,heads,serving", "--head-minutes", "0.1",
                           "--data", str(data), "--skip-first", "2", "--per-category", "1", "--fp32-per-category", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "device_check.json").read_text())
    shapes = result["shapes"]["rows"]
    assert [r["shape"] for r in shapes] == ["tiny-llama", "tiny-qwen3"]
    assert all("error" not in r and r["step_ms"] > 0 and len(r["verify"]) == 16 for r in shapes)
    assert all(sorted(r["batch_verify"]) == ["1", "2"] and r["batch_verify"]["1"][0] == 1.0
               and all(x > 0 for x in r["batch_verify"]["2"]) for r in shapes)  # the verify table by batch size
    assert "verify table by batch size" in proc.stdout
    (kernels,) = result["kernels"]["rows"]  # the first quick shape's step under the profiler
    assert kernels["shape"] == "tiny-llama" and kernels["kernels_per_step"] > 0 and kernels["top"]
    assert 0 < kernels["busy_ms"]
    assert kernels["busy_share"] == pytest.approx(kernels["busy_ms"] / kernels["step_ms"], abs=0.01)
    emb = result["embedded"]
    assert emb["calibrate"]["ok"], emb["calibrate"]["tail"]
    fp32 = {"ar", "knn-ssd", "pld", "hf", "hf-pld"}  # the equality run leaves out hf-static's compilation
    for dtype, methods in (("bfloat16", fp32 | {"hf-static"}), ("float32", fp32)):
        report = emb[f"bench_{dtype}"]["report"]
        assert set(report) == methods
        assert all(r["tokens_per_s"] > 0 for r in report.values())
    assert all(r["identical_to_ar"] for m, r in emb["bench_float32"]["report"].items() if m != "ar")
    assert set(emb["raced"]) == {"qa", "math_reasoning"}  # each domain's decision and raced speedups
    assert all(r["decision"] and all(x > 0 for x in r["raced"].values()) for r in emb["raced"].values())
    assert "| knn-ssd |" in proc.stdout and "(b) random-weight shapes" in proc.stdout
    assert "where the plain step's time goes" in proc.stdout and "raced on the calibration prompts" in proc.stdout
    heads = result["heads"]  # issue 61's: a head distilled here into the profile, benched beside ar
    assert heads["distill"]["ok"], heads["distill"]["tail"]
    assert 0 <= heads["head"]["acceptance"] <= 1 and heads["head"]["train_seconds"] > 0
    assert set(heads["bench_bfloat16"]["report"]) == {"ar", "knn-ssd", "eagle", "eagle-chain", "pld"}
    assert heads["bench_float32"]["report"]["eagle"]["identical_to_ar"]
    assert "## eagle head trained on this device" in proc.stdout
    serving = result["serving"]  # issue 64's serving part: every client count, speculation on and off
    assert "error" not in serving, serving.get("error")
    assert [(r["clients"], r["speculation"]) for r in serving["rows"]] == [(1, "auto"), (1, "off"), (2, "auto"),
                                                                          (2, "off")]
    assert all("error" not in r and r["tokens_per_s"] > 0 and r["server_errors"] == 0 for r in serving["rows"])
    assert all(r["ttft_s"]["median"] > 0 and r["itl_s"]["median"] > 0 for r in serving["rows"])
    assert not serving["batched_graphs"]  # the CPU batches eagerly
    assert [r["batch"] for r in serving["peer"]] == [1, 2] and all(r["tokens_per_s"] > 0 for r in serving["peer"])
    assert "## serving: adaptive serve" in proc.stdout
