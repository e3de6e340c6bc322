"""Cross-object wiring of a render: what the API server would accept but the mesh would not work with."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from .objects import Object, component_name, container, env_of, find, object_id, pods_selected, port_of, selects
from .render import Rendered
from .settings import BACKENDS, COMPONENTS

AUTOSCALER_KINDS = ("HorizontalPodAutoscaler", "ScaledObject")
_HEADLESS_TARGET = re.compile(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.[a-z0-9.-]+:(\d+)")


def wiring_problems(rendered: Rendered) -> list[str]:
    """Every wiring problem of the render: Deployments, Services, the gateway's targets, autoscalers, selectors."""
    objects = rendered.objects
    deployments = {d["metadata"]["name"]: d for d in find(objects, "Deployment")}
    services = {s["metadata"]["name"]: s for s in find(objects, "Service")}
    problems: list[str] = []
    for component in COMPONENTS:
        name = component_name(component, rendered.release)
        if name not in deployments:
            problems.append(f"no Deployment {name}")
            continue
        problems += deployment_problems(rendered, component, deployments[name])
    problems += service_problems(objects, services)
    problems += gateway_target_problems(rendered, deployments, services)
    problems += autoscaler_problems(objects, deployments)
    problems += selector_problems(objects)
    return problems


def _autoscaled(objects: list[Object]) -> list[Object]:
    return [o for kind in AUTOSCALER_KINDS for o in find(objects, kind)]


