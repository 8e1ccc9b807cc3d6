"""Whether a directory is a checkpoint to load: the one place that decides it, for resume, load, export and prune.

    inspect(step_dir) -> Verdict     what a step directory is: VERIFIED, UNVERIFIED, DAMAGED, MALFORMED, ...
    trusted(step_dir) -> meta        its manifest, or CheckpointError saying in one line why it is refused
    find(path) -> Found | None       the checkpoint `--resume PATH` means: PATH itself, or the newest complete one
    published(root)                  the step directories under root that a save published (complete or not)

[Note: `latest` is a hint] `latest` is written after the rename that publishes a step, so a crash or a full
disk between the two leaves a complete `step_N` that `latest` does not name, and a user can delete or damage
`latest` itself. The step directories are the truth: resume takes the newest published one, and `latest` only
adds a note when it disagrees. The newest published checkpoint must verify; a damaged one is refused by name,
never skipped in favour of an older one (that would silently throw away training).

[Note: unverifiable] A manifest without checksums (or with checksums that skip a file) gives no way to tell a
damaged shard from a good one, and a damaged shard loads silently and turns the loss into NaN. Such a checkpoint
is refused unless the caller passes allow_unverified (`--allow-unverified`).

The manifest is checked field by field (types included) before anything uses it: a hand-edited or foreign
fsdp_lab.json is a one-line error, never a KeyError from deep inside the loader.
"""
from __future__ import annotations

import enum
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from fsdp_lab.checkpoint.files import DCP_METADATA, FORMAT, LATEST, META_FILE, CheckpointError, read_latest, \
    step_of

_SHA256 = re.compile(r"[0-9a-f]{64}")


class Kind(enum.Enum):
    VERIFIED = "complete and verified"          # every file matches the checksums the save recorded
    UNVERIFIED = "unverifiable"                 # complete, but no checksums: nothing vouches for the shards
    DAMAGED = "damaged"                         # a file is missing, truncated or changed since the save
    MALFORMED = "malformed"                     # fsdp_lab.json is unreadable or has the wrong shape
    INCOMPLETE = "not a complete checkpoint"    # no .metadata or no fsdp_lab.json: never published by a save
    ABSENT = "not a directory"                  # missing, a file, or a symbolic link (never followed)


@dataclass(frozen=True)
class Verdict:
    path: Path
    kind: Kind
    reason: str = ""          # why it is not VERIFIED (one line per damaged file)
    meta: dict | None = None  # the validated manifest, when it could be read

    def describe(self) -> str:
        return f"{self.path.name} ({self.kind.value}{': ' + self.reason if self.reason else ''})"


@dataclass(frozen=True)
class Found:
    step_dir: Path
    meta: dict
    note: str = ""  # what the caller should tell the user (e.g. `latest` disagreed)


# -- the manifest: every field the loader and the export read, with its type -----------------------------
def _field(meta: dict, key: str, kinds, where: str, optional: bool = False):
    if key not in meta:
        if optional:
            return None
        raise ValueError(f"{where}: '{key}' is missing")
    value = meta[key]
    if optional and value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _tuple(kinds)):
        names = "/".join(k.__name__ for k in _tuple(kinds))
        raise ValueError(f"{where}: '{key}' should be {names}, found {type(value).__name__} {_short(value)}")
    return value


def _tuple(kinds):
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _list_of(meta: dict, key: str, kinds, where: str) -> list:
    items = _field(meta, key, list, where)
    for i, item in enumerate(items):
        if not isinstance(item, kinds) or isinstance(item, bool):
            raise ValueError(f"{where}: '{key}'[{i}] should be {kinds.__name__}, found {type(item).__name__}")
    return items


