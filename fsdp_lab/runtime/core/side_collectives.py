"""Collectives off the unit lifecycle, through the collective log: construction checks, sync_module_states,
optimizer state dicts, checkpoints, the training loop's loss.

The three lifecycle collectives (fsdp_lab/runtime/core/collectives.py) are not all FSDP issues: building a model
checks that every rank wrapped the same one, sync_module_states broadcasts rank 0's values, an optimizer state
dict gathers what each rank holds as objects, a checkpoint asks every rank whether its state is finite. Each of
these is one more place where a rank can be missing, so each is recorded in its group's collective log like the
others (op, unit, phase, shape, dtype, bytes; issued, then done) and a failure raises CollectiveFailed with the
log's report. `issue(dist.broadcast, t, src=0, group=pg, unit=..., phase="init")` runs the torch.distributed
function itself, positional arguments and keywords as torch takes them.

[Note: patient collectives] A group's timeout is what names a hang, so it is short where a learner waits for it
(the live ranks use a few seconds). Some collectives follow work that one rank may do for much longer than its
peers, and then a short timeout fails a run that is fine: the construction checks follow each rank's imports and
model building (seconds apart on a loaded machine), rank 0 reads or writes files before the broadcast that hands
the result to every rank, and a checkpoint's DCP calls write each rank's files between their collectives. These
are issued `patient=True`: for their duration the group's backends take the process's patient timeout
(`set_patient_timeout`, kept on the default group's log; the live ranks set their start-up timeout), and get
their own timeout back after. torch gives one collective a timeout of its own only in monitored_barrier (a
Work's wait(timeout) bounds the host's wait, not the backend's), and none for object collectives or DCP's; so
this sets the backend's default timeout (as torch.distributed.distributed_c10d._set_pg_timeout does), which the
collectives issued meanwhile take. Without a patient timeout set, patient collectives wait as long as any other.
"""
from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from fsdp_lab.runtime.core import collective_log
from fsdp_lab.runtime.core.collective_log import DONE, OBJECTS, STATE
from fsdp_lab.runtime.core.collectives import failure


def issue(fn, *args, group=None, unit: str = "root", phase: str = "", like=None, patient: bool = False,
          **kwargs):
    """`fn(*args, group=group, **kwargs)`, a torch.distributed collective, recorded in `group`'s collective log
    as `fn`'s name with `unit` and `phase`; `like` is what it moves for the record (a tensor, or a list of
    objects; default: the first argument). A failure raises CollectiveFailed with the log's report; `patient`:
    [Note: patient collectives]. Outside torch.distributed it just calls `fn`."""
    log = collective_log.log_of(group)
    if log is None:
        return fn(*args, group=group, **kwargs)
    what = args[0] if like is None and args else like
    if isinstance(what, torch.Tensor):
        rec = log.issue(fn.__name__, unit, phase, what.shape, what.dtype, what.numel())
    else:  # a list of objects (or of tensors): how many, their bytes are not known before pickling
        n = len(what) if hasattr(what, "__len__") else 1
        rec = log.issue(fn.__name__, unit, phase, (n,), OBJECTS, n)
    try:
        if patient:
            with patient_timeout(group):
                out = fn(*args, group=group, **kwargs)
        else:
            out = fn(*args, group=group, **kwargs)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as err:
        raise failure(fn.__name__, unit if unit != "root" else "", _moved(rec, log), (log, rec), err) from err
    rec[STATE] = DONE
    return out


def _moved(rec, log) -> str:
    shape, dtype, numel = rec[collective_log.SHAPE], rec[collective_log.DTYPE], rec[collective_log.NUMEL]
    what = f"{numel:,} objects" if dtype == OBJECTS else f"{tuple(shape)} {dtype}"
    return f"{what}, {len(log.ranks)} ranks"


def set_patient_timeout(seconds: Optional[float]) -> None:
    """How long this process's patient collectives may wait ([Note: patient collectives]); None: as long as
    any other. Kept on the default group's log, so a fresh group starts without it."""
    if seconds is not None and not seconds > 0:
        raise ValueError(f"a patient timeout must be a number of seconds > 0 (or None), got {seconds!r}")
    log = collective_log.log_of(None)
    if log is None:
        raise RuntimeError("set_patient_timeout needs torch.distributed initialised: it belongs to the default "
                           "process group")
    log.patient_timeout_s = seconds


def _backends(group) -> list:
    """The distinct backends (gloo, NCCL) of `group` (None: the default group)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    found = []
    for device in getattr(group, "_device_types", ()):
        try:
            backend = group._get_backend(device)
        except RuntimeError:
            continue
        if all(backend is not b for b in found):
            found.append(backend)
    return found


@contextmanager
def patient_timeout(group=None):
    """Inside: `group`'s backends time out after the process's patient timeout where that is longer than their
    own, which they get back on the way out ([Note: patient collectives])."""
    default = collective_log.log_of(None)
    seconds = default.patient_timeout_s if default is not None else None
    changed = []
    if seconds is not None:
        longer = timedelta(seconds=seconds)
        for backend in _backends(group):
            try:
                own = backend.options._timeout
                if own < longer:
                    backend._set_default_timeout(longer)
                    changed.append((backend, own))
            except (AttributeError, RuntimeError):  # a backend without a settable timeout keeps its own
                continue
    try:
        yield
    finally:
        for backend, own in changed:
            backend._set_default_timeout(own)
