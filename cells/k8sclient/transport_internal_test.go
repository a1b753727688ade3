package k8sclient

import "testing"

func TestRequestInfo(t *testing.T) {
	for _, tt := range []struct {
		method, path, query string
		verb, resource      string
	}{
		{"GET", "/apis/cilium.io/v2/ciliumidentities/48213", "", "get", "ciliumidentities.cilium.io"},
		{"GET", "/apis/cilium.io/v2/ciliumidentities", "limit=500", "list", "ciliumidentities.cilium.io"},
		{"GET", "/apis/cilium.io/v2/ciliumidentities", "allowWatchBookmarks=true&resourceVersion=7&watch=true", "watch", "ciliumidentities.cilium.io"},
		{"GET", "/apis/cilium.io/v2/watch/ciliumidentities", "", "watch", "ciliumidentities.cilium.io"},
		{"GET", "/apis/cilium.io/v2/ciliumidentities", "watch=false", "list", "ciliumidentities.cilium.io"},
		{"POST", "/apis/cilium.io/v2/ciliumidentities", "", "create", "ciliumidentities.cilium.io"},
		{"PUT", "/apis/cilium.io/v2/ciliumidentities/1", "", "update", "ciliumidentities.cilium.io"},
		{"PATCH", "/apis/cilium.io/v2/ciliumidentities/1", "", "patch", "ciliumidentities.cilium.io"},
		{"DELETE", "/apis/cilium.io/v2/ciliumidentities/1", "", "delete", "ciliumidentities.cilium.io"},
		{"DELETE", "/apis/cilium.io/v2/ciliumidentities", "", "deletecollection", "ciliumidentities.cilium.io"},
		{"PUT", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/x.cilium.io/status", "", "update", "customresourcedefinitions.apiextensions.k8s.io/status"},
		{"GET", "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/node-1", "", "get", "leases.coordination.k8s.io"},
		{"GET", "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases", "", "list", "leases.coordination.k8s.io"},
		{"GET", "/api/v1/namespaces", "", "list", "namespaces"},
		{"GET", "/api/v1/namespaces/default", "", "get", "namespaces"},
		{"PUT", "/api/v1/namespaces/default/finalize", "", "update", "namespaces/finalize"},
		{"GET", "/api/v1/namespaces/default/pods/p/log", "", "get", "pods/log"},
		{"GET", "/api/v1/nodes/n1", "", "get", "nodes"},
		{"GET", "/api", "", "get", "/api"},
		{"GET", "/api/v1", "", "get", "/api"},
		{"GET", "/apis", "", "get", "/apis"},
		{"GET", "/apis/cilium.io", "", "get", "/apis"},
		{"GET", "/apis/cilium.io/v2", "", "get", "/apis"},
		{"GET", "/readyz", "", "get", "/readyz"},
		{"GET", "/version", "", "get", "/version"},
		{"GET", "/openapi/v3/apis/cilium.io/v2", "", "get", "/openapi"},
		{"GET", "/", "", "get", "/"},
	} {
		verb, resource := requestInfo(tt.method, tt.path, tt.query)
		if verb != tt.verb || resource != tt.resource {
			t.Errorf("%s %s?%s: got %s %s, want %s %s", tt.method, tt.path, tt.query, verb, resource, tt.verb, tt.resource)
		}
	}
}
