"""What the checks look at: where the chart and images live, the Kubernetes version, the values scenarios."""

from __future__ import annotations

from pathlib import Path

K8S_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = K8S_DIR.parent.parent
CHART_DIR = K8S_DIR / "voicemesh"
IMAGES_DIR = K8S_DIR / "images"
YAMLLINT_CONFIG = K8S_DIR / ".yamllint"
CHECKOV_SKIPS = K8S_DIR / "checkov-skips.yaml"

#: Kubernetes version the manifests are validated against (bundled by kubernetes-validate).
KUBERNETES_VERSION = "1.30.0"
RELEASE = "voicemesh"
NAMESPACE = "voicemesh"
COMPONENTS = ("asr", "llm", "tts", "gateway")
BACKENDS = ("asr", "llm", "tts")

#: Check-only overlay naming the credential Secrets: values.yaml alone refuses to render (auth is on by default).
CREDENTIALS = "ci/values-credentials.yaml"

#: Values scenarios: name -> overlay files (relative to the chart) applied over values.yaml, in order.
SCENARIOS: dict[str, tuple[str, ...]] = {
    "default": (CREDENTIALS,),
    "cpu-small": ("values-cpu-small.yaml", CREDENTIALS),
    "gpu": ("values-gpu.yaml",),
    "all-features": ("ci/values-all-features.yaml", "ci/values-observability.yaml"),
    "secure": ("ci/values-secure.yaml", "ci/values-observability.yaml"),
}

#: values.yaml keys whose children are user-defined (no typo check below them).
FREE_FORM_KEYS = frozenset(
    {
        "resources",
        "affinity",
        "nodeSelector",
        "extraEnv",
        "podAnnotations",
        "podLabels",
        "annotations",
        "labels",
        "podSecurityContext",
        "containerSecurityContext",
    }
)

#: Images: Dockerfile stem -> (chart component, pip extra).
IMAGES: dict[str, tuple[str, str]] = {
    "asr": ("asr", "asr"),
    "llm": ("llm", "llm"),
    "llm-vllm": ("llm", "vllm"),
    "tts": ("tts", "tts"),
    "gateway": ("gateway", "gateway"),
}