def validate_meta(meta, path: Path) -> dict:
    """`meta` if it has the shape this fsdp_lab writes, else CheckpointError naming the first wrong field."""
    where = str(path)
    try:
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: should hold a JSON object, found {type(meta).__name__}")
        if meta.get("format") != FORMAT:
            raise ValueError(f"{where}: format {_short(meta.get('format'))}, this fsdp_lab reads {FORMAT!r}")
        if _field(meta, "step", int, where) < 0 or _field(meta, "world_size", int, where) < 1:
            raise ValueError(f"{where}: step {meta['step']} / world_size {meta['world_size']} out of range")
        _field(meta, "strategy", str, where)
        _field(meta, "torch", str, where)
        _field(meta, "model_config", dict, where, optional=True)
        _field(meta, "optimizer", dict, where, optional=True)
        _field(meta, "extra", dict, where, optional=True)
        _field(meta, "run", str, where, optional=True)
        _list_of(meta, "state_dict_order", str, where)
        _list_of(meta, "buffers", str, where)
        for i, unit in enumerate(_list_of(meta, "units", dict, where)):
            at = f"{where}: units[{i}]"
            _field(unit, "key", str, at)
            _field(unit, "numel", int, at)
            for j, slot in enumerate(_list_of(unit, "slots", dict, at)):
                _field(slot, "offset", int, f"{at}.slots[{j}]")
                _field(slot, "numel", int, f"{at}.slots[{j}]")
                _list_of(slot, "shape", int, f"{at}.slots[{j}]")
                _list_of(slot, "names", str, f"{at}.slots[{j}]")
        checksums = _field(meta, "checksums", dict, where, optional=True)
        for name, entry in (checksums or {}).items():
            if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or \
                    not _SHA256.fullmatch(str(entry.get("sha256"))):
                raise ValueError(f"{where}: checksums[{name!r}] should be {{'bytes': int, 'sha256': 64 hex}}")
    except ValueError as err:
        raise CheckpointError(f"malformed manifest {err}") from None
    return meta


def read_meta(step_dir: str | os.PathLike) -> dict:
    """The validated manifest of `step_dir` (no file checks: see trusted())."""
    path = Path(step_dir) / META_FILE
    try:
        raw = path.read_bytes()
        meta = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"cannot read {path}: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise CheckpointError(f"cannot read {path}: nested too deeply to be a manifest") from None
    return validate_meta(meta, path)


# -- the files: checked against the sizes and SHA-256 the save recorded ------------------------------------
def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_checksums(step_dir: str | os.PathLike) -> dict:
    """{file name: {"bytes": size, "sha256": hex}} for every file of a written checkpoint except fsdp_lab.json."""
    step_dir = Path(step_dir)
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
            for p in sorted(step_dir.iterdir()) if p.is_file() and p.name != META_FILE}


def verify_checksums(step_dir: str | os.PathLike, meta: dict, deep: bool = True) -> list[str]:
    """One line per damaged, truncated or missing file (empty when all match). deep=False compares sizes only:
    a quick look before any rank starts; the load itself always hashes."""
    step_dir = Path(step_dir)
    problems = []
    for name, want in (meta.get("checksums") or {}).items():
        path = step_dir / name
        if path.is_symlink() or not path.is_file():
            problems.append(f"{path}: missing (the save wrote {want['bytes']} bytes)")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{path}: {size} bytes, the save wrote {want['bytes']} (truncated or overwritten)")
        elif deep and sha256_of(path) != want["sha256"]:
            problems.append(f"{path}: contents changed since the save (SHA-256 differs from {META_FILE})")
    return problems


def _unrecorded(step_dir: Path, meta: dict) -> list[str]:
    """Files the loader may read that the checksums do not cover (all of them when there are no checksums)."""
    recorded = set(meta.get("checksums") or {})
    present = {p.name for p in step_dir.iterdir() if p.name != META_FILE}
    return sorted((present | {DCP_METADATA}) - recorded)


# -- the verdict ---------------------------------------------------------------------------------------------
def inspect(step_dir: str | os.PathLike, deep: bool = True) -> Verdict:
    """What `step_dir` is. Never raises for a bad checkpoint: the verdict says what is wrong."""
    path = Path(step_dir)
    if path.is_symlink() or not path.is_dir():
        what = "a symbolic link" if path.is_symlink() else ("a file" if path.exists() else "missing")
        return Verdict(path, Kind.ABSENT, what)
    missing = [name for name in (DCP_METADATA, META_FILE) if not (path / name).is_file()]
    if missing:
        return Verdict(path, Kind.INCOMPLETE, f"no {' and no '.join(missing)}")
    try:
        meta = read_meta(path)
    except CheckpointError as err:
        return Verdict(path, Kind.MALFORMED, str(err))
    if meta.get("checksums") is None:
        return Verdict(path, Kind.UNVERIFIED, f"{META_FILE} records no checksums", meta)
    problems = verify_checksums(path, meta, deep=deep)
    if problems:
        return Verdict(path, Kind.DAMAGED, "\n".join(problems), meta)
    unrecorded = _unrecorded(path, meta)
    if unrecorded:
        return Verdict(path, Kind.UNVERIFIED, f"{META_FILE} records no checksum for {', '.join(unrecorded[:4])}",
                       meta)
    return Verdict(path, Kind.VERIFIED, "", meta)


