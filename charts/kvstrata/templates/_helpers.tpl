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

{{/*
An image reference from a values image (repository, tag, digest) and the chart:
repository:tag, or repository:tag@digest; an empty tag is the chart's appVersion.
With global.imageRegistry set, that registry replaces the repository's own (its
first path element when that names a host: it has a dot or a port, or is
localhost), so a mirror serves every image under the same paths.
Called with (list IMAGE $).
*/}}
{{- define "kvstrata.imageRef" -}}
{{- $image := index . 0 }}
{{- $root := index . 1 }}
{{- $repository := $image.repository }}
{{- $registry := (($root.Values.global | default dict).imageRegistry) | default "" }}
{{- if $registry }}
{{- $parts := splitList "/" $repository }}
{{- $first := first $parts }}
{{- if and (gt (len $parts) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) }}
{{- $repository = join "/" (rest $parts) }}
{{- end }}
{{- $repository = printf "%s/%s" (trimSuffix "/" $registry) $repository }}
{{- end }}
{{- $ref := printf "%s:%s" $repository (default $root.Chart.AppVersion $image.tag) }}
{{- if $image.digest }}{{ printf "%s@%s" $ref $image.digest }}{{ else }}{{ $ref }}{{ end }}
{{- end }}

{{/*
The operator's namespaced rules: cluster-wide (ClusterRole) when it watches every
namespace, else in a Role in each watched namespace only.
*/}}
{{- define "kvstrata.namespacedRules" -}}
# KVCaches: list/watch to reconcile them; patch because kopf keeps its
# progress in kvstrata.io/* annotations on each object.
- apiGroups: [kvstrata.io]
  resources: [kvcaches]
  verbs: [get, list, watch, patch]
# Status: conditions, observedGeneration, injectedPods.
- apiGroups: [kvstrata.io]
  resources: [kvcaches/status]
  verbs: [get, patch]
# Owned objects: the sidecar ConfigMap, the Valkey and metrics Services and
# the Valkey auth Secret. get: compare and read back; create+patch: server-side apply.
# Secrets get also reads the S3/Valkey credentials a KVCache names.
- apiGroups: [""]
  resources: [configmaps, services, secrets]
  verbs: [get, create, patch]
# The managed Valkey StatefulSet: apply it and read its readiness; list+patch
# also find the StatefulSets whose pod template asks for a cache and stamp the
# config hash that rolls them.
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, create, patch]
# Deployments whose pod template asks for a cache: list them, patch the config
# hash that rolls them.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, patch]
# Count the injected pods (label kvstrata.io/cache) for status.injectedPods.
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# Events about reconciles and skipped injections.
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
# A per-KVCache ServiceMonitor when spec.metrics.serviceMonitor.enabled; get
# also tells whether the Prometheus Operator CRD exists.
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, create, patch]
{{- end }}

{{/*
"true" when the operator runs as kopf peers (more than one replica), else "":
one replica reconciles, the others stand by, all serve the webhook.
*/}}
{{- define "kvstrata.peering" -}}
{{- if gt (int .Values.operator.replicas) 1 }}true{{ end }}
{{- end }}

{{/* The peering object the replicas share: one per release. */}}
{{- define "kvstrata.peeringName" -}}
{{- include "kvstrata.fullname" . }}
{{- end }}

{{/*
What kopf's peering does with the peering kind (RESOURCE: clusterkopfpeerings
or kopfpeerings): list and watch every object of the kind (kopf lists the
kind, not one name), patch its own keep-alive into this release's object only.
Called with (list RESOURCE $).
*/}}
{{- define "kvstrata.peeringRules" -}}
{{- $resource := index . 0 }}
{{- $root := index . 1 -}}
# kopf peering: list and watch the peering kind to see the other replicas.
- apiGroups: [kopf.dev]
  resources: [{{ $resource }}]
  verbs: [list, watch]
# kopf peering: write this replica's keep-alive into this release's object.
- apiGroups: [kopf.dev]
  resources: [{{ $resource }}]
  resourceNames: [{{ include "kvstrata.peeringName" $root | quote }}]
  verbs: [patch]
{{- end }}
