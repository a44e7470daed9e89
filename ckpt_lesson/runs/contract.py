"""The resume contract: check *what* a save belongs to before loading a single tensor.

A checkpoint that verifies byte for byte can still be the wrong one to resume:
saved on another dataset, by a different model or config, or under another
software stack. Loading it anyway "works": the shapes fit, training goes on,
and the result is neither the old run nor a clean new one. So a resume has two
layers of checks:

1. **contract** (this module, cheap, before any compute): the manifest's
   recorded data fingerprint, model fingerprint, config fingerprint and
   environment are compared with the current run;
2. **numeric** (:mod:`ckpt_lesson.files.checkpoint`): hashes, shapes and buckets
   when the tensors are loaded.

Data, model and config differences are always refused: resuming across them
silently changes the experiment, and the right tool for "start from these
weights on something new" is :func:`ckpt_lesson.runs.warm_start.warm_start_from`.
An environment change (a torch upgrade, a move from CPU to GPU) is refused by
default too, because bit-for-bit resume is only claimed in the same
environment; ``env_policy="warn"`` or ``"allow"`` accepts it once someone has
decided the change is harmless.

Fingerprints travel in the manifest's ``metadata``, as top-level
``model_fingerprint``/``config_fingerprint`` keys or in a ``contract`` block
(see :func:`contract_metadata`); the data block is the manifest's ``data``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, ContractMismatchError
from ckpt_lesson.files.schema import current_env
from ckpt_lesson.files.train_state import model_state
from ckpt_lesson.short_repr import short_repr

__all__ = [
    "CONTRACT_KEY",
    "ENV_FIELDS",
    "ENV_POLICIES",
    "ContractRow",
    "ResumeReport",
    "check_contract",
    "config_fingerprint",
    "contract_metadata",
    "current_contract",
    "model_fingerprint",
    "resume_report",
]

log = logging.getLogger(__name__)

#: Key of the fingerprint block inside a manifest's ``metadata``.
CONTRACT_KEY = "contract"
#: Environment fields compared on resume.
ENV_FIELDS = ("torch", "numpy", "python", "device_type", "world_size")
ENV_POLICIES = ("refuse", "warn", "allow")

_FIXES = {
    "data": "resume on the same data (same samples, same order seed); to train on new data, start a new "
    "experiment with warm_start_from()",
    "model": "build the same architecture as the saved run; to change it, start a new experiment with "
    "warm_start_from()",
    "config": "resume with the saved run's config; to change it, start a new experiment with "
    "warm_start_from()",
    "env": "resume in the saved environment, or pass env_policy='warn' (or 'allow') once you have checked "
    "that the change is harmless for this run",
}


def model_fingerprint(model: torch.nn.Module | Mapping[str, Any]) -> str:
    """sha256 of the sorted parameter/buffer names, shapes and dtypes (not the values).

    Two models that can load each other's state dicts have the same
    fingerprint; training changes values, never the fingerprint.

    Example:
        >>> from ckpt_lesson.course.training import make_model
        >>> model_fingerprint(make_model()) == model_fingerprint(make_model())
        True
        >>> model_fingerprint(make_model()) == model_fingerprint(make_model(hidden=16))
        False
    """
    sd = model_state(model) if isinstance(model, torch.nn.Module) else model  # wrapper-free keys
    lines = []
    for name in sorted(sd):
        t = sd[name]
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        dtype = str(t.dtype) if isinstance(t, torch.Tensor) else ""
        lines.append(f"{name}\t{shape}\t{dtype}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """sha256 of a config as canonical JSON (sorted keys), so key order does not matter.

    Raises:
        CheckpointError: The config is not JSON-serializable.

    Example:
        >>> config_fingerprint({"lr": 0.01, "bs": 16}) == config_fingerprint({"bs": 16, "lr": 0.01})
        True
    """
    try:
        text = json.dumps(dict(config), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"config is not JSON-serializable ({exc}); fingerprint plain values only."
        ) from exc
    return hashlib.sha256(text.encode()).hexdigest()


def contract_metadata(
    *, model: torch.nn.Module | None = None, config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``metadata`` entry to record with every save, e.g. ``CheckpointManager(metadata=...)``."""
    block: dict[str, Any] = {}
    if model is not None:
        block["model_fingerprint"] = model_fingerprint(model)
    if config is not None:
        block["config_fingerprint"] = config_fingerprint(config)
    return {CONTRACT_KEY: block}


