"""Without --model/--gpu the doctor draws the roofline for the model and device kvpilot's capacity endpoint
names (`fit_model`, `fit_device`): the verdict says how far decode is from it, while the rules keep judging
only by a roofline the user gave (fit's device figures are catalog values nobody vouched for)."""

from __future__ import annotations

import json
from pathlib import Path

from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.inputs import inputs_from_documents
from kvpilot.doctor.server_config import ServerConfig, from_capacity
from tests.doctor.scenarios import SCENARIOS


def _documents(tmp_path: Path) -> list[tuple[dict, str]]:
    paths, _, _, _ = SCENARIOS["decode-bound"](tmp_path)  # 30 ms per token at batch 1
    return [(json.loads(Path(p).read_text()), p) for p in paths]


def test_the_servers_model_and_device_give_the_verdict_a_roofline(tmp_path: Path) -> None:
    config = from_capacity({"num_blocks": 100, "block_size": 16, "dtype": "bfloat16", "fit_model": "smollm2-135m",
                            "fit_device": "cpu"})
    assert (config.fit_model, config.fit_device) == ("smollm2-135m", "cpu")
    inputs = inputs_from_documents(_documents(tmp_path), server_config=config)
    assert inputs.roofline is None and inputs.served_roofline is not None  # rules see none
    report = diagnose(inputs)
    assert report.roofline is not None and report.roofline["gpu"] == "cpu" and report.roofline_share is not None
    assert "of the bfloat16 roofline (smollm2-135m on cpu)" in report.verdict
    assert all("roofline" not in e.name for f in report.findings for e in f.evidence)


def test_a_model_fit_cannot_read_here_leaves_the_verdict_without_one(tmp_path: Path) -> None:
    """The server's GGUF path on another host: no roofline, no error (the user asked for none)."""
    config = ServerConfig(source="test", fit_model="/elsewhere/model.gguf", fit_device="cpu")
    report = diagnose(inputs_from_documents(_documents(tmp_path), server_config=config))
    assert report.roofline is None and "roofline" not in report.verdict


def test_the_roofline_reads_the_weights_in_the_format_they_are_served_in(tmp_path: Path) -> None:
    """A server that quantized at load (int8) reads half the bytes a token of a bf16 one: its floor is lower,
    and the verdict names the format."""
    def served(quantization: str) -> tuple[float, str]:
        config = from_capacity({"num_blocks": 100, "block_size": 16, "dtype": "bfloat16", "fit_device": "cpu",
                                "fit_model": "smollm2-135m", "quantization": quantization})
        report = diagnose(inputs_from_documents(_documents(tmp_path), server_config=config))
        return report.roofline["decode_step_ms"], report.verdict

    dense_ms, dense_verdict = served("none")
    int8_ms, int8_verdict = served("int8")
    assert int8_ms < 0.7 * dense_ms, (int8_ms, dense_ms)
    assert "of the bfloat16 roofline" in dense_verdict and "of the int8 roofline" in int8_verdict
