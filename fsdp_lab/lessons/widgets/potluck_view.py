"""HTML for one potluck frame: a pure function of a FrameState (no widgets), so it can be tested and saved.

Every household card has the same rows in every frame (all units in the fridge, a slot per unit on the table,
every memory kind), so the picture does not jump while the animation plays.
"""
from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.lessons.widgets.fmt import MEMORY_KINDS, esc, human_bytes, memory_total
from fsdp_lab.lessons.widgets.frames import BEATS, FrameState, Household, Sizes

_GATHER = BEATS["gather"].colour  # a unit still arriving on the table
_REDUCE = BEATS["reduce_scatter"].colour  # a unit whose gradient is being reduce-scattered
_UNIT_PX = 150  # bar length of the largest gathered unit
# Explicit line heights: ipywidgets gives HTML content the 28 px line height of an input row.
_FONT = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:13px;color:#111827;line-height:19px"


@dataclass(frozen=True)
class Scale:
    """Trace-wide maxima, so bar lengths compare across frames."""

    full_max: int  # one byte scale for fridge and table: a gathered unit is visibly N times its shard
    memory_max: int
    fridge_max: int = 1  # the AdamW row's scale: the largest optimizer state in the trace

    @classmethod
    def of(cls, events: list, sizes: Sizes) -> "Scale":
        full = max((max(s.full_bytes, s.shard_bytes) for s in sizes.units.values()), default=1)
        mem = max((memory_total(e.get("mem", {})) for e in events), default=1)
        adam = max((e.get("mem", {}).get("optimizer_state", 0) for e in events), default=1)
        return cls(max(full, 1), max(mem, 1), max(adam, full, 1))


def _bar(fraction: float, colour: str, width_px: int, style: str = "solid") -> str:
    w = max(2, round(min(1.0, fraction) * width_px)) if fraction > 0 else 0
    return (f"<span style='display:inline-block;vertical-align:middle;height:12px;width:{w}px;"
            f"background:{colour if style == 'solid' else 'transparent'};border:1px {style} {colour};"
            f"border-radius:3px'></span>")


def _row(name: str, body: str, note: str = "", weight: str = "400") -> str:
    return (f"<div style='display:flex;align-items:center;gap:6px;height:19px;line-height:19px'>"
            f"<span style='flex:0 0 72px;font-family:monospace;font-weight:{weight};overflow:hidden;"
            f"text-overflow:ellipsis;white-space:nowrap'>{esc(name)}</span>{body}"
            f"<span style='color:#374151;white-space:nowrap;min-width:0;overflow:hidden;text-overflow:ellipsis'>"
            f"{note}</span></div>")


def _fridge(h: Household, scale: Scale) -> str:
    rows = []
    for unit, nbytes in h.fridge.items():
        body = _bar(nbytes / scale.full_max, "#60a5fa", _UNIT_PX)
        note = human_bytes(nbytes)
        if unit in h.grad_shards:
            body += _bar(h.grad_shards[unit] / scale.full_max, "#f97316", _UNIT_PX)
            note += f" + grad {human_bytes(h.grad_shards[unit])}"
        rows.append(_row(unit, body, note))
    if h.optimizer_bytes:
        rows.append(_row("Adam", _bar(h.optimizer_bytes / scale.fridge_max, "#34d399", _UNIT_PX),
                         f"{human_bytes(h.optimizer_bytes)} · AdamW moments"))
    else:
        rows.append(_row("Adam", "<span style='color:#9ca3af'>none yet: AdamW makes its moments at the first "
                                 "optimizer step</span>"))
    return "".join(rows)


def _table(h: Household, units: dict, scale: Scale) -> str:
    rows = []
    for unit, size in units.items():
        frac = size.full_bytes / scale.full_max
        if unit in h.table:
            computing, reducing = h.computing == unit, h.reducing == unit
            body = _bar(frac, "#16a34a" if computing else _REDUCE if reducing else "#1d4ed8", _UNIT_PX)
            note = human_bytes(h.table[unit]) + (" · computing 计算中" if computing else
                                                 " · reduce-scatter 归约回分" if reducing else
                                                 " · in use (outer unit)" if unit in h.busy else "")
            rows.append(_row(unit, body, note, "700" if computing else "400"))
        elif unit in h.arriving:
            rows.append(_row(unit, _bar(frac, _GATHER, _UNIT_PX, "dashed"), "arriving… 聚合中"))
        else:
            empty = "<span style='color:#9ca3af'>empty</span>"
            rows.append(_row(unit, _bar(frac, "#d1d5db", _UNIT_PX, "dotted"), empty))
    return "".join(rows)


