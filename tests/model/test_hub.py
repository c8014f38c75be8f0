"""Issue 50 item 3: `--model org/name[@revision][:QUANT]` downloads from the Hugging Face Hub with
huggingface_hub, against a local stand-in for the Hub (tests/model/hub_standin.py; HF_ENDPOINT points at
it, nothing touches the internet): download, cache reuse, revision, resume after a cut, offline mode,
401/404 errors, GGUF choice; and the downloaded model generates what the same local directory does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.model.errors import ModelLoadError
from kvpilot.model.hub import HubModel, parse_hub_id, pick_gguf, resolve_model
from tests.model.hub_standin import StandinHub, make_repo

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 256, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32", "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def _tiny_repo_files(seed: int) -> dict[str, bytes]:
    import torch
    from safetensors.torch import save

    generator = torch.Generator().manual_seed(seed)
    h, i, v, kv = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"], 2 * 16
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{n}"
        shapes |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.self_attn.q_proj.weight": (h, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                   f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, h),
                   f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h),
                   f"{p}.mlp.down_proj.weight": (h, i)}
    tensors = {name: 0.1 * torch.randn(shape, generator=generator) + (1.0 if "norm" in name else 0.0)
               for name, shape in shapes.items()}
    return {"config.json": json.dumps(TINY).encode(), "model.safetensors": save(tensors),
            "README.md": b"not downloaded", "optimizer.pt": b"not downloaded either"}


@pytest.fixture()
def hub(monkeypatch):
    with StandinHub() as standin:
        monkeypatch.setenv("HF_ENDPOINT", standin.url)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield standin


def test_hub_ids_and_local_paths(tmp_path: Path, monkeypatch) -> None:
    assert parse_hub_id("Qwen/Qwen3-0.6B") == HubModel("Qwen/Qwen3-0.6B")
    assert parse_hub_id("org/name@v1.0:Q4_K_M") == HubModel("org/name", "v1.0", "Q4_K_M")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    for local in ("org/local", "./x/y", "/abs/path", "model.gguf", "a/b/c.gguf", "qwen3-0.6b", "a/b/c"):
        assert parse_hub_id(local) is None, local
    with pytest.raises(ModelLoadError, match="apply to a Hugging Face Hub id"):
        resolve_model("org/local", revision="v1")


def test_gguf_choice() -> None:
    files = ["README.md", "m-Q4_0.gguf", "m-Q4_K_M.gguf", "m-Q8_0.gguf"]
    assert pick_gguf(files, "q4_k_m", None, "o/m") == "m-Q4_K_M.gguf"
    assert pick_gguf(files, None, "m-Q8_0.gguf", "o/m") == "m-Q8_0.gguf"
    assert pick_gguf(["config.json", "model.safetensors", "x.gguf"], None, None, "o/m") is None
    with pytest.raises(ModelLoadError, match="several GGUF files.*m-Q4_0.gguf"):
        pick_gguf(files, None, None, "o/m")
    with pytest.raises(ModelLoadError, match="no GGUF file names contain 'IQ2'"):
        pick_gguf(files, "IQ2", None, "o/m")


def test_download_cache_revision_and_generation(hub, tmp_path: Path) -> None:
    from kvpilot import LLM, SamplingParams

    main, v2 = _tiny_repo_files(0), _tiny_repo_files(1)
    hub.state.repos["org/tiny"] = make_repo({"main": main, "v2": v2})
    path = Path(resolve_model("org/tiny", download_dir=str(tmp_path / "cache")))
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]  # only what loads
    assert (path / "model.safetensors").read_bytes() == main["model.safetensors"]
    assert resolve_model("org/tiny", download_dir=str(tmp_path / "cache")) == str(path)
    assert hub.state.downloads["model.safetensors"] == 1  # the second call read the cache
    assert Path(resolve_model("org/tiny@v2", download_dir=str(tmp_path / "cache"))).joinpath(
        "model.safetensors").read_bytes() == v2["model.safetensors"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10]]
    served = LLM("org/tiny", download_dir=str(tmp_path / "cache"), dtype="float32", kv_cache_memory="4MiB")
    assert served.loaded.name == "org/tiny"
    local = LLM(str(path), dtype="float32", kv_cache_memory="4MiB")
    assert [o.outputs[0].token_ids for o in served.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in local.generate(prompts, params)]


def test_resume_after_a_cut(hub, tmp_path: Path) -> None:
    big = bytes(range(256)) * 50_000  # 12.8 MB: huggingface_hub resumes from its last 10 MiB chunk
    hub.state.repos["org/big"] = make_repo({"main": {"config.json": b"{}", "model.safetensors": big}})
    hub.state.cut_once["model.safetensors"] = 11_000_000
    path = Path(resolve_model("org/big", download_dir=str(tmp_path)))
    assert (path / "model.safetensors").read_bytes() == big
    assert hub.state.ranges == ["bytes=10485760-"]  # resumed, not restarted


def test_offline_uses_the_cache_or_says_what_to_do(hub, tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub.constants as hf_constants

    hub.state.repos["org/tiny"] = make_repo({"main": {"config.json": b"{}", "model.safetensors": b"w"}})
    path = resolve_model("org/tiny", download_dir=str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    hub.state.repos.clear()  # offline must not ask
    assert resolve_model("org/tiny", download_dir=str(tmp_path)) == path
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE is set"):
        resolve_model("org/other", download_dir=str(tmp_path))


def test_errors_say_what_to_do(hub, tmp_path: Path, monkeypatch) -> None:
    hub.state.repos["org/gated"] = make_repo({"main": {"config.json": b"{}"}}, gated=True)
    hub.state.repos["org/private"] = make_repo({"main": {"config.json": b"{}"}}, private_token="secret")
    hub.state.repos["org/tiny"] = make_repo({"main": {"config.json": b"{}"}})
    cache = str(tmp_path)
    with pytest.raises(ModelLoadError, match="org/missing: no such model repository.*set HF_TOKEN"):
        resolve_model("org/missing", download_dir=cache)
    with pytest.raises(ModelLoadError, match="org/gated is gated: accept its terms"):
        resolve_model("org/gated", download_dir=cache)
    with pytest.raises(ModelLoadError, match="org/tiny: no revision 'v9'"):
        resolve_model("org/tiny@v9", download_dir=cache)
    with pytest.raises(ModelLoadError, match="no such model repository"):
        resolve_model("org/private", download_dir=cache)
    monkeypatch.setenv("HF_TOKEN", "secret")
    assert Path(resolve_model("org/private", download_dir=cache), "config.json").read_bytes() == b"{}"
    with pytest.raises(ModelLoadError, match="org/tiny has no file 'x.gguf'"):
        resolve_model("org/tiny", download_dir=cache, gguf_file="x.gguf")


def test_gguf_repository_downloads_one_file(hub, tmp_path: Path, gguf_path: Path) -> None:
    data = gguf_path.read_bytes()
    hub.state.repos["org/smol-GGUF"] = make_repo({"main": {"smol-Q4_1.gguf": data, "smol-Q8_0.gguf": b"other",
                                                           "README.md": b"x"}})
    path = Path(resolve_model("org/smol-GGUF:q4_1", download_dir=str(tmp_path)))
    assert path.name == "smol-Q4_1.gguf" and sorted(p.name for p in path.parent.iterdir()) == ["smol-Q4_1.gguf"]
    assert hub.state.downloads["smol-Q8_0.gguf"] == 0


def test_serve_takes_the_hub_flags() -> None:
    """`kvpilot serve --model org/name --revision ... --download-dir ... --gguf-file ...` parses into the
    engine's settings (the download itself happens in the engine core: tested above through LLM)."""
    from typer.main import get_command

    from kvpilot.cli import app

    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    params = serve.make_context("serve", ["--model", "org/m-GGUF:Q4_K_M", "--revision", "v2", "--download-dir",
                                          "/tmp/hf", "--gguf-file", "m.gguf"]).params
    assert (params["model"], params["revision"], params["download_dir"], params["gguf_file"]) == \
        ("org/m-GGUF:Q4_K_M", "v2", "/tmp/hf", "m.gguf")
