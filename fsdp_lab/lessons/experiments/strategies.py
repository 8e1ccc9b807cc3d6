"""The ZeRO chapter's measurements: what each strategy keeps per rank, gathers at its peak and sends per step.

Every strategy runs on the same ranks, one after another in one launch (one process start for the whole
comparison), on the same model, batch and optimizer. What comes back is measured by the runtime itself, from the
trace: the memory fields of the optimizer_step event (what persists between steps) and the bytes each
collective event reports (fsdp_lab.observe.traffic).
"""
from __future__ import annotations

from typing import Iterable, Union

from fsdp_lab.lessons.experiments.common import RunSpec, mixed_precision_for, train
from fsdp_lab.lessons.experiments.together import Job
from fsdp_lab.observe.traffic import comm_summary
from fsdp_lab.runtime.core.memory import KINDS
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import GPTConfig

ALL_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "ZERO1", "NO_SHARD")


def summarize(result: dict) -> dict:
    """Reduce one rank's train() result to the figures the formulas predict (all plain ints and dicts).

    persistent: memory at the last optimizer_step event (params, grads, optimizer state: what survives a step).
    peak_unsharded: the largest params_unsharded over all events (gathered parameters plus any replica).
    comm_per_step: {step: bytes this rank sent}.
    """
    events = result["events"]
    steps = [e for e in events if e["event"] == "optimizer_step"]
    if not steps:
        raise ValueError(f"rank {result['rank']}: no optimizer_step event in {len(events)} events; was the "
                         f"optimizer watched by the tracer?")
    mem = steps[-1]["mem"]
    comm = comm_summary(events)
    rank = result["rank"]
    root_bytes = sum(u["full_bytes"] for u in result["units"] if u["is_root"])
    others = [u for u in result["units"] if not u["is_root"]]
    return {
        "rank": rank,
        "persistent": {"params": mem["params_sharded"] + mem["params_unsharded"],
                       "grads": mem["grads_sharded"] + mem["grads_unsharded"],
                       "optimizer": mem["optimizer_state"], "total": mem["total"]},
        "persistent_by_kind": {k: mem[k] for k in KINDS},
        "peak_unsharded": max(e["mem"]["params_unsharded"] for e in events),
        "peak_unsharded_by_step": _peaks_by_step_and_phase(events),
        "comm_per_step": comm.per_step(rank),
        "comm_per_collective": comm.per_collective(rank, step=comm.steps[-1]) if comm.steps else {},
        "comm_calls_per_step": comm.calls(rank=rank, step=comm.steps[-1]) if comm.steps else 0,
        "numel_padded_total": sum(u["padded_numel"] for u in result["units"]),
        "numel_total": sum(u["numel"] for u in result["units"]),
        "root_full_bytes": root_bytes,
        "largest_unit_padded_numel": max((u["padded_numel"] for u in others), default=0),
        "root_padded_numel": sum(u["padded_numel"] for u in result["units"] if u["is_root"]),
        "units": result["units"],
        "optimizer_params": result["optimizer_params"],
        "step_tensor_bytes": result["step_tensor_bytes"],
        "losses": result["losses"],
    }


def _peaks_by_step_and_phase(events: list[dict]) -> dict[int, dict[str, int]]:
    """{step: {phase: largest params_unsharded}}: forward prefetch only starts once the first forward has
    recorded the unit order, so step 0 and later steps differ."""
    peaks: dict[int, dict[str, int]] = {}
    for e in events:
        slot = peaks.setdefault(e["step"], {})
        slot[e["phase"]] = max(slot.get(e["phase"], 0), e["mem"]["params_unsharded"])
    return peaks


def _names(strategies) -> tuple:
    return tuple(str(getattr(s, "name", s)).upper() for s in strategies)


def _matrix_rank(rank: int, world_size: int, spec: RunSpec, strategies: tuple, dtypes: tuple) -> dict:
    return {d: {s: summarize(train(rank, world_size, spec.with_(strategy=s, mixed_precision=mixed_precision_for(d))))
                for s in strategies} for d in dtypes}


