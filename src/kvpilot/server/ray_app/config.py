"""RayAppConfig: the Ray Serve application's settings, from `serve run kvpilot.ray:app key=value ...`, from a
YAML/JSON file (`config=FILE`, `kvpilot serve --ray --ray-config FILE`) or from a Serve config's `args`.

Shape (every key optional; docs/ray.md):
    routing: prefix | round_robin | power_of_two      load_factor: 1.25
    served_model_name: [names]   api_key: KEY   max_request_body_bytes: N   max_local_prefill_tokens: N
    engine: {EngineArgs fields}                        # shared by every lane
    lanes: [{name, num_replicas, max_prompt_chars, priorities, engine: {...}, autoscaling_config: {...},
             cpus_per_replica, gpus_per_replica, max_ongoing_requests, engine_process}]
A lane whose engine has kv_role prefill makes the application disaggregated: generate requests are prefilled
there, then answered by a serving lane of kv_role decode workers (docs/disaggregation.md).
Flat keys (the `serve run` form, values as strings) are EngineArgs fields or fields of the single lane.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvpilot.engine.config import EngineConfigError
from kvpilot.engine.kv_events_config import KVEventsConfig
from kvpilot.launch.args import EngineArgs
from kvpilot.server.disagg.handoff import DEFAULT_MAX_LOCAL_PREFILL_TOKENS

ROUTINGS = ("prefix", "round_robin", "power_of_two")
DEFAULT_LANE = "default"
_APP_KEYS = {"routing", "load_factor", "served_model_name", "api_key", "max_request_body_bytes", "engine",
             "lanes", "config", "name", "max_local_prefill_tokens"}


class RayConfigError(ValueError):
    """The Ray application's configuration is wrong; the message names the key and what to write."""


@dataclass(frozen=True)
class LaneConfig:
    """One replica pool. Invariants: num_replicas >= 1 (the initial count under autoscaling);
    max_prompt_chars is None (takes any prompt) or >= 1; cpus_per_replica > 0 (Ray's num_cpus, also the
    replica's torch threads); gpus_per_replica None (from the engine's device, resources.replica_gpus) or >= 0;
    `engine` holds EngineArgs fields (already coerced) layered over the app's."""

    name: str = DEFAULT_LANE
    num_replicas: int = 1
    max_prompt_chars: int | None = None
    priorities: tuple[int, ...] = ()
    engine: Mapping[str, Any] = field(default_factory=dict)
    autoscaling_config: Mapping[str, Any] | None = None
    cpus_per_replica: float = 1.0
    gpus_per_replica: float | None = None
    max_ongoing_requests: int = 64
    engine_process: bool = True

    def engine_args(self) -> EngineArgs:
        return EngineArgs(**{"usage_context": "server", **dict(self.engine)})


@dataclass(frozen=True)
class RayAppConfig:
    """The whole application. Invariants: lane names are unique and non-empty; at most one lane has no
    max_prompt_chars (the catch-all; with none, the longest lane takes what fits nowhere);
    routing in ROUTINGS; load_factor >= 1 (the affinity router's load bound, affinity.py)."""

    lanes: tuple[LaneConfig, ...] = (LaneConfig(),)
    routing: str = "prefix"
    load_factor: float = 1.25
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_request_body_bytes: int = 32 * 1024 * 1024
    name: str = "kvpilot"
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS  # with a prefill lane (disagg/handoff.py)

    def lane(self, name: str) -> LaneConfig:
        return next(lane for lane in self.lanes if lane.name == name)

    @property
    def prefill_lane(self) -> str | None:
        """The lane of prefill workers (engine kv_role "prefill"): set, the application serves disaggregated
        (each generate request prefilled there, then answered by a serving lane); None otherwise."""
        return next((lane.name for lane in self.lanes if _role(lane) == "prefill"), None)

    @property
    def serving_lanes(self) -> tuple[LaneConfig, ...]:
        """The lanes that answer requests: every lane but the prefill lane."""
        return tuple(lane for lane in self.lanes if _role(lane) != "prefill")


