{{/* Names are truncated to 63 characters (the DNS label limit). */}}
{{- define "trainmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trainmesh.fullname" -}}
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

{{/* A component's name: <fullname>-<suffix>, the fullname shortened so the whole fits 63. */}}
{{- define "trainmesh.componentName" -}}
{{- $suffix := .suffix }}
{{- $base := include "trainmesh.fullname" .ctx | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" }}
{{- printf "%s-%s" $base $suffix }}
{{- end }}

{{- define "trainmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trainmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "trainmesh.labels" -}}
helm.sh/chart: {{ include "trainmesh.chart" . }}
{{ include "trainmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* At most 50 characters: with the autoscaler on, KubeRay shortens the head pod's account name
to 50 (utils.CheckName) but binds its Role to the account it finds under the full name. */}}
{{- define "trainmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "trainmesh.fullname" . | trunc 50 | trimSuffix "-") .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "trainmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* A name KubeRay accepts for a RayCluster (at most 53) or RayJob (at most 47): a DNS-1035
label, which must start with a letter (KubeRay's validation.go refuses others). Args: ctx,
suffix, limit, what. */}}
{{- define "trainmesh.kuberayName" -}}
{{- $name := include "trainmesh.componentName" (dict "ctx" .ctx "suffix" .suffix) | trunc (int .limit) | trimSuffix "-" }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "%s name %q is not a DNS-1035 label (KubeRay refuses it: it must start with a letter); set fullnameOverride to a name that starts with a letter, or use such a release name" .what $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "trainmesh.clusterName" -}}
{{- include "trainmesh.kuberayName" (dict "ctx" . "suffix" "ray" "limit" 53 "what" "RayCluster") }}
{{- end }}

{{- define "trainmesh.jobName" -}}
{{- include "trainmesh.kuberayName" (dict "ctx" . "suffix" "job" "limit" 47 "what" "RayJob") }}
{{- end }}

{{/* rayStartParams as KubeRay wants them: strings, whole numbers without an exponent (a YAML
number arrives as a float, which toString writes as 1e+10 and `ray start` refuses). */}}
{{- define "trainmesh.startParams" -}}
{{- $out := dict }}
{{- range $k, $val := . }}
{{- if and (kindIs "float64" $val) (eq (float64 (int64 $val)) $val) }}
{{- $_ := set $out $k (printf "%d" (int64 $val)) }}
{{- else }}
{{- $_ := set $out $k (toString $val) }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{- define "trainmesh.jobConfigMap" -}}
{{- include "trainmesh.componentName" (dict "ctx" . "suffix" "job") }}
{{- end }}

{{/* The Secret the Ray pods read MLFLOW_TRACKING_URI (and credentials) from. */}}
{{- define "trainmesh.mlflowSecretName" -}}
{{- if .Values.mlflow.enabled }}
{{- include "trainmesh.componentName" (dict "ctx" . "suffix" "mlflow") }}
{{- else }}
{{- required "mlflow.external.existingSecret: name a Secret with key 'uri' when mlflow.enabled is false" .Values.mlflow.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "trainmesh.mlflowEnv" -}}
- name: MLFLOW_TRACKING_URI
  valueFrom:
    secretKeyRef:
      name: {{ include "trainmesh.mlflowSecretName" . }}
      key: uri
- name: MLFLOW_TRACKING_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ include "trainmesh.mlflowSecretName" . }}
      key: username
      optional: true
- name: MLFLOW_TRACKING_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "trainmesh.mlflowSecretName" . }}
      key: password
      optional: true
{{- end }}

{{/* An S3-compatible object store for checkpoints and data, as the standard variables s3fs
reads in every process of the pod (the controller on the head, the ranks on the workers). */}}
{{- define "trainmesh.objectStoreEnv" -}}
{{- $o := .Values.objectStore }}
{{- with $o.endpoint }}
- name: FSSPEC_S3_ENDPOINT_URL
  value: {{ . | quote }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with $o.region }}
- name: AWS_DEFAULT_REGION
  value: {{ . | quote }}
{{- end }}
{{- with $o.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $o.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $o.secretAccessKeyKey }}
{{- end }}
{{- end }}

