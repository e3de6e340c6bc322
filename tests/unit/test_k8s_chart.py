"""The Helm chart's wiring, rendered offline: probes, backend targets, autoscalers, GPU values, images, full check.

Drives deploy/k8s/checks/ (the modules behind deploy/k8s/check.py); the tools come from
deploy/k8s/requirements.txt (their own venv).
"""

from __future__ import annotations

import copy
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
):
    pytest.importorskip(module, reason=f"{module} missing: pip install -r deploy/k8s/requirements.txt")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "k8s"))

from checks import cli, dockerfiles, keda, render, schema, settings, values, wiring  # noqa: E402
from checks.dockerignore import DockerIgnore  # noqa: E402
from checks.objects import component_name, container, env_of, find, one, pods_selected, port_of  # noqa: E402

PORTS = {"asr": 50061, "llm": 50062, "tts": 50063, "gateway": 50051}


@pytest.fixture(scope="module")
def rendered():
    return {name: render.render_scenario(name) for name in settings.SCENARIOS}


def deployment(result, component):
    return one(result.objects, "Deployment", component_name(component))


@pytest.mark.parametrize("scenario", list(settings.SCENARIOS))
def test_every_probe_hits_the_containers_grpc_port(rendered, scenario):
    for component, port in PORTS.items():
        ctr = container(deployment(rendered[scenario], component))
        assert port_of(deployment(rendered[scenario], component), "grpc") == port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert ctr[probe]["grpc"] == {"port": port}, (component, probe)


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
    result = render.render(release="prod", namespace="voice")
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
    assert any("voicemesh_llm_queue_wait_seconds" in q and 'namespace="voicemesh"' in q for q in queries)


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
    result = render.render(
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
        render.render(set_values={"llm": {"engine": "vllm"}})


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
    ],
    ids=["no-metrics-no-netpol", "no-sa-no-spread", "no-pdb-no-hpa", "external-secret-and-target"],
)
def test_switches_render_valid_and_consistent(set_values):
    result = render.render(set_values=set_values, release="edge")
    failures, _ = schema.validate_objects(result.objects)
    assert failures == []
    assert wiring.wiring_problems(result) == []


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
