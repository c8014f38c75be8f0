"""`--model org/name[@revision][:QUANT]`: a Hugging Face Hub id, downloaded with huggingface_hub.

Torch-free. A `--model` value is a hub id only when no local file or directory of that name exists and it
has the `org/name` shape; the embedded default and local paths never touch the network. Downloads go to
huggingface_hub's cache (or `--download-dir`), honour HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE, resume
an interrupted file, and fetch only what the engine reads: config, generation config, tokenizer files and
the safetensors shards, or one GGUF file picked by `--gguf-file` or a quant name (`org/name:Q4_K_M`, as
llama.cpp's `-hf`). Every failure is a ModelLoadError that says what to do.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.model.errors import ModelLoadError

# What an HF-directory load reads (model/hf_dir.py, model/tokenizer.py, model/chat_template.py).
HF_DIR_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                "model.safetensors.index.json", "*.safetensors")
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+?))?"
                     r"(?::(?P<quant>[\w.-]+))?")


@dataclass(frozen=True)
class HubModel:
    """A parsed hub id. `revision` None: the default branch; `quant` None: no GGUF quant named."""

    repo_id: str
    revision: str | None = None
    quant: str | None = None


def parse_hub_id(model: str) -> HubModel | None:
    """The hub id `model` names, or None when it is a local path (existing, absolute, ./-relative, a .gguf
    file) or not of the `org/name` shape."""
    if not model or model.startswith((".", "/", "~")) or Path(model).exists() or model.endswith(".gguf"):
        return None
    match = _HUB_ID.fullmatch(model)
    if match is None:
        return None
    return HubModel(match["repo"], match["revision"], match["quant"])


def check_local_model(model: str | None, load_format: str = "auto") -> None:
    """Raises ModelLoadError when `model` names a local path that is not there, torch-free, so `serve`,
    `generate` and `chat` say so at once instead of after seconds of loading; None (the embedded model), a
    hub id and dummy models pass."""
    if model is None or load_format == "dummy" or model.startswith("dummy:") or parse_hub_id(model) is not None:
        return
    path = Path(model).expanduser()
    if path.exists():
        return
    if path.suffix == ".gguf":
        raise ModelLoadError(f"{model}: no such GGUF file")
    raise ModelLoadError(missing_model_message(model))


def missing_model_message(model: str) -> str:
    """What --model takes, for a local `model` that is neither a file nor a directory."""
    return (f"{model}: no such file or directory. Pass a .gguf file, an HF model directory with config.json and "
            "*.safetensors, a Hugging Face Hub id (org/name, downloaded once into the HF cache), or --load-format "
            f"dummy to run the {model!r} architecture with random weights")


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _as_load_error(exc: Exception, hub: HubModel) -> ModelLoadError:
    """huggingface_hub's errors as messages that say what to do."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    repo, url = hub.repo_id, f"{_endpoint()}/{hub.repo_id}"
    if isinstance(exc, GatedRepoError):
        return ModelLoadError(f"{repo} is gated: accept its terms at {url} while logged in, then set HF_TOKEN "
                              "to a token of that account")
    if isinstance(exc, RepositoryNotFoundError):
        token = "HF_TOKEN is set: it has no access to it" if os.environ.get("HF_TOKEN") else \
            "if it is private, set HF_TOKEN"
        return ModelLoadError(f"{repo}: no such model repository on {_endpoint()} (check the name; {token})")
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(f"{repo}: no revision {hub.revision!r} (a branch, tag or commit of the repository)")
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return ModelLoadError(f"{repo} is not in the Hugging Face cache and the Hub is not reachable "
                              f"({'HF_HUB_OFFLINE is set' if _offline() else exc}): download it once online, "
                              "or pass a local path")
    if isinstance(exc, EntryNotFoundError):
        return ModelLoadError(f"{repo}: a file is missing from the repository ({exc})")
    if isinstance(exc, HfHubHTTPError):
        return ModelLoadError(f"{repo}: the Hub answered {exc}")
    return ModelLoadError(f"{repo}: download failed: {exc}")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _list_files(hub: HubModel, cache_dir: str | None) -> list[str] | None:
    """The repository's file names; None when offline (then the cached snapshot decides)."""
    if _offline():
        return None
    from huggingface_hub import HfApi

    info = HfApi(endpoint=_endpoint()).model_info(hub.repo_id, revision=hub.revision)
    return [sibling.rfilename for sibling in info.siblings or []]


