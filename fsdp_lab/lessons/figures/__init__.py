"""Figures the chapters draw from their measurements, so a learner's cell stays about FSDP: it calls one of
these in a line and reads the picture. Each takes plain data (what the ranks returned, or a plan) and draws
inline with pyplot; none of them computes a number the chapter reports.
"""
from fsdp_lab.lessons.figures.fsdp2 import copy_cost, side_by_side, weight_owners
from fsdp_lab.lessons.figures.granularity import flat_buffer_layout, granularity_bars, units_tradeoff, wrapping_bill
from fsdp_lab.lessons.figures.memory import (checkpointing_bars, live_bytes_by_kind, state_by_kind,
                                             step_memory_by_strategy, strategy_memory)
from fsdp_lab.lessons.figures.planning import minifsdp_peaks, state_per_gpu, use_case_peaks
from fsdp_lab.lessons.figures.potluck import potluck_picture
from fsdp_lab.lessons.figures.precision import master_precision_curves, update_stall_curves
from fsdp_lab.lessons.figures.timeline import draw_timeline, prefetch_timelines, trace_timeline
from fsdp_lab.lessons.figures.traffic import bytes_by_beat, gather_share, ratio_by_depth, strategy_traffic

__all__ = ["bytes_by_beat", "checkpointing_bars", "copy_cost", "draw_timeline", "flat_buffer_layout",
           "gather_share", "granularity_bars", "live_bytes_by_kind", "master_precision_curves", "minifsdp_peaks",
           "potluck_picture", "prefetch_timelines", "ratio_by_depth", "side_by_side", "state_by_kind", "state_per_gpu",
           "step_memory_by_strategy", "strategy_memory", "strategy_traffic", "trace_timeline", "units_tradeoff",
           "update_stall_curves", "use_case_peaks", "weight_owners", "wrapping_bill"]
