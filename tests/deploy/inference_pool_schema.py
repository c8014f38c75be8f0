"""A JSON schema for the InferencePool of the Gateway API Inference Extension, API version
inference.networking.k8s.io/v1 (a CRD, so not in the Kubernetes OpenAPI schemas that kubernetes-validate
bundles).

Written from the extension's v1 API reference (site-src/reference/spec.md of
kubernetes-sigs/gateway-api-inference-extension: InferencePoolSpec, LabelSelector, Port, EndpointPickerRef):
`selector.matchLabels` (1-64 labels), `targetPorts` (exactly one `{number}`), `endpointPickerRef` (`name`,
optional `group`/`kind`, `port.number`, `failureMode` FailOpen | FailClose). Unknown fields are refused, so
the older v1alpha2 shape (`targetPortNumber`, `extensionRef`) fails here as the v1 CRD's API server would.
"""

from __future__ import annotations

from typing import Any

API_VERSION = "inference.networking.k8s.io/v1"

_PORT: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
_LABEL_KEY = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"  # optional DNS prefix/
              r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_GROUP = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_KIND = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"

INFERENCE_POOL_V1: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": API_VERSION},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False, "required": ["matchLabels"],
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1, "maxProperties": 64,
                        "propertyNames": {"maxLength": 253, "pattern": _LABEL_KEY},
                        "additionalProperties": {"type": "string", "maxLength": 63, "pattern": _LABEL_VALUE}}},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": _PORT},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "group": {"type": "string", "maxLength": 253, "pattern": _GROUP},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": _KIND},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    # "Port is required when the referent is a Kubernetes Service" (the default kind)
                    "anyOf": [{"required": ["port"]},
                              {"required": ["kind"], "properties": {"kind": {"not": {"const": "Service"}}}}],
                },
            },
        },
    },
}
