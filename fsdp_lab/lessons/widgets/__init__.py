"""The course's widgets: thin ipywidgets views over real traces (fsdp_lab.observe.trace) and the formulas.

    PotluckLifecycle.from_run(world_size=2)        a real run's lifecycle, event by event (Play + slider):
                                                   shard → gather → compute → free → re-gather → reduce-scatter
    LiveMemoryChart.run(world_size=2, steps=3)     per-rank memory of a running job, redrawn as its traces grow
    Planner(measured=MeasuredPoint.from_run(run))  the article's memory formulas with a real run beside them

The state each widget draws comes from pure functions (frames.frame, planner.plan), which the tests check
without a browser. Names are imported on first use, so `fsdp_lab.lessons.widgets.runs` and `.frames` work where
ipywidgets is not installed (a bare GPU machine recording traces).
"""
from importlib import import_module

_HOME = {
    "BEATS": "frames", "Beat": "frames", "FrameState": "frames", "Household": "frames", "Sizes": "frames",
    "beat_of": "frames", "frame": "frames", "sizes_from_unit_table": "frames", "step_bytes_sent": "frames",
    "unit_sizes": "frames", "LiveMemoryChart": "live_memory", "MeasuredPoint": "planner", "Planner": "planner",
    "PotluckLifecycle": "potluck", "LifecycleRun": "runs", "record_lifecycle": "runs", "resolve_device": "runs",
    "NoShippedTrace": "sources", "ShippedTrace": "sources", "list_gpu_traces": "sources",
    "load_gpu_trace": "sources", "gpu_trace_note": "sources", "HiddenAnswers": "answers", "reveal_answers": "answers",
    "QuietRepr": "static", "beat_spans": "live_memory", "SolutionButton": "solution", "show_solution": "solution",
}
__all__ = sorted(_HOME)


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module 'fsdp_lab.lessons.widgets' has no attribute {name!r}")
    return getattr(import_module(f"fsdp_lab.lessons.widgets.{_HOME[name]}"), name)


def __dir__():
    return __all__
