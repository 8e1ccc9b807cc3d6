"""`fsdp-lab scores DIR --csv out.csv`: an instructor's table of a class's quiz results."""
from __future__ import annotations

import argparse
import io
import sys

from fsdp_lab.commands._argtypes import path

NAME = "scores"
HELP = ("Collect learners' progress files under DIR into one CSV (file, name, chapter, best score, max, "
        "attempts, last attempt); each file is one learner; unreadable files are reported and skipped.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=path,
                        help="folder holding the learners' progress .json files (searched recursively)")
    parser.add_argument("--csv", type=path, default=None, metavar="PATH",
                        help="write the CSV here (default: print it)")


def run(args: argparse.Namespace) -> int:
    from fsdp_lab.lessons.quiz.progress import collect, progress_files, write_csv
    from fsdp_lab.user_files import FileRefused, printable, refuse_inputs, replace_text, replaceable

    try:
        if args.csv is not None:  # refused before anything is read: the export must not replace an input
            replaceable(args.csv)
            refuse_inputs("--csv", args.csv, progress_files(args.dir))
        rows, problems = collect(args.dir)
    except (NotADirectoryError, FileRefused) as exc:
        print(f"fsdp-lab scores: error: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"skipped {printable(problem)}", file=sys.stderr)
    if not rows and not problems:
        print(f"warning: no quiz results under {printable(str(args.dir))} (no progress .json files with an answered "
              f"attempt)", file=sys.stderr)
    if args.csv is None:
        write_csv(rows, sys.stdout)  # its text cells are escaped already (spreadsheet_cell)
        return 0
    buffer = io.StringIO()
    write_csv(rows, buffer)
    try:
        replace_text(args.csv, buffer.getvalue())
    except FileRefused as exc:
        print(f"fsdp-lab scores: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"fsdp-lab scores: cannot write {printable(str(args.csv))}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    learners = len({r.file for r in rows})  # one progress file per learner; names may repeat ("root")
    print(f"wrote {len(rows)} rows ({learners} learners) to {printable(str(args.csv))}; skipped {len(problems)} "
          f"unreadable file(s)")
    return 0
