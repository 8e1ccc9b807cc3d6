"""Exit codes every `fsdp-lab` subcommand shares: a signal ends a command with 128 + its number, as a shell
reports for a program the signal killed, and a script can tell Ctrl-C from a failure."""
INTERRUPTED = 130  # 128 + SIGINT (Ctrl-C)
BROKEN_PIPE = 141  # 128 + SIGPIPE (stdout closed early: `fsdp-lab memory | head -3`)
TERMINATED = 143   # 128 + SIGTERM (`timeout`, `kill`, a batch scheduler)