def pick_gguf(files: list[str], quant: str | None, gguf_file: str | None, repo: str) -> str | None:
    """The one GGUF file to fetch: `gguf_file` exactly, else the file whose name carries `quant`
    (case-insensitive), else None when the repository has safetensors weights or no GGUF file. Refuses
    ambiguity."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if gguf_file is not None:
        if gguf_file not in files:
            raise ModelLoadError(f"{repo} has no file {gguf_file!r}; its GGUF files: {', '.join(ggufs) or 'none'}")
        return gguf_file
    if quant is None:
        if not ggufs or any(f.endswith(".safetensors") for f in files):
            return None  # an HF directory (the load names what is missing when it has no weights)
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"{repo} holds several GGUF files: name one as {repo}:QUANT (e.g. Q4_K_M) or with "
                             f"--gguf-file; choices: {', '.join(ggufs) or 'none'}")
    matches = [f for f in ggufs if quant.lower() in Path(f).name.lower()]
    if len(matches) != 1:
        found = "several" if matches else "no"
        raise ModelLoadError(f"{repo}: {found} GGUF file names contain {quant!r}; choices: "
                             f"{', '.join(ggufs) or 'none (this repository has no GGUF files)'}")
    return matches[0]


def download(hub: HubModel, *, revision: str | None = None, download_dir: str | None = None,
             gguf_file: str | None = None) -> Path:
    """Downloads what the engine needs of `hub` (resuming, cached) and returns the local HF directory or
    GGUF file. `revision` overrides the id's `@revision`."""
    from huggingface_hub import snapshot_download

    for name in ("httpx", "httpx2"):  # one INFO line per HTTP request: the progress bar says enough
        logging.getLogger(name).setLevel(logging.WARNING)
    hub = HubModel(hub.repo_id, revision or hub.revision, hub.quant)
    try:
        files = _list_files(hub, download_dir)
        gguf = pick_gguf(files, hub.quant, gguf_file, hub.repo_id) if files is not None else \
            gguf_file or _cached_gguf(hub, download_dir)
        patterns: Any = [gguf] if gguf else list(HF_DIR_FILES)
        folder = Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=download_dir,
                                        allow_patterns=patterns, endpoint=_endpoint()))
    except ModelLoadError:
        raise
    except Exception as exc:  # huggingface_hub's errors, and network errors under them
        raise _as_load_error(exc, hub) from exc
    return folder / gguf if gguf else folder


def _cached_gguf(hub: HubModel, cache_dir: str | None) -> str | None:
    """Offline: the cached GGUF file matching the quant, if the cached snapshot holds GGUF files."""
    if hub.quant is None:
        return None
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=cache_dir,
                                    local_files_only=True))
    return pick_gguf([p.name for p in folder.iterdir()], hub.quant, None, hub.repo_id)


def resolve_model(model: str | None, *, revision: str | None = None, download_dir: str | None = None,
                  gguf_file: str | None = None) -> str | None:
    """`model` itself when it is None or local; for a hub id, the local path of its downloaded files."""
    hub = parse_hub_id(model) if model else None
    if hub is None:
        if revision is not None or gguf_file is not None:
            raise ModelLoadError("--revision and --gguf-file apply to a Hugging Face Hub id (--model org/name); "
                                 f"{model or 'the embedded model'} is local")
        return model
    return str(download(hub, revision=revision, download_dir=download_dir, gguf_file=gguf_file))
