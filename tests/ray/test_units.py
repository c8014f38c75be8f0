"""The Ray application's plain-Python parts (no cluster): config, lanes, routing keys, affinity, metrics merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.server.ray_app.affinity import LoadTracker, PrefixAffinity, RoundRobin
from kvpilot.server.ray_app.config import LaneConfig, RayConfigError, parse_app_config
from kvpilot.server.ray_app.lanes import UnknownLaneError, choose_lane, lane_by_length
from kvpilot.server.ray_app.metrics_merge import ReplicaMetrics, aggregate_text, per_replica_text
from kvpilot.server.ray_app.prefix_key import CHUNK_CHARS, prompt_chars, prompt_text, route_key
from kvpilot.server.ray_app.replica_table import lanes_scaled_to_zero, replica_table


def test_flat_serve_run_args_are_coerced_to_field_types() -> None:
    config = parse_app_config({"model": "dummy:llama", "num_replicas": "3", "max_num_seqs": "8",
                                "enable_prefix_caching": "false", "kv_cache_memory": "16MiB", "routing": "round_robin",
                                "load_factor": "1.5", "served_model_name": "a,b", "cpus_per_replica": "2"})
    (lane,) = config.lanes
    assert (lane.name, lane.num_replicas, lane.cpus_per_replica) == ("default", 3, 2.0)
    assert lane.engine == {"model": "dummy:llama", "max_num_seqs": 8, "enable_prefix_caching": False,
                           "kv_cache_memory": "16MiB"}
    assert (config.routing, config.load_factor, config.served_model_names) == ("round_robin", 1.5, ("a", "b"))


def test_a_config_file_gives_lanes_over_shared_engine_settings(tmp_path: Path) -> None:
    path = tmp_path / "lanes.yaml"
    path.write_text("engine: {model: dummy:llama, max_num_seqs: 16}\n"
                    "lanes:\n"
                    "  - {name: interactive, max_prompt_chars: 2000, priorities: [0, 1],\n"
                    "     engine: {max_num_batched_tokens: 256}}\n"
                    "  - name: long\n"
                    "    engine: {max_num_batched_tokens: 4096, max_num_seqs: 4}\n"
                    "    autoscaling_config: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}\n")
    config = parse_app_config({"config": str(path), "routing": "prefix"})
    short, long = config.lanes
    assert short.engine == {"model": "dummy:llama", "max_num_seqs": 16, "max_num_batched_tokens": 256}
    assert long.engine == {"model": "dummy:llama", "max_num_seqs": 4, "max_num_batched_tokens": 4096}
    assert (short.max_prompt_chars, short.priorities, long.max_prompt_chars) == (2000, (0, 1), None)
    assert long.autoscaling_config == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}


@pytest.mark.parametrize(("args", "message"), [
    ({"routing": "random"}, "routing must be one of prefix, round_robin, power_of_two"),
    ({"load_factor": "0.5"}, "load_factor must be >= 1"),
    ({"num_replicas": "0"}, "num_replicas and max_ongoing_requests must be >= 1"),
    ({"max_num_seqs": "many"}, "max_num_seqs='many': expected int"),
    ({"lanes": [{"name": "a"}, {"name": "a"}]}, "lane names must be unique"),
    ({"lanes": [{"name": "a"}, {"name": "b"}]}, "only one lane may leave max_prompt_chars out"),
    ({"lanes": [{"name": "a", "colour": "red"}]}, "lanes[0] has unknown keys ['colour']"),
    ({"num_replicas": "2", "lanes": [{"name": "a", "max_prompt_chars": 9}, {"name": "b"}]},
     "set lane fields for several lanes"),
    ({"gpu_memory_utilization": "2"}, "lane 'default': gpu_memory_utilization must be in (0, 1]"),
    ({"config": "/nonexistent/lanes.yaml"}, "cannot read the Ray app config /nonexistent/lanes.yaml"),
    ({"gpus_per_replica": "-1"}, "gpus_per_replica must be >= 0"),
])
def test_bad_configs_name_the_key(args: dict[str, object], message: str) -> None:
    with pytest.raises(RayConfigError) as info:
        parse_app_config(args)
    assert message in str(info.value)


LANES = (LaneConfig(name="short", max_prompt_chars=100), LaneConfig(name="medium", max_prompt_chars=1000),
         LaneConfig(name="long", priorities=(5,)))


def test_lanes_by_header_then_priority_then_length() -> None:
    assert choose_lane(LANES, {"x-lane": "long"}, {"priority": 0}, 10) == "long"
    assert choose_lane(LANES, {}, {"priority": 5}, 10) == "long"
    assert choose_lane(LANES, {}, {"priority": 3}, 10) == "short"
    assert choose_lane(LANES, {}, None, 101) == "medium"
    assert choose_lane(LANES, {}, [1, 2], 1001) == "long"
    with pytest.raises(UnknownLaneError, match="X-Lane 'bulk' names no lane of this server: use one of short, "
                                               "medium, long"):
        choose_lane(LANES, {"x-lane": "bulk"}, {}, 1)


def test_all_lanes_bounded_sends_too_long_prompts_to_the_largest() -> None:
    lanes = LANES[:2]
    assert lane_by_length(lanes, 5000) == "medium"
    assert lane_by_length(lanes, 100) == "short"


def test_prompts_sharing_leading_chunks_share_leading_keys() -> None:
    shared = "x" * (3 * CHUNK_CHARS)
    a, b = route_key(shared + "a" * CHUNK_CHARS), route_key(shared + "b" * CHUNK_CHARS)
    assert len(a) == len(b) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert route_key("y" + shared)[0] != a[0]  # chained from the start: a shifted prompt shares nothing
    assert route_key("x" * (CHUNK_CHARS - 1)) == ()  # no whole chunk yet
    assert route_key(list(range(40))) == route_key(list(range(32)) + [99])  # token ids: chunks of 16
    assert route_key(shared) == route_key(shared)  # stable (blake2b, not the salted hash())


def test_prompt_text_of_chat_and_completion_bodies() -> None:
    chat = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": [{"type": "text", "text": "U1"}, {"type": "text", "text": "U2"}]}]}
    assert prompt_text(chat) == "system\x1fS\x1euser\x1fU1U2\x1e"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_text({"prompt": 7}) == "" and prompt_text("junk") == ""
    assert prompt_chars([1, 2, 3]) == 12 and prompt_chars("abcd") == 4


def _route(policy: PrefixAffinity | RoundRobin, key: tuple[int, ...], replicas: list[str],
           complete: bool = True) -> str:
    chosen = policy.rank(key, replicas)[0]
    policy.routed(key, chosen)
    if complete:
        policy.completed(chosen)
    return chosen


def test_affinity_keeps_each_prefix_on_one_replica_and_spreads_prefixes() -> None:
    policy = PrefixAffinity(load_factor=1.25)
    replicas = ["r1", "r2"]
    groups = [route_key(f"group {g} " * 40) for g in range(8)]
    first = [_route(policy, key, replicas) for key in groups]
    again = [_route(policy, key + (1000 + g,), replicas) for g, key in enumerate(groups)]
    assert again == first  # a longer prompt with a remembered prefix goes where the prefix is
    # the cached-prefix bound: no replica owns more than ceil(1.25 * mean) of the prefixes, whatever the hashes
    assert max(first.count(r) for r in replicas) <= 5
    assert policy.num_affinity_hits == 8


def test_the_load_bound_spills_a_hot_prefix() -> None:
    policy = PrefixAffinity(load_factor=1.0, min_load_bound=2)
    key = route_key("hot " * 100)
    chosen = [_route(policy, key, ["a", "b", "c"], complete=False) for _ in range(9)]
    assert chosen[:2] == [chosen[0]] * 2  # below the minimum bound, the prefix's replica batches them
    assert sorted(chosen.count(r) for r in "abc") == [3, 3, 3]  # then bound ceil(1.0 * (k + 1) / 3) spills


def test_rank_lists_every_candidate_once_and_forget_drops_a_dead_replica() -> None:
    policy = PrefixAffinity()
    key = route_key("p" * 640)
    holder = _route(policy, key, ["a", "b", "c"])
    ranked = policy.rank(key, ["a", "b", "c"])
    assert ranked[0] == holder and sorted(ranked) == ["a", "b", "c"]
    policy.forget(holder)
    assert policy.holder(key, {"a", "b", "c"}) is None and holder not in policy.owned
    assert policy.tracker.load(holder) == 0


def test_a_burst_of_keyless_requests_spreads_before_any_is_routed() -> None:
    """Ray reports a request routed after later ones may have been chosen: reservations count at once, and
    prompts with no prefix key go to the least loaded replica."""
    now = [0.0]
    policy = PrefixAffinity()
    policy.tracker = LoadTracker(clock=lambda: now[0])
    chosen = []
    for token in range(6):
        replica = policy.rank((), ["a", "b"])[0]
        policy.tracker.reserve(token, replica)
        chosen.append(replica)
    assert sorted(chosen.count(r) for r in "ab") == [3, 3]
    policy.tracker.settle(0)  # routed: the reservation becomes the routed request
    policy.routed((), chosen[0])
    assert policy.tracker.load(chosen[0]) == 3
    now[0] = 60.0  # requests cancelled before routing stop counting after RESERVATION_TTL_S
    policy.tracker.reserve("late", "a")
    assert (policy.tracker.load("a"), policy.tracker.load("b")) == (1 + (chosen[0] == "a"), chosen[0] == "b")


def test_round_robin_ignores_the_prompt() -> None:
    policy = RoundRobin()
    key = route_key("same " * 100)
    assert [_route(policy, key, ["b", "a"]) for _ in range(4)] == ["a", "b", "a", "b"]


REPLICA_A = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m"} 10.0
vllm:prompt_tokens_created{model_name="m"} 1.7e9
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.2
# HELP vllm:num_requests_running Running requests.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# HELP vllm:cache_config_info KV cache config.
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0
# HELP vllm:e2e_request_latency_seconds E2E latency.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 2.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 3.5
"""
REPLICA_B = (REPLICA_A.replace("} 10.0", "} 30.0").replace("} 0.2", "} 0.6").replace("} 3.0", "} 1.0")
             .replace("} 3.5", "} 0.5"))


