"""The KEDA ScaledObject schema: KEDA's CRD as packaged in cloudcoil-models-keda, made strict, plus our rules.

We found no PyPI, npm or Debian package shipping KEDA's CRD YAML or its JSON schema; cloudcoil-models-keda is
generated from the CRD's OpenAPI schema (KEDA 2.16.1 in 2.16.1.0), and pydantic writes that back out as JSON schema.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import version
from typing import Any

import jsonschema
from cloudcoil.models.keda.v1alpha1 import ScaledObject
from jsonschema.protocols import Validator

API_VERSION = "keda.sh/v1alpha1"
KIND = "ScaledObject"

#: cloudcoil-models-keda's version is KEDA's, plus one digit for the models' own releases.
KEDA_VERSION = ".".join(version("cloudcoil.models.keda").split(".")[:3])

#: What the CRD does not say but we refuse anyway (the earlier hand-written schema did): KEDA itself
#: rejects most of it later, at admission or while scaling, where it is harder to see.
VOICEMESH_RULES: dict[str, Any] = {
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        # A chart sets these four; the rest of ObjectMeta (finalizers, ownerReferences...) belongs to the cluster.
        "metadata": {"required": ["name"], "propertyNames": {"enum": ["name", "namespace", "labels", "annotations"]}},
        "status": False,  # KEDA writes the status; a chart never does
        "spec": {
            "properties": {
                "pollingInterval": {"minimum": 1},
                "cooldownPeriod": {"minimum": 0},
                "initialCooldownPeriod": {"minimum": 0},
                "idleReplicaCount": {"minimum": 0},
                "minReplicaCount": {"minimum": 0},
                "maxReplicaCount": {"minimum": 1},
                "triggers": {
                    "minItems": 1,
                    "items": {"properties": {"metricType": {"enum": ["AverageValue", "Value", "Utilization"]}}},
                },
            }
        },
    },
}

# Keywords that only document a schema; dropped so that messages and the strict copy stay small.
_ANNOTATIONS = frozenset({"title", "description", "default"})
_NULL = {"type": "null"}


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema an API server with strict field validation applies (like kubeconform -strict).

    pydantic writes `Optional[X] = None` as "X or null" and leaves unknown fields allowed (the models ignore
    them); a CRD means "X, or absent" and the API server refuses unknown fields. So: null alternatives are
    dropped and every object with declared properties gets additionalProperties: false.
    """
    strict: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key in ("properties", "$defs", "patternProperties"):
            strict[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            strict[key] = [strict_schema(sub) for sub in value if sub != _NULL]
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            strict[key] = strict_schema(value)
        else:
            strict[key] = value
    if len(strict.get("anyOf", ())) == 1:
        strict.update(strict.pop("anyOf")[0])
    if "properties" in strict and "additionalProperties" not in strict:
        strict["additionalProperties"] = False
    return strict


@cache
def scaled_object_schema() -> dict[str, Any]:
    """The strict CRD schema and VOICEMESH_RULES, both of which an object must satisfy (JSON schema 2020-12)."""
    crd = strict_schema(ScaledObject.model_json_schema(by_alias=True, mode="validation"))
    definitions = crd.pop("$defs", {})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$defs": definitions,
        "allOf": [crd, VOICEMESH_RULES],
    }


@cache
def validator() -> Validator:
    """A jsonschema validator of scaled_object_schema(), built once."""
    schema = scaled_object_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)
