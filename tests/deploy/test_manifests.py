"""deploy/kubernetes: every manifest is valid for the Kubernetes API (no cluster runs here, so against the
OpenAPI schemas that kubernetes-validate bundles, offline), the InferencePool against its CRD's v1 fields,
and kustomize builds the base and its components."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.assets import KUBERNETES, KUSTOMIZATION, REPO, Manifest, manifest_docs, one, yaml_files
from tests.deploy.inference_pool_schema import INFERENCE_POOL_V1

# The Kubernetes version the manifests target: a release that still has vendor support in 2026 and has
# the preStop `sleep` action (beta, on by default, since 1.30). Strict: unknown fields are errors.
KUBERNETES_VERSION = "1.33"
CRD_KINDS = {"InferencePool"}  # not in Kubernetes' own schemas: checked by test_inference_pool_*
SECRET_EXAMPLE = "secret.example.yaml"  # applied by hand, never by kustomize (it would commit a key)


def _core_manifests() -> list[Manifest]:
    return [m for m in manifest_docs() if m.kind not in CRD_KINDS]


def _validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("manifest", _core_manifests(), ids=lambda m: m.where)
def test_manifest_is_valid_for_the_kubernetes_api(manifest: Manifest) -> None:
    try:
        _validate(manifest.doc)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{manifest.where} is not a valid {manifest.kind} for Kubernetes {KUBERNETES_VERSION}: "
                    f"{path}: {exc.message}")


def test_every_kind_of_manifest_is_checked() -> None:
    kinds = {m.kind for m in manifest_docs()}
    assert {"Deployment", "Service", "Secret", "HorizontalPodAutoscaler", "InferencePool"} <= kinds
    assert kinds - CRD_KINDS == {m.kind for m in _core_manifests()}


def test_strict_validation_refuses_a_misspelt_field() -> None:
    """The validator is live: a typo that kubectl would reject fails here too."""
    deployment = copy.deepcopy(one("Deployment").doc)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        _validate(deployment)


def test_inference_pool_matches_the_v1_api() -> None:
    jsonschema.validate(one("InferencePool").doc, INFERENCE_POOL_V1)


def test_inference_pool_schema_refuses_the_v1alpha2_shape() -> None:
    """The schema is live: the pre-v1 fields (targetPortNumber, extensionRef) are not the v1 API."""
    pool = copy.deepcopy(one("InferencePool").doc)
    spec = pool["spec"]
    spec["targetPortNumber"] = spec.pop("targetPorts")[0]["number"]
    spec["extensionRef"] = {"name": spec.pop("endpointPickerRef")["name"]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL_V1)


def _kustomizations() -> dict[Path, dict]:
    return {path.parent: yaml.safe_load(path.read_text(encoding="utf-8"))
            for path in yaml_files() if path.name == KUSTOMIZATION}


def test_every_manifest_belongs_to_a_kustomization() -> None:
    listed: set[Path] = set()
    for folder, kustomization in _kustomizations().items():
        for resource in kustomization.get("resources", []):
            assert (folder / resource).is_file(), f"{folder / KUSTOMIZATION} lists {resource}: no such file"
            listed.add(folder / resource)
    manifests = {path for path in yaml_files() if path.name != KUSTOMIZATION}
    assert manifests - listed == {KUBERNETES / SECRET_EXAMPLE}


def _kustomize(folder: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_kustomize_builds_the_base_and_its_components(tmp_path: Path) -> None:
    """An overlay like a user's: the base plus both optional components."""
    base = os.path.relpath(KUBERNETES, tmp_path)  # kustomize refuses absolute paths
    (tmp_path / KUSTOMIZATION).write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [base],
        "components": [f"{base}/components/autoscaling", f"{base}/components/inference-pool"]}))
    docs = _kustomize(tmp_path)
    assert sorted(doc["kind"] for doc in docs) == ["Deployment", "HorizontalPodAutoscaler", "InferencePool",
                                                   "Service"]
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            jsonschema.validate(doc, INFERENCE_POOL_V1)
        else:
            _validate(doc)


def test_kustomize_sets_the_image_of_this_version() -> None:
    import kvpilot

    (deployment,) = [doc for doc in _kustomize(KUBERNETES) if doc["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"kvpilot:{kvpilot.__version__}", \
        f"tag the image as the package version ({REPO / 'pyproject.toml'}) in {KUBERNETES / KUSTOMIZATION}"
