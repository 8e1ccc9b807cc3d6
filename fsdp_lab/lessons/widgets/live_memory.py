"""LiveMemoryChart: per-rank memory of a multi-rank job, redrawn as each rank's JSONL trace grows.

    chart = LiveMemoryChart.run(world_size=2, steps=3)   # start a real job and follow it
    chart                                                # display; it redraws while the job runs
    run = chart.wait()                                   # block until done (returns the LifecycleRun)

    LiveMemoryChart(trace_dir).follow()                  # attach to a job someone else started
    LiveMemoryChart.replay()                             # a shipped GPU trace, with its provenance

The y value is `cuda_allocated` when the trace has it (a GPU run), else the runtime's exact count of live FSDP
bytes (fsdp_lab.runtime.memory). Files are read incrementally, complete lines only, so a line the job is still writing
is picked up on the next `update()`. The figure is drawn with matplotlib's object API into a PNG and handed to
an Output widget as its whole output, which is safe from the background polling thread.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import ipywidgets as widgets
from matplotlib.figure import Figure

from fsdp_lab.lessons.widgets.fmt import esc, memory_total, show_figure
from fsdp_lab.lessons.widgets.sources import NoShippedTrace, load_gpu_trace
from fsdp_lab.observe.trace import FileCursor

_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def byte_unit(max_bytes: float) -> tuple:
    """The largest binary unit that keeps the axis readable (at least 1 of it at the top)."""
    for name, size in _UNITS:
        if max_bytes >= size:
            return name, size
    return "bytes", 1


class LiveMemoryChart(widgets.VBox):
    def __init__(self, trace_dir, *, total_steps: Optional[int] = None, world_size: Optional[int] = None,
                 title: str = "memory per rank", provenance: str = ""):
        self.trace_dir = Path(trace_dir)
        self.total_steps, self.world_size = total_steps, world_size
        self.events: dict = {}  # rank → its events, in file order
        self._cursors: dict = {}  # file → FileCursor (bytes consumed so far, half-written tail)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._job: Optional[threading.Thread] = None
        self._poller: Optional[threading.Thread] = None
        self.result, self.error = None, None
        self.chart_title = title
        expected = (total_steps or 0) * (world_size or 0)
        self.progress = widgets.IntProgress(value=0, min=0, max=max(expected, 1), description="steps",
                                            bar_style="info")
        self.status = widgets.HTML()
        self.provenance = widgets.HTML(f"<span style='color:#6b7280;font-size:12px'>{esc(provenance)}</span>")
        self.out = widgets.Output()
        super().__init__([widgets.HBox([self.progress, self.status]), self.out, self.provenance])

    # -- reading ---------------------------------------------------------------------------------------------
    def update(self) -> int:
        """Read whatever the ranks appended since the last call, redraw, and return how many events were new."""
        with self._lock:
            new = 0
            for path in sorted(self.trace_dir.glob("rank*.jsonl")):
                cursor = self._cursors.setdefault(path, FileCursor(path))
                for e in cursor.read_new():
                    self.events.setdefault(e["rank"], []).append(e)
                    new += 1
            if new or not self.out.outputs:
                self._redraw()
            return new

    def _t0(self) -> float:
        return min((ev[0]["t"] for ev in self.events.values() if ev), default=0.0)

    def series(self) -> dict:
        """rank → (seconds since the job's first event, memory bytes), one point per event."""
        t0 = self._t0()
        return {r: ([e["t"] - t0 for e in ev], [memory_total(e.get("mem", {})) for e in ev])
                for r, ev in sorted(self.events.items()) if ev}

    @property
    def steps_done(self) -> int:
        return sum(1 for ev in self.events.values() for e in ev if e["event"] == "optimizer_step")

    # -- drawing ---------------------------------------------------------------------------------------------
    def figure(self) -> Figure:
        """Left: the whole job against time. Right: the latest step alone, where the sawtooth of gather and
        free is visible even when start-up takes most of the wall time."""
        fig = Figure(figsize=(10, 3.4), dpi=100, layout="constrained")
        whole, zoom = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1]})
        peak = max((memory_total(e.get("mem", {})) for ev in self.events.values() for e in ev), default=0)
        unit, size = byte_unit(peak)
        on_gpu = any("cuda_allocated" in e.get("mem", {}) for ev in self.events.values() for e in ev)
        what = "torch.cuda.memory_allocated" if on_gpu else "FSDP live bytes (runtime's exact count)"
        fig.suptitle(f"{self.chart_title} · {what}", fontsize=10)
        self._plot(whole, self.events, self._t0(), size, 1.0, on_gpu)
        whole.set_xlabel("time since the job's first event (s)")
        whole.set_title("the whole job (dotted: optimizer steps)", fontsize=9)
        last = max((e.get("step", 0) for ev in self.events.values() for e in ev), default=0)
        in_step = {r: [e for e in ev if e.get("step", 0) == last] for r, ev in self.events.items()}
        t_step = min((ev[0]["t"] for ev in in_step.values() if ev), default=0.0)
        self._plot(zoom, in_step, t_step, size, 1000.0, on_gpu)
        zoom.set_xlabel(f"time since step {last} began (ms)")
        zoom.set_title(f"step {last} alone: gather ↑, free ↓, reduce-scatter, optimizer", fontsize=9)
        whole.set_ylim(bottom=0)  # the zoom keeps matplotlib's limits: its job is the shape of one step
        for ax in (whole, zoom):
            ax.set_ylabel(f"memory ({unit})")
            ax.grid(alpha=0.3)
            if self.events:
                ax.legend(loc="upper left", fontsize=8)
            else:
                ax.text(0.5, 0.5, "waiting for the first trace lines…", ha="center", va="center",
                        transform=ax.transAxes, color="#6b7280")
        return fig

    @staticmethod
    def _plot(ax, events: dict, t0: float, size: int, time_scale: float, on_gpu: bool) -> None:
        styles = ("-", "--", "-.", ":")  # ranks often hold identical bytes: dashes keep every line visible
        for i, (rank, ev) in enumerate(sorted(events.items())):
            if not ev:
                continue
            t = [(e["t"] - t0) * time_scale for e in ev]
            ax.step(t, [memory_total(e.get("mem", {})) / size for e in ev], where="post", label=f"rank {rank}",
                    linestyle=styles[i % 4], linewidth=2.2 if i == 0 else 1.5)
            if i == 0 and on_gpu:  # what of the allocator's total is FSDP's own state
                ax.step(t, [e.get("mem", {}).get("total", 0) / size for e in ev], where="post", color="#6b7280",
                        linewidth=1, label=f"rank {rank}: FSDP state only")
            if i == 0:
                for e in ev:
                    if e["event"] == "optimizer_step":
                        ax.axvline((e["t"] - t0) * time_scale, color="#9ca3af", linestyle=":", linewidth=1)

    def _redraw(self) -> None:
        show_figure(self.out, self.figure())
        done = self.steps_done
        self.progress.max = max(self.progress.max, done, 1)
        self.progress.value = done
        n_events = sum(len(ev) for ev in self.events.values())
        self.status.value = (f"<span style='font-size:12px'>{len(self.events)} rank file(s), {n_events} events, "
                             f"{done} optimizer step(s) seen</span>")

    # -- following a job -------------------------------------------------------------------------------------
    def follow(self, poll_s: float = 0.5) -> "LiveMemoryChart":
        """Poll the trace files in a background thread until `stop()` or until the job thread ends."""
        def loop():
            while not self._stop.wait(poll_s):
                self.update()
                if self._job is not None and not self._job.is_alive():
                    break
            self.update()

        self._stop.clear()
        self._poller = threading.Thread(target=loop, name="fsdp-lab-live-memory", daemon=True)
        self._poller.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=10)

    def wait(self, timeout_s: float = 180.0):
        """Block until the job started by `run()` ends; return its LifecycleRun or raise its error."""
        if self._job is not None:
            self._job.join(timeout=timeout_s)
            if self._job.is_alive():
                raise TimeoutError(f"the traced job did not finish within {timeout_s:.0f} s")
        self.stop()
        self.update()
        self.progress.bar_style = "danger" if self.error else "success"
        if self.error is not None:
            raise self.error
        return self.result

    @classmethod
    def run(cls, world_size: int = 2, steps: int = 3, strategy: str = "FULL_SHARD", preset: str = "tiny",
            device: str = "auto", trace_dir=None, poll_s: float = 0.3, timeout_s: float = 120.0,
            step_sleep_s: float = 0.0, **run_kwargs) -> "LiveMemoryChart":
        """Start a real traced job (fsdp_lab.lessons.widgets.runs.record_lifecycle) in a thread and follow its files."""
        import tempfile

        from fsdp_lab.lessons.widgets.runs import record_lifecycle, resolve_device

        trace_dir = Path(trace_dir or tempfile.mkdtemp(prefix="fsdp-lab-live-"))
        for old in trace_dir.glob("rank*.jsonl"):
            old.unlink()
        device = resolve_device(device)
        chart = cls(trace_dir, total_steps=steps, world_size=world_size,
                    title=f"{world_size} ranks, {strategy}, {preset}, {device}",
                    provenance=f"live run now: trace files in {trace_dir}")

        def job():
            try:
                chart.result = record_lifecycle(world_size=world_size, strategy=strategy, steps=steps,
                                                preset=preset, trace_dir=trace_dir, device=device,
                                                step_sleep_s=step_sleep_s, timeout_s=timeout_s, **run_kwargs)
            except BaseException as err:  # handed to wait(), which re-raises it in the notebook
                chart.error = err

        chart._job = threading.Thread(target=job, name="fsdp-lab-traced-job", daemon=True)
        chart._job.start()
        return chart.follow(poll_s)

    @classmethod
    def replay(cls, name: Optional[str] = None) -> "LiveMemoryChart":
        """Draw a shipped GPU trace with where it came from; without one, a chart that says so."""
        try:
            shipped = load_gpu_trace(name)
        except NoShippedTrace as err:
            chart = cls(Path("/nonexistent"), title="no GPU trace", provenance=str(err))
            chart.update()
            return chart
        directory = shipped.path if shipped.path.is_dir() else shipped.path.parent
        chart = cls(directory, title=f"GPU trace {shipped.name}", provenance=shipped.describe())
        if shipped.path.is_dir():
            chart.update()
        else:
            for e in shipped.events:
                chart.events.setdefault(e["rank"], []).append(e)
            chart._redraw()
        return chart
