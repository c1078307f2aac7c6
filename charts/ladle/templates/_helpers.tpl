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