def strategy_matrix_job(strategies: Iterable[str] = ALL_STRATEGIES, dtypes: Iterable[str] = ("fp32", "bf16"),
                        preset: Union[str, GPTConfig] = "tiny", steps: int = 2, **spec_fields) -> Job:
    """measure_strategy_matrix's rank function and arguments, to run with others in one launch
    (fsdp_lab.lessons.experiments.together)."""
    spec_fields.setdefault("backward_prefetch", None)
    spec = RunSpec(preset=preset, steps=steps, **spec_fields)
    dtypes = tuple(dtypes)
    for d in dtypes:
        mixed_precision_for(d)
    return Job(_matrix_rank, (spec, _names(strategies), dtypes))


def measure_strategy_matrix(world_size: int = 2, strategies: Iterable[str] = ALL_STRATEGIES,
                            dtypes: Iterable[str] = ("fp32", "bf16"), preset: Union[str, GPTConfig] = "tiny",
                            steps: int = 2, timeout_s: float = 180.0, **spec_fields) -> list[dict]:
    """Per rank, {dtype: {strategy: summarize(...)}}, every combination in one launch. Backward prefetch is
    turned off unless spec_fields says otherwise (torch's default is BACKWARD_PRE, which holds a second block in
    backward): these runs measure the article's ZeRO formulas, which count one gathered unit."""
    job = strategy_matrix_job(strategies, dtypes, preset, steps, **spec_fields)
    return run_on_ranks(job.fn, world_size, *job.args, timeout_s=timeout_s)


def measure_strategies(world_size: int = 2, strategies: Iterable[str] = ALL_STRATEGIES, dtype="fp32",
                       preset: Union[str, GPTConfig] = "tiny", steps: int = 2, timeout_s: float = 180.0,
                       **spec_fields) -> list[dict]:
    """Per rank, {strategy: summarize(...)}: persistent bytes, peak unsharded bytes, bytes sent per step.

    dtype: "fp32", "bf16" (bf16 parameters and gathers, fp32 reduction and masters) or a MixedPrecision.
    """
    results = measure_strategy_matrix(world_size, strategies, (dtype,), preset, steps, timeout_s, **spec_fields)
    return [r[dtype] for r in results]


PREFETCH_SETTINGS = {"none": (False, None), "prefetch": (True, "BACKWARD_PRE")}


def _prefetch_rank(rank: int, world_size: int, spec: RunSpec, settings: tuple) -> dict:
    out = {}
    for name in settings:
        forward, backward = PREFETCH_SETTINGS[name]
        result = train(rank, world_size, spec.with_(forward_prefetch=forward, backward_prefetch=backward))
        out[name] = summarize(result)
        out[name]["events"] = [{k: e[k] for k in ("event", "unit", "phase", "step")}
                               | {"params_unsharded": e["mem"]["params_unsharded"]} for e in result["events"]]
    return out


def measure_prefetch(world_size: int = 2, dtype="fp32", preset: Union[str, GPTConfig] = "tiny",
                     strategy: str = "FULL_SHARD", settings: Iterable[str] = ("none", "prefetch"),
                     steps: int = 2, timeout_s: float = 120.0) -> list[dict]:
    """Per rank, {"none": ..., "prefetch": ...}: summarize() of a run with prefetch turned off
    (backward_prefetch=None, not torch's default) and of one with forward_prefetch=True and
    backward_prefetch=BACKWARD_PRE, plus each run's event list (names and
    params_unsharded only) so a chart can show when the second unit's buffer appears.

    Forward prefetch needs the unit order, which the first forward records (as in torch FSDP1), so it acts
    from step 1 on: keep steps >= 2 to see it. Backward prefetch acts from step 0."""
    settings = tuple(settings)
    unknown = [s for s in settings if s not in PREFETCH_SETTINGS]
    if unknown:
        raise ValueError(f"unknown prefetch settings {unknown}; expected {sorted(PREFETCH_SETTINGS)}")
    spec = RunSpec(strategy=strategy, preset=preset, mixed_precision=mixed_precision_for(dtype), steps=steps)
    return run_on_ranks(_prefetch_rank, world_size, spec, settings, timeout_s=timeout_s)
