"""``make test`` from a fresh clone, run as each class of CPU this machine can imitate.

    python benchmarks/make_test_as.py --classes own,avx2,zen4 --out results/cpu/make_test_as.json

Each class gets a clone of the committed tree (``HEAD``) in a temporary folder and runs the
README's test command there, ``make test CPU=<class>`` (``own``: plain ``make test``), one after
another, never two at once, each making its own ``.venv`` as a new user's would. The record keeps,
per class, whether it passed, its wall time, the pytest summaries (unit tests, page checks),
whether the strict book build finished, the variables the class set and the end of the log. A
class's environment is what ``make`` exports (:data:`llmlib.kernels.flags.CLASSES`): that class's
code paths on this CPU, not its speed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", re.M)


def run_one(name: str, commit: str) -> dict:
    from llmlib.kernels.flags import class_env

    with tempfile.TemporaryDirectory(prefix=f"make-test-{name}-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", commit], check=True)
        cmd = ["make", "test"] + ([] if name == "own" else [f"CPU={name}"])
        t0 = time.perf_counter()
        run = subprocess.run(
            cmd, cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        seconds = time.perf_counter() - t0
    log = run.stdout
    summaries = SUMMARY.findall(log)
    return {
        "class": name,
        "command": " ".join(cmd),
        "env": {} if name == "own" else class_env(name),
        "passed": run.returncode == 0,
        "returncode": run.returncode,
        "seconds": round(seconds, 1),
        "unit_tests": summaries[0] if summaries else None,
        "page_checks": summaries[-1] if len(summaries) > 1 else None,
        "book_built": "build succeeded" in log,
        "failed": re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M),
        "crashed": re.findall(
            r"^\[gw\d\] node down: .*$|worker '\w+' crashed while running '.*$", log, re.M
        ),
        "log_tail": log[-3000:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--classes", default="avx2,zen4", help="own, avx2, zen4, comma-separated")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--out", help="write the record here (JSON)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from llmlib.device import machine_info

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", args.commit], capture_output=True, text=True
    ).stdout.strip()
    runs = []
    for name in args.classes.split(","):
        print(f"make test as {name} (commit {commit[:7]}) ...", flush=True)
        runs.append(run_one(name.strip(), commit))
        r = runs[-1]
        print(
            f"  {'passed' if r['passed'] else 'FAILED'} in {r['seconds']:.0f} s: "
            f"{r['unit_tests']}; pages {r['page_checks']}"
            + "".join(f"\n    {line}" for line in r["failed"] + r["crashed"]),
            flush=True,
        )
        result = {"machine": machine_info("cpu"), "commit": commit, "runs": runs}
        if args.out:  # after each class, so a long run keeps what it has if stopped
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    sys.exit(0 if all(r["passed"] for r in runs) else 1)


if __name__ == "__main__":
    main()
