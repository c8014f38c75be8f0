"""The deployment assets under test, read once: paths, parsed YAML documents, the Deployment's container.

Invariant: every `.yaml` under deploy/kubernetes is a manifest or a kustomization; `manifest_docs()` yields
the non-empty documents of the manifests only (kustomizations are kustomize's, not the API server's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
INSTALL_SCRIPT = REPO / "scripts" / "install.sh"
KUSTOMIZATION = "kustomization.yaml"


@dataclass(frozen=True)
class Manifest:
    """One YAML document of one file, with where it came from (for failure messages)."""

    path: Path
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc.get("kind"))

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)} ({self.kind} {self.doc.get('metadata', {}).get('name')})"


def yaml_files() -> list[Path]:
    return sorted(KUBERNETES.rglob("*.yaml"))


def manifest_docs() -> list[Manifest]:
    return [Manifest(path, doc) for path in yaml_files() if path.name != KUSTOMIZATION
            for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def one(kind: str) -> Manifest:
    found = [m for m in manifest_docs() if m.kind == kind]
    if len(found) != 1:
        raise LookupError(f"expected one {kind} under {KUBERNETES}, found {[m.where for m in found]}")
    return found[0]


def server_container() -> dict[str, Any]:
    """The Deployment's kvpilot container (the only one)."""
    (container,) = one("Deployment").doc["spec"]["template"]["spec"]["containers"]
    return container


def container_env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}
