"""The Helm chart's wiring, rendered offline: probes, backend targets, autoscalers, GPU values, security, images.

Drives deploy/k8s/checks/ (the modules behind deploy/k8s/check.py); the tools come from
deploy/k8s/requirements.txt (their own venv).
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
import sys
from pathlib import Path

import pytest

for module in (
    "helm_python",
    "kubernetes_validate",
    "yamllint",
    "dockerfile_parse",
    "jsonschema",
    "yaml",
    "pathspec",
    "cloudcoil.models.keda",
    "cloudcoil.models.prometheus_operator",
    "promql_parser",
    "grafana_foundation_sdk",
):
    pytest.importorskip(module, reason=f"{module} missing: pip install -r deploy/k8s/requirements.txt")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "k8s"))

from checks import cli, dashboard, dockerfiles, keda, monitoring, render, schema, settings, values, wiring  # noqa: E402
from checks.dockerignore import DockerIgnore  # noqa: E402
from checks.objects import component_name, container, env_of, find, one, pods_selected, port_of  # noqa: E402

PORTS = {"asr": 50061, "llm": 50062, "tts": 50063, "gateway": 50051}
BACKENDS = ("asr", "llm", "tts")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
NOTES = "voicemesh/templates/NOTES.txt"
AUTH_OFF = {"gateway": {"auth": {"enabled": False}}, "serviceAuth": {"enabled": False}}


@pytest.fixture(scope="module")
def rendered():
    return {name: render.render_scenario(name) for name in settings.SCENARIOS}


def deployment(result, component, release=settings.RELEASE):
    return one(result.objects, "Deployment", component_name(component, release))


def with_credentials(**kwargs):
    """render.render with the credential Secrets named (values.yaml alone refuses to render: auth is on)."""
    return render.render([settings.CREDENTIALS], **kwargs)


def secret_refs(result):
    """(deployment name, env name) -> secretKeyRef, for every env entry read from a Secret."""
    return {
        (d["metadata"]["name"], e["name"]): e["valueFrom"]["secretKeyRef"]
        for d in find(result.objects, "Deployment")
        for e in container(d).get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


@pytest.mark.parametrize("scenario", list(settings.SCENARIOS))
def test_every_probe_hits_the_grpc_port_or_the_health_port(rendered, scenario):
    for component, port in PORTS.items():
        d = deployment(rendered[scenario], component)
        assert port_of(d, "grpc") == port
        health = port_of(d, "health")
        expected = port if health is None else health
        for probe in PROBES:
            assert container(d)[probe]["grpc"] == {"port": expected}, (component, probe)


def test_gateway_llm_target_is_the_llm_headless_service(rendered):
    result = rendered["default"]
    env = env_of(deployment(result, "gateway"))
    assert env["VOICEMESH_GATEWAY_LLM_TARGET"] == "dns:///voicemesh-llm-headless.voicemesh.svc.cluster.local:50062"
    headless = one(result.objects, "Service", "voicemesh-llm-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["ports"][0]["port"] == 50062
    assert pods_selected(result.objects, headless["spec"]["selector"]) == [deployment(result, "llm")]
    for backend in ("asr", "tts"):
        assert env[f"VOICEMESH_GATEWAY_{backend.upper()}_TARGET"].startswith(
            f"dns:///voicemesh-{backend}-headless.voicemesh.svc"
        )


def test_targets_follow_release_and_namespace():
    result = with_credentials(release="prod", namespace="voice")
    env = env_of(one(result.objects, "Deployment", "prod-voicemesh-gateway"))
    assert env["VOICEMESH_GATEWAY_LLM_TARGET"] == "dns:///prod-voicemesh-llm-headless.voice.svc.cluster.local:50062"
    one(result.objects, "Service", "prod-voicemesh-llm-headless")


@pytest.mark.parametrize("scenario", list(settings.SCENARIOS))
def test_pdbs_and_autoscalers_match_their_deployments(rendered, scenario):
    result = rendered[scenario]
    for pdb in find(result.objects, "PodDisruptionBudget"):
        component = pdb["metadata"]["labels"]["app.kubernetes.io/component"]
        assert pods_selected(result.objects, pdb["spec"]["selector"]["matchLabels"]) == [deployment(result, component)]
    assert len(find(result.objects, "PodDisruptionBudget")) == 4
    scalers = find(result.objects, "HorizontalPodAutoscaler") + find(result.objects, "ScaledObject")
    targets = [s["spec"]["scaleTargetRef"] for s in scalers]
    assert len({t["name"] for t in targets}) == len(targets), "two autoscalers on one Deployment"
    for scaler, target in zip(scalers, targets, strict=True):
        component = scaler["metadata"]["labels"]["app.kubernetes.io/component"]
        assert target["name"] == deployment(result, component)["metadata"]["name"]
        assert target.get("kind", "Deployment") == "Deployment"
        assert "replicas" not in deployment(result, component)["spec"], "HPA-owned replicas must not be set"


def test_keda_replaces_the_cpu_hpa(rendered):
    result = rendered["all-features"]
    assert not find(result.objects, "HorizontalPodAutoscaler")
    llm = one(result.objects, "ScaledObject", "voicemesh-llm")
    queries = [t["metadata"]["query"] for t in llm["spec"]["triggers"]]
    assert any('voicemesh:queue_wait_seconds:p95_rate1m{namespace="voicemesh", service="llm"}' in q for q in queries)


def test_gpu_values_run_vllm_on_a_gpu(rendered):
    llm = deployment(rendered["gpu"], "llm")
    ctr, pod = container(llm), llm["spec"]["template"]["spec"]
    env = env_of(llm)
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env["VOICEMESH_LLM_ENGINE"] == "vllm"
    assert env["VOICEMESH_LLM_MAX_NUM_SEQS"] == "32"
    assert env["VOICEMESH_LLM_MODEL_PATH"].startswith("/models/")
    assert ctr["image"].startswith("voicemesh/llm-vllm:")
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    startup = ctr["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert {"name": "shm", "mountPath": "/dev/shm"} in ctr["volumeMounts"]
    for component in ("asr", "tts", "gateway"):
        assert "nvidia.com/gpu" not in str(container(deployment(rendered["gpu"], component))["resources"])
    assert "nvidia.com/gpu" not in str(container(deployment(rendered["default"], "llm"))["resources"])
    assert env_of(deployment(rendered["default"], "llm"))["VOICEMESH_LLM_ENGINE"] == "llama_cpp"


def test_the_llm_replicas_get_their_models_turn_end_calibration(rendered):
    default = env_of(deployment(rendered["default"], "llm"))
    assert default["VOICEMESH_LLM_TURN_END_SCORER"] == "line_end"
    assert (default["VOICEMESH_LLM_TURN_END_COMPLETE_AT"], default["VOICEMESH_LLM_TURN_END_INCOMPLETE_AT"]) == (
        "0",
        "0",
    ), "the scorer's own operating point"
    other = with_credentials(
        set_values={"llm": {"turnEnd": {"scorer": "probe", "completeAt": 0.8, "incompleteAt": 0.35}}}
    )
    env = env_of(deployment(other, "llm"))
    assert env["VOICEMESH_LLM_TURN_END_SCORER"] == "probe"
    assert (env["VOICEMESH_LLM_TURN_END_COMPLETE_AT"], env["VOICEMESH_LLM_TURN_END_INCOMPLETE_AT"]) == ("0.8", "0.35")
    asr, other_asr = env_of(deployment(rendered["default"], "asr")), env_of(deployment(other, "asr"))
    assert (asr["VOICEMESH_ASR_TURN_MODEL"], asr["VOICEMESH_ASR_TURN_FUSION"]) == ("smart-turn", "line_end")
    assert other_asr["VOICEMESH_ASR_TURN_FUSION"] == "probe", "the ASR fuses the score by the fit on the LLM's scorer"
    assert env_of(deployment(rendered["default"], "llm"))["VOICEMESH_LLM_MAX_BATCH"] == "8", "batched on CPU"


def test_cpu_small_runs_one_replica_each_without_autoscalers(rendered):
    result = rendered["cpu-small"]
    assert not find(result.objects, "HorizontalPodAutoscaler")
    for component in PORTS:
        assert deployment(result, component)["spec"]["replicas"] == 1


@pytest.mark.parametrize("scenario", list(settings.SCENARIOS))
def test_termination_grace_covers_prestop_and_drain(rendered, scenario):
    for component in PORTS:
        d = deployment(rendered[scenario], component)
        drain = int(env_of(d)[f"VOICEMESH_{component.upper()}_DRAIN_GRACE_S"])
        sleep = int(container(d)["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + sleep


def test_pods_are_locked_down(rendered):
    for component in PORTS:
        d = deployment(rendered["default"], component)
        pod_security = d["spec"]["template"]["spec"]["securityContext"]
        ctr_security = container(d)["securityContext"]
        assert pod_security["runAsNonRoot"] and pod_security["seccompProfile"]["type"] == "RuntimeDefault"
        assert ctr_security["readOnlyRootFilesystem"] and not ctr_security["allowPrivilegeEscalation"]
        assert ctr_security["capabilities"]["drop"] == ["ALL"]
        assert container(d)["imagePullPolicy"] == "IfNotPresent"


def test_models_volume_switch_mounts_the_claim_and_sets_paths():
    result = with_credentials(
        set_values={
            "models": {
                "volume": {
                    "enabled": True,
                    "existingClaim": "weights",
                    "llmModelPath": "m.gguf",
                    "ttsVoicePath": "v.onnx",
                }
            }
        }
    )
    assert env_of(deployment(result, "llm"))["VOICEMESH_LLM_MODEL_PATH"] == "/models/m.gguf"
    assert env_of(deployment(result, "tts"))["VOICEMESH_TTS_VOICE_PATH"] == "/models/v.onnx"
    assert "VOICEMESH_ASR_MODEL_DIR" not in env_of(deployment(result, "asr"))  # unset path = packaged model
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in deployment(result, "llm")["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["weights"]
    assert not find(result.objects, "PersistentVolumeClaim")  # existing claim: the chart makes none
    assert not wiring.wiring_problems(result)


def test_vllm_without_model_volume_refuses_to_render():
    with pytest.raises(Exception, match="packaged GGUF"):
        with_credentials(set_values={"llm": {"engine": "vllm"}})


def test_wiring_check_catches_a_probe_on_the_wrong_port(rendered):
    broken = copy.deepcopy(rendered["default"])
    container(deployment(broken, "tts"))["readinessProbe"]["grpc"]["port"] = 9464
    assert any("voicemesh-tts: readinessProbe" in p for p in wiring.wiring_problems(broken))


def test_values_overlays_have_no_unknown_keys():
    defaults = render.load_values_file(settings.CHART_DIR / "values.yaml")
    assert values.unknown_keys({"llm": {"maxNumSeq": 4}}, defaults) == ["unknown key llm.maxNumSeq"]
    for overlays in settings.SCENARIOS.values():
        for overlay in overlays:
            assert values.unknown_keys(render.load_values_file(settings.CHART_DIR / overlay), defaults) == []


def test_full_check_passes():
    if not (Path(sys.executable).with_name("checkov").exists() or shutil.which("checkov")):
        pytest.skip("checkov missing: pip install -r deploy/k8s/requirements.txt")
    results = cli.run_all()
    failures = [f"{r.name}: {f}" for r in results for f in r.failures]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "set_values",
    [
        {"metrics": {"enabled": False}, "networkPolicy": {"enabled": False}},
        {"serviceAccount": {"create": False}, "common": {"topologySpread": {"enabled": False}}},
        {name: {"pdb": {"enabled": False}, "autoscaling": {"enabled": False}} for name in PORTS},
        {"gateway": {"existingSecret": "creds", "targets": {"llm": "dns:///llm.elsewhere:50062"}}},
        AUTH_OFF,
        {"serviceAuth": {"enabled": False}, "serviceTLS": {"enabled": True, "existingSecret": "s", "mutual": True}},
        {"gateway": {"tls": {"existingSecret": "gw-tls"}, "auth": {"enabled": False}}},
    ],
    ids=[
        "no-metrics-no-netpol",
        "no-sa-no-spread",
        "no-pdb-no-hpa",
        "external-secret-and-target",
        "auth-off",
        "mtls-instead-of-token",
        "tls-without-auth",
    ],
)
def test_switches_render_valid_and_consistent(set_values):
    result = with_credentials(set_values=set_values, release="edge")
    failures, _ = schema.validate_objects(result.objects)
    assert failures == []
    assert wiring.wiring_problems(result) == []


# --- Security: fails closed, TLS, credentials -------------------------------------------------------------


def test_auth_on_without_a_credential_refuses_to_render():
    with pytest.raises(
        Exception, match=r"gateway.auth.enabled is true but no client credential.*gateway.existingSecret"
    ):
        render.render()
    with pytest.raises(
        Exception, match=r"serviceAuth.enabled is true but no service token.*serviceAuth.existingSecret"
    ):
        render.render(set_values={"gateway": {"auth": {"token": "t" * 24}}})
    with pytest.raises(Exception, match=r"no key of gateway\.existingSecret"):
        with_credentials(set_values={"gateway": {"auth": {"existingSecretKeys": {"token": ""}}}})
    with pytest.raises(Exception, match=r"gateway\.auth\.token and gateway\.auth\.jwtKeys must be empty"):
        with_credentials(set_values={"gateway": {"auth": {"token": "t" * 24}}})


def test_auth_explicitly_off_renders_without_auth_env_and_says_so():
    result = render.render(set_values=AUTH_OFF)
    assert not find(result.objects, "Secret")
    assert secret_refs(result) == {}
    for component in PORTS:
        d = deployment(result, component)
        names = set(env_of(d))
        assert not names & {f"VOICEMESH_{component.upper()}_{s}" for s in ("AUTH_TOKEN", "JWT_KEYS", "SERVICE_TOKEN")}
        assert port_of(d, "health") is None  # nothing guards the grpc port: the probes stay on it
    notes = result.files[NOTES]
    assert "gateway authentication is OFF" in notes and "service token is OFF" in notes
    assert "authentication is OFF" not in with_credentials().files[NOTES]


@pytest.mark.parametrize("scenario", ["default", "gpu", "secure", "all-features"])
def test_secret_key_references_are_never_optional(rendered, scenario):
    refs = secret_refs(rendered[scenario])
    assert refs
    for where, ref in refs.items():
        assert "optional" not in ref, where
    if scenario in ("default", "gpu"):
        assert refs[("voicemesh-gateway", "VOICEMESH_GATEWAY_AUTH_TOKEN")] == {
            "name": "voicemesh-gateway-credentials",
            "key": "auth-token",
        }


def test_wiring_check_refuses_an_optional_secret_reference(rendered):
    broken = copy.deepcopy(rendered["default"])
    for item in container(deployment(broken, "gateway"))["env"]:
        if item["name"] == "VOICEMESH_GATEWAY_AUTH_TOKEN":
            item["valueFrom"]["secretKeyRef"]["optional"] = True
    assert any("VOICEMESH_GATEWAY_AUTH_TOKEN is optional" in p for p in wiring.wiring_problems(broken))


@pytest.mark.parametrize("scenario", ["default", "all-features", "secure"])
def test_services_take_the_token_the_gateway_sends(rendered, scenario):
    result = rendered[scenario]
    refs = secret_refs(result)
    sent = refs[("voicemesh-gateway", "VOICEMESH_GATEWAY_SERVICE_TOKEN")]
    for backend in BACKENDS:
        assert refs[(f"voicemesh-{backend}", f"VOICEMESH_{backend.upper()}_AUTH_TOKEN")] == sent, backend
    expected = {"default": "voicemesh-service-credentials", "all-features": "voicemesh-service-auth"}
    assert sent["name"] == expected.get(scenario, "voicemesh-service-credentials")
    if scenario == "all-features":  # the chart's own Secret holds the value from values
        secret = one(result.objects, "Secret", "voicemesh-service-auth")
        assert base64.b64decode(secret["data"][sent["key"]]).decode() == result.values["serviceAuth"]["token"]


def test_tls_values_mount_the_secrets_and_point_env_at_them(rendered):
    result = rendered["secure"]
    gateway = deployment(result, "gateway")
    env, ctr = env_of(gateway), container(gateway)
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m for m in ctr["volumeMounts"]}
    assert volumes["tls"]["secret"]["secretName"] == "voicemesh-gateway-tls"
    assert [i["key"] for i in volumes["tls"]["secret"]["items"]] == ["tls.crt", "tls.key"]
    assert volumes["client-ca"]["secret"]["secretName"] == "voicemesh-clients-ca"
    assert all(m["readOnly"] for m in mounts.values() if m["name"] in ("tls", "client-ca", "service-tls"))
    assert env["VOICEMESH_GATEWAY_TLS_CERT"] == mounts["tls"]["mountPath"] + "/tls.crt"
    assert env["VOICEMESH_GATEWAY_TLS_KEY"] == mounts["tls"]["mountPath"] + "/tls.key"
    assert env["VOICEMESH_GATEWAY_TLS_CLIENT_CA"] == mounts["client-ca"]["mountPath"] + "/ca.crt"
    service_tls = mounts["service-tls"]["mountPath"]
    assert env["VOICEMESH_GATEWAY_SERVICE_TLS_CA"] == service_tls + "/ca.crt"
    assert env["VOICEMESH_GATEWAY_SERVICE_TLS_CERT"] == service_tls + "/tls.crt"
    sources = [s["secret"]["name"] for s in volumes["service-tls"]["projected"]["sources"]]
    assert sources == ["voicemesh-services-tls", "voicemesh-gateway-client-tls"]  # the CA, then its own pair
    for backend in BACKENDS:
        d = deployment(result, backend)
        env, prefix = env_of(d), f"VOICEMESH_{backend.upper()}_"
        (volume,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "voicemesh-services-tls"
        assert env[prefix + "TLS_CERT"] == "/etc/voicemesh/tls/tls.crt"
        assert env[prefix + "TLS_CLIENT_CA"] == "/etc/voicemesh/tls/ca.crt"  # mutual: the gateway's cert is checked
    http = [p for p in one(result.objects, "Service", "voicemesh-gateway")["spec"]["ports"] if p["name"] == "http"]
    assert http[0]["appProtocol"] == "https"
    default = deployment(rendered["default"], "gateway")
    assert not {"VOICEMESH_GATEWAY_TLS_CERT", "VOICEMESH_GATEWAY_SERVICE_TLS_CA"} & set(env_of(default))
    with pytest.raises(Exception, match="mutual TLS is TLS first"):
        with_credentials(set_values={"gateway": {"tls": {"clientCASecret": "ca"}}})
    with pytest.raises(Exception, match=r"serviceTLS\.enabled needs serviceTLS\.existingSecret"):
        with_credentials(set_values={"serviceTLS": {"enabled": True}})


@pytest.mark.parametrize(
    ("set_values", "guarded"),
    [
        (AUTH_OFF, set()),
        ({"serviceAuth": {"enabled": False}}, {"gateway"}),
        ({"gateway": {"auth": {"enabled": False}}}, set(BACKENDS)),
        ({**AUTH_OFF, "serviceTLS": {"enabled": True, "existingSecret": "s"}}, set(BACKENDS)),
        ({**AUTH_OFF, "gateway": {"auth": {"enabled": False}, "tls": {"existingSecret": "t"}}}, {"gateway"}),
        ({"common": {"healthPort": 9000}}, set(PORTS)),
    ],
    ids=["all-off", "client-auth", "service-token", "service-tls", "gateway-tls", "health-port-moved"],
)
def test_probes_use_the_health_port_when_tls_or_auth_is_on(set_values, guarded):
    result = with_credentials(set_values=set_values)
    health_port = result.values["common"]["healthPort"]
    for component, port in PORTS.items():
        d = deployment(result, component)
        expected = health_port if component in guarded else port
        assert {container(d)[probe]["grpc"]["port"] for probe in PROBES} == {expected}, component
        assert (port_of(d, "health") == health_port) == (component in guarded), component
        assert env_of(d).get(f"VOICEMESH_{component.upper()}_HEALTH_PORT") == (
            str(health_port) if component in guarded else None
        )
    for service in find(result.objects, "Service"):
        assert "health" not in {p["name"] for p in service["spec"]["ports"]}, service["metadata"]["name"]
    assert not wiring.wiring_problems(result)
    with pytest.raises(Exception, match=r"common\.healthPort 9464 collides"):
        with_credentials(set_values={"common": {"healthPort": 9464}})


def test_wiring_check_refuses_a_probe_on_a_guarded_grpc_port(rendered):
    broken = copy.deepcopy(rendered["secure"])
    container(deployment(broken, "llm"))["livenessProbe"]["grpc"]["port"] = 50062
    assert any("voicemesh-llm: livenessProbe" in p for p in wiring.wiring_problems(broken))


@pytest.mark.parametrize("scenario", list(settings.SCENARIOS))
def test_transcripts_stay_out_of_logs_unless_turned_on(rendered, scenario):
    on = scenario == "all-features"  # the check-only overlay turns every switch on
    for component in PORTS:
        value = env_of(deployment(rendered[scenario], component))[f"VOICEMESH_{component.upper()}_LOG_TRANSCRIPTS"]
        assert value == ("true" if on else "false"), (scenario, component)
    assert ("personal data" in rendered[scenario].files[NOTES]) == on


def test_turn_secret_and_urls_reach_the_gateway(rendered):
    env = env_of(deployment(rendered["secure"], "gateway"))
    assert env["VOICEMESH_GATEWAY_TURN_SECRET"] == {"secretKeyRef": {"name": "voicemesh-turn", "key": "turn-secret"}}
    assert env["VOICEMESH_GATEWAY_TURN_URLS"] == (
        "turn:turn.example.com:3478?transport=udp,turns:turn.example.com:5349?transport=tcp"
    )
    assert env["VOICEMESH_GATEWAY_TURN_TTL_S"] == "600"
    assert env["VOICEMESH_GATEWAY_ICE_SERVERS"] == '[{"urls":["stun:stun.example.com:3478"]}]'
    assert not any(k.startswith("VOICEMESH_GATEWAY_TURN_") for k in env_of(deployment(rendered["default"], "gateway")))
    with pytest.raises(Exception, match=r"needs gateway\.turn\.urls"):
        with_credentials(set_values={"gateway": {"turn": {"existingSecret": "turn"}}})
    with pytest.raises(Exception, match="not a turn: or turns: URL"):
        with_credentials(set_values={"gateway": {"turn": {"existingSecret": "turn", "urls": ["stun:x:3478"]}}})
    static = [{"urls": ["turn:turn.example.com:3478"], "username": "u", "credential": "c"}]
    with pytest.raises(Exception, match="no username or credential in values"):
        with_credentials(set_values={"gateway": {"webrtc": {"iceServers": static}}})


def test_jwt_keys_must_be_long_enough():
    keys = {"gateway": {"existingSecret": "", "auth": {"jwtKeys": "k1:too-short"}}}
    with pytest.raises(Exception, match="at least 32 bytes"):
        with_credentials(set_values=keys)
    keys["gateway"]["auth"]["jwtKeys"] = "k1:" + "x" * 32
    refs = secret_refs(with_credentials(set_values=keys))
    assert refs[("voicemesh-gateway", "VOICEMESH_GATEWAY_JWT_KEYS")] == {"name": "voicemesh-gateway", "key": "jwt-keys"}
    assert ("voicemesh-gateway", "VOICEMESH_GATEWAY_AUTH_TOKEN") not in refs  # only the keys named are read


def test_credentials_given_in_values_stay_in_secrets(rendered):
    result = rendered["all-features"]
    auth = result.values["gateway"]["auth"]
    credentials = [
        auth["token"],
        *(e.split(":", 1)[1] for e in auth["jwtKeys"].split(",")),
        result.values["serviceAuth"]["token"],
    ]
    for obj in result.objects:
        if obj["kind"] == "Secret":
            continue
        text = str(obj)
        for credential in credentials:
            assert credential not in text, (obj["kind"], obj["metadata"]["name"])
            assert base64.b64encode(credential.encode()).decode() not in text
    for configmap in find(result.objects, "ConfigMap"):
        assert not any(k.endswith(("TOKEN", "KEYS", "SECRET")) for k in configmap.get("data", {}))
    gateway_secret = one(result.objects, "Secret", "voicemesh-gateway")
    assert base64.b64decode(gateway_secret["data"]["auth-token"]).decode() == auth["token"]


def test_notes_warn_about_plaintext_exposure():
    exposed = {"gateway": {"service": {"type": "LoadBalancer"}, "ingress": {"enabled": True}}}
    notes = with_credentials(set_values=exposed).files[NOTES]
    assert "LoadBalancer without TLS" in notes and "Ingress serves plain HTTP" in notes
    exposed["gateway"]["tls"] = {"existingSecret": "gw-tls"}
    exposed["gateway"]["ingress"]["tlsSecretName"] = "edge-tls"
    notes = with_credentials(set_values=exposed).files[NOTES]
    assert "without TLS" not in notes and "plain HTTP" not in notes and "backend-protocol" in notes


# --- .dockerignore: Docker's rules, through pathspec ------------------------------------------------------


def test_dockerignore_double_star_matches_any_depth_including_none():
    ignore = DockerIgnore(["**/__pycache__", "**/*.pyc", "a/**/b"])
    for path in ("__pycache__", "__pycache__/m.pyc", "voicemesh/x/__pycache__/m.py", "x.pyc", "services/asr/y.pyc"):
        assert ignore.excludes(path), path
    for path in ("a/b", "a/x/y/b", "a/x/y/b/c.py"):  # ** is zero or more directories
        assert ignore.excludes(path), path
    for path in ("voicemesh/x.py", "a/bc", "ab", "services/asr/pyc"):
        assert not ignore.excludes(path), path
    assert ignore.excluding_pattern("services/asr/__pycache__/m.cpython-311.pyc") == "**/*.pyc"  # the last match


def test_dockerignore_follows_docker_not_gitignore():
    # Patterns are relative to the context root: *.pyc is only the top level's (gitignore: any depth).
    assert DockerIgnore(["*.pyc"]).excludes("x.pyc")
    assert not DockerIgnore(["*.pyc"]).excludes("voicemesh/x.pyc")
    # * stays within one directory (fnmatch's * crossed "/").
    assert not DockerIgnore(["voicemesh/*.py"]).excludes("voicemesh/v1/x.py")
    # A matched directory takes its contents with it; the last matching line decides, even below it.
    ignore = DockerIgnore(["*", "!voicemesh", "voicemesh/v1/*_pb2*", "# comment", "", "/tests/"])
    assert ignore.excludes("Makefile") and ignore.excludes("tests/unit/x.py") and ignore.excludes(".venv/bin/python")
    assert not ignore.excludes("voicemesh/conversation.py")
    assert ignore.excluding_pattern("voicemesh/v1/asr_pb2_grpc.py") == "voicemesh/v1/*_pb2*"
    assert ignore.patterns == ["*", "!voicemesh", "voicemesh/v1/*_pb2*", "tests"]


def test_copy_of_a_source_excluded_by_a_double_star_pattern_is_refused(tmp_path):
    from dockerfile_parse import DockerfileParser

    dockerfile = tmp_path / "x.Dockerfile"
    dockerfile.write_text("FROM python:3.11-slim AS builder\nCOPY voicemesh/ voicemesh/\nCOPY gateway/ gateway/\n")
    instructions = DockerfileParser(path=str(dockerfile)).structure
    ignore = DockerIgnore(["**/voicemesh"], name="x.Dockerfile.dockerignore")  # fnmatch never matched this
    assert dockerfiles.copy_problems("x.Dockerfile", instructions, ignore) == [
        "x.Dockerfile:2: COPY source voicemesh/ is excluded by x.Dockerfile.dockerignore (**/voicemesh)"
    ]


def test_every_image_dockerignore_keeps_the_copied_sources_and_drops_the_rest():
    for path in sorted(settings.IMAGES_DIR.glob("*.Dockerfile.dockerignore")):
        ignore = DockerIgnore.from_file(path)
        for kept in ("pyproject.toml", "README.md", "protos/voicemesh/v1/asr.proto", "voicemesh/conversation.py"):
            assert not ignore.excludes(kept), (path.name, kept)
        for dropped in ("tests/unit/test_k8s_chart.py", "deploy/k8s/check.py", "voicemesh/v1/asr_pb2.py"):
            assert ignore.excludes(dropped), (path.name, dropped)
        assert ignore.excludes("services/asr/__pycache__/server.cpython-311.pyc"), path.name


# --- KEDA ScaledObject: the CRD's schema -----------------------------------------------------------------


@pytest.fixture()
def scaled_object(rendered):
    return copy.deepcopy(one(rendered["all-features"].objects, "ScaledObject", "voicemesh-llm"))


def _schema_failures(obj):
    failures, _ = schema.validate_objects([obj])
    return failures


def test_keda_schema_is_the_crds(scaled_object):
    assert keda.KEDA_VERSION == "2.16.1"
    definitions = keda.scaled_object_schema()["$defs"]
    assert {"ScaledObjectSpec", "ScaleTargetRef", "TriggerModel", "Fallback", "ObjectMeta"} <= set(definitions)
    assert definitions["ScaledObjectSpec"]["additionalProperties"] is False
    assert _schema_failures(scaled_object) == []


@pytest.mark.parametrize(
    ("field", "mutate"),
    [
        ("maxReplicas", lambda o: o["spec"].update(maxReplicas=4)),  # maxReplicaCount misspelt
        ("scaleDwn", lambda o: o["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"].update(scaleDwn={})),
        ("replicas", lambda o: o["spec"].update(fallback={"failureThreshold": 3})),  # fallback needs replicas
        ("x", lambda o: o["spec"]["triggers"][0].update(authenticationRef={"name": "a", "x": 1})),
        ("pollingInterval", lambda o: o["spec"].update(pollingInterval="15")),
        ("threshold", lambda o: o["spec"]["triggers"][0]["metadata"].update(threshold=5)),  # metadata is strings
    ],
    ids=[
        "unknown-spec-field",
        "unknown-behavior-field",
        "incomplete-fallback",
        "unknown-authref-field",
        "string-int",
        "int-metadata",
    ],
)
def test_keda_schema_refuses_a_wrong_field(scaled_object, field, mutate):
    mutate(scaled_object)
    failures = _schema_failures(scaled_object)
    assert len(failures) == 1 and failures[0].startswith("ScaledObject/voicemesh-llm: "), failures
    assert field in failures[0]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o["spec"].update(triggers=[]),
        lambda o: o["spec"].update(pollingInterval=0),
        lambda o: o["spec"].update(maxReplicaCount=0),
        lambda o: o["spec"]["triggers"][0].update(metricType="Average"),
        lambda o: o["metadata"].update(finalizers=["x"]),
        lambda o: o.update(status={}),
        lambda o: o["metadata"].pop("name"),
    ],
    ids=["no-triggers", "polling-0", "max-0", "metric-type", "finalizers", "status", "no-name"],
)
def test_keda_rules_beyond_the_crd_still_hold(scaled_object, mutate):
    mutate(scaled_object)
    assert _schema_failures(scaled_object)


# --- Dockerfiles: the image contract ------------------------------------------------------------------------


def test_image_contract_catches_root_and_a_wrong_entrypoint(tmp_path):
    good = (settings.IMAGES_DIR / "tts.Dockerfile").read_text()
    bad = tmp_path / "tts.Dockerfile"
    bad.write_text(good.replace("USER 10001:10001", "USER root").replace('"serve", "tts"', '"serve", "asr"'))
    problems, _ = dockerfiles.dockerfile_problems(bad)
    assert "tts.Dockerfile: runs as root" in problems
    assert "tts.Dockerfile: ENTRYPOINT is not voicemesh serve tts" in problems
    assert dockerfiles.dockerfile_problems(settings.IMAGES_DIR / "tts.Dockerfile")[0] == []


def test_a_shared_node_splits_one_cpu_budget_between_the_stages_as_voicemesh_up_does(rendered):
    sys.path.insert(0, str(ROOT))
    from voicemesh.cpus import thread_split  # stdlib only: the one definition of the split

    env = {}
    for component in BACKENDS:
        env |= env_of(deployment(rendered["cpu-small"], component))
    assert {name: env[name] for name in thread_split(4)} == {name: str(n) for name, n in thread_split(4).items()}
    for cpus in (1, 2, 6):
        result = with_credentials(set_values={"sharedNode": {"cpus": cpus}})
        env = {}
        for component in BACKENDS:
            env |= env_of(deployment(result, component))
        assert {name: env[name] for name in thread_split(cpus)} == {
            name: str(n) for name, n in thread_split(cpus).items()
        }
    own = env_of(deployment(rendered["default"], "llm"))
    assert "VOICEMESH_LLM_N_THREADS_BATCH" not in own, "without a shared node each pod keeps its own values"


# ---- monitoring: PodMonitors, PrometheusRule, dashboard ---------------------------------------------------------


def test_monitoring_objects_are_off_by_default(rendered):
    kinds = {obj["kind"] for obj in rendered["default"].objects}
    assert not kinds & {"PodMonitor", "PrometheusRule"}
    assert not [c for c in find(rendered["default"].objects, "ConfigMap") if "voicemesh.json" in c.get("data", {})]


def test_pod_monitors_scrape_with_the_token_metrics_wants(rendered):
    for scenario, service_secret, gateway_secret in (
        ("all-features", ("voicemesh-service-auth", "service-token"), ("voicemesh-gateway", "auth-token")),
        ("secure", ("voicemesh-service-credentials", "service-token"), ("voicemesh-gateway-credentials", "auth-token")),
    ):
        result = rendered[scenario]
        for component in ("asr", "llm", "tts", "gateway"):
            monitor = one(result.objects, "PodMonitor", component_name(component))
            endpoint = monitor["spec"]["podMetricsEndpoints"][0]
            credentials = endpoint["authorization"]["credentials"]
            expected = gateway_secret if component == "gateway" else service_secret
            assert (credentials["name"], credentials["key"]) == expected, (scenario, component)
            assert endpoint["port"] == "metrics" and monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
            selected = pods_selected(result.objects, monitor["spec"]["selector"]["matchLabels"])
            assert [d["metadata"]["name"] for d in selected] == [component_name(component)]
            relabel = endpoint["relabelings"][0]
            assert relabel["targetLabel"] == "component"


def test_pod_monitor_of_a_jwt_only_gateway_needs_a_named_token():
    overlays = [settings.CREDENTIALS, monitoring.OVERLAY]
    jwt_only = {"gateway": {"auth": {"existingSecretKeys": {"token": "", "jwtKeys": "jwt-keys"}}}}
    with pytest.raises(Exception, match=r"metrics\.podMonitor\.gatewayToken"):
        render.render(overlays, set_values=jwt_only)
    named = {"metrics": {"podMonitor": {"gatewayToken": {"secretName": "scrape", "key": "token"}}}}
    result = render.render(overlays, set_values=render.deep_merge(jwt_only, named))
    endpoint = one(result.objects, "PodMonitor", component_name("gateway"))["spec"]["podMetricsEndpoints"][0]
    assert endpoint["authorization"]["credentials"] == {"name": "scrape", "key": "token"}
    auth_off = render.render([monitoring.OVERLAY], set_values=AUTH_OFF)
    assert (
        "authorization"
        not in one(auth_off.objects, "PodMonitor", component_name("asr"))["spec"]["podMetricsEndpoints"][0]
    )


def test_rules_record_what_the_issue_asks_and_alert_where_tls_is_on(rendered):
    def names(result):
        return {
            rule.get("record") or rule.get("alert") for g in monitoring.prometheus_rules(result) for rule in g["rules"]
        }

    secure, plain = names(rendered["secure"]), names(rendered["all-features"])
    for quantile in ("p50", "p95", "p99"):
        assert f"voicemesh:turn_v2v_seconds:{quantile}_rate5m" in plain
    assert {"voicemesh:queue_wait_seconds:p99_rate5m", "voicemesh:compute_seconds:p99_rate5m"} <= plain
    alerts = {"VoicemeshV2VBudgetBurnFast", "VoicemeshV2VBudgetBurnSlow", "VoicemeshStageErrors",
              "VoicemeshStageSaturated", "VoicemeshStageQueueing", "VoicemeshNoHealthyReplica"}  # fmt: skip
    assert alerts <= plain and "VoicemeshCertificateExpiring" not in plain
    assert alerts | {"VoicemeshCertificateExpiring"} <= secure


def test_slo_budget_and_bucket_are_settings():
    slo = {"metrics": {"prometheusRule": {"slo": {"v2vSeconds": "1.0", "objective": 0.995}}}}
    result = render.render([settings.CREDENTIALS, monitoring.OVERLAY], set_values=slo)
    rules = {r.get("record") or r.get("alert"): r for g in monitoring.prometheus_rules(result) for r in g["rules"]}
    assert 'le="1.0"' in rules["voicemesh:turn_v2v_slo_errors:ratio_rate1h"]["expr"]
    fast = rules["VoicemeshV2VBudgetBurnFast"]["expr"]
    assert "ratio_rate1h > 0.072" in fast and "ratio_rate6h > 0.03" in fast  # 14.4 and 6 times a 0.5% budget
    assert not monitoring.monitoring_problems(result)
    with pytest.raises(Exception, match="objective must lie between 0 and 1"):
        render.render(
            [settings.CREDENTIALS, monitoring.OVERLAY],
            set_values={"metrics": {"prometheusRule": {"slo": {"objective": 1}}}},
        )


def test_every_shipped_query_names_an_exported_metric(rendered):
    for scenario in ("all-features", "secure"):
        queries = monitoring.shipped_queries(rendered[scenario])
        kinds = {where.split()[0] for where, _ in queries}
        assert kinds == {"rule", "dashboard", "ScaledObject"} or scenario == "secure"
        assert not monitoring.monitoring_problems(rendered[scenario])
    exported = monitoring.exported_metrics()
    assert {"voicemesh_turn_v2v_seconds_bucket", "voicemesh_errors_total", "voicemesh_serving"} <= exported
    assert "voicemesh_turns_created" in exported and "voicemesh_turns_total_total" not in exported


def test_a_query_naming_an_unexported_metric_fails_the_check():
    typo = {
        "asr": {"keda": {"enabled": True, "triggers": [{"query": "sum(voicemesh_asr_queue_depth)", "threshold": "1"}]}}
    }
    result = render.render([settings.CREDENTIALS, monitoring.OVERLAY], set_values=typo)
    problems = monitoring.monitoring_problems(result)
    assert problems == [
        "ScaledObject voicemesh-asr: voicemesh_asr_queue_depth is neither a metric the code exports (voicemesh, "
        "gateway, services) nor a recording rule of the chart"
    ]
    known = monitoring.exported_metrics() | monitoring.chart_recordings()
    assert monitoring.query_problems("x", 'rate(voicemesh_turn_v2v_seconds_bucket{le="1.25"}[5m])', known) == [
        "x: voicemesh_turn_v2v_seconds_bucket has no bucket le='1.25'"
    ]
    assert "does not parse" in monitoring.query_problems("x", "sum(rate(voicemesh_turns_total[5m]", known)[0]
    # A rule file with an unexported metric is found the same way (the scenario check runs this on every render).
    bad = {"kind": "PrometheusRule", "metadata": {}, "spec": {"groups": [{"name": "g", "rules": [
        {"alert": "Typo", "expr": "voicemesh_turn_v2v_second_count > 0"}]}]}}  # fmt: skip
    result.objects.append(bad)
    assert any("rule Typo: voicemesh_turn_v2v_second_count" in p for p in monitoring.monitoring_problems(result))


def test_dashboard_is_built_from_code_and_committed_fresh(rendered):
    config = next(c for c in find(rendered["all-features"].objects, "ConfigMap") if "voicemesh.json" in c["data"])
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    model = json.loads(config["data"]["voicemesh.json"])
    assert model == dashboard.build() and model["uid"] == dashboard.UID
    titles = {title for title, _ in dashboard.panel_queries(model)}
    for wanted in ("V2V p50 / p95 / p99", "Stage split p99 (upload / queue / compute / downlink)", "Sessions",
                   "LLM batch occupancy", "LLM tokens per second", "ASR and TTS real-time factor",
                   "Failovers by stage", "Errors by stage"):  # fmt: skip
        assert wanted in titles
    assert monitoring.generated_files_check().ok, monitoring.generated_files_check().failures


def test_custom_resources_are_validated_strictly():
    monitor = {"apiVersion": monitoring.API_VERSION, "kind": "PodMonitor", "metadata": {"name": "m"},
               "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "metrics", "bearerTokenSecret": 3}]}}  # fmt: skip
    failures, _ = schema.validate_objects([monitor])
    assert failures and "bearerTokenSecret" in failures[0]
    rule = {"apiVersion": monitoring.API_VERSION, "kind": "PrometheusRule", "metadata": {"name": "r"},
            "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up", "forr": "5m"}]}]}}  # fmt: skip
    failures, _ = schema.validate_objects([rule])
    assert failures and "forr" in failures[0]
