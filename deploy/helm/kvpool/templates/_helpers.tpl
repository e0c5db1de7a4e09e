{{/* Where the nodes and the engines meet etcd (cluster membership). */}}
{{- define "kvpool.etcdUrl" -}}
http://kvpool-etcd.{{ .Values.namespace }}.svc:2379
{{- end }}

{{/* The vLLM command of an engine with kvpool's connector in the given role. */}}
{{- define "kvpool.vllmArgs" -}}
pip install kvpool && vllm serve {{ .model }} --port 8000 --kv-transfer-config '{"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm", "kv_role": "{{ .role }}", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {}}'
{{- end }}

{{/* What an engine pod needs of its server's node: who it is, where the node is. */}}
{{- define "kvpool.engineEnv" -}}
- {name: KVPOOL_NODE_NAME, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
- {name: KVPOOL_HOST_ID, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
- name: KVPOOL_ADDRESS
  value: unix:{{ .Values.node.runDir }}/$(KVPOOL_NODE_NAME)/kvpool.sock
{{- end }}
