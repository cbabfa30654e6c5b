"""Run the stress harness over a seed range, restarting after seeds that kill the job.

Against faulty code a seed may hang in a call without a deadline (the
watchdog then ends the job) or crash a rank (a segfault): the MPI job is
gone, and the seeds after it would go unrun. This driver runs
``mpiexec ... stress_harness.py --report FILE``, sees from the report which
seed was the last one finished, records the next one as killed (``hang`` if
the harness printed ``HANG:``, else ``crash``), and starts again after it.
At the end it prints, per defect class, the seeds that showed it.

Not under mpiexec:  python tests/stress/resume.py --seeds 40 --report /tmp/r.jsonl \\
    [--pythonpath /work/stress-base] [-- extra harness arguments]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).resolve().parents[1] / "stress_harness.py"


def _done(report: Path) -> dict[int, dict[str, Any]]:
    if not report.exists():
        return {}
    out = {}
    for line in report.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[int(rec["seed"])] = rec
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--report", required=True, type=Path)
    parser.add_argument("--log", type=Path, help="mpiexec output (default: REPORT.log)")
    parser.add_argument("--pythonpath", default="", help="put this tree first (old code)")
    parser.add_argument("--job-timeout", type=int, default=900, help="mpiexec --timeout")
    parser.add_argument("extra", nargs="*", help="after --: more harness arguments")
    args = parser.parse_args()
    log = args.log or args.report.with_suffix(".log")
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="true",
        OMPI_MCA_mpi_yield_when_idle="true",
    )
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    end = args.first + args.seeds
    seed = args.first
    while seed < end:
        cmd = [
            "mpiexec", "-n", str(args.np), "--timeout", str(args.job_timeout),
            sys.executable, "-m", "mpi4py", str(HARNESS),
            "--first", str(seed), "--seeds", str(end - seed), "--report", str(args.report),
            *args.extra,
        ]  # fmt: skip
        with open(log, "a") as out:
            out.write(f"\n$ {' '.join(cmd)}\n")
            out.flush()
            start = out.tell()  # read only this job's output below
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        done = _done(args.report)
        last = max((s for s in done if args.first <= s < end), default=seed - 1)
        if last >= end - 1:
            break
        killed = last + 1
        with open(log) as f:
            f.seek(start)
            tail = f.read().splitlines()
        hang = [ln for ln in tail if ln.startswith("HANG:")]
        reason = "hang" if hang else "crash"
        signs = ("exited on signal", "Segmentation", "Error")
        why = (
            hang[-1]
            if hang
            else next(
                (ln for ln in reversed(tail) if any(s in ln for s in signs)),
                f"mpiexec exited with {proc.returncode}",
            )
        )
        # Defects a rank found before the job died (printed by the harness's die()).
        tag = "UNREPORTED "
        unreported = sorted({ln[len(tag) :] for ln in tail if ln.startswith(tag)})
        counts = {reason: 1}
        for ln in unreported:
            head = ln.split(": ")
            if len(head) > 2:
                counts[head[1]] = counts.get(head[1], 0) + 1
        rec: dict[str, Any] = {
            "seed": killed,
            "episodes": [],
            "killed": reason,
            "counts": counts,
            "lines": [f"seed {killed} job: {reason}: the job died: {why.strip()[:400]}"]
            + unreported,
        }
        with open(args.report, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(rec["lines"][0], flush=True)
        seed = killed + 1
    done = _done(args.report)
    classes: dict[str, list[int]] = {}
    for s in sorted(done):
        if args.first <= s < end:
            for cls, n in done[s]["counts"].items():
                if n:
                    classes.setdefault(cls, []).append(s)
    for cls, seeds in sorted(classes.items()):
        print(f"{cls}: {len(seeds)} seed(s): {seeds}")
    # The same by episode (each line reads "seed N EPISODE: CLASS: ...").
    by_episode: dict[str, set[int]] = {}
    for s in sorted(done):
        if args.first <= s < end:
            for line in done[s]["lines"]:
                head = line.split(": ")
                if len(head) > 2 and " " in head[0]:
                    by_episode.setdefault(f"{head[0].split()[-1]}: {head[1]}", set()).add(s)
    for what, seeds_ in sorted(by_episode.items()):
        print(f"  {what}: {len(seeds_)} seed(s): {sorted(seeds_)}")
    ran = sum(1 for s in done if args.first <= s < end)
    print(f"{ran} of {args.seeds} seeds reported; log in {log}")
    return 1 if classes else 0


if __name__ == "__main__":
    sys.exit(main())
