"""Exit codes every `fsdp-lab` subcommand shares: a signal ends a command with 128 + its number, as a shell
reports for a program the signal killed, and a script can tell Ctrl-C from a failure."""
USAGE = 2          # bad flags, or a run this machine cannot hold (too many ranks, too little memory)
INTERRUPTED = 130  # 128 + SIGINT (Ctrl-C)
BROKEN_PIPE = 141  # 128 + SIGPIPE (stdout closed early: `fsdp-lab memory | head -3`)
TERMINATED = 143   # 128 + SIGTERM (`timeout`, `kill`, a batch scheduler)


def for_signal(signum: int) -> tuple[int, str]:
    """(exit code, words) for a command a signal stopped: 128 + its number, and the signal named as it is, so a
    hangup (a closed terminal or ssh session) is never reported as a Ctrl-C."""
    import signal

    if signum == signal.SIGINT:
        return INTERRUPTED, "interrupted (Ctrl-C)"
    if signum == signal.SIGTERM:
        return TERMINATED, "terminated (SIGTERM)"
    try:
        name = signal.Signals(signum).name
        what = signal.strsignal(signum) or name
    except ValueError:
        name = what = f"signal {signum}"
    return 128 + int(signum), f"stopped by {name} ({what.lower()})"
