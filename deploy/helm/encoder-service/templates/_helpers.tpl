{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "encoder-service.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; the release name alone when it already contains the chart name. */}}
{{- define "encoder-service.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of the in-chart Redis Deployment / Service (room left for the "-redis" suffix). */}}
{{- define "encoder-service.redisName" -}}
{{- printf "%s-redis" (include "encoder-service.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "encoder-service.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "encoder-service.labels" -}}
helm.sh/chart: {{ include "encoder-service.chart" . }}
{{ include "encoder-service.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels shared by all components; each template adds app.kubernetes.io/component
     (encoder | redis | test) so the encoder Service never selects the Redis or test pods. */}}
{{- define "encoder-service.selectorLabels" -}}
app.kubernetes.io/name: {{ include "encoder-service.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "encoder-service.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "encoder-service.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "encoder-service.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The chart's own Secret: holds only the values given inline (hf token, auth token, redis url). */}}
{{- define "encoder-service.secretName" -}}
{{- include "encoder-service.fullname" . }}
{{- end }}

{{- define "encoder-service.createSecret" -}}
{{- if or (and .Values.model.hfToken.value (not .Values.model.hfToken.existingSecret))
          (and .Values.auth.enabled .Values.auth.token (not .Values.auth.existingSecret))
          (and (eq .Values.redis.mode "external") .Values.redis.external.url (not .Values.redis.external.existingSecret)) -}}
true
{{- end }}
{{- end }}

{{/* secretKeyRef bodies: an existing Secret with its key, or the chart's Secret with a fixed key. */}}
{{- define "encoder-service.hfTokenRef" -}}
{{- if .Values.model.hfToken.existingSecret -}}
name: {{ .Values.model.hfToken.existingSecret }}
key: {{ .Values.model.hfToken.key }}
{{- else -}}
name: {{ include "encoder-service.secretName" . }}
key: hf-token
{{- end }}
{{- end }}

{{- define "encoder-service.authTokenRef" -}}
{{- if .Values.auth.existingSecret -}}
name: {{ .Values.auth.existingSecret }}
key: {{ .Values.auth.key }}
{{- else -}}
name: {{ include "encoder-service.secretName" . }}
key: auth-token
{{- end }}
{{- end }}

{{/* The Secret of the external Redis's TLS files, mounted read-only at redis.external.tls.mountPath ("": none). */}}
{{- define "encoder-service.redisTlsSecret" -}}
{{- if eq .Values.redis.mode "external" }}{{ .Values.redis.external.tls.existingSecret }}{{ end }}
{{- end }}

{{- define "encoder-service.redisUrlRef" -}}
{{- if .Values.redis.external.existingSecret -}}
name: {{ .Values.redis.external.existingSecret }}
key: {{ .Values.redis.external.key }}
{{- else -}}
name: {{ include "encoder-service.secretName" . }}
key: redis-url
{{- end }}
{{- end }}

{{/*
The encoder container's env. Every ENCODER_* variable is the env twin of an `encoder-service serve` flag
(README "Configuration"; tests/deploy/test_deploy.py checks the names against that table). A literal value that
is null or "" is left out, so the service's own default applies. YAML numbers reach templates as
float64: integral ones are printed without an exponent.
*/}}
{{- define "encoder-service.env" -}}
{{- $srv := .Values.server }}
{{- $model := ternary .Values.model.pvc.mountPath .Values.model.id (eq .Values.model.source "pvc") }}
{{- $revision := ternary "" .Values.model.revision (eq .Values.model.source "pvc") }}
{{- $redisUrl := "" }}
{{- if eq .Values.redis.mode "internal" }}
{{- $redisUrl = printf "redis://%s:6379/0" (include "encoder-service.redisName" .) }}
{{- end }}
{{- $literal := list
    (list "ENCODER_MODEL" $model)
    (list "ENCODER_REVISION" $revision)
    (list "ENCODER_DEVICE" $srv.device)
    (list "ENCODER_DTYPE" $srv.dtype)
    (list "ENCODER_PREPROCESS" $srv.preprocess)
    (list "ENCODER_EXIF_ORIENTATION" $srv.exifOrientation)
    (list "ENCODER_HOST" "0.0.0.0")
    (list "ENCODER_HTTP_PORT" .Values.ports.http)
    (list "ENCODER_GRPC_PORT" .Values.ports.grpc)
    (list "ENCODER_REDIS_URL" $redisUrl)
    (list "ENCODER_REDIS_TTL_S" (ternary "" .Values.redis.ttlS (eq .Values.redis.mode "none")))
    (list "ENCODER_CACHE_BYTES" $srv.cacheBytes)
    (list "ENCODER_HASH" $srv.hash)
    (list "ENCODER_LEASE_S" $srv.leaseS)
    (list "ENCODER_MAX_PINNED_BYTES" $srv.maxPinnedBytes)
    (list "ENCODER_CUDA_GRAPHS" $srv.cudaGraphs)
    (list "ENCODER_GRAPH_BUCKETS" (join "," ($srv.graphBuckets | default list)))
    (list "ENCODER_BATCH_TOKENS" $srv.batchTokens)
    (list "ENCODER_MAX_QUEUE" $srv.maxQueue)
    (list "ENCODER_ATTENTION" $srv.attention)
    (list "ENCODER_MAX_IMAGES" $srv.maxImages)
    (list "ENCODER_MAX_BODY_BYTES" $srv.maxBodyBytes)
    (list "ENCODER_MAX_IMAGE_BYTES" $srv.maxImageBytes)
    (list "ENCODER_MAX_PIXELS" $srv.maxPixels)
    (list "ENCODER_MAX_REQUEST_PIXELS" $srv.maxRequestPixels)
    (list "ENCODER_MAX_FETCH_BYTES" $srv.maxFetchBytes)
    (list "ENCODER_ALLOW_URL_HOSTS" (join "," ($srv.allowUrlHosts | default list)))
    (list "ENCODER_MAX_VIDEOS" $srv.maxVideos)
    (list "ENCODER_MAX_VIDEO_BYTES" $srv.maxVideoBytes)
    (list "ENCODER_MAX_VIDEO_DURATION_S" $srv.maxVideoDurationS)
    (list "ENCODER_MAX_VIDEO_FRAMES" $srv.maxVideoFrames)
    (list "ENCODER_MAX_VIDEO_SOURCE_FRAMES" $srv.maxVideoSourceFrames)
    (list "ENCODER_MAX_VIDEO_FRAME_PIXELS" $srv.maxVideoFramePixels)
    (list "ENCODER_MAX_VIDEO_PIXELS" $srv.maxVideoPixels)
    (list "ENCODER_MAX_VIDEO_TOKENS" $srv.maxVideoTokens)
    (list "ENCODER_VIDEO_CONTAINERS" (join "," ($srv.videoContainers | default list)))
    (list "ENCODER_VIDEO_CODECS" (join "," ($srv.videoCodecs | default list)))
    (list "ENCODER_VIDEO_DECODER_THREADS" $srv.videoDecoderThreads)
    (list "ENCODER_VIDEO_WINDOW" $srv.videoWindow)
    (list "ENCODER_LOG_LEVEL" $srv.logLevel)
    (list "ENCODER_ACCESS_LOG" $srv.accessLog)
    (list "ENCODER_SHM_FETCH" $srv.shmFetch)
    (list "ENCODER_SHM_DIR" $srv.shmDir)
    (list "ENCODER_IPC_ARENA_BYTES" $srv.ipcArenaBytes)
    (list "ENCODER_IPC_LEASE_S" $srv.ipcLeaseS)
    (list "ENCODER_IPC_CHANNEL" $srv.ipcChannel)
    (list "ENCODER_SEND_THREADS" $srv.sendThreads)
    (list "ENCODER_READ_TIMEOUT_S" $srv.readTimeoutS)
    (list "ENCODER_REDIS_ROW_COPY_BYTES" (ternary "" $srv.redisRowCopyBytes (eq .Values.redis.mode "none")))
    (list "ENCODER_SGLANG_PROTOCOL" (ternary "true" "" .Values.sglang.enabled))
    (list "ENCODER_SGLANG_PORT" (ternary .Values.sglang.port "" .Values.sglang.enabled))
    (list "HF_HOME" .Values.model.cache.mountPath)
    (list "HOME" "/tmp") }}
{{- range $literal }}
{{- $v := index . 1 }}
{{- if and (kindIs "float64" $v) (eq $v (float64 (int64 $v))) }}
{{- $v = int64 $v }}
{{- end }}
{{- if not (or (kindIs "invalid" $v) (eq (toString $v) "")) }}
- name: {{ index . 0 }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- end }}
{{- if eq .Values.redis.mode "external" }}
- name: ENCODER_REDIS_URL
  valueFrom:
    secretKeyRef:
      {{- include "encoder-service.redisUrlRef" . | nindent 6 }}
{{- end }}
{{- if ne .Values.redis.mode "none" }}
# Where the other replicas fetch this one's rows: its own pod IP (they never go through the Service for it).
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: ENCODER_ADVERTISE_URL
  value: "http://$(POD_IP):{{ .Values.ports.http }}"
{{- end }}
{{- if .Values.auth.enabled }}
- name: ENCODER_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      {{- include "encoder-service.authTokenRef" . | nindent 6 }}
{{- end }}
{{- if or .Values.model.hfToken.existingSecret .Values.model.hfToken.value }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      {{- include "encoder-service.hfTokenRef" . | nindent 6 }}
{{- end }}
{{- with $srv.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The main Service's sessionAffinity: service.sessionAffinity, or when empty ClientIP without Redis (ids live
only on the replica that encoded them) and None with it (any replica serves any id).
*/}}
{{- define "encoder-service.sessionAffinity" -}}
{{- if .Values.service.sessionAffinity }}
{{- .Values.service.sessionAffinity }}
{{- else if eq .Values.redis.mode "none" }}
{{- "ClientIP" }}
{{- else }}
{{- "None" }}
{{- end }}
{{- end }}

{{/* Values that cannot work: fail at render time with a message instead of a crash-looping pod. */}}
{{- define "encoder-service.validate" -}}
{{- if and (eq .Values.model.source "hub") (not .Values.model.id) }}
{{- fail "model.source=hub needs model.id (a hub repository id)" }}
{{- end }}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) }}
{{- fail "model.source=pvc needs model.pvc.claimName" }}
{{- end }}
{{- if and .Values.auth.enabled (not (or .Values.auth.existingSecret .Values.auth.token)) }}
{{- fail "auth.enabled needs auth.existingSecret or auth.token" }}
{{- end }}
{{- if and (eq .Values.redis.mode "external") (not (or .Values.redis.external.existingSecret .Values.redis.external.url)) }}
{{- fail "redis.mode=external needs redis.external.existingSecret or redis.external.url" }}
{{- end }}
{{- with .Values.redis.external }}
{{- if and (eq $.Values.redis.mode "external") .url (not .existingSecret) }}
{{- $scheme := regexReplaceAll "^rediss" (first (splitList "://" .url)) "redis" }}
{{- $schemes := get (dict "standalone" (list "redis") "cluster" (list "redis+cluster" "redis") "sentinel" (list "redis+sentinel")) .kind }}
{{- if not (has $scheme $schemes) }}
{{- fail (printf "redis.external.kind=%s needs a url starting %s:// (or rediss for TLS), not %s://" .kind (join ":// or " $schemes) (first (splitList "://" .url))) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.sglang.enabled (has (int .Values.sglang.port) (list (int .Values.ports.http) (int .Values.ports.grpc))) }}
{{- fail "sglang.port must differ from ports.http and ports.grpc" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" }}
{{- end }}
{{- end }}