def _values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_aggregate_sums_counters_and_histograms_and_averages_ratios() -> None:
    merged = _values(aggregate_text([ReplicaMetrics("a", "x", REPLICA_A), ReplicaMetrics("b", "y", REPLICA_B)]))
    m = (("model_name", "m"),)
    assert merged[("vllm:prompt_tokens_total", m)] == 40.0
    assert merged[("vllm:kv_cache_usage_perc", m)] == pytest.approx(0.4)
    assert merged[("vllm:num_requests_running", m)] == 4.0
    assert merged[("vllm:cache_config_info", (("block_size", "16"), ("num_gpu_blocks", "100")))] == 1.0
    assert merged[("vllm:e2e_request_latency_seconds_bucket", (("le", "+Inf"),) + m)] == 4.0
    assert merged[("vllm:e2e_request_latency_seconds_sum", m)] == 4.0
    assert not any(name.endswith("_created") for name, _ in merged)


def test_per_replica_text_labels_every_series() -> None:
    text = per_replica_text([ReplicaMetrics("a", "x", REPLICA_A), ReplicaMetrics("b", "y", REPLICA_B)])
    values = _values(text)
    key = ("vllm:prompt_tokens_total", (("lane", "y"), ("model_name", "m"), ("replica", "b")))
    assert values[key] == 30.0
    assert text.count("# TYPE vllm:prompt_tokens_total counter") == 1
    assert all(dict(labels).get("replica") in ("a", "b") for _, labels in values)


