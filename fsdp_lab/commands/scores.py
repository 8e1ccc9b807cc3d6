"""`fsdp-lab scores DIR --csv out.csv`: an instructor's table of a class's quiz results."""
from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

NAME = "scores"
HELP = ("Collect learners' progress files under DIR into one CSV (file, name, chapter, best score, max, "
        "attempts, last attempt); each file is one learner; unreadable files are reported and skipped.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path,
                        help="folder holding the learners' progress .json files (searched recursively)")
    parser.add_argument("--csv", type=Path, default=None, metavar="PATH",
                        help="write the CSV here (default: print it)")


def run(args: argparse.Namespace) -> int:
    from fsdp_lab.lessons.quiz.progress import collect, write_atomic, write_csv

    try:
        rows, problems = collect(args.dir)
    except NotADirectoryError as exc:
        print(f"fsdp-lab scores: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"skipped {problem}", file=sys.stderr)
    if not rows and not problems:
        print(f"warning: no quiz results under {args.dir} (no progress .json files with an answered attempt)",
              file=sys.stderr)
    if args.csv is None:
        write_csv(rows, sys.stdout)
        return 0
    buffer = io.StringIO()
    write_csv(rows, buffer)
    try:
        write_atomic(args.csv, buffer.getvalue())
    except OSError as exc:
        print(f"fsdp-lab scores: cannot write {args.csv}: {exc}", file=sys.stderr)
        return 1
    learners = len({r.file for r in rows})  # one progress file per learner; names may repeat ("root")
    print(f"wrote {len(rows)} rows ({learners} learners) to {args.csv}; skipped {len(problems)} unreadable file(s)")
    return 0
