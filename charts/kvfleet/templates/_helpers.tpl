{{/* Chart name, shortened to 63 characters. */}}
{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object name prefix: release name + chart name unless the release name already holds it. */}}
{{- define "kvfleet.fullname" -}}
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

{{/* Labels on every object. */}}
{{- define "kvfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfleet
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "controller"). */}}
{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The image reference, by digest when one is given. */}}
{{- define "kvfleet.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.controller.fullname" -}}
{{- printf "%s-controller" (include "kvfleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfleet.webhook.fullname" -}}
{{- printf "%s-webhook" (include "kvfleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfleet.controller.serviceAccountName" -}}
{{- if .Values.controller.serviceAccount.create -}}
{{- default (include "kvfleet.controller.fullname" .) .Values.controller.serviceAccount.name -}}
{{- else -}}
{{- required "controller.serviceAccount.name is required when controller.serviceAccount.create is false" .Values.controller.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.webhook.serviceAccountName" -}}
{{- if .Values.webhook.serviceAccount.create -}}
{{- default (include "kvfleet.webhook.fullname" .) .Values.webhook.serviceAccount.name -}}
{{- else -}}
{{- required "webhook.serviceAccount.name is required when webhook.serviceAccount.create is false" .Values.webhook.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Secret holding the webhook's serving certificate (self-managed or cert-manager). */}}
{{- define "kvfleet.webhook.tlsSecretName" -}}
{{- printf "%s-tls" (include "kvfleet.webhook.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of the ValidatingWebhookConfiguration (cluster-scoped: carries the release namespace). */}}
{{- define "kvfleet.webhook.configurationName" -}}
{{- printf "%s-%s" (include "kvfleet.webhook.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of the controller's leader-election Lease. */}}
{{- define "kvfleet.controller.leaseName" -}}
{{- include "kvfleet.controller.fullname" . -}}
{{- end -}}

{{/* Name of the cert-manager Certificate. */}}
{{- define "kvfleet.webhook.certificateName" -}}
{{- include "kvfleet.webhook.fullname" . -}}
{{- end -}}

{{/* Namespaces the webhook does not check: the configured ones plus the release namespace. */}}
{{- define "kvfleet.webhook.excludedNamespaces" -}}
{{- $ns := concat .Values.webhook.excludedNamespaces (list .Release.Namespace) | uniq -}}
{{- toYaml $ns -}}
{{- end -}}