def current_contract(
    *,
    data: Mapping[str, Any] | None = None,
    model: torch.nn.Module | None = None,
    config: Mapping[str, Any] | None = None,
    world_size: int = 1,
) -> dict[str, Any]:
    """What the current run expects, in the shape :func:`resume_report` compares.

    Args:
        data: The data block, e.g. ``{"fingerprint": ds.fingerprint(), "order_seed": 11}``.
        model: The freshly built model (fingerprinted, values ignored).
        config: The run's config dict.
        world_size: Processes in the current job.
    """
    out: dict[str, Any] = {"env": current_env(world_size=world_size)}
    if data is not None:
        out["data"] = dict(data)
    return {**out, **contract_metadata(model=model, config=config)[CONTRACT_KEY]}


@dataclass(frozen=True)
class ContractRow:
    """One compared field.

    ``status`` is ``"match"``, ``"differs"``, ``"not recorded"`` (the save has
    no value: cannot be checked) or ``"not checked"`` (the current run gave none).
    """

    field: str
    kind: str
    saved: Any
    current: Any
    status: str


@dataclass(frozen=True)
class ResumeReport:
    """Which save a resume would use, and how it compares with the current run."""

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    save_id: str | None
    step: int | None
    rows: tuple[ContractRow, ...]

    def differences(self, kind: str | None = None) -> list[ContractRow]:
        """Rows whose values differ, optionally only of one kind."""
        return [r for r in self.rows if r.status == "differs" and (kind is None or r.kind == kind)]

    def to_dict(self) -> dict[str, Any]:
        return {"save_id": self.save_id, "step": self.step, "rows": [asdict(r) for r in self.rows]}

    def format(self) -> str:
        """A fixed-width table for logs and notebooks (no paths, no times)."""
        head = f"resume contract for save {self.save_id} at step {self.step}"
        width = max([len(r.field) for r in self.rows] + [5])
        lines = [head, f"  {'field':<{width}}  {'status':<12}  saved -> current"]
        for r in self.rows:
            lines.append(f"  {r.field:<{width}}  {r.status:<12}  {_short(r.saved)} -> {_short(r.current)}")
        return "\n".join(lines)


def _short(value: Any) -> str:
    text = str(value)
    return text[:16] + "..." if isinstance(value, str) and len(value) == 64 else text


