{{- define "vkubelet.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vkubelet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vkubelet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vkubelet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vkubelet.labels" -}}
{{ include "vkubelet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
vkubelet.io/provider: {{ include "vkubelet.provider" . }}
{{- end -}}

{{- define "vkubelet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "vkubelet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The providers whose RBAC this release needs: the one of `provider`, or every one named in
     agentConfig.nodes. */}}
{{- define "vkubelet.providers" -}}
{{- $names := list -}}
{{- if .Values.agentConfig.nodes -}}
{{- range .Values.agentConfig.nodes -}}{{- $names = append $names .provider -}}{{- end -}}
{{- else -}}
{{- $names = list .Values.provider -}}
{{- end -}}
{{- range $names -}}
{{- if eq . "vm" -}}
{{- fail "provider vm: the chart does not run VMs. QEMU in the agent's container would count guest memory against its limit, die with every agent restart and go unreaped, and a replica on another host would boot the VMs afresh without their disks. Run the vm provider as a service on each hypervisor host instead: docs/host-install.md" -}}
{{- end -}}
{{- if not (has . (list "mock" "ssh" "cluster")) -}}
{{- fail (printf "provider %q: expected one of mock, ssh, cluster (vm: docs/host-install.md)" .) -}}
{{- end -}}
{{- end -}}
{{- $names | uniq | sortAlpha | join "," -}}
{{- end -}}

{{- define "vkubelet.provider" -}}
{{- include "vkubelet.providers" . | replace "," "-" -}}
{{- end -}}

{{- define "vkubelet.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The provider config's file name: mock's format is JSON, the others' YAML. */}}
{{- define "vkubelet.providerConfigFile" -}}
{{- if eq .Values.provider "mock" -}}provider.json{{- else -}}provider.yaml{{- end -}}
{{- end -}}

{{- define "vkubelet.secretName" -}}
{{- default (printf "%s-files" (include "vkubelet.fullname" .)) .Values.existingSecret -}}
{{- end -}}

{{- define "vkubelet.hasSecret" -}}
{{- if or .Values.existingSecret .Values.secretFiles -}}true{{- end -}}
{{- end -}}

{{/* The provider config's content; the mock provider's has a default (one node). */}}
{{- define "vkubelet.providerConfig" -}}
{{- if .Values.providerConfig -}}
{{- toYaml .Values.providerConfig -}}
{{- else if eq .Values.provider "mock" -}}
{{- toYaml (dict .Values.nodeName (dict "cpu" "8" "memory" "32Gi" "pods" "110")) -}}
{{- end -}}
{{- end -}}
