{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "kvstrata.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart unless the release name holds the chart name. */}}
{{- define "kvstrata.fullname" -}}
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

{{- define "kvstrata.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels on every object. */}}
{{- define "kvstrata.labels" -}}
helm.sh/chart: {{ include "kvstrata.chart" . }}
{{ include "kvstrata.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels the operator Deployment selects its pods by. */}}
{{- define "kvstrata.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstrata.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvstrata.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvstrata.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvstrata.webhookName" -}}
{{- printf "%s-webhook" (include "kvstrata.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvstrata.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "kvstrata.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvstrata.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
