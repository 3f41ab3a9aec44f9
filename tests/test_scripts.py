"""The maintainers' scripts that had no test of their own: their arguments are checked before they start any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    """`python scripts/<name> ARGS` from the repository root, as docs/development.md runs them (no PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def test_fault_battery_prints_its_usage_and_refuses_a_filter_that_matches_no_try():
    """`--help` had been read as a filter that matched no try: nothing ran and the battery passed."""
    shown = _script("fault_battery.py", "--help")
    assert shown.returncode == 0 and "usage: fault_battery.py" in shown.stdout and "\ntried " not in shown.stdout
    refused = _script("fault_battery.py", "no such try")
    assert refused.returncode == 2 and "no try's name contains 'no such try'" in refused.stderr


def test_profile_ddp_step_names_its_variants_and_refuses_an_unknown_one_before_spawning():
    """A misspelt variant had failed inside both spawned GPU workers; no variant at all profiled nothing."""
    shown = _script("profile_ddp_step.py", "--help")
    assert shown.returncode == 0 and "BucketedDDP (default: auto)" in shown.stdout
    for args, words in ((("BucketedDDP",), "invalid choice: 'BucketedDDP'"), ((), "the following arguments are "
                                                                                  "required: VARIANT")):
        refused = _script("profile_ddp_step.py", *args)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr
