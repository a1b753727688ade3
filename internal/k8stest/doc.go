// Package k8stest runs a real Kubernetes API server as a separate process
// for tests: the apiextensions-apiserver of this module's
// k8s.io/apiextensions-apiserver version, which serves
// CustomResourceDefinitions and their objects with the same storage,
// validation, watch and conflict handling as a cluster's kube-apiserver,
// backed by a real etcd (internal/etcdtest).
//
// The server binary is built once from the module (see Binary) and cached
// under the user cache directory, like the etcd servers. Each Server has
// its own certificates: the server's for 127.0.0.1, and client certificates
// signed by the same CA, the admin's in group system:masters, which the
// server's authorizer allows everything; any other user (UserKubeconfig) is
// forbidden every request. A server can be stopped, killed and restarted on
// the same port with the same certificates, so clients made before keep
// working, to test what clients do when the API server goes away.
//
// The standalone server has no core API (no namespaces, leases or other
// built-in resources; /api lists no versions), and runs no admission
// webhooks or priority and fairness. Discovery works: /apis lists
// apiextensions.k8s.io and the groups of the established CRDs. The admin can
// read the server's /metrics, which count requests by verb, resource and
// code (apiserver_request_total).
//
//	s := k8stest.Start(t)
//	k8stest.InstallCRD(t, s.RESTConfig(), crd)
//	s.Restart(t)
//
// Every process is killed when the test ends; the server's log is printed
// through the test's log only when the test failed.
package k8stest
