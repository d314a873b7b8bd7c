{{/*
The chart name, or .Values.nameOverride (63 characters at most: a label value).
*/}}
{{- define "rolegate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name: .Values.fullnameOverride, else the release name when it
contains the chart name, else "<release>-<chart name>"; 63 characters at most.
*/}}
{{- define "rolegate.fullname" -}}
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

{{/*
The chart label value: "<name>-<version>".
*/}}
{{- define "rolegate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The ConfigMap the operator writes and the proxies watch (created by the operator, not
by Helm, so `helm upgrade` never overwrites a compiled configuration).
*/}}
{{- define "rolegate.configMapName" -}}
{{- printf "%s-config" (include "rolegate.fullname" .) }}
{{- end }}

{{/*
Selector labels of one component: the stable subset, never changed by an upgrade.
Call with (dict "root" $ "component" "proxy").
*/}}
{{- define "rolegate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rolegate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
The standard labels of one component's objects. Call with (dict "root" $ "component" "proxy").
*/}}
{{- define "rolegate.labels" -}}
{{ include "rolegate.selectorLabels" . }}
app.kubernetes.io/version: {{ regexReplaceAll "[^A-Za-z0-9._-]" (.root.Values.image.tag | default .root.Chart.AppVersion) "_" | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/part-of: rolegate
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ include "rolegate.chart" .root }}
{{- end }}

{{/*
The namespaces watched, as a JSON list: .Values.watchNamespaces, or the release namespace.
*/}}
{{- define "rolegate.watchNamespaces" -}}
{{- if .Values.watchNamespaces }}
{{- .Values.watchNamespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{/*
Every namespace the chart writes Roles to: the release namespace (the ConfigMap's), then
each watched namespace.
*/}}
{{- define "rolegate.rbacNamespaces" -}}
{{- $watched := include "rolegate.watchNamespaces" . | fromJsonArray }}
{{- prepend $watched .Release.Namespace | uniq | toJson }}
{{- end }}

{{/*
The image reference.
*/}}
{{- define "rolegate.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
The pod-level security context: the restricted Pod Security profile.
*/}}
{{- define "rolegate.podSecurityContext" -}}
runAsNonRoot: true
{{- with .Values.securityContext.runAsUser }}
runAsUser: {{ . | int64 }}
{{- end }}
{{- with .Values.securityContext.runAsGroup }}
runAsGroup: {{ . | int64 }}
fsGroup: {{ . | int64 }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
The container-level security context: the restricted Pod Security profile, plus a
read-only root filesystem (the pods write only to the /tmp emptyDir).
*/}}
{{- define "rolegate.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
The fewest proxy pods there will be: replicas, or the autoscaler's minReplicas.
*/}}
{{- define "rolegate.proxyMinReplicas" -}}
{{- if .Values.proxy.autoscaling.enabled }}
{{- .Values.proxy.autoscaling.minReplicas | int64 }}
{{- else }}
{{- .Values.proxy.replicas | int64 }}
{{- end }}
{{- end }}

{{/*
NetworkPolicy: the egress rules every rolegate pod needs, DNS and the Kubernetes API
server (the proxy's ConfigMap watch and status writes, the operator's everything).
*/}}
{{- define "rolegate.networkPolicy.clusterEgress" -}}
{{- $np := .Values.networkPolicy }}
{{- $dns := list }}
{{- $resolver := dict }}
{{- with $np.dns.namespaceSelector }}{{ $_ := set $resolver "namespaceSelector" . }}{{ end }}
{{- with $np.dns.podSelector }}{{ $_ := set $resolver "podSelector" . }}{{ end }}
{{- if $resolver }}{{ $dns = append $dns $resolver }}{{ end }}
{{- $dns = concat $dns ($np.dns.extraPeers | default list) }}
{{- if not $dns }}
{{- fail "networkPolicy.dns: name the resolver (namespaceSelector, podSelector or extraPeers); without one, no name would resolve" }}
{{- end }}
# DNS: the cluster's resolver, UDP and TCP 53.
- to:
    {{- toYaml $dns | nindent 4 }}
  ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
# The Kubernetes API server, at the addresses the pod's packets reach (after the
# `kubernetes` Service's translation: its endpoints, usually port 6443).
- to:
    {{- range $np.apiServer.cidrs }}
    - ipBlock:
        cidr: {{ . | quote }}
    {{- end }}
  ports:
    {{- range $np.apiServer.ports }}
    - port: {{ . | int64 }}
      protocol: TCP
    {{- end }}
{{- end }}

{{/*
NetworkPolicy: the peers admitted to the metrics and health ports, as a JSON list
(networkPolicy.metricsFrom). An empty list means no rule at all: a rule without peers
would admit everyone.
*/}}
{{- define "rolegate.networkPolicy.metricsPeers" -}}
{{- $from := .Values.networkPolicy.metricsFrom }}
{{- $peers := list }}
{{- with $from.namespaceSelector }}{{ $peers = append $peers (dict "namespaceSelector" .) }}{{ end }}
{{- concat $peers ($from.extraPeers | default list) | toJson }}
{{- end }}

{{/*
PromQL label matchers selecting one component's series in the alert rules: the values'
prometheusRule.<component>Selector, else the job the chart's ServiceMonitor gives them
(the Service's name) in the release namespace. Call with (dict "root" $ "component" "proxy").
*/}}
{{- define "rolegate.metricsSelector" -}}
{{- $given := get .root.Values.prometheusRule (printf "%sSelector" .component) }}
{{- $given | default (printf "job=%q,namespace=%q" (printf "%s-%s" (include "rolegate.fullname" .root) .component) .root.Release.Namespace) }}
{{- end }}
