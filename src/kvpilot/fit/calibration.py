"""Calibration profiles: this machine's measured memory bandwidth, GEMM rates and per-step overhead, stored as
JSON under the user's cache dir and keyed by the machine's fingerprint (torch-free; the measuring is done by
kvpilot.calibrate, which the `kvpilot` command installs here with `set_calibrator`).

Where: $KVPILOT_CACHE_DIR, else $XDG_CACHE_HOME/kvpilot, else ~/.cache/kvpilot; then
calibration/<fingerprint key>.json. Invariant: a profile is used only under the fingerprint it was measured
with; any other is ignored with a note saying how to measure this machine.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpilot.fit.errors import FitError
from kvpilot.fit.fingerprint import MachineFingerprint, current_fingerprint

SCHEMA_VERSION = 1
CALIBRATE_HINT = "run `kvpilot fit --calibrate` on this machine to measure it"


@dataclass(frozen=True)
class DeviceRates:
    """What one device sustains with kvpilot's kernels. Invariant: the rates are positive (bytes/s, FLOP/s),
    the overhead non-negative. ``catalog_name``: the fit catalog GPU it is ("" for the CPU)."""

    name: str
    bandwidth_bytes_per_s: float
    bf16_flops: float
    fp32_flops: float
    step_overhead_seconds: float
    catalog_name: str = ""

    def __post_init__(self) -> None:
        if min(self.bandwidth_bytes_per_s, self.bf16_flops, self.fp32_flops) <= 0 or self.step_overhead_seconds < 0:
            raise FitError(f"calibration of {self.name}: rates must be positive and the overhead non-negative, "
                           f"got {self}; {CALIBRATE_HINT} again.")


@dataclass(frozen=True)
class MachineProfile:
    """One machine's calibration: its CPU's rates, its GPU's when it has one (None otherwise)."""

    fingerprint: MachineFingerprint
    cpu: DeviceRates
    gpu: DeviceRates | None
    created_unix: float
    method: str  # what measured it, e.g. "kvpilot kernels"

    def rates_for(self, device_name: str) -> DeviceRates | None:
        """The rates for fit's device name ("cpu" or a catalog GPU), None when this profile has none."""
        if device_name == "cpu":
            return self.cpu
        return self.gpu if self.gpu is not None and self.gpu.catalog_name == device_name else None

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MachineProfile:
        """FitError when the document is not a profile of this schema."""
        try:
            if data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}")
            gpu = data.get("gpu")
            return cls(MachineFingerprint(**data["fingerprint"]), DeviceRates(**data["cpu"]),
                       DeviceRates(**gpu) if gpu else None, float(data["created_unix"]), str(data["method"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FitError(f"not a kvpilot calibration profile ({exc}); {CALIBRATE_HINT} again.") from None


@dataclass(frozen=True)
class ProfileLookup:
    """The profile for this machine (None: nominal rates) and a note on why one was not used, if any."""

    profile: MachineProfile | None
    path: Path
    note: str | None = None


def cache_dir() -> Path:
    """kvpilot's cache directory (see the module docstring)."""
    explicit = os.environ.get("KVPILOT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpilot"


def profile_path(fingerprint: MachineFingerprint) -> Path:
    return cache_dir() / "calibration" / f"{fingerprint.key()}.json"


def save_profile(profile: MachineProfile) -> Path:
    """Writes the profile (atomically: a reader never sees half a file); returns its path."""
    path = profile_path(profile.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    partial.replace(path)
    return path


def load_profile(fingerprint: MachineFingerprint | None = None) -> ProfileLookup:
    """This machine's profile when one was measured here; otherwise no profile, with a note when profiles of
    other machines exist (a shared home directory) or the file does not describe this machine."""
    here = fingerprint or current_fingerprint()
    path = profile_path(here)
    if not path.is_file():
        others = sorted(path.parent.glob("*.json")) if path.parent.is_dir() else []
        note = (f"the calibration profiles in {path.parent} are for other machines, not this one "
                f"({here.describe()}); using nominal rates: {CALIBRATE_HINT}") if others else None
        return ProfileLookup(None, path, note)
    try:
        profile = MachineProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, FitError) as exc:
        return ProfileLookup(None, path, f"ignored the calibration profile {path}: {exc}")
    if profile.fingerprint != here:
        return ProfileLookup(None, path, f"ignored the calibration profile {path}: it was measured on "
                                         f"{profile.fingerprint.describe()}, this machine is {here.describe()}; "
                                         f"{CALIBRATE_HINT}")
    return ProfileLookup(profile, path)


def busy_note(fingerprint: MachineFingerprint | None = None) -> str | None:
    """A warning when other processes keep the cores busy (1-minute load average above half of them): the
    rates measured then are lower than the machine sustains."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None
    num_cpus = (fingerprint or current_fingerprint()).num_cpus
    if load <= num_cpus / 2:
        return None
    return (f"this machine is busy (load average {load:.1f} on {num_cpus} cores): the measured rates are below "
            "what it sustains idle; calibrate again when it is quiet")


def new_profile(cpu: DeviceRates, gpu: DeviceRates | None, method: str,
                fingerprint: MachineFingerprint | None = None) -> MachineProfile:
    """A profile measured now, on this machine unless `fingerprint` says otherwise."""
    return MachineProfile(fingerprint or current_fingerprint(), cpu, gpu, time.time(), method)


Calibrator = Callable[[], MachineProfile]
_calibrator: Calibrator | None = None


def set_calibrator(calibrator: Calibrator | None) -> None:
    """Installs what `kvpilot fit --calibrate` runs (kvpilot.calibrate: torch kernels, so fit stays torch-free)."""
    global _calibrator
    _calibrator = calibrator


def run_calibrator() -> MachineProfile:
    """Measures this machine with the installed calibrator; FitError when none is installed."""
    if _calibrator is None:
        raise FitError("calibration needs kvpilot's kernels: run it as `kvpilot fit --calibrate`.")
    return _calibrator()
