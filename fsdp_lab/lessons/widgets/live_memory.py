"""LiveMemoryChart: per-rank memory of a multi-rank job, redrawn as each rank's JSONL trace grows.

    chart = LiveMemoryChart.run(world_size=2, steps=3)   # start a real job and follow it
    chart                                                # display; it redraws while the job runs
    run = chart.wait()                                   # block until done (returns the LifecycleRun)

    LiveMemoryChart(trace_dir).follow()                  # attach to a job someone else started
    LiveMemoryChart.replay()                             # a shipped GPU trace, with its provenance

The y value is `cuda_allocated` when the trace has it (a GPU run), else the runtime's exact count of live FSDP
bytes (fsdp_lab.runtime.core.memory). Files are read incrementally, complete lines only, so a line the job is
still writing is picked up on the next `update()`. The figure is drawn with matplotlib's object API into a PNG and
handed to an Output widget as its whole output, which is safe from the background polling thread.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import ipywidgets as widgets
from matplotlib.figure import Figure

from fsdp_lab.lessons.widgets.fmt import esc, figure_png, memory_total, show_figure
from fsdp_lab.lessons.widgets.frames import beat_of
from fsdp_lab.lessons.widgets.sources import NoShippedTrace, load_gpu_trace
from fsdp_lab.lessons.widgets.static import QuietRepr
from fsdp_lab.observe.trace import FileCursor

_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def byte_unit(max_bytes: float) -> tuple:
    """The largest binary unit that keeps the axis readable (at least 1 of it at the top)."""
    for name, size in _UNITS:
        if max_bytes >= size:
            return name, size
    return "bytes", 1


_SHORT_BEAT = {"gather": "gather", "compute": "compute", "free": "free", "regather": "re-gather",
               "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce", "backward_end": "bwd done",
               "optimizer": "optimizer"}


def beat_spans(events: list, rank: int = 0) -> list:
    """(first index, last index, beat, unit) runs of `rank`'s beats over a merged trace's event indices: each of
    the rank's events opens a span that lasts until its next event; neighbouring spans of one beat and unit merge."""
    mine = [i for i, e in enumerate(events) if e["rank"] == rank]
    out = []
    for k, i in enumerate(mine):
        end = mine[k + 1] - 1 if k + 1 < len(mine) else len(events) - 1
        beat, unit = beat_of(events[i]), events[i]["unit"]
        if out and out[-1][2] is beat and out[-1][3] == unit:
            out[-1] = (out[-1][0], end, beat, unit)
        else:
            out.append((i, end, beat, unit))
    return out


