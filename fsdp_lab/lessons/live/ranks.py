"""Ranks that live across notebook cells: ipyparallel engines, each one a gloo rank of one process group.

    ranks = Ranks(2).start()          # a controller and 2 engines; every engine joins the gloo group
    ranks.run("print(rank)")          # → CellRun: each rank's output, and how each ended
    ranks.pull("loss")                # [value on rank 0, value on rank 1]
    ranks.restart()                   # fresh engines and a fresh group (after a death or a hang)
    ranks.stop()                      # nothing left running

Every wait has a deadline: start-up (`start_timeout_s`), each cell (`timeout_s`), the group's collectives
(`group_timeout_s`, 10 s: a collective that hangs in a cell fails that soon, with the collective log's report of
where every rank was, fsdp_lab/runtime/core/collective_log.py; each engine posts its log after every cell).
[Note: the live ranks' timeouts] 10 s names a hang before the learner wonders, and is still far above what any
collective of the chapters' cells takes once every rank has entered it (milliseconds for the course's models). It
counts from when a rank enters, so what it must also cover is how far apart ranks enter: within a cell they start
together and run the same code, except where one rank does work the others wait for. Those collectives are
patient (fsdp_lab/runtime/core/side_collectives.py) and wait longer: the checks when a model is wrapped or first
runs (after each rank's imports and model building), sync_module_states, a checkpoint's save and load (DCP writes
each rank's files between its collectives), rank 0's file work that a broadcast hands on. A patient collective
waits `_PATIENT_SHARE` of the cell's timeout (at most `start_timeout_s`, at least the group's timeout): whatever
one rank does for its peers must end within the cell anyway, and a patient collective that one rank never enters
then fails inside the cell, with the rest of it left for the collective log's exchange and the traceback (seconds
on a starved machine), so the learner reads the log's report rather than a bare "did not finish in time". A rank that raises is reported with its traceback and the others keep their
state, unless what it raised is a failed collective, which breaks the group. A rank that dies, or is still
running at the deadline, breaks the group too ([Note: one process group per engine lifetime]
in fsdp_lab.lessons.live.engine): the cell says which rank and what happened (exit code, or the line it is stuck
on), and every later cell refuses to run until `restart()`. A dead engine or controller found before a cell is named
the same way. Nothing outlives the kernel, however it ends ([Note: who cleans up after a SIGKILLed kernel] in
fsdp_lab.lessons.live.lifeline).

Each engine's namespace starts with `rank`, `world_size` and `trace_dir` (a fresh directory for this handle's
trace files, fsdp_lab.observe.trace.rank_file(trace_dir, rank)).

A learner's copy's stubs are tracked for the NameErrors they cause ([Note: a name an unwritten exercise would
define] in fsdp_lab/lessons/live/unwritten.py).

[Note: what start-up costs] `startup_s` records it. On a 2-core machine shared with other test runs (load
average 3 to 15) two ranks took 9 to 20 s, four ranks 20 s: about 2 s for the controller, most of the rest for
the engines' own start (IPython, zmq, registration) and each engine's `import torch`. That is why a notebook
starts its ranks once and keeps them, and why `restart()` keeps the controller.
"""
from __future__ import annotations

import enum
import logging
import math
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import fsdp_lab
from fsdp_lab.lessons.live import engine, lifeline
from fsdp_lab.lessons.live.outcome import (CellRun, RankOutput, RanksFailed, RankStatus, plain,
                                           stack_of_current_thread)
from fsdp_lab.lessons.live.processes import KnownProcesses, kill, running, signal_pid, with_descendants
from fsdp_lab.lessons.live.unwritten import UnwrittenStubs
from fsdp_lab.training import host_memory
from fsdp_lab.training.launch import free_port, usable_cores

_POLL_S = 0.05
_PATIENT_SHARE = 0.5  # of a cell's timeout, for its patient collectives ([Note: the live ranks' timeouts])
_TRACEBACK_LINES = 12


