"""Planner: sliders for Φ, N, GPU memory, strategy, precision, sequence length, micro-batch, recompute, the
attention kind, HSDP's nodes and CPU offload; the article's formula beside a measured point.

    Planner()                                          # formulas only
    Planner(measured=MeasuredPoint.from_run(run))      # plus a real run's bytes next to the prediction

Every number comes from fsdp_lab.theory.formulas (`plan`, `m_ddp`…`m_zero3`, `runtime_state_bytes`); this module only
lays them out. GB here is 1e9 bytes, as in the article (7B: 16Φ = 112 GB).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import ipywidgets as widgets
from matplotlib.figure import Figure

from fsdp_lab.lessons.widgets.fmt import esc, figure_png, human_bytes, show_figure
from fsdp_lab.lessons.widgets.static import QuietRepr
from fsdp_lab.theory import formulas, planner
from fsdp_lab.training.models import PRESETS

STAGE_FORMULA = {"DDP": ("16Φ", lambda phi, n: formulas.m_ddp(phi)),
                 "ZeRO-1": ("4Φ + 4Φ + 8Φ/N", formulas.m_zero1),
                 "ZeRO-2": ("4Φ + 12Φ/N", formulas.m_zero2),
                 "ZeRO-3": ("16Φ/N", formulas.m_zero3)}
RUNTIME_NAME = {"DDP": "NO_SHARD", "ZeRO-1": "ZERO1", "ZeRO-2": "SHARD_GRAD_OP", "ZeRO-3": "FULL_SHARD"}
STAGE_OF = {runtime: stage for stage, runtime in RUNTIME_NAME.items()}
_KINDS = (("params", ("params_sharded", "params_unsharded")), ("grads", ("grads_sharded", "grads_unsharded")),
          ("optimizer", ("optimizer_state",)))


_TABLE = "border-collapse:separate;border-spacing:14px 1px;margin:4px 0 4px -14px;text-align:right"


def _short(x: int) -> str:
    for div, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k")):
        if x >= div:
            return f"{x / div:.3g}{suffix}"
    return str(x)


def phi_options(*extra) -> list:
    """(label, Φ) pairs for the Φ slider: a 1-2-5 series from 100k to 1T, well-known model sizes, and any
    value passed in (the initial Φ, a measured run's Φ) so the slider can show it exactly."""
    values = {m * 10**e for e in range(5, 12) for m in (1, 2, 5)} | {10**12}
    values |= {125_000_000, 350_000_000, 1_300_000_000, 7 * 10**9, 13 * 10**9, 70 * 10**9, 175 * 10**9}
    labels = {}
    for x in extra:
        if isinstance(x, MeasuredPoint):
            values.add(x.phi)
            labels[x.phi] = f"{x.phi:,} (measured run)"
        elif x is not None:
            values.add(round(x))
    return [(labels.get(v, _short(v)), v) for v in sorted(values)]


def n_options(*extra) -> list:
    """GPU counts for the N slider: 1–8 one by one, then the sizes clusters come in (up to 1024)."""
    values = set(range(1, 9)) | {12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024}
    return sorted(values | {int(x) for x in extra if x})


def gb(x: float) -> str:
    """Bytes as GB (1e9) from 0.01 GB up; smaller amounts (a toy model's) in KiB/MiB, never "0.00 GB"."""
    return f"{x / formulas.GB:,.2f} GB" if x >= formulas.GB / 100 or x == 0 else human_bytes(x)


def seq_options(*extra) -> list:
    """Sequence lengths: powers of two from 16 to 128k, plus any passed in (a measured run's)."""
    return sorted({2**k for k in range(4, 18)} | {int(x) for x in extra if x})


@dataclass(frozen=True)
class MeasuredPoint:
    """Persistent state bytes one rank really held right after an optimizer step of a real run."""

    phi: int  # parameters of the model
    numel_padded_total: int  # P: flat elements after padding each unit to a multiple of N
    n: int
    strategy: str  # runtime name: FULL_SHARD, SHARD_GRAD_OP, ZERO1, NO_SHARD
    memory: dict  # fsdp_lab.runtime.core.memory kinds → bytes
    step_tensor_bytes: int  # AdamW's 0-d `step` counters, one per parameter tensor: not in the 16Φ formulas
    label: str = ""
    # the run's shape, so the planner sizes activations and logits for this model, not a LLaMA-like guess
    layers: Optional[int] = None
    hidden: Optional[int] = None
    heads: Optional[int] = None
    vocab: Optional[int] = None
    seq_len: Optional[int] = None
    micro_batch: Optional[int] = None
    precision: str = "fp32"

    @property
    def measured(self) -> dict:
        out = {k: sum(self.memory.get(m, 0) for m in kinds) for k, kinds in _KINDS}
        out["total"] = sum(out.values())
        return out

    @property
    def predicted(self):
        return formulas.runtime_state_bytes(self.strategy, self.numel_padded_total, self.n)

    @classmethod
    def from_run(cls, run, rank: int = 0) -> "MeasuredPoint":
        """From a fsdp_lab.lessons.widgets.runs.LifecycleRun: the memory record of `rank`'s last optimizer step."""
        steps = [e for e in run.events if e["rank"] == rank and e["event"] == "optimizer_step"]
        if not steps:
            raise ValueError(f"rank {rank} has no optimizer_step event in this trace ({len(run.events)} events)")
        cfg = PRESETS[run.preset]
        return cls(run.phi, run.numel_padded_total, run.world_size, run.strategy, dict(steps[-1]["mem"]),
                   run.ranks[rank]["step_tensor_bytes"],
                   f"real run: preset {run.preset!r}, {run.world_size} ranks, {run.strategy}, {run.device}, "
                   f"rank {rank} after its last optimizer step",
                   cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, run.seq_len or cfg.block_size,
                   run.micro_batch or 1)


class Planner(QuietRepr, widgets.VBox):
    preview_hint = ("Run this cell (Shift+Enter) to move the planner's sliders; until then this is its first view, "
                    "the article's example.")

    def preview_html(self) -> str:
        return self.formula.value + self._measured_html()
    def __init__(self, measured: Optional[MeasuredPoint] = None, phi: float = 7e9, n: int = 8,
                 gpu_mem_gb: int = 80, strategy: str = "ZeRO-3", precision: str = "bf16", nodes: int = 1,
                 cpu_offload: bool = False):
        self.measured = measured
        style = {"description_width": "130px"}
        wide = widgets.Layout(width="460px")
        self.phi = widgets.SelectionSlider(options=phi_options(phi, measured), value=round(phi),
                                           description="Φ (params)", style=style, layout=wide)
        self.n = widgets.SelectionSlider(options=n_options(n, measured.n if measured else None), value=n,
                                         description="N (GPUs)", style=style, layout=wide)
        self.gpu = widgets.IntSlider(value=gpu_mem_gb, min=8, max=192, description="GPU memory (GB)", style=style,
                                     layout=wide)
        self.strategy = widgets.ToggleButtons(options=list(planner.STAGES), value=strategy, description="strategy",
                                              style={"description_width": "130px", "button_width": "70px"})
        self.precision = widgets.ToggleButtons(options=list(planner.PRECISION_BYTES), value=precision,
                                               description="precision",
                                               style={"description_width": "130px", "button_width": "70px"})
        self.seq = widgets.SelectionSlider(options=seq_options(2048, measured.seq_len if measured else None),
                                           value=2048, description="sequence length", style=style, layout=wide)
        self.micro_batch = widgets.IntSlider(value=1, min=1, max=64, description="micro-batch", style=style,
                                             layout=wide)
        self.recompute = widgets.Checkbox(value=False, description="activation recompute (checkpointing)",
                                          indent=False, layout=widgets.Layout(margin="0 0 0 134px"))
        self.attention = widgets.ToggleButtons(
            options=[("fused (SDPA/Flash)", "fused"), ("scores stored", "materialized")], value="fused",
            description="attention", tooltips=["no s×s scores kept (what current models run)",
                                               "the article's sbh(34 + 5as/h): the s×s scores kept"],
            style={"description_width": "130px", "button_width": "130px"})
        self.nodes = widgets.Dropdown(options=sorted({1, 2, 4, 8, 16, nodes}), value=nodes,
                                      description="nodes (HSDP)",
                                      style=style, layout=widgets.Layout(width="260px"))
        self.cpu_offload = widgets.Checkbox(value=cpu_offload, description="CPU offload (params, grads, Adam on the host)",
                                            indent=False, layout=widgets.Layout(margin="0 0 0 134px"))
        self.use_measured = widgets.Button(description="set every control to the measured run",
                                           disabled=measured is None, layout=widgets.Layout(width="280px"))
        self.use_measured.on_click(lambda _b: self.jump_to_measured())
        self.formula = widgets.HTML(layout=widgets.Layout(flex="1 1 0", margin="0 24px 0 0"))
        self.measured_html = widgets.HTML(layout=widgets.Layout(flex="1 1 0"))
        self.out = widgets.Output()
        self.plan: Optional[planner.Plan] = None
        self._quiet = False
        for w in (self.phi, self.n, self.gpu, self.strategy, self.precision, self.seq, self.micro_batch,
                  self.recompute, self.attention, self.nodes, self.cpu_offload):
            w.observe(self._redraw, names="value")
        if measured is None:
            self.use_measured.layout.display = self.measured_html.layout.display = "none"
        controls = widgets.VBox([self.phi, self.n, self.gpu, self.strategy, self.precision, self.seq,
                                 self.micro_batch, self.recompute, self.attention, self.nodes, self.cpu_offload,
                                 self.use_measured])
        super().__init__([controls, widgets.HBox([self.formula, self.measured_html]), self.out])
        self._redraw()

    def jump_to_measured(self) -> None:
        m = self.measured
        if m is None:
            return
        self._quiet = True  # one redraw for the three changes, not three
        try:
            self.phi.value, self.n.value, self.strategy.value = m.phi, m.n, STAGE_OF[m.strategy]
            self.precision.value, self.recompute.value = m.precision, False
            if m.seq_len:
                self.seq.value = m.seq_len
            if m.micro_batch:
                self.micro_batch.value = min(m.micro_batch, self.micro_batch.max)
        finally:
            self._quiet = False
        self._redraw()

    def numbers(self) -> dict:
        """What the widget shows, straight from fsdp_lab.theory.formulas (tests compare these with the formulas)."""
        p, stage = self.plan, self.strategy.value
        return {"state_bytes": p.state_bytes(stage), "peak_bytes": p.peak_bytes(stage), "n_min": p.n_min,
                "n_min_with_activations": p.n_min_with_activations, "n_min_with_reserve": p.n_min_with_reserve,
                "fits": p.fits(stage), "rows": p.rows(), "gpu_bytes": p.gpu_bytes, "host_bytes": p.host_bytes,
                "comm": p.comm_bytes_per_step()}

    def _redraw(self, _change=None) -> None:
        if self._quiet:
            return
        phi, n, stage, m = round(self.phi.value), self.n.value, self.strategy.value, self.measured
        if n % self.nodes.value:  # N GPUs that do not split evenly over the nodes: back to one node
            self._quiet = True
            try:
                self.nodes.value = 1
            finally:
                self._quiet = False
        nodes = self.nodes.value if stage == "ZeRO-3" else 1  # HSDP is ZeRO-3 inside each node
        shape = {}
        if m is not None and phi == m.phi and m.hidden:  # the measured model: its own shape and vocabulary
            shape = dict(layers=m.layers, hidden=m.hidden, heads=m.heads, vocab=m.vocab)
        self.plan = planner.plan(phi, n, self.gpu.value, strategy=stage, precision=self.precision.value,
                                 seq_len=self.seq.value, micro_batch=self.micro_batch.value,
                                 recompute=self.recompute.value, attention=self.attention.value, nodes=nodes,
                                 cpu_offload=self.cpu_offload.value, **shape)
        self.formula.value = self._formula_html(phi, n, stage)
        self.measured_html.value = self._measured_html()
        show_figure(self.out, self.figure())

    def _formula_html(self, phi: int, n: int, stage: str) -> str:
        p, (expr, fn) = self.plan, STAGE_FORMULA[stage]
        verdict = lambda ok: "<b style='color:#15803d'>fits</b>" if ok else "<b style='color:#b91c1c'>does not fit</b>"
        rows = "".join(f"<tr style='{'font-weight:700' if s == stage else ''}'><td>{s}</td><td>{gb(st)}</td>"
                       f"<td>{gb(pk)}</td><td>{'yes' if fit else 'no'}</td></tr>" for s, st, pk, _, fit in p.rows())
        nmin = lambda v: "never (even N → ∞ is not enough)" if v is None else f"{v}"
        return (f"<div style='font-size:13px;line-height:20px'><b>formula 公式</b> "
                f"({esc(stage)}, Φ = {_short(phi)}, N = {n})<br>"
                f"M<sub>{esc(stage)}</sub> = {expr} = <b>{gb(fn(phi, n))}</b> per GPU (states only)<br>"
                f"+ one unit's working copies {gb(p.working_bytes)} + activations {gb(p.activation_bytes)} "
                f"{f'+ the layer recomputed in backward {gb(p.recompute_layer_bytes)} ' if p.recompute else ''}"
                f"+ logits and their fp32 loss copy {gb(p.logits_bytes)} (vocab {p.vocab:,}) "
                f"(seq {p.seq_len}, micro-batch {p.micro_batch}, {p.precision}, "
                f"{'recompute' if p.recompute else 'no recompute'}, "
                f"{'fused attention' if p.attention == 'fused' else 's×s scores stored'}) "
                f"= peak <b>{gb(p.peak_bytes(stage))}"
                f"</b>: {verdict(p.fits(stage))} in {self.gpu.value} GB<br>"
                f"<span style='color:#6b7280'>Precision sets the working copies, activations and logits "
                f"({planner.PRECISION_BYTES[p.precision]} bytes a value), so it moves the peak. The states do not "
                f"move: the article counts fp32 master weights, gradients and Adam moments (16 bytes a parameter) "
                f"whatever the compute precision.</span><br>"
                f"N<sub>min</sub> = ⌈16Φ / M<sub>GPU</sub>⌉ = <b>{p.n_min}</b>; with activations: "
                f"{nmin(p.n_min_with_activations)}; keeping {p.reserve_fraction:.0%} free: "
                f"{nmin(p.n_min_with_reserve)}<br>"
                f"{self._options_html(stage)}"
                f"<table style='{_TABLE}'><tr><th>stage</th><th>states</th>"
                f"<th>peak</th><th>peak fits</th></tr>{rows}</table>"
                f"<div style='color:#6b7280;font-size:11px;line-height:14px'>{esc(p.assumptions)}</div></div>")

    def _options_html(self, stage: str) -> str:
        """The HSDP and CPU offload lines (planner.Plan.gpu_bytes, host_bytes, comm_bytes_per_step)."""
        p, comm = self.plan, self.plan.comm_bytes_per_step()
        lines = []
        if self.nodes.value > 1 and stage != "ZeRO-3":
            lines.append(f"HSDP shards like ZeRO-3 inside a node: pick ZeRO-3 to plan {self.nodes.value} nodes")
        elif p.nodes > 1:
            lines.append(f"<b>HSDP</b> on {p.nodes} nodes × {p.shard_group} GPUs: states 16Φ/G = "
                         f"{gb(p.hybrid_state_bytes)} per GPU (each node keeps a whole copy); per step each GPU "
                         f"sends {gb(comm['intra_node'])} inside its node and {gb(comm['inter_node'])} across nodes "
                         f"(the all-reduce of its gradient shard, fp32)")
        else:
            lines.append(f"one node: each GPU sends {gb(comm['intra_node'])} a step (two gathers and a "
                         f"reduce-scatter, fp32 reduce), none across nodes")
        if p.cpu_offload:
            lines.append(f"<b>CPU offload</b>: the card holds {gb(p.gpu_bytes)} (working copies, activations, "
                         f"logits, one unit's shard copied in); the host holds {gb(p.host_bytes)} per rank "
                         f"(fp32 shards, their gradients and Adam's state; the optimizer steps there)")
        return "".join(f"{line}<br>" for line in lines)

    def _measured_html(self) -> str:
        m = self.measured
        if m is None:
            return ""
        got, want = m.measured, m.predicted
        pred = {"params": want.params, "grads": want.grads, "optimizer": want.optimizer, "total": want.total}
        rows = "".join(f"<tr><td>{k}</td><td>{got[k]:,} B</td><td>{pred[k]:,} B</td><td>{got[k] - pred[k]:+,}</td></tr>"
                       for k in ("params", "grads", "optimizer", "total"))
        diff = got["total"] - want.total
        why = (f"The {diff} extra bytes are AdamW's <code>step</code> counters (one scalar per flat shard), "
               f"which the formula does not count." if diff == m.step_tensor_bytes and diff else "")
        return (f"<div style='font-size:13px;line-height:20px'><b>measured 实测</b> ({esc(m.label)})<br>"
                f"Φ = {m.phi:,}, padded P = {m.numel_padded_total:,}, N = {m.n}. Formula: "
                f"runtime_state_bytes({esc(m.strategy)}) = {human_bytes(want.total)}; the ZeRO formula "
                f"{esc(STAGE_FORMULA[STAGE_OF[m.strategy]][0])} = "
                f"{human_bytes(STAGE_FORMULA[STAGE_OF[m.strategy]][1](m.phi, m.n))}<br>"
                f"<table style='{_TABLE}'><tr><th>kind</th><th>measured</th>"
                f"<th>formula</th><th>diff</th></tr>{rows}</table>{why}</div>")

    def static_png(self) -> bytes:
        return figure_png(self.figure())

    def figure(self) -> Figure:
        """Left: each stage's states against N (DDP and ZeRO-3 from the article, ZeRO-1/2 from the ZeRO paper).
        Right: the peak of each stage at the chosen Φ, N and precision, split into its parts, against the card."""
        fig = Figure(figsize=(10, 3.4), dpi=100, layout="constrained")
        left, right = fig.subplots(1, 2)
        phi, n, p = round(self.phi.value), self.n.value, self.plan
        ns = [2**k for k in range(11)]
        for s, (_expr, fn) in STAGE_FORMULA.items():
            bold = s == self.strategy.value
            left.plot(ns, [fn(phi, k) / formulas.GB for k in ns], marker="o" if bold else None, markersize=3,
                      linewidth=2.4 if bold else 1.1, label=s)
        left.axhline(self.gpu.value, color="#b91c1c", linestyle="--", linewidth=1, label="GPU memory")
        left.plot([n], [STAGE_FORMULA[self.strategy.value][1](phi, n) / formulas.GB], "k*", markersize=12,
                  label=f"your N = {n}")
        left.set(xscale="log", yscale="log", xlabel="N (GPUs)", ylabel="states per GPU (GB)",
                 title=f"states (16Φ convention): Φ = {_short(phi)} on N GPUs")
        left.set_xticks(ns, [str(k) for k in ns], fontsize=7)
        left.grid(alpha=0.3, which="both")
        left.legend(fontsize=7)
        parts = (("states", lambda s: p.state_bytes(s), "#60a5fa"), ("working copies", lambda s: p.working_bytes,
                 "#a855f7"), ("activations", lambda s: p.activation_bytes + p.recompute_layer_bytes, "#f97316"),
                 ("logits + loss copy", lambda s: p.logits_bytes, "#facc15"))
        x = range(len(planner.STAGES))
        bottom = [0.0] * len(planner.STAGES)
        tiny = max(p.peak_bytes(s) for s in planner.STAGES) < formulas.GB / 100  # a toy model: MiB, not 0.00 GB
        unit, unit_name = (2**20, "MiB") if tiny else (formulas.GB, "GB")
        for label, value, colour in parts:
            heights = [value(s) / unit for s in planner.STAGES]
            right.bar(x, heights, 0.6, bottom=bottom, color=colour, label=label,
                      edgecolor=["black" if s == self.strategy.value else colour for s in planner.STAGES])
            bottom = [b + h for b, h in zip(bottom, heights)]
        if not tiny:
            right.axhline(self.gpu.value, color="#b91c1c", linestyle="--", linewidth=1, label="GPU memory")
        right.set_xticks(list(x), list(planner.STAGES))
        right.set(xlabel="ZeRO stage", ylabel=f"peak per GPU ({unit_name})",
                  title=f"peak at N = {n}, {p.precision}, seq {p.seq_len}, micro-batch {p.micro_batch}"
                        f"{', recompute' if p.recompute else ''}")
        right.grid(alpha=0.3, axis="y")
        right.legend(fontsize=7)
        return fig
