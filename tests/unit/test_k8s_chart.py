"""The Helm chart's wiring, rendered offline: probes, backend targets, autoscalers, GPU values, full check.

Uses the helpers of deploy/k8s/check.py; the tools come from deploy/k8s/requirements.txt (their own venv).
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

for module in ("helm_python", "kubernetes_validate", "yamllint", "dockerfile_parse", "jsonschema", "yaml"):
    pytest.importorskip(module, reason=f"{module} missing: pip install -r deploy/k8s/requirements.txt")

ROOT = Path(__file__).resolve().parents[2]
CHECK_PATH = ROOT / "deploy" / "k8s" / "check.py"


def _load_check():
    spec = importlib.util.spec_from_file_location("voicemesh_k8s_check", CHECK_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


check = _load_check()

PORTS = {"asr": 50061, "llm": 50062, "tts": 50063, "gateway": 50051}


@pytest.fixture(scope="module")
def rendered():
    return {name: check.render_scenario(name) for name in check.SCENARIOS}


def deployment(result, component):
    return check.one(result.objects, "Deployment", check.component_name(component))


@pytest.mark.parametrize("scenario", list(check.SCENARIOS))
def test_every_probe_hits_the_containers_grpc_port(rendered, scenario):
    for component, port in PORTS.items():
        ctr = check.container(deployment(rendered[scenario], component))
        assert check.port_of(deployment(rendered[scenario], component), "grpc") == port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert ctr[probe]["grpc"] == {"port": port}, (component, probe)


def test_gateway_llm_target_is_the_llm_headless_service(rendered):
    result = rendered["default"]
    env = check.env_of(deployment(result, "gateway"))
    assert env["VOICEMESH_GATEWAY_LLM_TARGET"] == "dns:///voicemesh-llm-headless.voicemesh.svc.cluster.local:50062"
    headless = check.one(result.objects, "Service", "voicemesh-llm-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["ports"][0]["port"] == 50062
    assert check.pods_selected(result.objects, headless["spec"]["selector"]) == [deployment(result, "llm")]
    for backend in ("asr", "tts"):
        assert env[f"VOICEMESH_GATEWAY_{backend.upper()}_TARGET"].startswith(
            f"dns:///voicemesh-{backend}-headless.voicemesh.svc"
        )


def test_targets_follow_release_and_namespace():
    result = check.render(release="prod", namespace="voice")
    env = check.env_of(check.one(result.objects, "Deployment", "prod-voicemesh-gateway"))
    assert env["VOICEMESH_GATEWAY_LLM_TARGET"] == "dns:///prod-voicemesh-llm-headless.voice.svc.cluster.local:50062"
    check.one(result.objects, "Service", "prod-voicemesh-llm-headless")


@pytest.mark.parametrize("scenario", list(check.SCENARIOS))
def test_pdbs_and_autoscalers_match_their_deployments(rendered, scenario):
    result = rendered[scenario]
    for pdb in check.find(result.objects, "PodDisruptionBudget"):
        component = pdb["metadata"]["labels"]["app.kubernetes.io/component"]
        assert check.pods_selected(result.objects, pdb["spec"]["selector"]["matchLabels"]) == [
            deployment(result, component)
        ]
    assert len(check.find(result.objects, "PodDisruptionBudget")) == 4
    scalers = check.find(result.objects, "HorizontalPodAutoscaler") + check.find(result.objects, "ScaledObject")
    targets = [s["spec"]["scaleTargetRef"] for s in scalers]
    assert len({t["name"] for t in targets}) == len(targets), "two autoscalers on one Deployment"
    for scaler, target in zip(scalers, targets, strict=True):
        component = scaler["metadata"]["labels"]["app.kubernetes.io/component"]
        assert target["name"] == deployment(result, component)["metadata"]["name"]
        assert target.get("kind", "Deployment") == "Deployment"
        assert "replicas" not in deployment(result, component)["spec"], "HPA-owned replicas must not be set"


def test_keda_replaces_the_cpu_hpa(rendered):
    result = rendered["all-features"]
    assert not check.find(result.objects, "HorizontalPodAutoscaler")
    llm = check.one(result.objects, "ScaledObject", "voicemesh-llm")
    queries = [t["metadata"]["query"] for t in llm["spec"]["triggers"]]
    assert any("voicemesh_llm_queue_wait_seconds" in q and 'namespace="voicemesh"' in q for q in queries)


def test_gpu_values_run_vllm_on_a_gpu(rendered):
    llm = deployment(rendered["gpu"], "llm")
    ctr, pod = check.container(llm), llm["spec"]["template"]["spec"]
    env = check.env_of(llm)
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
        assert "nvidia.com/gpu" not in str(check.container(deployment(rendered["gpu"], component))["resources"])
    assert "nvidia.com/gpu" not in str(check.container(deployment(rendered["default"], "llm"))["resources"])
    assert check.env_of(deployment(rendered["default"], "llm"))["VOICEMESH_LLM_ENGINE"] == "llama_cpp"


def test_cpu_small_runs_one_replica_each_without_autoscalers(rendered):
    result = rendered["cpu-small"]
    assert not check.find(result.objects, "HorizontalPodAutoscaler")
    for component in PORTS:
        assert deployment(result, component)["spec"]["replicas"] == 1


@pytest.mark.parametrize("scenario", list(check.SCENARIOS))
def test_termination_grace_covers_prestop_and_drain(rendered, scenario):
    for component in PORTS:
        d = deployment(rendered[scenario], component)
        drain = int(check.env_of(d)[f"VOICEMESH_{component.upper()}_DRAIN_GRACE_S"])
        sleep = int(check.container(d)["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + sleep


def test_pods_are_locked_down(rendered):
    for component in PORTS:
        d = deployment(rendered["default"], component)
        pod_security = d["spec"]["template"]["spec"]["securityContext"]
        ctr_security = check.container(d)["securityContext"]
        assert pod_security["runAsNonRoot"] and pod_security["seccompProfile"]["type"] == "RuntimeDefault"
        assert ctr_security["readOnlyRootFilesystem"] and not ctr_security["allowPrivilegeEscalation"]
        assert ctr_security["capabilities"]["drop"] == ["ALL"]
        assert check.container(d)["imagePullPolicy"] == "IfNotPresent"


def test_models_volume_switch_mounts_the_claim_and_sets_paths():
    result = check.render(
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
    assert check.env_of(deployment(result, "llm"))["VOICEMESH_LLM_MODEL_PATH"] == "/models/m.gguf"
    assert check.env_of(deployment(result, "tts"))["VOICEMESH_TTS_VOICE_PATH"] == "/models/v.onnx"
    assert "VOICEMESH_ASR_MODEL_DIR" not in check.env_of(deployment(result, "asr"))  # unset path = packaged model
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in deployment(result, "llm")["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["weights"]
    assert not check.find(result.objects, "PersistentVolumeClaim")  # existing claim: the chart makes none
    assert not check.wiring_problems(result)


def test_vllm_without_model_volume_refuses_to_render():
    with pytest.raises(Exception, match="packaged GGUF"):
        check.render(set_values={"llm": {"engine": "vllm"}})


def test_wiring_check_catches_a_probe_on_the_wrong_port(rendered):
    broken = copy.deepcopy(rendered["default"])
    check.container(deployment(broken, "tts"))["readinessProbe"]["grpc"]["port"] = 9464
    assert any("voicemesh-tts: readinessProbe" in p for p in check.wiring_problems(broken))


def test_values_overlays_have_no_unknown_keys():
    defaults = check.load_values_file(check.CHART_DIR / "values.yaml")
    assert check.unknown_keys({"llm": {"maxNumSeq": 4}}, defaults) == ["unknown key llm.maxNumSeq"]
    for overlays in check.SCENARIOS.values():
        for overlay in overlays:
            assert check.unknown_keys(check.load_values_file(check.CHART_DIR / overlay), defaults) == []


def test_full_check_passes():
    if not (Path(sys.executable).with_name("checkov").exists() or shutil.which("checkov")):
        pytest.skip("checkov missing: pip install -r deploy/k8s/requirements.txt")
    results = check.run_all()
    failures = [f"{r.name}: {f}" for r in results for f in r.failures]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "set_values",
    [
        {"metrics": {"enabled": False}, "networkPolicy": {"enabled": False}},
        {"serviceAccount": {"create": False}, "common": {"topologySpread": {"enabled": False}}},
        {name: {"pdb": {"enabled": False}, "autoscaling": {"enabled": False}} for name in PORTS},
        {"gateway": {"existingSecret": "creds", "targets": {"llm": "dns:///llm.elsewhere:50062"}}},
    ],
    ids=["no-metrics-no-netpol", "no-sa-no-spread", "no-pdb-no-hpa", "external-secret-and-target"],
)
def test_switches_render_valid_and_consistent(set_values):
    result = check.render(set_values=set_values, release="edge")
    failures, _ = check.validate_objects(result.objects)
    assert failures == []
    assert check.wiring_problems(result) == []