def test_replica_table_rates_and_imbalance() -> None:
    busy = {"num_running": 3, "num_waiting": 1, "prefix_cache_hits": 30, "prefix_cache_queries": 40}
    idle = {"num_running": 0, "num_waiting": 0, "prefix_cache_hits": 0, "prefix_cache_queries": 60}
    reports = [{"replica_id": "a", "lane": "x", "time": 0.0, "load": busy},
               {"replica_id": "b", "lane": "x", "time": 0.0, "load": idle}]
    table = replica_table(reports, parse_app_config({}))
    assert [r["prefix_cache_hit_rate"] for r in table["replicas"]] == [0.75, 0.0]
    assert table["prefix_cache_hit_rate"] == 0.3 and table["load_imbalance"] == 2.0
    assert json.loads(json.dumps(table))["num_replicas"] == 2


def test_health_leaves_only_lanes_scaled_to_zero_asleep() -> None:
    config = parse_app_config({"lanes": [
        {"name": "chat", "max_prompt_chars": 2000, "autoscaling_config": {"min_replicas": 0, "max_replicas": 2}},
        {"name": "batch", "autoscaling_config": {"min_replicas": 0, "max_replicas": 2}},
        {"name": "long", "max_prompt_chars": 90000, "autoscaling_config": {"max_replicas": 2}},  # Ray's min: 1
        {"name": "fixed", "max_prompt_chars": 9, "num_replicas": 1}]})
    reports = [{"replica_id": "r1", "lane": "batch", "time": 0.0, "load": {}}]
    assert lanes_scaled_to_zero(reports, config) == ["chat"]  # batch has a replica: it is asked
    assert lanes_scaled_to_zero([], config) == ["chat", "batch"]


def test_the_shipped_lanes_example_parses() -> None:
    config = parse_app_config({"config": str(Path(__file__).parents[2] / "deploy" / "ray" / "lanes.yaml")})
    assert [lane.name for lane in config.lanes] == ["interactive", "long"]
    assert config.lanes[0].engine == {"max_model_len": 8192, "max_num_batched_tokens": 512, "max_num_seqs": 64}
    assert config.lanes[1].autoscaling_config == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}


def _options(cluster_gpus: float, **args: object) -> dict[str, object]:
    from kvpilot.server.ray_app.app import _lane_options  # noqa: PLC0415 (imports Ray Serve)

    config = parse_app_config({"model": "dummy:llama", **args})
    return _lane_options(config.lanes[0], config, cluster_gpus)


def test_replicas_ask_ray_for_the_gpus_their_engine_uses() -> None:
    """CPU engines ask for CPUs only; a CUDA engine (or auto on a cluster with GPUs) for one GPU per
    tensor-parallel rank, several of them as one STRICT_PACK bundle (the ranks are the replica's children)."""
    pytest.importorskip("ray.serve")
    assert _options(0.0)["ray_actor_options"] == {"num_cpus": 1.0}
    assert _options(8.0, device="cpu")["ray_actor_options"] == {"num_cpus": 1.0}
    one = _options(8.0, cpus_per_replica="4")
    assert one["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 1.0} and "placement_group_bundles" not in one
    assert _options(0.0, device="cuda")["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    tp = _options(8.0, tensor_parallel_size="4", cpus_per_replica="2")
    assert tp["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 4.0}
    assert tp["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 4.0}] and tp["placement_group_strategy"] == \
        "STRICT_PACK"
    assert _options(8.0, gpus_per_replica="0.5")["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert _options(8.0, gpus_per_replica="0")["ray_actor_options"] == {"num_cpus": 1.0}
