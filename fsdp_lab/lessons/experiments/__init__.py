"""The runs the course shows, launched on N real ranks; each returns plain, picklable data.

Notebooks, tests, the CLI and scripts/record_gpu_traces.py all call these, so what a learner sees in a chapter is
what the tests check. Ranks are separate processes: call these from a package or a script guarded by
`if __name__ == "__main__":` (a notebook is fine).
"""
from fsdp_lab.lessons.experiments.common import RunSpec, mixed_precision_for, train, unit_table
from fsdp_lab.lessons.experiments.lifecycle import run_lifecycle, trace_on_off, unit_event_sequences
from fsdp_lab.lessons.experiments.strategies import (ALL_STRATEGIES, measure_prefetch, measure_strategies,
                                                     measure_strategy_matrix, summarize)

__all__ = ["RunSpec", "mixed_precision_for", "train", "unit_table", "run_lifecycle", "trace_on_off",
           "unit_event_sequences", "ALL_STRATEGIES", "measure_prefetch", "measure_strategies",
           "measure_strategy_matrix", "summarize"]
