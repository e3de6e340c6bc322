{{/*
Shared names, labels and per-component pieces. Component helpers take
(dict "root" $ "component" "asr"|"llm"|"tts"|"gateway").
*/}}

{{/* The four components, in pipeline order; every per-component template ranges over this. */}}
{{- define "voicemesh.components" -}}
asr llm tts gateway
{{- end -}}

{{/* The backends the gateway dials. */}}
{{- define "voicemesh.backends" -}}
asr llm tts
{{- end -}}

{{- define "voicemesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "<release>-<chart>", or the release name when it already contains the chart name. */}}
{{- define "voicemesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>": Deployment, Service, HPA, PDB and NetworkPolicy name. */}}
{{- define "voicemesh.componentName" -}}
{{- printf "%s-%s" (include "voicemesh.fullname" .root) .component | trunc 55 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels; a component's pods carry these and nothing else selects on more. */}}
{{- define "voicemesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "voicemesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{/* Labels on every object; pass component "" for chart-wide objects. */}}
{{- define "voicemesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "voicemesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: voicemesh
{{- end -}}

{{- define "voicemesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "voicemesh.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The component's image reference: registry/repository@digest, or :tag. */}}
{{- define "voicemesh.image" -}}
{{- $c := index .root.Values .component -}}
{{- $repository := $c.image.repository -}}
{{- if .root.Values.image.registry -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" .root.Values.image.registry) $repository -}}
{{- end -}}
{{- if $c.image.digest -}}
{{- printf "%s@%s" $repository $c.image.digest -}}
{{- else -}}
{{- $tag := required (printf "%s.image.tag or image.tag must be set" .component) (default .root.Values.image.tag $c.image.tag) | toString -}}
{{- if eq $tag "latest" -}}
{{- fail (printf "%s image tag must be pinned, not latest" .component) -}}
{{- end -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Prefix of the component's settings variables: VOICEMESH_ASR_ etc. */}}
{{- define "voicemesh.envPrefix" -}}
{{- printf "VOICEMESH_%s_" (upper .component) -}}
{{- end -}}

{{/* Headless Service name of a backend (all ready replicas, for client-side routing). */}}
{{- define "voicemesh.headlessName" -}}
{{- printf "%s-headless" (include "voicemesh.componentName" .) -}}
{{- end -}}

{{/* The gateway's gRPC target for a backend: the override, else dns:/// on its headless Service. */}}
{{- define "voicemesh.backendTarget" -}}
{{- $override := index .root.Values.gateway.targets .component -}}
{{- if $override -}}
{{- $override -}}
{{- else -}}
{{- printf "dns:///%s.%s.svc.%s:%v" (include "voicemesh.headlessName" .) .root.Release.Namespace .root.Values.clusterDomain (index .root.Values .component).port -}}
{{- end -}}
{{- end -}}

{{/* Seconds the kubelet waits before SIGKILL: preStop sleep + drain grace + margin. */}}
{{- define "voicemesh.terminationGrace" -}}
{{- $c := index .root.Values .component -}}
{{- add $c.preStopSleepSeconds $c.drainGraceSeconds .root.Values.common.terminationMarginSeconds -}}
{{- end -}}

{{/* Model path inside the volume for a component ("" = packaged default, no mount). */}}
{{- define "voicemesh.modelSubPath" -}}
{{- $volume := .root.Values.models.volume -}}
{{- if $volume.enabled -}}
{{- if eq .component "asr" -}}{{ $volume.asrModelDir }}
{{- else if eq .component "llm" -}}{{ $volume.llmModelPath }}
{{- else if eq .component "tts" -}}{{ $volume.ttsVoicePath }}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "voicemesh.modelsClaimName" -}}
{{- default (printf "%s-models" (include "voicemesh.fullname" .)) .Values.models.volume.existingClaim -}}
{{- end -}}

{{- define "voicemesh.gatewaySecretName" -}}
{{- default (printf "%s-gateway" (include "voicemesh.fullname" .)) .Values.gateway.existingSecret -}}
{{- end -}}

{{/* True ("true") when the chart creates the gateway Secret. */}}
{{- define "voicemesh.createGatewaySecret" -}}
{{- if and (not .Values.gateway.existingSecret) (or .Values.gateway.auth.token .Values.gateway.webrtc.iceServers) -}}
true
{{- end -}}
{{- end -}}

{{/* True ("true") when the scaler (HPA or KEDA) owns the replica count. */}}
{{- define "voicemesh.autoscaled" -}}
{{- $c := index .root.Values .component -}}
{{- if or $c.autoscaling.enabled $c.keda.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* Component-specific settings variables (the common ones are in deployment.yaml). */}}
{{- define "voicemesh.componentEnv" -}}
{{- $c := index .root.Values .component -}}
{{- $prefix := include "voicemesh.envPrefix" . -}}
{{- $modelPath := include "voicemesh.modelSubPath" . -}}
{{- $mount := .root.Values.models.volume.mountPath -}}
{{- if eq .component "asr" }}
- name: {{ $prefix }}CPU_THREADS
  value: {{ $c.cpuThreads | quote }}
- name: {{ $prefix }}WORKERS
  value: {{ $c.workers | quote }}
{{- if not (has $c.turnModel (list "smart-turn" "text")) }}
{{- fail (printf "asr.turnModel must be smart-turn or text, not %q" $c.turnModel) }}
{{- end }}
- name: {{ $prefix }}TURN_MODEL
  value: {{ $c.turnModel | quote }}
{{- if $modelPath }}
- name: {{ $prefix }}MODEL_DIR
  value: {{ printf "%s/%s" $mount $modelPath | quote }}
{{- end }}
{{- else if eq .component "llm" }}
{{- if not (has $c.engine (list "llama_cpp" "vllm")) }}
{{- fail (printf "llm.engine must be llama_cpp or vllm, not %q" $c.engine) }}
{{- end }}
{{- if and (eq $c.engine "vllm") (not $modelPath) }}
{{- fail "llm.engine=vllm cannot read the packaged GGUF: enable models.volume and set models.volume.llmModelPath to a Hugging Face model directory" }}
{{- end }}
- name: {{ $prefix }}ENGINE
  value: {{ $c.engine | quote }}
- name: {{ $prefix }}N_THREADS
  value: {{ $c.nThreads | quote }}
- name: {{ $prefix }}MAX_NUM_SEQS
  value: {{ $c.maxNumSeqs | quote }}
- name: {{ $prefix }}MAX_NUM_BATCHED_TOKENS
  value: {{ $c.maxNumBatchedTokens | quote }}
- name: {{ $prefix }}MAX_QUEUE_WAIT_MS
  value: {{ $c.maxQueueWaitMs | quote }}
{{- if $modelPath }}
- name: {{ $prefix }}MODEL_PATH
  value: {{ printf "%s/%s" $mount $modelPath | quote }}
{{- end }}
{{- else if eq .component "tts" }}
- name: {{ $prefix }}INTRA_OP_THREADS
  value: {{ $c.intraOpThreads | quote }}
- name: {{ $prefix }}WORKERS
  value: {{ $c.workers | quote }}
{{- if $modelPath }}
- name: {{ $prefix }}VOICE_PATH
  value: {{ printf "%s/%s" $mount $modelPath | quote }}
{{- end }}
{{- else if eq .component "gateway" }}
- name: {{ $prefix }}HTTP_PORT
  value: {{ $c.httpPort | quote }}
{{- range $backend := splitList " " (include "voicemesh.backends" .root) }}
- name: {{ $prefix }}{{ upper $backend }}_TARGET
  value: {{ include "voicemesh.backendTarget" (dict "root" $.root "component" $backend) | quote }}
{{- end }}
{{- if or .root.Values.gateway.existingSecret .root.Values.gateway.auth.token }}
- name: {{ $prefix }}AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "voicemesh.gatewaySecretName" .root }}
      key: auth-token
      optional: {{ not (empty .root.Values.gateway.existingSecret) }}
{{- end }}
{{- if or .root.Values.gateway.existingSecret .root.Values.gateway.webrtc.iceServers }}
- name: {{ $prefix }}ICE_SERVERS
  valueFrom:
    secretKeyRef:
      name: {{ include "voicemesh.gatewaySecretName" .root }}
      key: ice-servers
      optional: {{ not (empty .root.Values.gateway.existingSecret) }}
{{- end }}
{{- end }}
{{- end -}}
