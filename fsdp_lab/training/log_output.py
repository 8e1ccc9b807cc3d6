"""Log lines that never stop training: a full disk under --json-log, or a reader that went away
(`fsdp-lab train | head -3`), costs one warning, and training goes on. Checkpoints are not written through
this: a checkpoint that cannot be saved must fail loudly (fsdp_lab.checkpoint)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Optional, TextIO


@dataclass
class WarnOnceWriter:
    """Writes whole lines to `stream`; the first failed write prints one warning naming `what` and the error,
    and every later write is skipped (the stream is in an unknown state)."""
    stream: Optional[TextIO]
    what: str
    warn_to: TextIO = field(default_factory=lambda: sys.stderr)
    failed: Optional[str] = None

    def write_line(self, text: str) -> None:
        if self.stream is None or self.failed is not None:
            return
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError) as err:  # ValueError: the stream was closed under us
            self._give_up(err)

    def _give_up(self, err: Exception) -> None:
        self.failed = f"{type(err).__name__}: {getattr(err, 'strerror', None) or err}"
        if self.stream is sys.stdout or self.stream is sys.__stdout__:
            _detach_stdout()
        try:
            print(f"warning: cannot write {self.what} ({self.failed}); training goes on without it",
                  file=self.warn_to, flush=True)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self.stream is None:
            return
        stream, self.stream = self.stream, None
        try:
            stream.close()
        except (OSError, ValueError) as err:  # the final flush hit the same full disk
            if self.failed is None:
                self.stream = stream  # so _give_up can tell what it was
                self._give_up(err)
                self.stream = None


def _detach_stdout() -> None:
    """Point file descriptor 1 at /dev/null: buffered bytes and the interpreter's final flush then go nowhere
    instead of raising BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
