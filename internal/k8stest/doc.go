// Package k8stest runs a real Kubernetes API server as a separate process
// for tests: kube-apiserver, built from k8s.io/kubernetes in a module of
// its own (kept in internal/k8stest/kubeapiserver), backed by a real etcd
// (internal/etcdtest). It serves what a cluster's API server serves: the
// core API (Namespaces, Pods and their status, Nodes, ServiceAccounts and
// their tokens through TokenRequest), coordination.k8s.io Leases, RBAC,
// and CustomResourceDefinitions and their objects, with the same storage,
// validation, watch and conflict handling.
//
// The server binary is built once from its module (see Binary) and cached
// under the user cache directory, like the etcd servers. Each Server has
// its own certificates: the server's for 127.0.0.1, and client certificates
// signed by the same CA, the admin's in group system:masters, which the
// server's authorizer allows everything. The authorizer is RBAC: any other
// user (UserKubeconfig), and a service account's token, may do only what
// the default roles give every authenticated user and what the roles bound
// to it grant. A server can be stopped, killed and restarted on the same
// port with the same certificates and service account key, so clients and
// tokens made before keep working, to test what clients do when the API
// server goes away.
//
// No controllers run (no kube-controller-manager, no kubelet): a deleted
// namespace stays Terminating, a pod bound to a node is deleted only with
// no grace period, and service accounts exist only when a test creates
// them (the ServiceAccount admission, which would require one named
// "default" for every pod, is off). The admin can read the server's
// /metrics, which count requests by verb, resource and code
// (apiserver_request_total).
//
//	s := k8stest.Start(t)
//	k8stest.InstallCRD(t, s.RESTConfig(), crd)
//	s.Restart(t)
//
// Every process is killed when the test ends; the server's log is printed
// through the test's log only when the test failed.
package k8stest