def _role(lane: LaneConfig) -> str | None:
    transfer = lane.engine_args().kv_transfer()
    return transfer.role if transfer is not None else None


def parse_app_config(args: Mapping[str, Any]) -> RayAppConfig:
    """From a builder's args (nested, or flat `key=value` strings); `config` names a file merged under them."""
    values = dict(args)
    if "config" in values:
        values = {**load_config_file(str(values.pop("config"))), **values}
    unknown_flat = {k: v for k, v in values.items() if k not in _APP_KEYS}
    engine = {**dict(values.get("engine") or {}), **{k: v for k, v in unknown_flat.items() if _is_engine(k)}}
    lane_flat = {k: v for k, v in unknown_flat.items() if not _is_engine(k)}
    lanes_raw = values.get("lanes") or [{}]
    if lane_flat and len(lanes_raw) > 1:
        raise RayConfigError(f"{sorted(lane_flat)} set lane fields for several lanes: put them in each lane")
    lanes = tuple(_lane({**lane_flat, **raw} if len(lanes_raw) == 1 else raw, engine, i)
                  for i, raw in enumerate(lanes_raw))
    config = RayAppConfig(lanes=lanes, routing=str(values.get("routing", "prefix")),
                          load_factor=float(values.get("load_factor", 1.25)),
                          served_model_names=_names(values.get("served_model_name")),
                          api_key=values.get("api_key") or None, name=str(values.get("name", "kvpilot")),
                          max_request_body_bytes=int(values.get("max_request_body_bytes", 32 * 1024 * 1024)),
                          max_local_prefill_tokens=int(values.get("max_local_prefill_tokens",
                                                                  DEFAULT_MAX_LOCAL_PREFILL_TOKENS)))
    check_app_config(config)
    return config


def load_config_file(path: str) -> dict[str, Any]:
    """A YAML or JSON file holding one mapping (a Serve config's `args` for this app)."""
    text = _read(path)
    try:
        import yaml

        data = yaml.safe_load(text)
    except ImportError:  # PyYAML comes with ray[serve]; without it, JSON still works
        data = json.loads(text)
    except yaml.YAMLError as exc:
        raise RayConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise RayConfigError(f"{path} must hold a mapping (routing:, engine:, lanes: ...), got {type(data).__name__}")
    return data


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise RayConfigError(f"cannot read the Ray app config {path}: {exc.strerror}") from exc


def check_app_config(config: RayAppConfig) -> None:
    if config.routing not in ROUTINGS:
        raise RayConfigError(f"routing must be one of {', '.join(ROUTINGS)}, got {config.routing!r}")
    if config.load_factor < 1:
        raise RayConfigError(f"load_factor must be >= 1 (1.25: a replica may take 25% above the mean load), "
                             f"got {config.load_factor}")
    names = [lane.name for lane in config.lanes]
    if len(set(names)) != len(names) or not all(names):
        raise RayConfigError(f"lane names must be unique and non-empty, got {names}")
    for lane in config.lanes:
        try:
            lane.engine_args().check()
        except (TypeError, EngineConfigError) as exc:
            raise RayConfigError(f"lane {lane.name!r}: {exc}") from exc
    if sum(lane.max_prompt_chars is None for lane in config.serving_lanes) > 1:
        raise RayConfigError("only one lane may leave max_prompt_chars out (the catch-all lane): give the others "
                             "a max_prompt_chars")
    _check_disaggregation(config)


def _check_disaggregation(config: RayAppConfig) -> None:
    """At most one prefill lane, and then a serving lane of decode workers to pull its KV."""
    roles = {lane.name: _role(lane) for lane in config.lanes}
    prefill = [name for name, role in roles.items() if role == "prefill"]
    if len(prefill) > 1:
        raise RayConfigError(f"lanes {prefill} all have kv_role prefill: give one prefill lane (scale it with "
                             "num_replicas)")
    if prefill and not any(role in ("decode", "both") for role in roles.values()):
        raise RayConfigError(f"lane {prefill[0]!r} prefills for decode workers, but no lane has them: add a lane "
                             "with engine: {kv_role: decode}")
    if not prefill and any(role == "decode" for role in roles.values()):
        raise RayConfigError("a lane has kv_role decode but no lane prefills for it: add a lane with "
                             "engine: {kv_role: prefill}")


