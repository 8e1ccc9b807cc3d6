"""`fsdp-lab quiz [CHAPTER]`: the self-graded quiz in a terminal, answers read from stdin.

Nothing a learner typed is lost: the progress file is checked before the first question, and answers given
before `q`, end of input or Ctrl-C (exit 130) are saved; the next run of the chapter offers to resume them.
"""
from __future__ import annotations

import argparse
import getpass
import sys
from fsdp_lab.commands._argtypes import path
from fsdp_lab.commands._exit_codes import INTERRUPTED as EXIT_INTERRUPTED
from fsdp_lab.commands._paths import replaced_file_problem

NAME = "quiz"
HELP = ("Take a chapter's self-graded quiz in the terminal (chapter 10: the article's ten interview questions). "
        "Without CHAPTER, list the chapters and your best scores.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("chapter", nargs="?", help="01..10 or 06a, or a name such as 'interview', 'fsdp2' or '05-zero'")
    parser.add_argument("--lang", choices=("zh", "en"), default="en", help="language of questions and feedback")
    parser.add_argument("--seed", type=int, default=None,
                        help="shuffle the options with this seed (default: the order as written)")
    parser.add_argument("--progress", type=path, default=None, metavar="PATH",
                        help="progress file (default: ~/.fsdp-lab/progress.json)")
    parser.add_argument("--name", default=None, help="learner name saved with the results "
                                                     "(default: the one already in the file, else your login)")
    parser.add_argument("--bank", type=path, default=None, metavar="DIR",
                        help="question bank directory (default: quizzes/ of this checkout)")


def _utf8_safe(stream) -> None:
    """Chinese text on a terminal that is not UTF-8 prints as escapes instead of crashing."""
    if (getattr(stream, "encoding", "") or "").lower().replace("-", "") != "utf8" and hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="backslashreplace")


def _login() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name in some containers
        return "learner"


def _list(args, progress) -> int:
    from fsdp_lab.lessons.quiz.bank import load_bank
    from fsdp_lab.lessons.quiz.progress import counts
    from fsdp_lab.lessons.quiz.questions import msg, points

    bank = load_bank(args.bank)
    print(msg(args.lang, "chapters"))
    for key, chapter in bank.items():
        tries = [a for a in progress.attempts if a.chapter == key and counts(a)]
        status = (msg(args.lang, "best", score=points(max(a.score for a in tries)), max=len(chapter.questions),
                      attempts=len(tries)) if tries else msg(args.lang, "never"))
        print(f"  {key}  {chapter.title.get(args.lang)} ({len(chapter.questions)}) — {status}")
    return 0


def run(args: argparse.Namespace) -> int:
    from fsdp_lab.lessons.quiz.bank import bank_files, chapter_key, load_chapter_by_key
    from fsdp_lab.lessons.quiz.progress import ProgressStore, resumable
    from fsdp_lab.lessons.quiz.questions import QuizFileError, msg, points
    from fsdp_lab.lessons.quiz.scoring import QuizRun
    from fsdp_lab.lessons.quiz.terminal import Ending, offer_resume, resume_from, run_terminal
    from fsdp_lab.user_files import FileRefused, printable, refuse_inputs

    _utf8_safe(sys.stdout), _utf8_safe(sys.stderr)
    store = ProgressStore(args.progress)
    problem = replaced_file_problem("--progress", store.path)
    if problem is None:
        try:
            refuse_inputs("--progress", store.path, bank_files(args.bank))
        except FileRefused as exc:
            problem = f"--progress {exc}"
        except QuizFileError:
            pass  # no bank there: said below, when a chapter is loaded
    if problem:
        print(f"fsdp-lab quiz: error: {printable(problem)}; your answers could not be saved there", file=sys.stderr)
        return 2
    try:
        progress, notice = store.load(args.name)
    except FileRefused as exc:
        print(f"fsdp-lab quiz: error: --progress {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"fsdp-lab quiz: cannot read {printable(str(store.path))}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if notice:
        print(printable(notice), file=sys.stderr)
    try:
        if args.chapter is None:
            return _list(args, progress)
        key = chapter_key(args.chapter)
    except QuizFileError as exc:
        print(f"fsdp-lab quiz: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"fsdp-lab quiz: {exc}", file=sys.stderr)
        return 2
    try:
        chapter = load_chapter_by_key(key, args.bank)
    except QuizFileError as exc:
        print(f"fsdp-lab quiz: {exc}", file=sys.stderr)
        return 1
    quiz = QuizRun(chapter, args.lang, args.seed)
    echo = not sys.stdin.isatty()
    partial, replaces = resumable(progress, key), None
    interrupted = False
    try:
        if partial is not None and offer_resume(partial, args.lang, sys.stdin, sys.stdout, echo):
            replaces = partial
            restored = resume_from(quiz, partial)
            print(msg(args.lang, "resumed", answered=restored, left=len(quiz) - len(quiz.answers)))
        finished = run_terminal(quiz, sys.stdin, sys.stdout, echo=echo)
    except KeyboardInterrupt:
        interrupted, finished = True, False
    if quiz.answered == 0:
        print(msg(args.lang, "nothing"), file=sys.stderr if interrupted else sys.stdout)
        if interrupted:
            print("fsdp-lab quiz: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED if interrupted else 0
    if not finished and not interrupted:
        ended = "quit" if finished is Ending.QUIT else "eof"
        print(msg(args.lang, ended, answered=quiz.answered, total=len(quiz), score=points(quiz.score),
                  max=quiz.max_score))
    try:
        notice = store.record(quiz.attempt(), args.name or progress.learner or _login(), replaces=replaces)
    except OSError as exc:
        print(printable(msg(args.lang, "not_saved", reason=exc)), file=sys.stderr)
        return 1
    if notice:
        print(printable(notice), file=sys.stderr)
    if interrupted:
        print("\nfsdp-lab quiz: " + msg(args.lang, "interrupted", answered=quiz.answered, total=len(quiz),
                                         path=printable(str(store.path))), file=sys.stderr)
        return EXIT_INTERRUPTED
    print(msg(args.lang, "saved", path=printable(str(store.path))))
    return 0
