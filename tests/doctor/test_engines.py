"""Issue #51 item 3: every engine users run is read into one engine-neutral snapshot, detected, and its fixes
printed as its own flags. llama-server's texts are real captures (fixtures/README.md); SGLang's and TGI's are
written from their documented metric names and exposition format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.engine_config import from_llamacpp_props, from_sglang_info, from_tgi_info
from kvpilot.doctor.engine_flags import translate
from kvpilot.doctor.engines import KVPILOT, LLAMACPP, SGLANG, TGI, VLLM, detect_engine
from kvpilot.doctor.findings import Fix
from kvpilot.doctor.inputs import DoctorInputs
from kvpilot.doctor.prometheus import metrics_delta, parse_prometheus_text
from kvpilot.doctor.render_console import fix_flags
from kvpilot.doctor.server_config import ServerConfig, from_metrics

FIX = Path(__file__).parent / "fixtures"


def _text(name: str) -> str:
    return (FIX / name).read_text()


def _json(name: str) -> dict:
    return json.loads((FIX / name).read_text())


@pytest.mark.parametrize(("owned_by", "header", "names", "engine"), [
    ("llamacpp", None, (), LLAMACPP), ("vllm", None, ("vllm:num_requests_running",), VLLM),
    ("sglang", None, (), SGLANG), ("kvpilot", None, (), KVPILOT),
    (None, "llama.cpp", (), LLAMACPP),  # llama-server's Server header
    (None, "uvicorn", ("vllm:num_requests_running", "kvpilot:kv_cache_blocks"), KVPILOT),  # exports both
    (None, None, ("tgi_queue_size",), TGI), (None, None, ("sglang:token_usage",), SGLANG),
    (None, None, ("process_cpu_seconds_total",), None)])
def test_engine_detection(owned_by: str | None, header: str | None, names: tuple[str, ...],
                          engine: str | None) -> None:
    assert detect_engine(owned_by, header, names) == engine


def test_llamacpp_models_and_metrics_captures_name_the_engine() -> None:
    entry = _json("llamacpp_models.json")["data"][0]
    assert detect_engine(entry["owned_by"]) == LLAMACPP and entry["meta"]["n_ctx"] == 1024
    assert parse_prometheus_text(_text("llamacpp_busy.txt")).engine == LLAMACPP


def test_llamacpp_busy_slots_are_read_as_running_and_waiting() -> None:
    """Captured with 6 requests sent to `llama-server -np 2`: 2 processing (one slot each), 4 deferred."""
    snap = parse_prometheus_text(_text("llamacpp_busy.txt"))
    assert (snap.get("running"), snap.get("waiting")) == (2.0, 4.0)
    done = metrics_delta(parse_prometheus_text(_text("llamacpp_idle.txt")),
                         parse_prometheus_text(_text("llamacpp_after.txt")))
    assert done.get("generation_tokens") == 6 * 64  # ignore_eos, max_tokens 64
    itl = done.mean_ms("itl")  # slot seconds spent generating per token
    assert itl is not None and 1.0 < itl < 1000.0
    assert done.values["prefix_queries"] == done.values["prompt_tokens"] + done.values["prefix_hits"]


def test_one_slot_too_few_on_llama_server_is_queueing_with_its_flags() -> None:
    """The busy capture with /props: two slots of 1,024 tokens, four requests deferred. Queueing names
    llama-server's flags: twice the slots, and the context they split grown with them."""
    config = from_llamacpp_props(_json("llamacpp_props.json"))
    assert (config.max_num_seqs, config.max_model_len, config.num_kv_tokens) == (2, 1024, None)
    report = diagnose(DoctorInputs(metrics=parse_prometheus_text(_text("llamacpp_busy.txt")), server_config=config))
    assert report.engine == LLAMACPP and report.findings[0].rule_id == "queueing"
    first = report.findings[0].fixes[0]
    assert first.engine_flags == "--parallel 4 --ctx-size 4096"
    assert fix_flags(first, report.engine)[0] == ("llama.cpp (running)", "--parallel 4 --ctx-size 4096")
    assert "kv-pool-too-small" not in [f.rule_id for f in report.findings]  # each slot owns its context


