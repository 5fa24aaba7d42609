"""benchmarks/engine_host.py: the host's time a request a decode step, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "engine_host.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


def test_it_times_both_settings_and_profiles_each_on_the_fake_gpu_and_on_cpu() -> None:
    """Both output settings a batch, and with --profile the top functions of each, in
    microseconds a request a step; on the fake GPU by default, and on a real backend."""
    for backend in ("fake", "cpu"):
        done = _run("--backend", backend, "--batch", "2", "--gen-tokens", "3",
                    "--prompt-tokens", "5", "--repeat", "1", "--profile", "4")  # fmt: skip
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["backend"] == backend and result["prompt_tokens"] == 5
        row = result["us_per_request_step"]["2"]
        assert row["every_step"] > 0 and row["final_only"] > 0
        for setting in ("every_step", "final_only"):
            top = result["profile"]["2"][setting]
            assert len(top) == 4 and all(r["calls"] > 0 and r["own_us"] >= 0 for r in top)


def test_a_bad_backend_or_model_is_one_line_naming_it() -> None:
    done = _run("--backend", "nope", "--batch", "2", "--repeat", "1")
    assert done.returncode == 1 and "engine_host.py: unknown backend 'nope'" in done.stderr
    assert "Traceback" not in done.stderr
    done = _run("--model", "/nonexistent/m.gguf", "--batch", "2", "--repeat", "1")
    assert done.returncode == 1 and "/nonexistent/m.gguf" in done.stderr
    assert "Traceback" not in done.stderr
