{{/*
Labels of every object the chart renders: the two manifests/ carries
(app.kubernetes.io/name, app.kubernetes.io/part-of) plus Helm's own four. The test
comparing the chart with the kustomization allows exactly these four extra keys.
Pod templates and selectors carry only manifests/' labels, so a Deployment installed
with kubectl can be taken over by the chart (a selector is immutable).
*/}}
{{- define "slipway.labels" -}}
app.kubernetes.io/name: slipway-operator
app.kubernetes.io/part-of: slipway
{{ include "slipway.helmLabels" . }}
{{- end }}

{{/* Helm's four, alone: for objects whose other labels come from manifests/monitoring/. */}}
{{- define "slipway.helmLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* A file under files/ (a copy from manifests/, see charts/sync-files), or fail naming it. */}}
{{- define "slipway.requiredFile" -}}
{{- $text := .root.Files.Get .path -}}
{{- if not $text -}}
{{- fail (printf "the chart lacks %s; run `make chart-files`" .path) -}}
{{- end -}}
{{- $text -}}
{{- end }}
