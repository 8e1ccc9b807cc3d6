"""The `fsdp-lab` command. Each subcommand lives in its own module under `fsdp_lab.commands`,
so adding one never touches this file: a module there defines NAME, HELP, add_arguments(parser)
and run(args) -> int.

Three endings are handled here for every subcommand, so none of them prints a traceback for them:
Ctrl-C (SIGINT) exits 130 and SIGTERM 143, with one line each, and a stdout closed early
(`fsdp-lab memory | head -3`) exits 141 (128 + SIGPIPE, what a shell reports for a program killed by a broken pipe)
without a word.

[Note: when the Ctrl-C promise starts] Python itself starts first (site, encodings, the import of this module),
and a Ctrl-C then is Python's KeyboardInterrupt, with its traceback, before any code of ours runs. The promise
of one line holds from the moment main() has installed its handler. A caller that must know when that is (a
test, a supervisor) sets FSDP_LAB_READY_FILE=PATH: main() creates PATH right after installing the handler.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys

from fsdp_lab import __version__, commands
from fsdp_lab.commands import _exit_codes as exit_codes

READY_FILE_ENV = "FSDP_LAB_READY_FILE"


class Terminated(BaseException):
    """SIGTERM (from `timeout`, `kill` or a scheduler), raised like KeyboardInterrupt so cleanup still runs."""


def _raise_terminated(signum, frame):
    raise Terminated()


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help text already states it."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        if "default" in help_text.lower() or action.default in (None, argparse.SUPPRESS) \
                or action.nargs == 0 or not action.option_strings:  # nargs 0: an on/off flag
            return help_text
        return f"{help_text} (default: %(default)s)"


def _command_modules():
    found = []
    for info in pkgutil.iter_modules(commands.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            found.append(module)
    return sorted(found, key=lambda m: m.NAME)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-lab", description="Learn FSDP by running one.")
    parser.add_argument("--version", action="version", version=f"fsdp-lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP,
                           formatter_class=DefaultsHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a file descriptor
        pass


def _announce_ready() -> None:
    """Create $FSDP_LAB_READY_FILE, if set ([Note: when the Ctrl-C promise starts])."""
    path = os.environ.get(READY_FILE_ENV)
    if path:
        try:
            with open(path, "x", encoding="utf-8") as fh:
                fh.write(f"{os.getpid()}\n")
        except OSError as err:
            print(f"warning: cannot create {READY_FILE_ENV} {path}: {err.strerror or err}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    # Building the parser imports the subcommands (and torch, for some). A KeyboardInterrupt raised inside an
    # import can come out as an ImportError (numpy turns it into one) or be swallowed, so a Ctrl-C pressed now
    # is only noted, and acted on once the imports are done.
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    _announce_ready()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        print("fsdp-lab: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return exit_codes.INTERRUPTED
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        print(f"fsdp-lab {args.command}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return exit_codes.INTERRUPTED
    except Terminated:
        print(f"fsdp-lab {args.command}: terminated (SIGTERM)", file=sys.stderr, flush=True)
        return exit_codes.TERMINATED
    except BrokenPipeError:
        _silence_stdout()
        return exit_codes.BROKEN_PIPE
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
