"""GET /v1/kvpilot/capacity matches `fit`'s prediction, and `kvpilot fit --url` reads it over HTTP."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvpilot.fit.server_capacity import compare_capacity
from kvpilot.server.core.messages import CapacityQuery
from tests.server.conftest import API_KEY


def test_capacity_endpoint_matches_the_prediction(http, live_server) -> None:
    capacity = http.get("/v1/kvpilot/capacity").json()
    engine = live_server.run_on_loop(live_server.state.client.query(CapacityQuery))  # asks the core itself
    assert capacity["num_blocks"] == engine.num_blocks and capacity["block_size"] == engine.block_size
    assert capacity["max_model_len"] == 1024 and capacity["kv_dtype_bytes"] == 4
    assert capacity["kv_cache_memory_bytes"] == 256 * 2**20
    assert compare_capacity(capacity).matches
    # the model and device as `kvpilot fit` names them (the doctor's roofline without --model/--gpu)
    assert capacity["fit_device"] == "cpu" and capacity["fit_model"].endswith(".gguf")
    assert capacity["prompt_gemm_dtype"] == "float32"  # packed layers, float32 activations: float32 prompt GEMMs
    # the GGUF's own blocks (Q4_1 layers, a Q8_0 embedding): the doctor advises no further quantizing
    assert capacity["quantization"] == "gguf" and 5 < capacity["weight_bits"] < 6.5


def test_fit_url_fetches_and_compares(live_server, monkeypatch) -> None:
    import typer

    from kvpilot.fit.cli import fit_command

    app = typer.Typer()
    app.command()(fit_command)
    monkeypatch.setenv("KVPILOT_API_KEY", API_KEY)
    result = CliRunner().invoke(app, ["--url", live_server.url, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["matches"] is True and report["actual"]["num_blocks"] == report["predicted"]["num_blocks"]
    monkeypatch.setenv("KVPILOT_API_KEY", "wrong")
    refused = CliRunner().invoke(app, ["--url", live_server.url])
    assert refused.exit_code == 2 and "HTTP 401" in refused.stderr
