"""Disaggregated serving on Ray Serve (issue #49 item 2): a lane of prefill workers and a lane of decode workers
behind the ingress, which prefills each generate request on the first and answers it from the second; the
output is token for token the engine's own. The configuration rules are checked without a cluster."""

from __future__ import annotations

import httpx
import pytest

from kvpilot.server.ray_app.config import RayConfigError, parse_app_config
from tests.ray.conftest import deploy, engine_settings


def _lanes(*roles: str | None) -> dict:
    return {"model": "dummy:llama", "lanes": [
        {"name": f"l{i}", "engine": {"kv_role": role} if role else {}} for i, role in enumerate(roles)]}


def test_a_prefill_lane_makes_the_app_disaggregated_and_is_never_a_serving_lane() -> None:
    config = parse_app_config(_lanes("prefill", "decode"))
    assert config.prefill_lane == "l0" and [lane.name for lane in config.serving_lanes] == ["l1"]
    assert parse_app_config(_lanes(None)).prefill_lane is None
    with pytest.raises(RayConfigError, match="no lane has them"):
        parse_app_config(_lanes("prefill", None))
    with pytest.raises(RayConfigError, match="no lane prefills for it"):
        parse_app_config(_lanes("decode"))
    with pytest.raises(RayConfigError, match="give one prefill lane"):
        parse_app_config(_lanes("prefill", "prefill", "decode"))
    with pytest.raises(RayConfigError, match="not EngineArgs fields"):
        parse_app_config({"model": "dummy:llama", "engine": {"served_model_name": "x"}})


@pytest.mark.slow
def test_ray_prefills_on_one_lane_and_decodes_on_the_other(ray_serve: str, tiny_model: str) -> None:
    pytest.importorskip("ray")
    from kvpilot import LLM, SamplingParams

    url = deploy(ray_serve, "disaggregated", {
        **engine_settings(tiny_model), "max_local_prefill_tokens": 0,
        "lanes": [{"name": "prefill", "engine_process": False, "engine": {"kv_role": "prefill"}},
                  {"name": "decode", "engine_process": False, "engine": {"kv_role": "decode"}}]})
    prompt = "The harbor at dawn was quiet, and the boats rocked on a grey sea while the gulls"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvpilot-lane"] == "decode" and answer.headers["x-kvpilot-prefill-replica"]
    assert answer.json()["kvpilot"]["kv_transfer_tokens"] > 0
    llm = LLM(model=tiny_model, load_format="dummy", dtype="float32", max_model_len=1024, kv_cache_memory="16MiB")
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert answer.json()["choices"][0]["text"] == want.text
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as stream:
        assert stream.status_code == 200 and sum(line.startswith("data: {") for line in stream.iter_lines()) >= 10
