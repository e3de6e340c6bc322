"""Look-ups over rendered Kubernetes objects: by kind and name, selectors, a Deployment's container, env and ports."""

from __future__ import annotations

from typing import Any

from .settings import RELEASE

Object = dict[str, Any]


def find(objects: list[Object], kind: str, name: str | None = None) -> list[Object]:
    """Objects of a kind (and name, if given)."""
    return [o for o in objects if o.get("kind") == kind and (name is None or o["metadata"].get("name") == name)]


def one(objects: list[Object], kind: str, name: str) -> Object:
    """The one object of that kind and name; LookupError if there are none or several."""
    found = find(objects, kind, name)
    if len(found) != 1:
        raise LookupError(f"expected one {kind}/{name}, found {len(found)}")
    return found[0]


def object_id(obj: Object) -> str:
    """Kind/name, for messages."""
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def component_name(component: str, release: str = RELEASE) -> str:
    """The chart's object name for a component (fullname rule of _helpers.tpl, no overrides)."""
    fullname = release if "voicemesh" in release else f"{release}-voicemesh"
    return f"{fullname}-{component}"


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """A non-empty matchLabels selector that these labels satisfy."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pods_selected(objects: list[Object], selector: dict[str, str]) -> list[Object]:
    """Deployments whose pod template labels match selector."""
    return [d for d in find(objects, "Deployment") if selects(selector, d["spec"]["template"]["metadata"]["labels"])]


def container(deployment: Object) -> dict[str, Any]:
    """The Deployment's first (and only) container."""
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(deployment: Object) -> dict[str, Any]:
    """name -> value (or the valueFrom dict) of the first container's env."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(deployment).get("env", [])}


def port_of(deployment: Object, name: str) -> int | None:
    """The containerPort of the named port of the first container, or None."""
    for port in container(deployment).get("ports", []):
        if port.get("name") == name:
            return int(port["containerPort"])
    return None
