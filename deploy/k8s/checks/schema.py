"""Strict schema validation of rendered objects: kubernetes-validate, KEDA's CRD for ScaledObjects and the Prometheus
Operator's CRDs for PodMonitors and PrometheusRules."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import jsonschema
import kubernetes_validate
from jsonschema.protocols import Validator

from . import keda, monitoring
from .objects import object_id
from .settings import KUBERNETES_VERSION

#: Custom resources kubernetes-validate has no schema for: (apiVersion, kind) -> their validator.
CUSTOM_RESOURCES: dict[tuple[str, str], Callable[[], Validator]] = {
    (keda.API_VERSION, keda.KIND): keda.validator,
    **monitoring.validators(),
}


def validate_objects(
    objects: list[dict[str, Any]], version: str = KUBERNETES_VERSION
) -> tuple[list[str], Counter[str]]:
    """Validate every object strictly (unknown fields fail). Returns (failures, count of valid objects by kind)."""
    failures: list[str] = []
    kinds: Counter[str] = Counter()
    for obj in objects:
        key = (obj.get("apiVersion"), obj.get("kind"))
        try:
            if key in CUSTOM_RESOURCES:
                CUSTOM_RESOURCES[key]().validate(obj)
            else:
                kubernetes_validate.validate(obj, version, strict=True)
            kinds[obj.get("kind")] += 1
        except jsonschema.ValidationError as error:
            where = ".".join(str(p) for p in error.path)
            failures.append(f"{object_id(obj)}: {where}: {error.message}")
        except kubernetes_validate.utils.SchemaNotFoundError as error:
            failures.append(f"{object_id(obj)}: {error.message}")
    return failures, kinds