class RanksState(enum.Enum):
    """Where the handle is. Only READY runs cells."""

    STOPPED = "stopped"  # no engines (before start, after stop)
    READY = "ready"  # every engine is a rank of one healthy group
    BROKEN = "broken"  # a rank died or hung: the group is unusable until restart()


def _tail(text: str, n: int) -> str:
    lines = plain(text).rstrip().splitlines()
    return "\n".join(lines[-n:])


class Ranks:
    def __init__(self, n: int = 2, *, timeout_s: float = 60.0, start_timeout_s: float = 120.0,
                 group_timeout_s: float = 10.0, threads_per_rank: int = 1, allow_oversubscribe: bool = False,
                 allow_low_memory: bool = False):
        if n < 1:
            raise ValueError(f"the number of ranks must be >= 1, got {n}")
        cores = usable_cores()  # [Note: no more ranks than cores] in fsdp_lab/commands/_ranks.py
        if n > cores and not allow_oversubscribe:
            raise ValueError(f"{n} live ranks are {n} engine processes but this machine has {cores} CPU core(s); "
                             f"start at most {cores}, or pass allow_oversubscribe=True")
        if not all(math.isfinite(t) and t > 0 for t in (timeout_s, start_timeout_s, group_timeout_s)):
            raise ValueError(f"timeouts must be finite and positive: timeout_s={timeout_s}, start_timeout_s={start_timeout_s},"
                             f" group_timeout_s={group_timeout_s}")
        self.n, self.timeout_s, self.start_timeout_s = n, timeout_s, start_timeout_s
        self.group_timeout_s, self.threads_per_rank = group_timeout_s, threads_per_rank
        self.allow_low_memory = allow_low_memory
        self.state = RanksState.STOPPED
        self.broken_because = ""
        self.startup_s: Optional[float] = None  # seconds the last start()/restart() took, measured
        self._cluster = None
        self._client = None
        self._engine_ids: list = []  # rank → ipyparallel engine id
        self._pids: list = []  # rank → engine process id
        self._stack_dir: Optional[Path] = None  # each rank's faulthandler file
        self._patient_s: Optional[float] = None  # the engines' patient timeout, set for the cell that runs next
        self._known: Optional[KnownProcesses] = None  # every process seen, and the reaper told of them
        self.trace_dir: Optional[Path] = None  # the ranks' trace files; made by start(), removed by stop()
        self._unwritten = UnwrittenStubs()  # [Note: a name an unwritten exercise would define] in unwritten.py

    def __repr__(self) -> str:
        why = f" ({self.broken_because.splitlines()[0]})" if self.broken_because else ""
        return f"<Ranks n={self.n} {self.state.value}{why}>"

    # -- life cycle ------------------------------------------------------------------------------------------
    def start(self) -> "Ranks":
        """Start the controller and the engines, and make every engine a rank; raise within start_timeout_s."""
        import ipyparallel as ipp

        if self.state is not RanksState.STOPPED:
            raise RuntimeError(f"{self!r} is already started: call restart() or stop() first")
        problem = self._memory_problem()
        if problem:
            raise MemoryError(problem)
        began = time.monotonic()
        self._stack_dir = Path(tempfile.mkdtemp(prefix="fsdp-lab-stacks-"))
        self.trace_dir = Path(tempfile.mkdtemp(prefix="fsdp-lab-live-trace-"))
        self._known = KnownProcesses([self._stack_dir, self.trace_dir])
        self._cluster = ipp.Cluster(n=self.n, log_level=logging.ERROR, engine_timeout=int(self.start_timeout_s),
                                    delay=0.1, config=_guarded_config())
        try:
            self._cluster.start_cluster_sync()
            self._known.remember(self._launcher_pids())
            self._client = self._cluster.connect_client_sync()
            self._client.wait_for_engines(self.n, timeout=self.start_timeout_s, interactive=False)
            self._engine_ids = sorted(self._client.ids)[:self.n]
            self._join(began)
        except BaseException:
            self.stop()
            raise
        return self

    def _memory_problem(self) -> Optional[str]:
        """[Note: no more memory than is free] in fsdp_lab/commands/_ranks.py, for n engine processes. This
        kernel has imported torch, so its own size bounds an engine's from above at no cost; only when that bound
        does not fit is a fresh `import torch` measured (about two seconds) for the real figure."""
        if self.allow_low_memory:
            return None
        available = host_memory.available_memory()
        problem = None
        for fresh in (False, True):
            need = host_memory.processes_need(self.n, host_memory.process_baseline(fresh=fresh))
            problem = host_memory.memory_problem(need, available, "pass allow_low_memory=True",
                                                advice="start fewer ranks")
            if problem is None:
                return None
        return f"{self.n} live ranks: {problem}"

    def restart(self) -> "Ranks":
        """Replace every engine (a hung rank cannot be cancelled) and form a fresh group; the controller stays."""
        if self._cluster is None:
            return self.start()
        dead = self._dead_controller()
        if dead:
            print(f"{dead}: starting a fresh controller and {self.n} engines")
            self.stop()
            return self.start()
        began = time.monotonic()
        old = set(self._client.ids)
        self._kill_engines()
        self._remove_output_files()
        self._cluster.stop_engines_sync()
        self.state, self.broken_because = RanksState.STOPPED, ""
        try:
            self._cluster.start_engines_sync(self.n)
            self._wait_for_new_engines(old, began)
            self._join(began)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the engines and the controller, and make sure no process of theirs is left.

        The engines are killed outright: they hold nothing worth saving, and a rank stuck in a collective would
        not answer a polite request anyway."""
        pids = self.all_pids()
        self._kill_engines()
        if self._client is not None:
            self._client.close()
        if self._cluster is not None:
            self._remove_output_files()
            try:
                if self._dead_controller():  # nothing would answer: end what is left of it ourselves
                    kill(pids + self._known.alive())
                self._cluster.stop_cluster_sync()
            finally:
                kill(pids + (self._known.alive() if self._known is not None else []))
        self._cluster = self._client = None
        self._engine_ids, self._pids = [], []
        self._unwritten.forget_all()
        self.state, self.broken_because = RanksState.STOPPED, ""
        for directory in (self._stack_dir, self.trace_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        if self._known is not None:
            self._known.close()
            self._known = None

    @property
    def pids(self) -> list:
        """The processes this handle started: the engines (rank order), then the controller."""
        return list(self._pids) + [p for p in self._launcher_pids() if p not in self._pids]

    def all_pids(self) -> list:
        """`pids` and everything they started in turn (the controller's schedulers, each engine's nanny)."""
        return with_descendants(self.pids)

    # -- running cells ---------------------------------------------------------------------------------------
    def run(self, code: str, timeout_s: Optional[float] = None, ranks: Optional[Sequence[int]] = None) -> CellRun:
        """Run `code` on the ranks (all by default) at once; wait at most timeout_s for every one of them."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        check_timeout("timeout_s", timeout_s)
        self._require_ready()
        targets = list(range(self.n)) if ranks is None else list(ranks)
        bad = [r for r in targets if not 0 <= r < self.n]
        if bad:
            raise ValueError(f"ranks {bad} do not exist: this group has ranks 0..{self.n - 1}")
        self._set_patient_timeout(self.patient_timeout_for(timeout_s))
        pending = {r: self._client[self._engine_ids[r]].execute(code, silent=False, block=False) for r in targets}
        done: dict = {}
        deadline = time.monotonic() + timeout_s
        try:
            self._wait(pending, done, deadline)
        except KeyboardInterrupt:  # the notebook's ■: interrupt the ranks too, and say the group needs a restart
            for r in pending:
                signal_pid(self._pids[r], signal.SIGINT)
            self.state = RanksState.BROKEN
            self.broken_because = f"the cell was interrupted while rank(s) {sorted(pending)} were running it"
            raise
        for r, ar in pending.items():
            done[r] = RankOutput(r, RankStatus.HUNG, stdout=ar.stdout or "", stderr=ar.stderr or "",
                                 where=self._where(r))
        run = CellRun([done[r] for r in targets], timeout_s)
        self._unwritten.after_run(code, (o.unwritten for o in run.outputs))
        if run.broke_the_group:
            self.state = RanksState.BROKEN
            self.broken_because = run.failures()
        return run

    def patient_timeout_for(self, cell_timeout_s: float) -> float:
        """How long the patient collectives of a cell with this timeout may wait ([Note: the live ranks'
        timeouts])."""
        return max(self.group_timeout_s, min(self.start_timeout_s, cell_timeout_s * _PATIENT_SHARE))

    def _set_patient_timeout(self, seconds: float) -> None:
        """Queued on every engine ahead of the cell (an engine runs what it is sent in order); sent only when it
        changes."""
        if seconds != self._patient_s:
            self._client[self._engine_ids].apply_async(engine.set_patient_timeout, seconds)
            self._patient_s = seconds

    def _wait(self, pending: dict, done: dict, deadline: float) -> None:
        """Move each rank from `pending` to `done` as it finishes, raises or dies, until `deadline`."""
        while pending and time.monotonic() < deadline:
            for r, ar in list(pending.items()):
                exit_code = self._exit_code(r)
                if exit_code is not None:
                    done[r] = RankOutput(r, RankStatus.DIED, stdout=ar.stdout or "", stderr=ar.stderr or "",
                                         error=f"its process ended with exit code {exit_code} while running this "
                                               f"cell")
                elif ar.ready():
                    done[r] = self._finished(r, ar)
                    # queued behind the cell, not waited for: the engine posts its collective log once it is idle
                    self._client[self._engine_ids[r]].apply_async(engine.post_finished)
                else:
                    continue
                del pending[r]
            time.sleep(_POLL_S)

    def run_or_raise(self, code: str, timeout_s: Optional[float] = None,
                     ranks: Optional[Sequence[int]] = None) -> CellRun:
        """`run`, printing every rank's output; raise RanksFailed naming each rank that did not finish."""
        run = self.run(code, timeout_s, ranks)
        text = run.render()
        if text:
            print(text)
        if not run.ok:
            advice = (f"\nThe process group is broken: call restart() on the ranks (what live.start() returned) "
                      f"for {self.n} fresh ones."
                      if run.broke_the_group else "")
            raise RanksFailed(run.failures() + advice, run)
        return run

    def pull(self, name: str, timeout_s: Optional[float] = None) -> list:
        """The value of `name` in every rank's namespace, in rank order (it must pickle)."""
        from ipyparallel.error import CompositeError, RemoteError

        self._require_ready()
        view = self._client[self._engine_ids]
        try:
            return view.pull(name, block=False).get(timeout=self.timeout_s if timeout_s is None else timeout_s)
        except RemoteError as err:
            errors = err.elist if isinstance(err, CompositeError) else [(err.ename, err.evalue)]
            why = self._unwritten.explain(*errors[0][:2]) if all(e[0] == "NameError" for e in errors) else None
            if why is None:
                raise
            raise RanksFailed(why) from None

    def push(self, **values) -> None:
        """Set names in every rank's namespace (the values must pickle)."""
        self._require_ready()
        self._client[self._engine_ids].push(values, block=False).get(timeout=self.timeout_s)

    # -- plumbing --------------------------------------------------------------------------------------------
    def _require_ready(self) -> None:
        if self.state is RanksState.READY:
            gone = self._dead_controller() or self._dead_engine()
            if gone:
                self.state, self.broken_because = RanksState.BROKEN, gone
                raise RanksFailed(f"{gone}; {_RESTART}")
        if self.state is RanksState.BROKEN:
            raise RanksFailed(f"the ranks are broken since an earlier cell:\n{self.broken_because}\n"
                              f"Call restart() on the ranks (what live.start() returned) for {self.n} fresh ones.")
        if self.state is not RanksState.READY:
            raise RanksFailed("the ranks are not running: call start() on them, or fsdp_lab.lessons.live.start()")

    def _join(self, began: float) -> None:
        """Every engine joins one fresh gloo group; ranks follow engine ids."""
        remaining = self.start_timeout_s - (time.monotonic() - began)
        view = self._client[self._engine_ids]
        root = str(Path(fsdp_lab.__file__).resolve().parent.parent)
        view.execute(f"import sys\nif {root!r} not in sys.path: sys.path.insert(0, {root!r})",
                     block=False).get(timeout=max(remaining, 1))
        port = free_port()
        calls = [self._client[eid].apply_async(engine.join, rank, self.n, port, self.group_timeout_s, os.getpid(),
                                               str(self._stack_dir / f"rank{rank}.txt"), self.threads_per_rank,
                                               self.patient_timeout_for(self.timeout_s))
                 for rank, eid in enumerate(self._engine_ids)]
        self._patient_s = self.patient_timeout_for(self.timeout_s)
        for rank, call in enumerate(calls):
            remaining = self.start_timeout_s - (time.monotonic() - began)
            if not call.wait(max(remaining, 0.1)):
                raise TimeoutError(f"rank {rank} did not join the gloo group within {self.start_timeout_s:g} s")
            self._pids.append(call.get()["pid"])
        self._known.remember(self.pids)
        trace_dir = str(self.trace_dir)
        for rank, eid in enumerate(self._engine_ids):
            refusal = engine.ExitRefused(rank)  # exit()/quit() would end the engine: refuse them by name
            self._client[eid].push({"rank": rank, "world_size": self.n, "trace_dir": trace_dir, "exit": refusal,
                                    "quit": refusal}, block=True)
        self._unwritten.forget_all()  # fresh namespaces
        self.state = RanksState.READY
        self.startup_s = time.monotonic() - began

    def _wait_for_new_engines(self, old: set, began: float) -> None:
        while len(set(self._client.ids) - old) < self.n:
            if time.monotonic() - began > self.start_timeout_s:
                raise TimeoutError(f"{len(set(self._client.ids) - old)} of {self.n} new engines registered within "
                                   f"{self.start_timeout_s:g} s")
            time.sleep(0.1)
        self._pids = []
        self._engine_ids = sorted(set(self._client.ids) - old)[:self.n]

    def _dead_controller(self) -> str:
        """'the controller (pid N) has died ...' once the controller's process has ended; else ''."""
        controller = getattr(self._cluster, "controller", None) if self._cluster is not None else None
        pid = getattr(controller, "pid", -1) if controller is not None else -1
        if pid > 0 and not running(pid):
            return f"the controller (pid {pid}) has died, so the engines cannot be reached"
        return ""

    def _dead_engine(self) -> str:
        """"rank r's engine (pid N) has died ..." for the first rank whose process has ended; else ''."""
        for rank, pid in enumerate(self._pids):
            if not running(pid):
                code = self._exit_code(rank)
                how = f" (exit code {code})" if code is not None else ""
                return f"rank {rank}'s engine (pid {pid}) has died{how}"
        return ""

    def _launchers(self) -> list:
        if self._cluster is None:
            return []
        return [launcher for engine_set in self._cluster.engines.values()
                for launcher in getattr(engine_set, "launchers", {}).values()]

    def _launcher_pids(self) -> list:
        pids = [launcher.pid for launcher in self._launchers() if getattr(launcher, "pid", -1) > 0]
        controller = getattr(self._cluster, "controller", None) if self._cluster is not None else None
        if controller is not None and getattr(controller, "pid", -1) > 0:
            pids.append(controller.pid)
        return pids

    def _exit_code(self, rank: int):
        """None while rank's process runs; once it has ended, its exit code (-N: killed by signal N)."""
        import psutil

        for launcher in self._launchers():
            if launcher.pid == self._pids[rank]:
                try:  # psutil caches the code, whichever thread reaped the process (ipyparallel's waiter does)
                    code = launcher.process.wait(timeout=0)
                except psutil.TimeoutExpired:
                    return None
                return "unknown" if code is None else code
        return None

    def _finished(self, rank: int, ar) -> RankOutput:
        from ipyparallel.error import RemoteError

        ar.wait_for_output(timeout=10)  # the reply can come before the last of the rank's printed output
        stdout, stderr = ar.stdout or "", ar.stderr or ""
        try:
            ar.get(timeout=1)
        except RemoteError as err:
            text = "\n".join(err.traceback) if isinstance(err.traceback, list) else err.traceback or ""
            trace = _tail("\n".join(line for line in plain(text).splitlines()
                                    if not set(line.strip()) <= {"-"} and "Traceback (most recent" not in line),
                          _TRACEBACK_LINES)
            message = f"{err.ename}: {err.evalue}"
            if err.ename == "NotImplementedError":  # a learner's copy's stub: say what to write, not where it raised
                return RankOutput(rank, RankStatus.RAISED, stdout, stderr,
                                  error=f"not written yet: {err.evalue}" if err.evalue else "not written yet",
                                  unwritten=str(err.evalue or ""))
            unwritten = self._unwritten.explain(err.ename, err.evalue)
            if unwritten:  # [Note: a name an unwritten exercise would define] in unwritten.py
                return RankOutput(rank, RankStatus.RAISED, stdout, stderr, error=unwritten)
            if "init_process_group" in str(err.evalue):  # the cell's group is gone: re-initialising is not the way
                message = (f"{err.ename}: rank {rank} has no process group any more (did a cell call "
                           f"destroy_process_group()?); {_RESTART}")
            return RankOutput(rank, RankStatus.RAISED, stdout, stderr, error=f"{message}\n{trace}",
                              broke_group=err.ename in GROUP_BREAKING)
        except Exception as err:  # the controller lost the engine (it unregistered): a death
            return RankOutput(rank, RankStatus.DIED, stdout, stderr, error=f"{type(err).__name__}: {err}")
        result = ar.execute_result
        text = None
        if result is not None:
            data = result.get("data") if isinstance(result, dict) else getattr(result, "data", None)
            text = (data or {}).get("text/plain")
        return RankOutput(rank, RankStatus.OK, stdout, stderr, result=text)

    def _where(self, rank: int) -> str:
        """The innermost frames of rank's main thread, from its faulthandler (empty if it cannot say)."""
        path = self._stack_dir / f"rank{rank}.txt"
        before = path.stat().st_size if path.exists() else 0
        if not running(self._pids[rank]):
            return ""
        signal_pid(self._pids[rank], engine.STACK_SIGNAL)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and (not path.exists() or path.stat().st_size == before):
            time.sleep(_POLL_S)
        time.sleep(0.1)  # the dump is written in one go, but give it a moment to finish
        dump = path.read_text(encoding="utf-8", errors="replace")[before:]
        return stack_of_current_thread(dump)

    def _remove_output_files(self) -> None:
        """[Note: output files go first] ipyparallel removes a process's output file twice at stop, from the
        stop call and from the exit callback its waiter thread schedules; when both see the file, the loser logs
        "Failed to remove ...ipcontroller-....log" under a stop that worked. Removed here first, neither sees it."""
        controller = getattr(self._cluster, "controller", None)
        sets = list(getattr(self._cluster, "engines", {}).values())
        for launcher in [controller, *sets, *self._launchers()]:
            path = getattr(launcher, "output_file", None) if launcher is not None else None
            if isinstance(path, str) and path:
                try:
                    os.remove(path)
                except OSError:
                    pass

    def _kill_engines(self) -> None:
        kill(with_descendants(list(self._pids) + [launcher.pid for launcher in self._launchers()]))


# A collective that failed (the collective log's CollectiveFailed, or torch.distributed's own errors from a cell's
# direct call) leaves the group's connections torn down: gloo fails every later collective at once.
GROUP_BREAKING = frozenset({"CollectiveFailed", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError"})

_RESTART = "run live_ranks.restart() (the handle live.start() returned) for fresh ranks"


def check_timeout(name: str, value) -> None:
    """Refuse a timeout that is not a finite number of seconds above 0 (nan would end every wait at once)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def _guarded_config():
    """ipyparallel configuration that starts the controller and each engine under the parent-death guard."""
    from traitlets.config import Config

    config = Config()
    config.ControllerLauncher.controller_cmd = lifeline.guard_command(os.getpid(), "ipyparallel.controller")
    config.EngineLauncher.engine_cmd = lifeline.guard_command(os.getpid(), "ipyparallel.engine")
    return config
