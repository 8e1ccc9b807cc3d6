"""What `fsdp-lab bench` reports: the JSON summary (its last output line) and the table printed above it.

The definitions of every figure are in fsdp_lab/bench/run.py, [Note: what is measured]; FLOPS_FORMULA and
MEMORY_METRIC repeat them inside the JSON, so a result file explains itself.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time

import torch

from fsdp_lab.training.models import GPT, PRESETS, count_params

FLOPS_FORMULA = "tokens * (6 * params + 12 * n_layer * n_embd * seq_len), per rank and step"
RATIO_DEFINITION = ("median over rounds of (ours / theirs), each a round's median step of the slowest rank "
                    "([Note: step-time ratios] in fsdp_lab/bench/run.py)")
# Issue 18's bars for the CPU bench (2 gloo ranks, tiny): result key -> the most it may be.
BARS = {"step_time_ratio_vs_fsdp2": 0.8, "fully_shard_step_time_ratio_vs_fsdp2": 0.8}
BAR_SETTING = {"device": "cpu", "world_size": 2, "preset": "tiny"}
MEMORY_METRIC = {
    "cuda": "torch.cuda.max_memory_allocated() over the memory steps of one setup built alone (peak stats reset "
            "after building it); max over ranks",
    "cpu": "bytes of parameters + gradients + optimizer state held right after backward (fsdp_lab: memory_report; "
           "fsdp2/plain: local tensors); activations excluded; max over ranks",
}


def summarize(cfg, per_rank: list[dict], wall_s: float, env: dict) -> dict:
    """The JSON the command prints last (cfg: a fsdp_lab.bench.run.BenchConfig; per_rank: what bench_rank returned
    on each rank). Ratios are fsdp_lab's figure (fully_shard_*: fsdp_lab_fully_shard's) divided by the other
    setup's; None where a setup is missing."""
    model_cfg, T = PRESETS[cfg.preset], cfg.resolved_seq_len
    with torch.device("meta"):
        n_params = count_params(GPT(model_cfg))
    tokens_rank = cfg.batch * T
    flops_rank = tokens_rank * (6 * n_params + 12 * model_cfg.n_layer * model_cfg.n_embd * T)
    results = {}
    for mode in cfg.modes:
        ranks = [r[mode] for r in per_rank]
        if any("error" in r for r in ranks):
            results[mode] = {"error": next(r["error"] for r in ranks if "error" in r)}
            continue
        row = {"peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
               "state_bytes": ranks[0].get("state_bytes")}
        if not cfg.memory_only:
            median = max(statistics.median(r["step_times_s"]) for r in ranks)
            rounds = [max(r["round_medians_s"][i] for r in ranks) for i in range(len(ranks[0]["round_medians_s"]))]
            row.update(median_step_s=median, round_medians_s=rounds, min_step_s=min(ranks[0]["step_times_s"]),
                       max_step_s=max(ranks[0]["step_times_s"]), steps_timed=len(ranks[0]["step_times_s"]),
                       tokens_per_s=tokens_rank * len(per_rank) / median, tflops_per_s=flops_rank / median / 1e12,
                       final_loss=ranks[0].get("final_loss"))
        results[mode] = row

    def ratio(key, other, ours="fsdp_lab"):
        if key not in results.get(ours, {}) or key not in results.get(other, {}):
            return None
        if key == "median_step_s":  # paired by round ([Note: step-time ratios])
            return statistics.median(a / b for a, b in zip(results[ours]["round_medians_s"],
                                                           results[other]["round_medians_s"]))
        return results[ours][key] / results[other][key]

    config = {**dataclasses.asdict(cfg), "modes": list(cfg.modes), "backend": cfg.resolved_backend,
              "optimizer": cfg.resolved_optimizer, "seq_len": T, "world_size": cfg.nproc, "params": n_params,
              "tokens_per_step_per_rank": tokens_rank, "dtype": "bf16 compute, fp32 master weights and reduction",
              **env}
    out = {"config": config, "flops_formula": FLOPS_FORMULA, "flops_per_step_per_rank": flops_rank,
           "memory_metric": MEMORY_METRIC[cfg.device], "results": results,
           "step_time_ratio_vs_fsdp2": ratio("median_step_s", "fsdp2"),
           "step_time_ratio_vs_plain": ratio("median_step_s", "plain"),
           "peak_memory_ratio_vs_fsdp2": ratio("peak_memory_bytes", "fsdp2"),
           "peak_memory_ratio_vs_plain": ratio("peak_memory_bytes", "plain"),
           "fully_shard_step_time_ratio_vs_fsdp2": ratio("median_step_s", "fsdp2", "fsdp_lab_fully_shard"),
           "fully_shard_step_time_ratio_vs_plain": ratio("median_step_s", "plain", "fsdp_lab_fully_shard"),
           "fully_shard_peak_memory_ratio_vs_fsdp2": ratio("peak_memory_bytes", "fsdp2", "fsdp_lab_fully_shard"),
           "step_time_ratio_definition": RATIO_DEFINITION, "wall_s": wall_s}
    measured_where = {"device": cfg.device, "world_size": cfg.nproc, "preset": cfg.preset}
    out["bars"] = {key: {"ratio": out[key], "at_most": limit,
                         "holds": None if out[key] is None else out[key] <= limit,
                         "setting": BAR_SETTING, "measured_in_that_setting": measured_where == BAR_SETTING}
                   for key, limit in BARS.items()}
    trace = per_rank[0].get("trace")
    if trace is not None:
        out["trace"] = trace
    return out


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device == "cuda" and torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return env


