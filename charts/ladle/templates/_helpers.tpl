{{- define "ladle.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ladle.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "ladle.labels" -}}
{{ include "ladle.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ladle.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ladle.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ladle.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "ladle.runtimeImage" -}}
{{- printf "%s:%s" .Values.runtime.image.repository (default .Chart.AppVersion .Values.runtime.image.tag) -}}
{{- end -}}

{{- define "ladle.gatewayName" -}}
{{- printf "%s-gateway" (include "ladle.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ladle.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "ladle.gatewayLabels" -}}
{{ include "ladle.gatewaySelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ladle.gatewayServiceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create -}}
{{- default (include "ladle.gatewayName" .) .Values.gateway.serviceAccount.name -}}
{{- else -}}
{{- required "gateway.serviceAccount.name is required when gateway.serviceAccount.create is false" .Values.gateway.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The gateway runs the operator image (the same wheel, no torch) unless told otherwise. */}}
{{- define "ladle.gatewayImage" -}}
{{- $repo := default .Values.image.repository .Values.gateway.image.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.gateway.image.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* The OpenAI base URL clients use inside the cluster; the operator writes it to status.url. */}}
{{- define "ladle.gatewayURL" -}}
{{- printf "http://%s.%s.svc.%s/v1" (include "ladle.gatewayName" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* Labels of every monitoring object: the chart's plus monitoring.labels (for selectors). */}}
{{- define "ladle.monitoringLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: monitoring
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
The TTFT objective as the runtime's `le` label value. It must be a bucket edge (the share is
then read exactly), written as Prometheus writes it: 1 is "1.0", 0.5 is "0.5". The edges are
runtime/server/metrics.py's LATENCY_BUCKETS (tests/monitoring/test_rules.py keeps them equal).
*/}}
{{- define "ladle.ttftLe" -}}
{{- $t := float64 .Values.monitoring.slo.latency.ttftSeconds -}}
{{- $edges := list 0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 1.5 2.0 2.5 5.0 7.5 10.0 20.0 40.0 80.0 160.0 320.0 640.0 -}}
{{- if not (has $t $edges) -}}
{{- fail (printf "monitoring.slo.latency.ttftSeconds: %v is not a bucket edge of ladle:time_to_first_token_seconds; use one of %v" $t $edges) -}}
{{- end -}}
{{- if eq $t (floor $t) -}}{{ printf "%.1f" $t }}{{- else -}}{{ $t }}{{- end -}}
{{- end -}}

{{/* An SLO objective in percent, checked: (0, 100). */}}
{{- define "ladle.objective" -}}
{{- $o := float64 .objective -}}
{{- if or (le $o 0.0) (ge $o 100.0) -}}
{{- fail (printf "monitoring.slo.%s.objectivePercent: %v must be above 0 and below 100" .name $o) -}}
{{- end -}}
{{- $o -}}
{{- end -}}

{{/* Relabelings that give runtime series the InferenceService and variant they serve. */}}
{{- define "ladle.runtimeRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_ladle_dev_inferenceservice]
  targetLabel: inferenceservice
- sourceLabels: [__meta_kubernetes_pod_label_ladle_dev_variant]
  targetLabel: variant
- targetLabel: job
  replacement: ladle-runtime
{{- end -}}

{{/* The environment profile, checked: "", dev, staging or prod. */}}
{{- define "ladle.envProfile" -}}
{{- $p := .Values.envProfile | default "" -}}
{{- if not (has $p (list "" "dev" "staging" "prod")) -}}
{{- fail (printf "envProfile: %q is not one of dev, staging, prod (or empty)" $p) -}}
{{- end -}}
{{- $p -}}
{{- end -}}

{{/* The log level a profile gives the operator and the gateway (the values table). */}}
{{- define "ladle.profileLogLevel" -}}
{{- get (dict "dev" "debug" "staging" "info" "prod" "info") (include "ladle.envProfile" .) | default "info" -}}
{{- end -}}