def refusal(verdict: Verdict) -> str:
    """The error for a checkpoint that may not be loaded: what it is, and what the user can do."""
    path, kind = verdict.path, verdict.kind
    if kind is Kind.DAMAGED:
        return (f"{path} is damaged, refusing to load it: {verdict.reason}\nRestore these files, or resume from "
                f"another checkpoint (--resume PATH)")
    if kind is Kind.UNVERIFIED:
        return (f"{path} is unverifiable: {verdict.reason}, so a damaged shard could not be told from a good one. "
                f"Refusing it; pass --allow-unverified to load it anyway")
    if kind is Kind.MALFORMED:
        return f"{path} cannot be loaded: {verdict.reason}"
    if kind is Kind.ABSENT and verdict.reason == "missing":
        return f"no checkpoint at {path}: the path does not exist"
    return f"{path} is {kind.value} ({verdict.reason})"


def trusted(step_dir: str | os.PathLike, allow_unverified: bool = False, deep: bool = True) -> dict:
    """The manifest of a checkpoint that may be loaded, or CheckpointError saying why not."""
    verdict = inspect(step_dir, deep=deep)
    if verdict.kind is Kind.VERIFIED or (verdict.kind is Kind.UNVERIFIED and allow_unverified):
        return verdict.meta
    raise CheckpointError(refusal(verdict))


# -- finding one -------------------------------------------------------------------------------------------
def step_dirs(root: str | os.PathLike) -> list[Path]:
    """Entries of `root` named step_N, newest first (symbolic links included: inspect() refuses them)."""
    root = Path(root)
    if not root.is_dir():
        return []
    named = [(step_of(p.name), p) for p in root.iterdir() if step_of(p.name) is not None]
    return [p for _step, p in sorted(named, key=lambda item: item[0], reverse=True)]


def published(root: str | os.PathLike) -> list[Verdict]:
    """Verdicts (sizes only, no hashing) of the step directories under root that a save published, newest
    first: everything but INCOMPLETE and ABSENT ones (a user's own folder named step_N, a link)."""
    verdicts = (inspect(p, deep=False) for p in step_dirs(root))
    return [v for v in verdicts if v.kind not in (Kind.INCOMPLETE, Kind.ABSENT)]


def _latest_hint(root: Path) -> tuple[str | None, str]:
    """(the step name `latest` gives, or None; a note when `latest` is unusable)."""
    pointer = root / LATEST
    if not os.path.lexists(pointer):
        return None, f"'{LATEST}' is missing"
    try:
        target = read_latest(root, check_target=False)
    except CheckpointError as err:
        return None, str(err)
    return target.name, ""


def find(path: str | os.PathLike, allow_unverified: bool = False, deep: bool = True) -> Found | None:
    """The checkpoint `path` names: a step directory itself, or under a checkpoint directory the newest one a
    save published ([Note: `latest` is a hint]). None when `path` is a checkpoint directory with nothing in it
    yet; CheckpointError (one line per problem) when what is there cannot be loaded."""
    path = Path(path)
    if (path / DCP_METADATA).exists() or (path / META_FILE).exists() or step_of(path.name) is not None:
        named = Path(os.path.realpath(path)) if path.is_symlink() else path  # named by the user: follow it
        return Found(named, trusted(named, allow_unverified, deep))
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist")
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: it is a file, not a checkpoint directory")
    hint, broken = _latest_hint(path)
    candidates = [inspect(p, deep=False) for p in step_dirs(path)]
    newest = next((v for v in candidates if v.kind not in (Kind.INCOMPLETE, Kind.ABSENT)), None)
    if newest is None:
        if not candidates and hint is None and not os.path.lexists(path / LATEST):
            return None  # nothing was ever published here
        found = "; ".join(v.describe() for v in candidates[:4]) or "no step directories"
        said = f"'{LATEST}' names {hint}" if hint else broken
        raise CheckpointError(f"no complete checkpoint in {path}: found {found}; {said}")
    meta = trusted(newest.path, allow_unverified, deep)
    note = ""
    if hint != newest.path.name:
        said = f"'{LATEST}' names {hint}" if hint else broken
        note = f"{said}; resuming from the newest complete checkpoint, {newest.path.name}"
    return Found(newest.path, meta, note)