def _memory(h: Household, scale: Scale) -> str:
    mem = h.memory
    segs = "".join(_bar(mem.get(k, 0) / scale.memory_max, c, 230) for k, _, c in MEMORY_KINDS if mem.get(k, 0))
    kinds = "".join(
        f"<div style='display:flex;justify-content:space-between;line-height:17px;"
        f"color:{'#111827' if mem.get(k) else '#9ca3af'}'>"
        f"<span><span style='display:inline-block;width:9px;height:9px;background:{c};margin-right:4px'></span>"
        f"{esc(label)}</span><span>{human_bytes(mem.get(k, 0))}</span></div>" for k, label, c in MEMORY_KINDS)
    cuda = (f"<div>CUDA allocated (whole process): <b>{human_bytes(mem['cuda_allocated'])}</b></div>"
            if "cuda_allocated" in mem else "")
    total = mem.get("total", sum(mem.get(k, 0) for k, _, _ in MEMORY_KINDS))
    return (f"<div style='margin-top:6px'><b>memory 显存/内存</b> · FSDP state {human_bytes(total)}</div>"
            f"<div style='display:flex;gap:0;height:14px;align-items:center'>{segs}</div>"
            f"<div style='font-size:12px'>{kinds}{cuda}</div>")


def _card(h: Household, state: FrameState, units: dict, scale: Scale) -> str:
    active = h.rank == state.event["rank"]
    border = state.beat.colour if active else "#e5e7eb"
    return (f"<div style='flex:1;min-width:300px;border:2px solid {border};border-radius:10px;padding:8px 10px;"
            f"background:{'#ffffff' if active else '#f9fafb'}'>"
            f"<div style='font-size:14px;font-weight:700;margin-bottom:4px'>household 家 {h.rank} "
            f"<span style='font-weight:400;color:#6b7280'>(rank {h.rank}, step {h.step})</span></div>"
            f"<div style='font-weight:600;margin-top:2px'>冰箱 fridge · its own 1/N shards and their optimizer state "
            f"<span style='font-weight:400'>{human_bytes(h.fridge_bytes)}</span></div>{_fridge(h, scale)}"
            f"<div style='font-weight:600;margin-top:6px'>长桌 long table · gathered full units "
            f"<span style='font-weight:400'>{human_bytes(h.table_bytes)}</span></div>"
            f"{_table(h, units, scale)}{_memory(h, scale)}</div>")


def _headline(state: FrameState) -> str:
    e, beat = state.event, state.beat
    moved = ""
    if e.get("bytes_sent") or e.get("bytes_received"):
        moved = f" · sent {human_bytes(e['bytes_sent'])}, received {human_bytes(e['bytes_received'])}"
    what = (f"rank {e['rank']} · {esc(e['event'])} · unit <code>{esc(e['unit'])}</code> · {esc(e.get('phase', ''))}"
            f" · step {e.get('step', 0)}{moved}")
    return (f"<div style='display:flex;align-items:center;gap:12px;flex-wrap:wrap;margin-bottom:8px'>"
            f"<span style='background:{beat.colour};color:#fff;border-radius:16px;padding:4px 14px;font-size:17px;"
            f"font-weight:700'>{esc(beat.zh)} · {esc(beat.en)}</span><span>{what}</span>"
            f"<span style='margin-left:auto;color:#6b7280'>event {state.index} of 0–{state.total - 1}"
            f" · t = {state.seconds:.3f} s</span></div>")


def render_frame(state: FrameState, sizes: Sizes, scale: Scale) -> str:
    cards = "".join(_card(h, state, sizes.units, scale) for h in state.households)
    note = "" if sizes.exact else ("<div style='color:#b45309;line-height:16px'>unit sizes derived from memory deltas "
                                   "(no unit table came with this trace)</div>")
    legend = ("<div style='color:#6b7280;font-size:12px;line-height:16px;margin-top:6px'>"
              "Each household (rank) keeps a 1/N slice "
              "of every unit in its fridge. To compute a unit it gathers the other slices and lays the full unit on "
              "its own table; FULL_SHARD clears it right after. After backward the summed gradient is split back: "
              "each fridge gets its gradient shard (orange).</div>")
    return (f"<div style='{_FONT}'>{_headline(state)}"
            f"<div style='display:flex;gap:12px;flex-wrap:wrap'>{cards}</div>{note}{legend}</div>")


def render_message(text: str) -> str:
    """A friendly box instead of a frame (e.g. no GPU trace shipped)."""
    return (f"<div style='{_FONT};border:1px solid #fcd34d;background:#fffbeb;border-radius:8px;padding:10px'>"
            f"{esc(text)}</div>")


def render_phase_strip(phase: str, index: int, total: int, phase_spans: dict) -> str:
    """Forward | backward | optimizer step, each as wide as its share of the events (never too narrow to read),
    the current one filled in; the slider already shows the position within the step."""
    from fsdp_lab.lessons.widgets.frames import PHASES

    cells = []
    for key, label in PHASES:
        lo, hi = phase_spans.get(key, (0, -1))
        if hi < lo:
            continue
        now = key == phase
        cells.append(f"<div style='flex:{hi - lo + 1} 1 0;min-width:150px;text-align:center;padding:2px 0;"
                     f"border-radius:4px;background:{'#0f766e' if now else '#e5e7eb'};"
                     f"color:{'#fff' if now else '#374151'};font-weight:{'700' if now else '400'};white-space:nowrap'>"
                     f"{esc(label)}{' ◀ now' if now else ''}</div>")
    return (f"<div style='display:flex;gap:2px;margin:4px 0 6px 0;font-size:13px;line-height:19px' "
            f"title='event {index} of 0–{total - 1}'>"
            f"{''.join(cells)}</div>")