def resume_report(manifest: Mapping[str, Any], *, current: Mapping[str, Any]) -> ResumeReport:
    """Compare a save's manifest with the current run, field by field; refuses nothing.

    Args:
        manifest: A manifest dict (``save_id``, ``step``, ``env``, ``data``,
            ``metadata["contract"]``), or a single-file payload (``state``,
            ``env``, ``data``, ``extras["contract"]``).
        current: From :func:`current_contract`; may also hold ``config``, the
            run's settings dict, compared key by key with the same keys of
            the manifest's ``metadata``.

    Returns:
        A :class:`ResumeReport`; pass it to :func:`check_contract`.
    """
    step = manifest.get("step")
    if step is None and isinstance(manifest.get("state"), Mapping):
        step = manifest["state"].get("step")
    saved_contract = _saved_contract(manifest)
    saved_data = manifest.get("data") if isinstance(manifest.get("data"), Mapping) else {}
    saved_env = manifest.get("env") if isinstance(manifest.get("env"), Mapping) else {}
    cur_data = current.get("data") or {}
    cur_env = current.get("env") or {}
    rows = [
        _row("data.fingerprint", "data", saved_data.get("fingerprint"), cur_data.get("fingerprint")),
        _row("data.order_seed", "data", saved_data.get("order_seed"), cur_data.get("order_seed")),
    ]
    for kind in ("model", "config"):
        key = f"{kind}_fingerprint"
        rows.append(_row(key, kind, saved_contract.get(key), current.get(key)))
    # A fingerprint says *that* the config differs; the settings themselves, when
    # the caller passes them and the save kept them as metadata, say *what* differs.
    settings = current.get("config")
    saved_meta = manifest.get("metadata")
    if isinstance(settings, Mapping) and isinstance(saved_meta, Mapping):
        rows += [_row(f"config.{k}", "config", saved_meta.get(k), settings[k]) for k in sorted(settings)]
    rows += [_row(f"env.{k}", "env", saved_env.get(k), cur_env.get(k)) for k in ENV_FIELDS]
    return ResumeReport(manifest.get("save_id"), step, tuple(rows))


def _saved_contract(manifest: Mapping[str, Any]) -> Mapping[str, Any]:
    """Fingerprints from ``metadata`` (or a payload's ``extras``): top-level keys or a ``contract`` block."""
    found: dict[str, Any] = {}
    for holder in ("metadata", "extras"):
        block = manifest.get(holder)
        if not isinstance(block, Mapping):
            continue
        for key in ("model_fingerprint", "config_fingerprint"):
            if block.get(key) is not None:
                found.setdefault(key, block[key])
        if isinstance(block.get(CONTRACT_KEY), Mapping):
            found.update({k: v for k, v in block[CONTRACT_KEY].items() if v is not None})
    return found


def _row(name: str, kind: str, saved: Any, current: Any) -> ContractRow:
    if current is None:
        status = "not checked"
    elif saved is None:
        status = "not recorded"
    else:
        status = "match" if saved == current else "differs"
    return ContractRow(name, kind, saved, current, status)


def check_contract(report: ResumeReport, *, env_policy: str = "refuse") -> list[str]:
    """Refuse a resume whose data, model, config (or environment) differ.

    Args:
        report: From :func:`resume_report`.
        env_policy: ``"refuse"`` (default), ``"warn"`` (log and go on) or
            ``"allow"`` (go on silently) for environment differences. Data,
            model and config differences are refused under every policy.

    Returns:
        Warnings: environment differences under ``"warn"`` and fields the save
        never recorded (they could not be checked).

    Raises:
        ContractMismatchError: Naming each differing field with its saved and
            current value and the fix.
        CheckpointError: An unknown ``env_policy``.

    Example:
        >>> check_contract(resume_report(manifest, current=current_contract(data=d)))  # doctest: +SKIP
        []
    """
    if env_policy not in ENV_POLICIES:
        raise CheckpointError(f"env_policy must be one of {ENV_POLICIES}, got {env_policy!r}.")
    refused = [r for r in report.differences() if r.kind != "env" or env_policy == "refuse"]
    if refused:
        where = f"save {report.save_id} (step {report.step})"
        details = "; ".join(f"{r.field}: saved {r.saved!r}, current {r.current!r}" for r in refused)
        fixes = "; ".join(dict.fromkeys(_FIXES[r.kind] for r in refused))
        raise ContractMismatchError(f"resume refused for {where}: {details}. Fix: {fixes}.")
    warnings = []
    if env_policy == "warn":
        for r in report.differences("env"):
            warnings.append(f"environment changed: {r.field} saved {r.saved!r}, current {r.current!r}")
    for r in report.rows:
        if r.status == "not recorded":
            warnings.append(f"{r.field} was not recorded by the save; it could not be checked")
    for w in warnings:
        log.warning("save %s: %s", report.save_id, w)
    return warnings
