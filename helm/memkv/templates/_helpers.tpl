{{/*
Names and labels, as KubeRay's ray-cluster chart makes them.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "memkv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The resource name prefix: fullnameOverride, else <release>-<chart> (once if equal). */}}
{{- define "memkv.fullname" -}}
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

{{/* chart-version, for the helm.sh/chart label. */}}
{{- define "memkv.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource. */}}
{{- define "memkv.labels" -}}
helm.sh/chart: {{ include "memkv.chart" . }}
{{ include "memkv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the release's pods. */}}
{{- define "memkv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "memkv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels that select the gateway's pods. */}}
{{- define "memkv.gatewaySelectorLabels" -}}
{{ include "memkv.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{/* The RayCluster's name (KubeRay names its head Service <name>-head-svc). */}}
{{- define "memkv.rayClusterName" -}}
{{- printf "%s-ray" (include "memkv.fullname" .) | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/* The Ray head's GCS address, as the gateway joins it. */}}
{{- define "memkv.rayAddress" -}}
{{- printf "%s-head-svc.%s.svc:6379" (include "memkv.rayClusterName" .) .Release.Namespace }}
{{- end }}

{{/* The image, with the appVersion as its default tag. */}}
{{- define "memkv.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "memkv.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "memkv.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret holding the token document (tokens.yaml). */}}
{{- define "memkv.tokensSecretName" -}}
{{- default (printf "%s-tokens" (include "memkv.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* Where the archive workers mount their storage: memkv's archive.directory. */}}
{{- define "memkv.archiveDirectory" -}}
{{- $archive := dict }}
{{- range $name, $group := .Values.workerGroups }}
{{- if and (not $group.disabled) (eq $group.kind "archive") }}
{{- $archive = $group }}
{{- end }}
{{- end }}
{{- if $archive }}{{ $archive.storage.mountPath }}{{ else }}/var/lib/memkv{{ end }}
{{- end }}

{{/*
memkv.yaml: the user's config with what the chart decides merged over it. Rendered as
JSON (which is YAML): values arrive as float64, and toYaml would write a size such as
8589934592 as 8.589934592e+09, which memkv rightly refuses as a byte count.
*/}}
{{/* memkv's Ray namespace (the config's cluster.namespace; memkv's default otherwise). */}}
{{- define "memkv.namespace" -}}
{{- dig "cluster" "namespace" "memkv" (default dict .Values.memkv.config) }}
{{- end }}

{{/* gateway.engines: the values' engines in memkv's config shape (only keys given). */}}
{{- define "memkv.engines" -}}
{{- $engines := list }}
{{- range .Values.gateway.engines }}
{{- $engine := dict "url" .url }}
{{- if .model }}{{- $_ := set $engine "model" .model }}{{- end }}
{{- if .node }}{{- $_ := set $engine "node" .node }}{{- end }}
{{- if .priorityScheduling }}{{- $_ := set $engine "priority_scheduling" true }}{{- end }}
{{- if .maxRequests }}{{- $_ := set $engine "max_requests" (int .maxRequests) }}{{- end }}
{{- if .tenants }}{{- $_ := set $engine "tenants" .tenants }}{{- end }}
{{- $engines = append $engines $engine }}
{{- end }}
{{- toJson $engines }}
{{- end }}

{{- define "memkv.config" -}}
{{- $config := deepCopy (default dict .Values.memkv.config) }}
{{- $chart := dict
  "profile" .Values.memkv.profile
  "archive" (dict "directory" (include "memkv.archiveDirectory" .))
  "gateway" (dict
    "host" "0.0.0.0"
    "port" (int .Values.gateway.port)
    "workers" (int .Values.gateway.workers)
    "block_port" (ternary (int .Values.gateway.blockPort) nil (gt (int .Values.gateway.blockPort) 0))
    "max_body_bytes" (int64 .Values.gateway.maxBodyBytes)
    "engines" (include "memkv.engines" . | fromJsonArray)
    "routing" (dict
      "spill_requests" (int .Values.gateway.routing.spillRequests)
      "spill_kv_use" (float64 .Values.gateway.routing.spillKvUse)
    )
    "auth" (dict
      "enabled" .Values.auth.enabled
      "open_metrics" .Values.auth.openMetrics
      "tokens_file" (ternary "/etc/memkv/tokens/tokens.yaml" nil .Values.auth.enabled)
    )
  )
}}
{{- toPrettyJson (mergeOverwrite $config $chart) }}
{{- end }}