_LANE_FIELDS = {f.name: f for f in dataclasses.fields(LaneConfig)}
_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def _is_engine(key: str) -> bool:
    return key in _ENGINE_FIELDS


def _lane(raw: Mapping[str, Any], shared_engine: Mapping[str, Any], index: int) -> LaneConfig:
    if not isinstance(raw, Mapping):
        raise RayConfigError(f"lanes[{index}] must be a mapping (name:, num_replicas:, engine: ...)")
    unknown = sorted(set(raw) - set(_LANE_FIELDS) - set(_ENGINE_FIELDS))
    if unknown:
        raise RayConfigError(f"lanes[{index}] has unknown keys {unknown}: a lane takes {sorted(_LANE_FIELDS)} "
                             "and EngineArgs fields (under engine:)")
    engine = {**shared_engine, **dict(raw.get("engine") or {}), **{k: v for k, v in raw.items() if _is_engine(k)}}
    not_engine = sorted(set(engine) - set(_ENGINE_FIELDS))
    if not_engine:
        raise RayConfigError(f"lane {raw.get('name', index)!r}: {not_engine} are not EngineArgs fields: "
                             "app keys (served_model_name, api_key, ...) go at the top level")
    lane = {k: _coerce(k, v, _LANE_FIELDS[k].type) for k, v in raw.items() if k in _LANE_FIELDS and k != "engine"}
    lane["engine"] = {k: _coerce(k, v, _ENGINE_FIELDS[k].type) for k, v in engine.items()}
    if "name" not in lane:
        lane["name"] = DEFAULT_LANE if index == 0 else f"lane{index}"
    out = LaneConfig(**lane)
    if out.num_replicas < 1 or out.cpus_per_replica <= 0 or out.max_ongoing_requests < 1:
        raise RayConfigError(f"lane {out.name!r}: num_replicas and max_ongoing_requests must be >= 1 and "
                             f"cpus_per_replica > 0, got {out.num_replicas}, {out.max_ongoing_requests}, "
                             f"{out.cpus_per_replica}")
    if out.gpus_per_replica is not None and out.gpus_per_replica < 0:
        raise RayConfigError(f"lane {out.name!r}: gpus_per_replica must be >= 0 (leave it out to follow the "
                             f"engine's device), got {out.gpus_per_replica}")
    if out.max_prompt_chars is not None and out.max_prompt_chars < 1:
        raise RayConfigError(f"lane {out.name!r}: max_prompt_chars must be >= 1, got {out.max_prompt_chars}")
    return out


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """A `serve run` string to the field's type (annotations are strings here: `from __future__`)."""
    ann = str(annotation)
    if key == "kv_events_config" and value is not None and not isinstance(value, KVEventsConfig):
        return KVEventsConfig.parse(value if isinstance(value, str) else json.dumps(value))
    if key == "priorities":
        return tuple(int(p) for p in (value.split(",") if isinstance(value, str) else value))
    if key == "cuda_graph_sizes" and value is not None:
        return tuple(int(p) for p in (value.split(",") if isinstance(value, str) else value))
    if key == "autoscaling_config" and isinstance(value, str):
        return json.loads(value)
    if not isinstance(value, str):
        return value
    try:
        return _from_string(value, ann)
    except ValueError as exc:
        raise RayConfigError(f"{key}={value!r}: expected {ann}") from exc


def _from_string(value: str, ann: str) -> Any:
    if "None" in ann and value.lower() in ("none", "null", ""):
        return None
    if ann.startswith("bool"):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(value)
        return value.lower() in ("true", "1", "yes")
    if ann.startswith("int") and "str" not in ann:
        return int(value)
    if ann.startswith("float"):
        return float(value)
    if ann.startswith("int | str"):
        return int(value) if value.isdigit() else value
    return value


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    return tuple(value.split(",")) if isinstance(value, str) else tuple(value)