def deployment_problems(rendered: Rendered, component: str, deployment: Object) -> list[str]:
    """One component's Deployment: ports and probes, command, image, drain timing, env, mounts, references."""
    objects, values = rendered.objects, rendered.values
    name = deployment["metadata"]["name"]
    spec, pod = deployment["spec"], deployment["spec"]["template"]["spec"]
    ctr = container(deployment)
    env = env_of(deployment)
    problems: list[str] = []
    if not selects(spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"]):
        problems.append(f"{name}: selector does not match its pod labels")
    grpc_port = port_of(deployment, "grpc")
    if grpc_port != values[component]["port"]:
        problems.append(f"{name}: grpc containerPort {grpc_port} != values {component}.port")
    problems += _probe_problems(name, component, deployment)
    if ctr.get("command") != ["voicemesh", "serve", component]:
        problems.append(f"{name}: command {ctr.get('command')} is not voicemesh serve {component}")
    if ctr.get("imagePullPolicy") != "IfNotPresent":
        problems.append(f"{name}: imagePullPolicy {ctr.get('imagePullPolicy')}")
    image = ctr["image"]
    if image.endswith(":latest") or (":" not in image.rsplit("/", 1)[-1] and "@" not in image):
        problems.append(f"{name}: image {image} is not pinned")
    prefix = f"VOICEMESH_{component.upper()}_"
    drain = int(env.get(prefix + "DRAIN_GRACE_S", -1))
    sleep = int(ctr["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = pod["terminationGracePeriodSeconds"]
    if drain < 0 or grace < drain + sleep:
        problems.append(f"{name}: terminationGracePeriodSeconds {grace} < preStop {sleep} + drain {drain}")
    problems += _file_setting_problems(name, ctr)
    if env.get(prefix + "HOST") != "0.0.0.0":
        problems.append(f"{name}: {prefix}HOST is not 0.0.0.0: probes could not reach it")
    mounts = {m["mountPath"] for m in ctr.get("volumeMounts", [])}
    if ctr["securityContext"].get("readOnlyRootFilesystem") and not {"/tmp", "/home/voicemesh"} <= mounts:
        problems.append(f"{name}: read-only root filesystem without writable /tmp and $HOME")
    scaled = {o["spec"]["scaleTargetRef"]["name"] for o in _autoscaled(objects)}
    if (name in scaled) == ("replicas" in spec):
        problems.append(f"{name}: spec.replicas must be set exactly when no HPA/ScaledObject owns it")
    return problems + _reference_problems(objects, values, deployment)


#: Env settings (suffixes of VOICEMESH_<SERVICE>_) that turn on TLS or a credential on a component's gRPC port.
_GUARDS = ("TLS_CERT", "AUTH_TOKEN", "JWT_KEYS")

#: Env settings that name a file in the pod (a mounted certificate).
_FILE_SETTINGS = re.compile(r"VOICEMESH_[A-Z]+_(SERVICE_)?TLS_(CERT|KEY|CLIENT_CA|CA)")


def _probe_problems(name: str, component: str, deployment: Object) -> list[str]:
    """Probes hit the grpc port, or the plaintext health port whenever TLS or a credential guards the grpc port."""
    ctr, env = container(deployment), env_of(deployment)
    prefix = f"VOICEMESH_{component.upper()}_"
    health_port = port_of(deployment, "health")
    guarded = [s for s in _GUARDS if prefix + s in env]
    problems: list[str] = []
    if (prefix + "HEALTH_PORT" in env) != (health_port is not None):
        problems.append(f"{name}: {prefix}HEALTH_PORT and a container port named health go together")
    elif health_port is not None and str(env[prefix + "HEALTH_PORT"]) != str(health_port):
        problems.append(f"{name}: {prefix}HEALTH_PORT {env[prefix + 'HEALTH_PORT']} != health containerPort")
    if guarded and health_port is None:
        problems.append(f"{name}: {', '.join(guarded)} set but no plaintext health port: kubelet probes would fail")
    expected = health_port if guarded or health_port is not None else port_of(deployment, "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        got = ctr.get(probe, {}).get("grpc", {}).get("port")
        if got != expected:
            problems.append(f"{name}: {probe} grpc port {got} != {'health' if guarded else 'grpc'} port {expected}")
    return problems


def _file_setting_problems(name: str, ctr: dict[str, Any]) -> list[str]:
    """Certificate settings name files under a read-only mount of the container."""
    mounts = {m["mountPath"]: m for m in ctr.get("volumeMounts", [])}
    problems: list[str] = []
    for item in ctr.get("env", []):
        if not _FILE_SETTINGS.fullmatch(item["name"]):
            continue
        value = str(item.get("value", ""))
        mount = mounts.get(value.rsplit("/", 1)[0])
        if mount is None:
            problems.append(f"{name}: {item['name']}={value} is not in a mounted volume")
        elif not mount.get("readOnly"):
            problems.append(f"{name}: {item['name']} is on a writable mount {mount['mountPath']}")
    return problems


def existing_secrets(values: dict[str, Any]) -> set[str]:
    """Secrets the values name as existing (made outside the chart)."""
    gateway = values["gateway"]
    names = {
        gateway["existingSecret"],
        gateway["tls"]["existingSecret"],
        gateway["tls"]["clientCASecret"],
        gateway["turn"]["existingSecret"],
        values["serviceAuth"]["existingSecret"],
        values["serviceTLS"]["existingSecret"],
        values["serviceTLS"]["clientSecret"],
    }
    return names - {""}


def _volume_secrets(volume: dict[str, Any]) -> list[str]:
    """The Secrets a pod volume reads (secret or projected)."""
    names = [volume["secret"]["secretName"]] if "secret" in volume else []
    names += [s["secret"]["name"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s]
    return names


def _reference_problems(objects: list[Object], values: dict[str, Any], deployment: Object) -> list[str]:
    """ConfigMaps, Secrets and volume claims the pod refers to: rendered, or named in values as existing."""
    name = deployment["metadata"]["name"]
    ctr = container(deployment)
    problems: list[str] = []
    existing = existing_secrets(values)
    for ref in [f["configMapRef"]["name"] for f in ctr.get("envFrom", []) if "configMapRef" in f]:
        if not find(objects, "ConfigMap", ref):
            problems.append(f"{name}: envFrom ConfigMap {ref} is not rendered")
    for item in ctr.get("env", []):
        secret = item.get("valueFrom", {}).get("secretKeyRef")
        if not secret:
            continue
        if secret.get("optional"):
            problems.append(f"{name}: env {item['name']} is optional: a missing key would run the pod without it")
        rendered = find(objects, "Secret", secret["name"])
        if not rendered and secret["name"] not in existing:
            problems.append(
                f"{name}: env {item['name']} refers to Secret {secret['name']}, neither rendered nor named as existing"
            )
        elif rendered and secret["key"] not in rendered[0].get("data", {}):
            problems.append(
                f"{name}: env {item['name']} refers to key {secret['key']} that Secret {secret['name']} lacks"
            )
    mounted = {m["name"] for m in ctr.get("volumeMounts", [])}
    for volume in deployment["spec"]["template"]["spec"].get("volumes", []):
        if volume["name"] not in mounted:
            problems.append(f"{name}: volume {volume['name']} is not mounted")
        for secret_name in _volume_secrets(volume):
            if not find(objects, "Secret", secret_name) and secret_name not in existing:
                problems.append(
                    f"{name}: volume {volume['name']} reads Secret {secret_name}, neither rendered nor existing"
                )
        claim = volume.get("persistentVolumeClaim", {}).get("claimName")
        if (
            claim
            and not find(objects, "PersistentVolumeClaim", claim)
            and claim != values["models"]["volume"]["existingClaim"]
        ):
            problems.append(f"{name}: volume claim {claim} neither rendered nor models.volume.existingClaim")
    return problems


def service_problems(objects: list[Object], services: dict[str, Object]) -> list[str]:
    """Each Service selects exactly one Deployment, and its named target ports exist there."""
    problems: list[str] = []
    for service in services.values():
        service_name = service["metadata"]["name"]
        targets = pods_selected(objects, service["spec"].get("selector", {}))
        if len(targets) != 1:
            problems.append(f"Service {service_name} selects {len(targets)} Deployments")
            continue
        for port in service["spec"]["ports"]:
            if isinstance(port["targetPort"], str) and port_of(targets[0], port["targetPort"]) is None:
                target_name = targets[0]["metadata"]["name"]
                problems.append(
                    f"Service {service_name}: targetPort {port['targetPort']} is not a port of {target_name}"
                )
    return problems


def gateway_target_problems(
    rendered: Rendered, deployments: dict[str, Object], services: dict[str, Object]
) -> list[str]:
    """The gateway's backend targets are the backends' headless Services, in their namespace, on their grpc ports."""
    gateway = deployments.get(component_name("gateway", rendered.release))
    if gateway is None:
        return []
    env = env_of(gateway)
    problems: list[str] = []
    for backend in BACKENDS:
        target = env.get(f"VOICEMESH_GATEWAY_{backend.upper()}_TARGET", "")
        if rendered.values["gateway"]["targets"][backend]:
            continue  # an explicit override points outside the chart
        match = _HEADLESS_TARGET.fullmatch(str(target))
        if not match:
            problems.append(f"gateway {backend} target {target!r} is not dns:///<headless>.<ns>.svc...:<port>")
            continue
        service_name, namespace, port = match.groups()
        headless = services.get(service_name)
        backend_deployment = deployments.get(component_name(backend, rendered.release))
        if headless is None or headless["spec"].get("clusterIP") != "None":
            problems.append(f"gateway {backend} target {target}: no headless Service {service_name}")
        elif backend_deployment is None or not selects(
            headless["spec"]["selector"], backend_deployment["spec"]["template"]["metadata"]["labels"]
        ):
            problems.append(f"gateway {backend} target {target}: Service does not select the {backend} pods")
        elif int(port) != port_of(backend_deployment, "grpc"):
            problems.append(f"gateway {backend} target {target}: port is not the {backend} grpc port")
        if headless is not None and namespace != headless["metadata"].get("namespace"):
            problems.append(f"gateway {backend} target {target}: namespace differs from the Service's")
    return problems


def autoscaler_problems(objects: list[Object], deployments: dict[str, Object]) -> list[str]:
    """HPAs and ScaledObjects target rendered Deployments, at most one autoscaler each."""
    problems: list[str] = []
    for kind in AUTOSCALER_KINDS:
        for obj in find(objects, kind):
            ref = obj["spec"]["scaleTargetRef"]
            if ref.get("kind", "Deployment") != "Deployment" or ref["name"] not in deployments:
                problems.append(f"{object_id(obj)} targets {ref.get('kind')}/{ref['name']}, not a rendered Deployment")
    per_target = Counter(o["spec"]["scaleTargetRef"]["name"] for o in _autoscaled(objects))
    problems += [f"{n} has {c} autoscalers" for n, c in per_target.items() if c > 1]
    return problems


def selector_problems(objects: list[Object]) -> list[str]:
    """PDBs and NetworkPolicies select exactly one Deployment; named NetworkPolicy ports exist on its pods."""
    problems: list[str] = []
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for obj in find(objects, kind):
            selector = obj["spec"]["selector" if kind == "PodDisruptionBudget" else "podSelector"]["matchLabels"]
            if len(pods_selected(objects, selector)) != 1:
                problems.append(f"{object_id(obj)} selects {len(pods_selected(objects, selector))} Deployments")
    for policy in find(objects, "NetworkPolicy"):
        target = pods_selected(objects, policy["spec"]["podSelector"]["matchLabels"])
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if isinstance(port.get("port"), str) and target and port_of(target[0], port["port"]) is None:
                    problems.append(f"{object_id(policy)}: port {port['port']} is not a port of the pods")
    return problems