def _size(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def format_table(result: dict) -> str:
    """The human-readable table printed before the JSON line."""
    cfg = result["config"]
    lines = [f"fsdp-lab bench: preset {cfg['preset']} ({cfg['params'] / 1e6:.1f}M params), {cfg['device']} "
             f"{cfg.get('gpu', '')}, {cfg['world_size']} rank(s) on {cfg['backend']}, batch {cfg['batch']}x"
             f"{cfg['seq_len']} per rank, AdamW {cfg['optimizer']}, torch {cfg['torch']}",
             f"{'setup':<22}{'median step':>13}{'tokens/s':>12}{'TFLOP/s':>10}{'peak memory':>14}{'loss':>9}"]
    for mode, row in result["results"].items():
        if "error" in row:
            lines.append(f"{mode:<22} FAILED: {row['error']}")
        elif "median_step_s" in row:
            lines.append(f"{mode:<22}{row['median_step_s'] * 1e3:>10.1f} ms{row['tokens_per_s']:>12.0f}"
                         f"{row['tflops_per_s']:>10.2f}{_size(row['peak_memory_bytes']):>14}"
                         f"{row['final_loss']:>9.3f}")
        else:
            lines.append(f"{mode:<22}{'-':>13}{'-':>12}{'-':>10}{_size(row['peak_memory_bytes']):>14}{'-':>9}")
    for key in ("step_time_ratio_vs_fsdp2", "step_time_ratio_vs_plain", "peak_memory_ratio_vs_fsdp2",
                "fully_shard_step_time_ratio_vs_fsdp2", "fully_shard_step_time_ratio_vs_plain"):
        if result.get(key) is not None:
            lines.append(f"{key}: {result[key]:.3f}")
    for key, bar in result.get("bars", {}).items():
        if bar["ratio"] is None:
            continue
        verdict = "holds" if bar["holds"] else "MISSED"
        where = "" if bar["measured_in_that_setting"] else " (the bar is set for cpu, 2 ranks, tiny: not this run)"
        lines.append(f"bar {key} <= {bar['at_most']}: {bar['ratio']:.3f} {verdict}{where}")
    lines.append(f"ratios: {result.get('step_time_ratio_definition', '')}")
    lines.append(f"memory: {result['memory_metric']}")
    lines.append(f"FLOPs: {result['flops_formula']}")
    if "trace" in result:
        lines.append(f"trace: {json.dumps(result['trace'])}")
    return "\n".join(lines)
