// Command kubeapiserver is Kubernetes' kube-apiserver (k8s.io/kubernetes
// cmd/kube-apiserver, of the version this module requires), which package
// k8stest builds and runs as a process so that tests talk to the API server
// a cluster runs: the core API (Namespaces, Pods, Nodes, Leases,
// ServiceAccounts and their tokens), RBAC with its own authorizer, and
// CustomResourceDefinitions.
//
// It is a module of its own: k8s.io/kubernetes is only usable with
// replace directives for its staging modules, which must not reach the
// go.mod of identityd or of a module that imports it. It takes
// kube-apiserver's flags.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	os.Exit(cli.Run(app.NewAPIServerCommand()))
}
