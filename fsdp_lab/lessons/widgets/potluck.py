"""PotluckLifecycle: play a real trace as the article's potluck (百家宴), one recorded event per frame.

    w = PotluckLifecycle.from_run(world_size=2)        # live CPU (or GPU) run in the notebook
    w = PotluckLifecycle.from_gpu_trace()              # a shipped GPU trace (a clear message when none)
    w                                                  # display it; press ▶ or drag the slider

Play → slider is a kernel-side `widgets.link`, so a headless kernel (tests, nbval) advances it too when a test
sets `play.value`; the view redraws whenever the slider's value changes. (`jslink` would only run in a
browser.)
"""
from __future__ import annotations

from typing import Optional

import ipywidgets as widgets

from fsdp_lab.lessons.widgets.frames import PHASE_OF, FrameState, Sizes, beat_of, frame, unit_sizes
from fsdp_lab.lessons.widgets.potluck_view import Scale, render_frame, render_message, render_phase_strip
from fsdp_lab.lessons.widgets.sources import NoShippedTrace, load_gpu_trace
from fsdp_lab.lessons.widgets.static import QuietRepr


def phase_spans(events: list) -> dict:
    """phase → (first index, last index) of its events in this trace."""
    out: dict = {}
    for i, e in enumerate(events):
        key = PHASE_OF.get(e.get("phase", ""))
        if key:
            lo, _hi = out.get(key, (i, i))
            out[key] = (lo, i)
    return out


def next_beat_index(events: list, index: int) -> int:
    """The first event after `index` at which the same household starts another beat (another beat or another
    unit); the last event when none does. Ranks interleave in a merged trace, so the household is held fixed."""
    rank, here = events[index]["rank"], (beat_of(events[index]).key, events[index]["unit"])
    for j in range(index + 1, len(events)):
        if events[j]["rank"] == rank and (beat_of(events[j]).key, events[j]["unit"]) != here:
            return j
    return len(events) - 1


class PotluckLifecycle(QuietRepr, widgets.VBox):
    """Households (ranks), their fridges (shards) and tables (gathered units), stepping through a trace."""

    preview_hint = ("Run the cells above and this one (Shift+Enter) to play the potluck: press ▶, drag the slider "
                    "or press next beat. Below is its first frame.")

    def __init__(self, events: Optional[list] = None, *, step: Optional[int] = None, sizes: Optional[Sizes] = None,
                 title: str = "", source: str = "", message: str = "", interval_ms: int = 350):
        """`events`: a merged trace (fsdp_lab.observe.trace.load_trace). `step`: keep only that training step, so a
        long run still plays one lifecycle. `sizes`: exact unit sizes (LifecycleRun.sizes); without them they
        are derived from the trace's memory records."""
        events = list(events or [])
        if step is not None:
            events = [e for e in events if e.get("step") == step]
        self.events = events
        self.title = widgets.HTML(f"<b>{title}</b>" if title else "")
        self.source = widgets.HTML(f"<span style='color:#6b7280;font-size:12px'>{source}</span>" if source else "")
        self.view = widgets.HTML()
        last = max(len(self.events) - 1, 0)
        self.play = widgets.Play(value=0, min=0, max=last, step=1, interval=interval_ms, description="play",
                                 disabled=not self.events)
        self.slider = widgets.IntSlider(value=0, min=0, max=last, step=1, description="event",
                                        continuous_update=True, disabled=not self.events,
                                        layout=widgets.Layout(width="460px"))
        self._link = widgets.link((self.play, "value"), (self.slider, "value"))
        self.next_button = widgets.Button(description="next beat »", disabled=not self.events,
                                          tooltip="jump to the next beat (another beat or another unit)",
                                          layout=widgets.Layout(width="120px"))
        self.next_button.on_click(lambda _b: self.next_beat())
        self.phase_strip = widgets.HTML(layout=widgets.Layout(width="600px"))
        self.state: Optional[FrameState] = None
        if self.events:
            self._sizes = sizes or unit_sizes(self.events)
            self._scale = Scale.of(self.events, self._sizes)
            self._phases = phase_spans(self.events)
            self.slider.observe(self._redraw, names="value")
            self._redraw()
        else:
            self.view.value = render_message(message or "This trace has no events to play.")
        controls = widgets.HBox([self.play, self.slider, self.next_button])
        strip = [self.phase_strip] if self.events else []
        super().__init__([w for w in (self.title, self.source) if w.value] + [controls] + strip + [self.view])

    def preview_html(self) -> str:
        return self.phase_strip.value + self.view.value

    def _redraw(self, _change=None) -> None:
        self.state = frame(self.events, self.slider.value, self._sizes)
        self.view.value = render_frame(self.state, self._sizes, self._scale)
        self.phase_strip.value = render_phase_strip(self.state.phase, self.state.index, len(self.events),
                                                    self._phases)

    def next_beat(self) -> FrameState:
        """Jump to the first event of the next beat (what the "next beat" button does)."""
        return self.show(next_beat_index(self.events, self.slider.value))

    def show(self, index: int) -> FrameState:
        """Jump to event `index` (as dragging the slider would) and return the frame shown."""
        self.slider.value = index
        return self.state

    # -- constructors ----------------------------------------------------------------------------------------
    @classmethod
    def from_run(cls, world_size: int = 2, strategy: str = "FULL_SHARD", steps: int = 1, preset: str = "tiny",
                 device: str = "auto", **kwargs) -> "PotluckLifecycle":
        """Record a real run now (spawned ranks, gloo) and play its trace."""
        from fsdp_lab.lessons.widgets.runs import record_lifecycle

        run = record_lifecycle(world_size=world_size, strategy=strategy, steps=steps, preset=preset, device=device)
        return cls.from_lifecycle_run(run, **kwargs)

    @classmethod
    def from_lifecycle_run(cls, run, **kwargs) -> "PotluckLifecycle":
        step = kwargs.get("step")
        source = (f"real run: {run.world_size} ranks, {run.strategy}, preset {run.preset!r}, device {run.device}"
                  f"{'' if step is None else f', step {step}'}")
        return cls(run.events, sizes=run.sizes, title="百家宴 the potluck: a training step, event by event",
                   source=source, **kwargs)

    @classmethod
    def from_gpu_trace(cls, name: Optional[str] = None, **kwargs) -> "PotluckLifecycle":
        """Play a GPU trace shipped with the package; without one, show why and what to do instead."""
        try:
            shipped = load_gpu_trace(name)
        except NoShippedTrace as err:
            return cls([], message=str(err), **kwargs)
        return cls(shipped.events, title=f"百家宴 on a GPU: {shipped.name}", source=shipped.describe(), **kwargs)
