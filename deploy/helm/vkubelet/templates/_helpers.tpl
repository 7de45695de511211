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
{{- $remoteFleet := and (eq .Values.provider "vm") (not .Values.agentConfig.nodes) .Values.providerConfig.hosts -}}
{{- range $names -}}
{{- if and (eq . "vm") (not $remoteFleet) -}}
{{- fail "provider vm: the chart does not run VMs in its pod. QEMU in the agent's container would count guest memory against its limit, die with every agent restart and go unreaped, and a replica on another host would boot the VMs afresh without their disks. Run the vm provider as a service on each hypervisor host instead (docs/host-install.md), or have the chart drive libvirt hosts over qemu+ssh: providerConfig.hosts (deploy/helm/vkubelet/README.md)" -}}
{{- end -}}
{{- if not (has . (list "mock" "ssh" "cluster" "vm")) -}}
{{- fail (printf "provider %q: expected one of mock, ssh, cluster, vm" .) -}}
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

{{/* The vm mode: a fleet of libvirt hosts over SSH, checked before anything is rendered. */}}
{{- define "vkubelet.vmFleetChecks" -}}
{{- range $i, $host := .Values.providerConfig.hosts -}}
{{- if not (regexMatch "^qemu\\+(ssh|libssh|libssh2|tls)://[^/]+/" (toString $host.uri)) -}}
{{- fail (printf "providerConfig.hosts[%d].uri: %q: the agent's pod has no libvirt daemon of its own; name a remote one (qemu+ssh://root@hv-1/system)" $i (toString $host.uri)) -}}
{{- end -}}
{{- if and $host.migrationURI (not (regexMatch "^[a-z0-9+]+://[^/?]+/" (toString $host.migrationURI))) -}}
{{- fail (printf "providerConfig.hosts[%d].migrationURI: %q: the other hosts' libvirt daemons reach this host's with it (a live migration): name this host, with a key on those hosts (qemu+libssh://root@hv-1/system?keyfile=/etc/vkubelet/migrate.key)" $i (toString $host.migrationURI)) -}}
{{- end -}}
{{- if and (not $.Values.vm.knownHosts) (not $host.noVerify) -}}
{{- fail (printf "providerConfig.hosts[%d]: vm.knownHosts is empty, so ssh cannot verify host %q: give its key in vm.knownHosts, or set noVerify: true on the host (not verified: see the chart's README)" $i (toString $host.name)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The provider config's content; the mock provider's has a default (one node); the vm
     fleet's state is in the agent's state volume and its machine GC lists VirtualMachines as
     the pod's ServiceAccount (no kubeconfig), unless the config says otherwise. */}}
{{- define "vkubelet.providerConfig" -}}
{{- if and (eq .Values.provider "vm") .Values.providerConfig.hosts -}}
{{- include "vkubelet.vmFleetChecks" . -}}
{{- $defaults := dict "stateDir" "/var/lib/vkubelet/vm" -}}
{{- if .Values.vm.machineGC.enabled -}}
{{- $_ := set $defaults "machineGC" (dict "intervalSeconds" .Values.vm.machineGC.intervalSeconds) -}}
{{- end -}}
{{- toYaml (merge (deepCopy .Values.providerConfig) $defaults) -}}
{{- else if .Values.providerConfig -}}
{{- toYaml .Values.providerConfig -}}
{{- else if eq .Values.provider "mock" -}}
{{- toYaml (dict .Values.nodeName (dict "cpu" "8" "memory" "32Gi" "pods" "110")) -}}
{{- end -}}
{{- end -}}

{{/* The RBAC rules only some providers need, beyond a node's: granted to whoever the agent
     acts as (`identity`). */}}
{{- define "vkubelet.providerRules" -}}
{{- $providers := splitList "," (include "vkubelet.providers" .) }}
{{- $webhook := and (has "cluster" $providers) .Values.cluster.webhook }}
  {{- if has "cluster" $providers }}
  # The cluster provider: the upper cluster's identity (kube-system's UID stamps lower objects).
  - apiGroups: [""]
    resources: [namespaces]
    resourceNames: [kube-system]
    verbs: [get]
  # The cluster provider: every ready endpoint of a Service reflected below, from the upper
  # EndpointSlices (a system:node identity may not read them).
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, watch]
  {{- end }}
  {{- if $webhook }}
  # The constraint webhook: its configuration (server-side apply), and the audit of pods
  # admitted without it.
  - apiGroups: [admissionregistration.k8s.io]
    resources: [mutatingwebhookconfigurations]
    verbs: [create, patch]
  - apiGroups: [""]
    resources: [namespaces]
    verbs: [list]
  {{- end }}
{{- end -}}

{{/* The node a node identity is for: `nodeName`, or the one node of `agentConfig`. A node
     identity is one node's: a fleet (ssh, several nodes) needs `identity: serviceAccount`. */}}
{{- define "vkubelet.nodeIdentityName" -}}
{{- $providers := splitList "," (include "vkubelet.providers" .) -}}
{{- $nodes := .Values.agentConfig.nodes | default list -}}
{{- if or (has "ssh" $providers) (has "vm" $providers) (gt (len $nodes) 1) -}}
{{- fail "identity: node is one node's identity (system:node:<name>); a fleet of nodes (provider ssh or vm, or several agentConfig nodes) needs identity: serviceAccount (docs/deploy.md)" -}}
{{- end -}}
{{- $name := .Values.nodeName -}}
{{- if $nodes -}}{{- $name = (index $nodes 0).name -}}{{- end -}}
{{- if not $name -}}
{{- fail "identity: node needs the node's name: set nodeName" -}}
{{- end -}}
{{- if .Values.servingCertificate.approveOwnCSRs -}}
{{- fail "servingCertificate.approveOwnCSRs: a node identity may not approve its own serving certificate; approve its CSR, name a TLS Secret in servingCertificate.secretName, or use identity: serviceAccount (docs/deploy.md)" -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* Who the agent acts as, as an RBAC subject: the node's own identity (which the Node
     authorizer limits to what its pods reference), or the chart's ServiceAccount. */}}
{{- define "vkubelet.agentSubject" -}}
{{- if eq .Values.identity "node" -}}
- apiGroup: rbac.authorization.k8s.io
  kind: User
  name: system:node:{{ include "vkubelet.nodeIdentityName" . }}
{{- else -}}
- kind: ServiceAccount
  name: {{ include "vkubelet.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end -}}
{{- end -}}

{{/* The vm fleet: the chart's agent drives libvirt hosts (the only vm mode it renders). */}}
{{- define "vkubelet.vmFleet" -}}
{{- if has "vm" (splitList "," (include "vkubelet.providers" .)) -}}true{{- end -}}
{{- end -}}