def test_sglang_queueing_is_read_from_its_histograms_and_fixed_with_its_flags() -> None:
    config = from_sglang_info(_json("sglang_server_info.json"))
    assert (config.max_num_seqs, config.num_kv_tokens, config.enable_prefix_caching) == (4, 471258, True)
    snap = parse_prometheus_text(_text("sglang_queueing.txt"))
    assert snap.engine == SGLANG and snap.mean_ms("queue") == pytest.approx(3090.0)
    report = diagnose(DoctorInputs(metrics=snap, server_config=config))
    top = report.findings[0]
    assert top.rule_id == "queueing" and top.explains is not None and top.explains.share > 0.9
    assert top.fixes[0].engine_flags == "--max-running-requests 8"
    assert "metrics file (sglang names)" in report.metrics_source


def test_tgi_queue_gauge_is_queueing_with_tgis_batch_flag() -> None:
    config = from_tgi_info(_json("tgi_info.json"))
    assert (config.max_num_seqs, config.max_model_len, config.num_kv_tokens) == (2, 4096, 16384)
    snap = parse_prometheus_text(_text("tgi_queueing.txt"))
    assert snap.engine == TGI and snap.get("waiting") == 14 and snap.mean_ms("queue") == pytest.approx(4060.0)
    report = diagnose(DoctorInputs(metrics=snap, server_config=config))
    assert report.findings[0].rule_id == "queueing"
    assert report.findings[0].fixes[0].engine_flags == "--max-batch-size 4"


@pytest.mark.parametrize(("vllm", "engine", "expected"), [
    ("--max-num-seqs 8", SGLANG, "--max-running-requests 8"),
    ("--max-model-len 4096", SGLANG, "--context-length 4096"),
    ("--enable-prefix-caching", LLAMACPP, "--cache-prompt"),
    ("--kv-cache-dtype fp8", SGLANG, "--kv-cache-dtype fp8_e5m2"), ("--tensor-parallel-size 2", TGI, "--num-shard 2"),
    ("--max-num-batched-tokens 8192", TGI, "--max-batch-prefill-tokens 8192"),
    ("--max-model-len 2048", LLAMACPP, "--ctx-size 4096"),  # two slots share the context
    ("--data-parallel-size 2", LLAMACPP, ""),  # no counterpart: no line
    ("--max-num-seqs <lower>", LLAMACPP, "--parallel <slots>"),  # a setting to choose: its name there
    ("--max-model-len <longest real request>", SGLANG, "--context-length <longest real request>"),
    ("--gpu-memory-utilization 0.95 (or --kv-cache-memory-bytes <larger>)", SGLANG, "")])  # not plain flags
def test_vllm_flags_translate_flag_by_flag(vllm: str, engine: str, expected: str) -> None:
    cfg = ServerConfig(source="test", max_num_seqs=2, max_model_len=1024)
    assert translate(Fix("a", vllm=vllm), engine, cfg) == expected


def test_a_real_vllm_capture_reads_as_a_healthy_vllm_server() -> None:
    """vLLM 0.32 (CPU build) serving one stream, scraped before and after four requests: V1 names, the KV pool from
    vllm:cache_config_info (128-token blocks), every stage's histogram mean, and nothing to report."""
    models = _json("vllm_real_models.json")["data"][0]
    assert detect_engine(models["owned_by"]) == VLLM and models["max_model_len"] == 2048
    snap = metrics_delta(parse_prometheus_text(_text("vllm_real_before.txt")),
                         parse_prometheus_text(_text("vllm_real_after.txt")))
    assert snap.engine == VLLM and snap.flavor == "vllm-v1" and snap.get("num_finished") == 4
    config = from_metrics(snap)
    assert config is not None and (config.num_blocks, config.block_size, config.enable_prefix_caching) == (1456, 128,
                                                                                                             True)
    assert all(snap.mean_ms(key) is not None for key in ("ttft", "itl", "e2e", "queue", "prefill", "decode"))
    report = diagnose(DoctorInputs(metrics=snap, server_config=config))
    assert report.healthy and report.engine == VLLM, [(f.rule_id, f.severity.value) for f in report.findings]
