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

{{/* True ("true") when the chart creates the gateway Secret (client credentials given in values). */}}
{{- define "voicemesh.createGatewaySecret" -}}
{{- $auth := .Values.gateway.auth -}}
{{- if and $auth.enabled (not .Values.gateway.existingSecret) (or $auth.token $auth.jwtKeys) -}}
true
{{- end -}}
{{- end -}}

{{- define "voicemesh.serviceAuthSecretName" -}}
{{- default (printf "%s-service-auth" (include "voicemesh.fullname" .)) .Values.serviceAuth.existingSecret -}}
{{- end -}}

{{- define "voicemesh.serviceAuthSecretKey" -}}
{{- ternary .Values.serviceAuth.existingSecretKey "service-token" (not (empty .Values.serviceAuth.existingSecret)) -}}
{{- end -}}

{{/* True ("true") when the chart creates the service-token Secret. */}}
{{- define "voicemesh.createServiceAuthSecret" -}}
{{- if and .Values.serviceAuth.enabled (not .Values.serviceAuth.existingSecret) .Values.serviceAuth.token -}}
true
{{- end -}}
{{- end -}}

{{/*
Fail closed: refuse a release whose security settings would silently turn something off. Called once from
deployment.yaml; renders nothing.
*/}}
{{- define "voicemesh.validateSecurity" -}}
{{- $v := .Values -}}
{{- $auth := $v.gateway.auth -}}
{{- if $auth.enabled -}}
{{- if $v.gateway.existingSecret -}}
{{- if or $auth.token $auth.jwtKeys -}}
{{- fail "gateway.existingSecret is set, so gateway.auth.token and gateway.auth.jwtKeys must be empty: put the credentials in that Secret" -}}
{{- end -}}
{{- if not (or $auth.existingSecretKeys.token $auth.existingSecretKeys.jwtKeys) -}}
{{- fail (printf "gateway.auth is enabled but no key of gateway.existingSecret %q is named: set gateway.auth.existingSecretKeys.token and/or .jwtKeys" $v.gateway.existingSecret) -}}
{{- end -}}
{{- else if not (or $auth.token $auth.jwtKeys) -}}
{{- fail "gateway.auth.enabled is true but no client credential is configured: set gateway.existingSecret (a Secret with key auth-token, see gateway.auth.existingSecretKeys), or gateway.auth.token / gateway.auth.jwtKeys; or set gateway.auth.enabled=false to run the gateway without authentication" -}}
{{- end -}}
{{- range $entry := splitList "," $auth.jwtKeys -}}
{{- if $entry -}}
{{- $parts := splitn ":" 2 $entry -}}
{{- if or (not $parts._0) (lt (len (default "" $parts._1)) 32) -}}
{{- fail "gateway.auth.jwtKeys: each entry must be kid:secret with a secret of at least 32 bytes" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $service := $v.serviceAuth -}}
{{- if $service.enabled -}}
{{- if $service.existingSecret -}}
{{- if $service.token -}}
{{- fail "serviceAuth.existingSecret is set, so serviceAuth.token must be empty: put the token in that Secret" -}}
{{- end -}}
{{- if not $service.existingSecretKey -}}
{{- fail "serviceAuth.existingSecretKey must name the key of serviceAuth.existingSecret that holds the service token" -}}
{{- end -}}
{{- else if not $service.token -}}
{{- fail "serviceAuth.enabled is true but no service token is configured: set serviceAuth.existingSecret (a Secret with key service-token, see serviceAuth.existingSecretKey) or serviceAuth.token; or set serviceAuth.enabled=false to let ASR, LLM and TTS take calls without a token" -}}
{{- end -}}
{{- end -}}
{{- if and $v.gateway.tls.clientCASecret (not $v.gateway.tls.existingSecret) -}}
{{- fail "gateway.tls.clientCASecret needs gateway.tls.existingSecret: mutual TLS is TLS first" -}}
{{- end -}}
{{- if $v.serviceTLS.enabled -}}
{{- if not $v.serviceTLS.existingSecret -}}
{{- fail "serviceTLS.enabled needs serviceTLS.existingSecret: a Secret with ca.crt, tls.crt and tls.key" -}}
{{- end -}}
{{- else if or $v.serviceTLS.mutual $v.serviceTLS.clientSecret -}}
{{- fail "serviceTLS.mutual and serviceTLS.clientSecret need serviceTLS.enabled: mutual TLS is TLS first" -}}
{{- end -}}
{{- if and $v.serviceTLS.clientSecret (not $v.serviceTLS.mutual) -}}
{{- fail "serviceTLS.clientSecret is the gateway's client certificate: it is only used with serviceTLS.mutual" -}}
{{- end -}}
{{- $turn := $v.gateway.turn -}}
{{- if and $turn.existingSecret (not $turn.urls) -}}
{{- fail "gateway.turn.existingSecret needs gateway.turn.urls (the turn:/turns: URLs the credentials are for)" -}}
{{- end -}}
{{- if and $turn.urls (not $turn.existingSecret) -}}
{{- fail "gateway.turn.urls needs gateway.turn.existingSecret (the TURN server's shared secret, key gateway.turn.secretKey)" -}}
{{- end -}}
{{- if and $turn.existingSecret (not $turn.secretKey) -}}
{{- fail "gateway.turn.secretKey must name the key of gateway.turn.existingSecret holding the shared secret" -}}
{{- end -}}
{{- range $url := $turn.urls -}}
{{- if not (or (hasPrefix "turn:" $url) (hasPrefix "turns:" $url)) -}}
{{- fail (printf "gateway.turn.urls: %q is not a turn: or turns: URL" $url) -}}
{{- end -}}
{{- end -}}
{{- if le (float64 $turn.ttlSeconds) 0.0 -}}
{{- fail "gateway.turn.ttlSeconds must be positive" -}}
{{- end -}}
{{- range $server := $v.gateway.webrtc.iceServers -}}
{{- if or (hasKey $server "username") (hasKey $server "credential") -}}
{{- fail "gateway.webrtc.iceServers holds STUN servers only: no username or credential in values; give TURN a shared secret in gateway.turn (short-lived credentials)" -}}
{{- end -}}
{{- range $url := (kindIs "slice" $server.urls | ternary $server.urls (list $server.urls)) -}}
{{- if not (hasPrefix "stun:" (toString $url)) -}}
{{- fail (printf "gateway.webrtc.iceServers: %q is not a stun: URL; TURN goes in gateway.turn" (toString $url)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $component := splitList " " (include "voicemesh.components" $) -}}
{{- $c := index $v $component -}}
{{- $taken := list (int $c.port) -}}
{{- if $v.metrics.enabled -}}
{{- $taken = append $taken (int $v.metrics.port) -}}
{{- end -}}
{{- if eq $component "gateway" -}}
{{- $taken = append $taken (int $c.httpPort) -}}
{{- end -}}
{{- if and (include "voicemesh.guarded" (dict "root" $ "component" $component)) (has (int $v.common.healthPort) $taken) -}}
{{- fail (printf "common.healthPort %v collides with another port of the %s pod" $v.common.healthPort $component) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
True ("true") when a component's gRPC port needs TLS or a credential: it then serves grpc.health.v1 in
plaintext on common.healthPort too, and its probes go there (kubelet gRPC probes do neither TLS nor tokens).
*/}}
{{- define "voicemesh.guarded" -}}
{{- $v := .root.Values -}}
{{- if eq .component "gateway" -}}
{{- if or $v.gateway.auth.enabled $v.gateway.tls.existingSecret -}}
true
{{- end -}}
{{- else if or $v.serviceAuth.enabled $v.serviceTLS.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* The port the kubelet's gRPC probes use: the plaintext health port when guarded, else the gRPC port. */}}
{{- define "voicemesh.probePort" -}}
{{- if include "voicemesh.guarded" . -}}
{{- .root.Values.common.healthPort -}}
{{- else -}}
{{- (index .root.Values .component).port -}}
{{- end -}}
{{- end -}}

{{/* Where the certificate Secrets are mounted (read-only). */}}
{{- define "voicemesh.tlsDir" -}}/etc/voicemesh/tls{{- end -}}
{{- define "voicemesh.clientCADir" -}}/etc/voicemesh/client-ca{{- end -}}
{{- define "voicemesh.serviceTLSDir" -}}/etc/voicemesh/service-tls{{- end -}}

{{/* A secretKeyRef env entry: (dict "name" ENV "secret" NAME "key" KEY); never optional (fail closed). */}}
{{- define "voicemesh.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secret }}
      key: {{ .key }}
{{- end -}}

{{/* Security settings of a component: health port, TLS file paths, credentials (from Secrets), transcripts. */}}
{{- define "voicemesh.securityEnv" -}}
{{- $v := .root.Values -}}
{{- $prefix := include "voicemesh.envPrefix" . -}}
- name: {{ $prefix }}LOG_TRANSCRIPTS
  value: {{ ternary "true" "false" (eq (toString $v.common.logTranscripts) "true") | quote }}
{{- if include "voicemesh.guarded" . }}
- name: {{ $prefix }}HEALTH_PORT
  value: {{ $v.common.healthPort | quote }}
{{- end }}
{{- if eq .component "gateway" }}
{{- $auth := $v.gateway.auth }}
{{- if $auth.enabled }}
{{- $secret := include "voicemesh.gatewaySecretName" .root }}
{{- $tokenKey := ternary $auth.existingSecretKeys.token (ternary "auth-token" "" (not (empty $auth.token))) (not (empty $v.gateway.existingSecret)) }}
{{- $jwtKey := ternary $auth.existingSecretKeys.jwtKeys (ternary "jwt-keys" "" (not (empty $auth.jwtKeys))) (not (empty $v.gateway.existingSecret)) }}
{{- if $tokenKey }}
{{ include "voicemesh.secretEnv" (dict "name" (printf "%sAUTH_TOKEN" $prefix) "secret" $secret "key" $tokenKey) }}
{{- end }}
{{- if $jwtKey }}
{{ include "voicemesh.secretEnv" (dict "name" (printf "%sJWT_KEYS" $prefix) "secret" $secret "key" $jwtKey) }}
{{- end }}
{{- with $auth.jwtAudience }}
- name: {{ $prefix }}JWT_AUDIENCE
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- if $v.serviceAuth.enabled }}
{{ include "voicemesh.secretEnv" (dict "name" (printf "%sSERVICE_TOKEN" $prefix) "secret" (include "voicemesh.serviceAuthSecretName" .root) "key" (include "voicemesh.serviceAuthSecretKey" .root)) }}
{{- end }}
{{- if $v.gateway.tls.existingSecret }}
- name: {{ $prefix }}TLS_CERT
  value: {{ include "voicemesh.tlsDir" . }}/tls.crt
- name: {{ $prefix }}TLS_KEY
  value: {{ include "voicemesh.tlsDir" . }}/tls.key
{{- end }}
{{- if $v.gateway.tls.clientCASecret }}
- name: {{ $prefix }}TLS_CLIENT_CA
  value: {{ include "voicemesh.clientCADir" . }}/ca.crt
{{- end }}
{{- if $v.serviceTLS.enabled }}
- name: {{ $prefix }}SERVICE_TLS_CA
  value: {{ include "voicemesh.serviceTLSDir" . }}/ca.crt
{{- if $v.serviceTLS.mutual }}
- name: {{ $prefix }}SERVICE_TLS_CERT
  value: {{ include "voicemesh.serviceTLSDir" . }}/tls.crt
- name: {{ $prefix }}SERVICE_TLS_KEY
  value: {{ include "voicemesh.serviceTLSDir" . }}/tls.key
{{- end }}
{{- end }}
{{- $turn := $v.gateway.turn }}
{{- if $turn.existingSecret }}
{{ include "voicemesh.secretEnv" (dict "name" (printf "%sTURN_SECRET" $prefix) "secret" $turn.existingSecret "key" $turn.secretKey) }}
- name: {{ $prefix }}TURN_URLS
  value: {{ join "," $turn.urls | quote }}
- name: {{ $prefix }}TURN_TTL_S
  value: {{ $turn.ttlSeconds | quote }}
{{- end }}
{{- else }}
{{- if $v.serviceAuth.enabled }}
{{ include "voicemesh.secretEnv" (dict "name" (printf "%sAUTH_TOKEN" $prefix) "secret" (include "voicemesh.serviceAuthSecretName" .root) "key" (include "voicemesh.serviceAuthSecretKey" .root)) }}
{{- end }}
{{- if $v.serviceTLS.enabled }}
- name: {{ $prefix }}TLS_CERT
  value: {{ include "voicemesh.tlsDir" . }}/tls.crt
- name: {{ $prefix }}TLS_KEY
  value: {{ include "voicemesh.tlsDir" . }}/tls.key
{{- if $v.serviceTLS.mutual }}
- name: {{ $prefix }}TLS_CLIENT_CA
  value: {{ include "voicemesh.tlsDir" . }}/ca.crt
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The certificate mounts of a component (read-only). */}}
{{- define "voicemesh.securityVolumeMounts" -}}
{{- $v := .root.Values -}}
{{- if eq .component "gateway" }}
{{- if $v.gateway.tls.existingSecret }}
- name: tls
  mountPath: {{ include "voicemesh.tlsDir" . }}
  readOnly: true
{{- end }}
{{- if $v.gateway.tls.clientCASecret }}
- name: client-ca
  mountPath: {{ include "voicemesh.clientCADir" . }}
  readOnly: true
{{- end }}
{{- if $v.serviceTLS.enabled }}
- name: service-tls
  mountPath: {{ include "voicemesh.serviceTLSDir" . }}
  readOnly: true
{{- end }}
{{- else if $v.serviceTLS.enabled }}
- name: tls
  mountPath: {{ include "voicemesh.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The certificate volumes of a component: only the keys it needs, readable by the pod's group only. */}}
{{- define "voicemesh.securityVolumes" -}}
{{- $v := .root.Values -}}
{{- if eq .component "gateway" }}
{{- with $v.gateway.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- with $v.gateway.tls.clientCASecret }}
- name: client-ca
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- if $v.serviceTLS.enabled }}
- name: service-tls
  projected:
    defaultMode: 0440
    sources:
      - secret:
          name: {{ $v.serviceTLS.existingSecret }}
          items:
            - key: ca.crt
              path: ca.crt
      {{- if $v.serviceTLS.mutual }}
      - secret:
          name: {{ default $v.serviceTLS.existingSecret $v.serviceTLS.clientSecret }}
          items:
            - key: tls.crt
              path: tls.crt
            - key: tls.key
              path: tls.key
      {{- end }}
{{- end }}
{{- else if $v.serviceTLS.enabled }}
- name: tls
  secret:
    secretName: {{ $v.serviceTLS.existingSecret }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      {{- if $v.serviceTLS.mutual }}
      - key: ca.crt
        path: ca.crt
      {{- end }}
{{- end }}
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
{{- $cpus := int .root.Values.sharedNode.cpus -}}
{{- if lt $cpus 0 }}
{{- fail (printf "sharedNode.cpus must be 0 (off) or the node's cores, not %d" $cpus) }}
{{- end }}
{{- $half := max 1 (div $cpus 2) -}}
{{- if eq .component "asr" }}
- name: {{ $prefix }}CPU_THREADS
  value: {{ ternary 1 $c.cpuThreads (gt $cpus 0) | quote }}
- name: {{ $prefix }}WORKERS
  value: {{ ternary (min $cpus 4) $c.workers (gt $cpus 0) | quote }}
{{- if not (has $c.turnModel (list "smart-turn" "text")) }}
{{- fail (printf "asr.turnModel must be smart-turn or text, not %q" $c.turnModel) }}
{{- end }}
- name: {{ $prefix }}TURN_MODEL
  value: {{ $c.turnModel | quote }}
- name: {{ $prefix }}TURN_FUSION
  value: {{ .root.Values.llm.turnEnd.scorer | quote }}
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
  value: {{ ternary $half $c.nThreads (gt $cpus 0) | quote }}
{{- if gt $cpus 0 }}
- name: {{ $prefix }}N_THREADS_BATCH
  value: {{ $cpus | quote }}
{{- /* The TTS on the same node synthesizes a reply's first chunk on every core meanwhile (voicemesh/cpus.py). */}}
- name: {{ $prefix }}FIRST_CHUNK_YIELD_MS
  value: "50"
{{- end }}
- name: {{ $prefix }}MAX_BATCH
  value: {{ $c.maxBatch | quote }}
- name: {{ $prefix }}MAX_NUM_SEQS
  value: {{ $c.maxNumSeqs | quote }}
- name: {{ $prefix }}MAX_NUM_BATCHED_TOKENS
  value: {{ $c.maxNumBatchedTokens | quote }}
- name: {{ $prefix }}MAX_QUEUE_WAIT_MS
  value: {{ $c.maxQueueWaitMs | quote }}
- name: {{ $prefix }}TURN_END_SCORER
  value: {{ $c.turnEnd.scorer | quote }}
- name: {{ $prefix }}TURN_END_COMPLETE_AT
  value: {{ $c.turnEnd.completeAt | quote }}
- name: {{ $prefix }}TURN_END_INCOMPLETE_AT
  value: {{ $c.turnEnd.incompleteAt | quote }}
{{- if $modelPath }}
- name: {{ $prefix }}MODEL_PATH
  value: {{ printf "%s/%s" $mount $modelPath | quote }}
{{- end }}
{{- else if eq .component "tts" }}
- name: {{ $prefix }}INTRA_OP_THREADS
  value: {{ ternary $half $c.intraOpThreads (gt $cpus 0) | quote }}
{{- if gt $cpus 0 }}
- name: {{ $prefix }}FIRST_CHUNK_THREADS
  value: {{ $cpus | quote }}
{{- end }}
- name: {{ $prefix }}WORKERS
  value: {{ $c.workers | quote }}
{{- if $modelPath }}
- name: {{ $prefix }}VOICE_PATH
  value: {{ printf "%s/%s" $mount $modelPath | quote }}
{{- end }}
{{- else if eq .component "gateway" }}
- name: {{ $prefix }}HTTP_PORT
  value: {{ $c.httpPort | quote }}
- name: {{ $prefix }}MAX_SESSION_S
  value: {{ $c.maxSessionSeconds | quote }}
{{- range $backend := splitList " " (include "voicemesh.backends" .root) }}
- name: {{ $prefix }}{{ upper $backend }}_TARGET
  value: {{ include "voicemesh.backendTarget" (dict "root" $.root "component" $backend) | quote }}
{{- end }}
{{- with .root.Values.gateway.webrtc.iceServers }}
- name: {{ $prefix }}ICE_SERVERS
  value: {{ toJson . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The Secret key a scrape of a component's /metrics presents as its bearer token, as YAML {name, key}; empty
while that component's auth is off. ASR, LLM and TTS want the service token; the gateway a client token.
*/}}
{{- define "voicemesh.metricsCredentials" -}}
{{- $v := .root.Values -}}
{{- if ne .component "gateway" -}}
{{- if $v.serviceAuth.enabled -}}
name: {{ include "voicemesh.serviceAuthSecretName" .root }}
key: {{ include "voicemesh.serviceAuthSecretKey" .root }}
{{- end -}}
{{- else if $v.gateway.auth.enabled -}}
{{- $given := $v.metrics.podMonitor.gatewayToken -}}
{{- if $given.secretName -}}
name: {{ $given.secretName }}
key: {{ required "metrics.podMonitor.gatewayToken.key is needed with its secretName" $given.key }}
{{- else if and $v.gateway.existingSecret $v.gateway.auth.existingSecretKeys.token -}}
name: {{ $v.gateway.existingSecret }}
key: {{ $v.gateway.auth.existingSecretKeys.token }}
{{- else if and (not $v.gateway.existingSecret) $v.gateway.auth.token -}}
name: {{ include "voicemesh.gatewaySecretName" .root }}
key: auth-token
{{- else -}}
{{- fail "the gateway accepts JWTs only, so its PodMonitor has no static token to scrape with: put a long-lived token in a Secret and name it in metrics.podMonitor.gatewayToken (secretName, key)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