class LiveMemoryChart(QuietRepr, widgets.VBox):
    preview_hint = ("Run this cell (Shift+Enter) to train the ranks and follow their memory live; the picture is "
                    "the chart of the run saved with the notebook.")
    # follow() alone trains nothing: the ranks train in a later cell, and no chart is saved before they do
    follow_hint = ("Run this cell (Shift+Enter), then the training cell below it: the chart draws your ranks' "
                   "memory as they write their trace.")

    def preview_html(self) -> str:
        return "" if self.events else ("<div style='color:#6b7280'>The chart appears here as the ranks write their "
                                       "trace.</div>")
    def __init__(self, trace_dir, *, total_steps: Optional[int] = None, world_size: Optional[int] = None,
                 title: str = "memory per rank", provenance: str = "", focus_step: Optional[int] = None):
        """`focus_step`: the step drawn event by event on the right (default: the latest); pass the step the
        potluck plays so both show the same events."""
        self.focus_step = focus_step
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
        expected = total_steps or 0
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
        """Training steps every rank has finished (each rank records its own optimizer_step)."""
        counts = [sum(1 for e in ev if e["event"] == "optimizer_step") for ev in self.events.values()]
        if self.world_size and len(counts) < self.world_size:
            return 0
        return min(counts, default=0)

    def static_png(self) -> Optional[bytes]:
        """The chart as it stands; nothing before the first trace line (an empty chart teaches nothing)."""
        return figure_png(self.figure()) if self.events else None

    # -- drawing ---------------------------------------------------------------------------------------------
    def figure(self) -> Figure:
        """Left: the whole job against time. Right: one step event by event (the potluck's slider numbers), each
        of rank 0's beats shaded and labelled with its unit, so the sawtooth of gather and free reads as the
        lifecycle even when start-up takes most of the wall time."""
        fig = Figure(figsize=(11, 3.8), dpi=100, layout="constrained")
        whole, zoom = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.5]})
        peak = max((memory_total(e.get("mem", {})) for ev in self.events.values() for e in ev), default=0)
        unit, size = byte_unit(peak)
        on_gpu = any("cuda_allocated" in e.get("mem", {}) for ev in self.events.values() for e in ev)
        what = "torch.cuda.memory_allocated" if on_gpu else "FSDP live bytes (runtime's exact count)"
        fig.suptitle(f"{self.chart_title} · {what}", fontsize=10)
        self._plot(whole, self.events, self._t0(), size, 1.0, on_gpu)
        whole.set_xlabel("time since the job's first event (s)")
        whole.set_title("the whole job (dotted: optimizer steps)", fontsize=9)
        last = max((e.get("step", 0) for ev in self.events.values() for e in ev), default=0)
        step = last if self.focus_step is None else min(self.focus_step, last)
        merged = sorted((e for ev in self.events.values() for e in ev if e.get("step", 0) == step),
                        key=lambda e: (e["t"], e["rank"]))
        self._plot_beats(zoom, merged, size)
        zoom.set_xlabel(f"event of step {step} (the potluck's slider), both ranks merged in time order (count)")
        zoom.set_title(f"step {step}, event by event: rank 0's beats shaded and labelled", fontsize=9)
        whole.set_ylim(bottom=0)
        for ax in (whole, zoom):
            ax.set_ylabel(f"memory ({unit})")
            ax.grid(alpha=0.3)
            if self.events:
                ax.legend(loc="lower right", fontsize=8)
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

    @staticmethod
    def _plot_beats(ax, merged: list, size: int) -> None:
        """Each rank's memory after each event of one step, against the event index; rank 0's beats as shaded,
        labelled spans."""
        if not merged:
            return
        top = max(memory_total(e.get("mem", {})) for e in merged) / size
        for lo, hi, beat, unit in beat_spans(merged, rank=min(e["rank"] for e in merged)):
            ax.axvspan(lo - 0.5, hi + 0.5, color=beat.colour, alpha=0.16, linewidth=0)
            ax.text((lo + hi) / 2, top * 1.02, f"{unit} · {_SHORT_BEAT.get(beat.key, beat.en)}", rotation=90,
                    ha="center", va="bottom", fontsize=6.5, color=beat.colour)
        styles = ("-", "--", "-.", ":")
        for i, rank in enumerate(sorted({e["rank"] for e in merged})):
            xs, ys, current = [], [], None
            for k, e in enumerate(merged):
                if e["rank"] == rank:
                    current = memory_total(e.get("mem", {})) / size
                if current is not None:
                    xs.append(k)
                    ys.append(current)
            ax.step(xs, ys, where="post", label=f"rank {rank}", linestyle=styles[i % 4],
                    linewidth=2.2 if i == 0 else 1.5)
        ax.set_xlim(-0.5, len(merged) - 0.5)
        ax.set_ylim(0, top * 1.75)

    def _redraw(self) -> None:
        show_figure(self.out, self.figure())
        done = self.steps_done
        self.progress.max = max(self.progress.max, done, 1)
        self.progress.value = done
        n_events = sum(len(ev) for ev in self.events.values())
        of = f" of {self.total_steps}" if self.total_steps else ""
        self.status.value = (f"<span style='font-size:12px'>{len(self.events)} rank file(s), {n_events} events; "
                             f"{done}{of} training step(s) done on every rank</span>")

    # -- following a job -------------------------------------------------------------------------------------
    def follow(self, poll_s: float = 0.5) -> "LiveMemoryChart":
        """Poll the trace files in a background thread until `stop()` or until the job thread ends."""
        def loop():
            while not self._stop.wait(poll_s):
                self.update()
                if self._job is not None and not self._job.is_alive():
                    break
            self.update()

        if self._job is None:
            self.preview_hint = self.follow_hint
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
        self.refresh_preview()  # the saved output shows the finished chart, not the empty one it started as
        if self.error is not None:
            raise self.error
        return self.result

    @classmethod
    def run(cls, world_size: int = 2, steps: int = 3, strategy: str = "FULL_SHARD", preset: str = "tiny",
            device: str = "auto", trace_dir=None, poll_s: float = 0.3, timeout_s: float = 120.0,
            step_sleep_s: float = 0.0, focus_step: Optional[int] = None, **run_kwargs) -> "LiveMemoryChart":
        """Start a real traced job (fsdp_lab.lessons.widgets.runs.record_lifecycle) in a thread and follow its files."""
        import tempfile

        from fsdp_lab.lessons.widgets.runs import record_lifecycle, resolve_device

        trace_dir = Path(trace_dir or tempfile.mkdtemp(prefix="fsdp-lab-live-"))
        for old in trace_dir.glob("rank*.jsonl"):
            old.unlink()
        device = resolve_device(device)
        chart = cls(trace_dir, total_steps=steps, world_size=world_size,
                    title=f"{world_size} ranks, {strategy}, {preset}, {device}", focus_step=focus_step,
                    provenance="live run now: each rank appends its trace file as it goes")

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