{{/* Volumes and mounts every Ray pod gets: /dev/shm in memory, shared storage, the job spec. */}}
{{- define "trainmesh.rayVolumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.rayCluster.workers.shmSize }}
{{- with .Values.sharedStorage.existingClaim }}
- name: shared
  persistentVolumeClaim:
    claimName: {{ . }}
{{- end }}
{{- if .Values.rayJob.enabled }}
- name: job-spec
  configMap:
    name: {{ include "trainmesh.jobConfigMap" . }}
{{- end }}
{{- end }}

{{- define "trainmesh.rayMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if .Values.sharedStorage.existingClaim }}
- name: shared
  mountPath: /mnt/trainmesh
{{- end }}
{{- if .Values.rayJob.enabled }}
- name: job-spec
  mountPath: /etc/trainmesh/jobs
  readOnly: true
{{- end }}
{{- end }}

{{/* The pod spec shared by the head and worker templates. Args: ctx, role, resources, env. */}}
{{- define "trainmesh.rayPod" -}}
{{- $v := .ctx.Values }}
metadata:
  labels:
    {{- include "trainmesh.labels" .ctx | nindent 4 }}
    app.kubernetes.io/component: ray-{{ .role }}
spec:
  serviceAccountName: {{ include "trainmesh.serviceAccountName" .ctx }}
  {{- /* The ServiceAccount mounts no token; the autoscaler in the head pod needs one. */}}
  automountServiceAccountToken: {{ .apiToken | default false }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- with .nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: ray-{{ .role }}
      image: {{ include "trainmesh.image" .ctx }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      securityContext:
        {{- toYaml $v.containerSecurityContext | nindent 8 }}
      {{- with .ports }}
      ports:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      resources:
        {{- toYaml .resources | nindent 8 }}
      env:
        {{- range $k, $val := .env }}
        - name: {{ $k }}
          value: {{ $val | quote }}
        {{- end }}
        {{- include "trainmesh.mlflowEnv" .ctx | nindent 8 }}
        {{- include "trainmesh.objectStoreEnv" .ctx | nindent 8 }}
      volumeMounts:
        {{- include "trainmesh.rayMounts" .ctx | nindent 8 }}
  volumes:
    {{- include "trainmesh.rayVolumes" .ctx | nindent 4 }}
{{- end }}

{{/* A KubeRay rayClusterSpec (RayCluster.spec and RayJob.spec.rayClusterSpec). */}}
{{- define "trainmesh.rayClusterSpec" -}}
{{- $rc := .Values.rayCluster }}
{{- $w := $rc.workers }}
{{- if not (and (le (int $w.minReplicas) (int $w.replicas)) (le (int $w.replicas) (int $w.maxReplicas))) }}
{{- fail (printf "rayCluster.workers: need minReplicas <= replicas <= maxReplicas, got %v, %v, %v; fix the three counts" $w.minReplicas $w.replicas $w.maxReplicas) }}
{{- end }}
{{- $account := include "trainmesh.serviceAccountName" . }}
{{- if and $rc.enableInTreeAutoscaling (or (gt (len $account) 50) (not (regexMatch "^[a-zA-Z]" $account))) }}
{{- fail (printf "serviceAccount.name %q: with rayCluster.enableInTreeAutoscaling KubeRay renames a ServiceAccount longer than 50 characters or not starting with a letter for the head pod, and that renamed account would not exist; use a shorter name starting with a letter" $account) }}
{{- end }}
{{- if and (not $rc.enableInTreeAutoscaling) (ne (int $w.minReplicas) (int $w.maxReplicas)) }}
{{- fail (printf "rayCluster.workers: minReplicas %v and maxReplicas %v differ but rayCluster.enableInTreeAutoscaling is false, so nothing would ever scale the workers; set enableInTreeAutoscaling: true or make the two equal" $w.minReplicas $w.maxReplicas) }}
{{- end }}
{{- $workerResources := deepCopy $w.resources }}
{{- if gt (int $w.gpusPerNode) 0 }}
{{- $_ := set $workerResources "requests" (merge (dict "nvidia.com/gpu" (toString $w.gpusPerNode)) (default dict $workerResources.requests)) }}
{{- $_ := set $workerResources "limits" (merge (dict "nvidia.com/gpu" (toString $w.gpusPerNode)) (default dict $workerResources.limits)) }}
{{- end }}
rayVersion: {{ $rc.rayVersion | quote }}
enableInTreeAutoscaling: {{ $rc.enableInTreeAutoscaling }}
{{- if $rc.enableInTreeAutoscaling }}
# The autoscaler container KubeRay adds to the head pod: restricted like every other container.
autoscalerOptions:
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
  resources:
    {{- toYaml $rc.autoscaler.resources | nindent 4 }}
{{- end }}
headGroupSpec:
  serviceType: {{ $rc.head.serviceType }}
  rayStartParams:
    {{- include "trainmesh.startParams" $rc.head.rayStartParams | nindent 4 }}
  template:
    {{- $ports := list (dict "containerPort" 6379 "name" "gcs") (dict "containerPort" 8265 "name" "dashboard") (dict "containerPort" 10001 "name" "client") }}
    {{- include "trainmesh.rayPod" (dict "ctx" . "role" "head" "resources" $rc.head.resources "env" dict "ports" $ports "nodeSelector" $rc.head.nodeSelector "tolerations" $rc.head.tolerations "apiToken" $rc.enableInTreeAutoscaling) | nindent 4 }}
workerGroupSpecs:
  - groupName: {{ $w.groupName }}
    replicas: {{ $w.replicas }}
    minReplicas: {{ $w.minReplicas }}
    maxReplicas: {{ $w.maxReplicas }}
    rayStartParams:
      {{- $wsp := deepCopy $w.rayStartParams }}
      {{- if gt (int $w.gpusPerNode) 0 }}
      {{- $_ := set $wsp "num-gpus" $w.gpusPerNode }}
      {{- end }}
      {{- include "trainmesh.startParams" $wsp | nindent 6 }}
    template:
      {{- include "trainmesh.rayPod" (dict "ctx" . "role" "worker" "resources" $workerResources "env" $w.ncclEnv "nodeSelector" $w.nodeSelector "tolerations" $w.tolerations) | nindent 6 }}
{{- end }}
