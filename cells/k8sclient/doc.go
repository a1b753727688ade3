// Package k8sclient is the Kubernetes API client cell. It knows nothing of
// identities: it finds the API server and the credentials, checks at start
// that the server answers, paces, bounds, counts and times requests, and
// reports the server's state. The allocator's CRD store builds on it.
//
// # What it provides
//
// Cell provides *Client when the agent needs one: in an allocation mode
// that keeps identities in CRDs (crd, doublewrite-readkvstore,
// doublewrite-readcrd: identity.AllocationMode.UsesCRD),
// or when --k8s-kubeconfig-path or --k8s-api-server is set. Otherwise it
// provides nil, contributes no metrics, and reads no kubeconfig; users of
// the client that are optional take a nil *Client as "no Kubernetes". The
// flags are validated either way.
//
//   - RESTConfig() returns a copy of the resolved *rest.Config to build
//     typed, dynamic or informer clients from. Every request made through
//     it passes the client's transport wrapper (counted and timed, see
//     Metrics; bounded by --k8s-request-timeout unless it is a watch, which
//     the server ends itself) and the node's rate limiter, one token
//     bucket shared by every copy, so that --k8s-client-qps bounds the
//     node, not each client. With --k8s-client-qps 0 (the default) the
//     limiter never waits: client-go's own default for a zero QPS (5 per
//     second) would throttle the allocator far below the API server's
//     speed, and the API server's flow control (priority and fairness)
//     protects it anyway. RESTConfig is nil before the start hook ran
//     and after it failed.
//   - Status(ctx) asks /version and reports the server, where its settings
//     came from, the rate limit, the server's version and the last error.
//
// # Resolution of the API server
//
// As in Cilium, at start:
//
//  1. --k8s-kubeconfig-path: that file's current context; a
//     --k8s-api-server replaces its server. KUBECONFIG and ~/.kube/config
//     are not read.
//  2. else --k8s-api-server alone: an https URL in a pod (where
//     KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are set) uses the
//     pod's service account credentials; otherwise the URL alone, with no
//     credentials.
//  3. else the in-cluster config (the pod's service account).
//  4. else the start fails with ErrNoAPIServer, which names the flags.
//
// The start then asks /readyz until it answers ok, and /version, for at
// most --k8s-request-timeout (and the hook's deadline). /readyz is open to
// every client; /version needs credentials the server accepts (a 401
// otherwise) and, on a server that authorizes it, the right to read it (a
// 403 otherwise; Kubernetes grants it to every user through the
// system:public-info-viewer role). A TLS failure, a 401 or a 403 fails the
// start at once, a refused connection or a server not ready yet only when
// the time is up; the error names the server, where its settings came
// from, and the cause. Whether the user may use the resources of the cells
// built on the client is for those cells to check.
//
// # Health
//
// The module reports OK once the start's check passed. Afterwards every
// request's outcome keeps it in step: Degraded, marked health.External,
// after a request that got no answer (refused, TLS, timeout), a 401 or a
// 5xx; OK again after one that got any other answer (a 404 or a 409 is the
// server answering). A request the caller cancelled says nothing. In a hive
// with a job registry (job.Cell) and a health provider, the job
// k8s-connectivity asks /readyz every 5s (3s timeout) unless a request got
// an answer meanwhile, so that an idle node notices a lost server, and
// every second while the last request failed, so that it turns OK again
// within about a second of the server's return.
//
// # Metrics
//
//	identityd_k8s_requests_total{verb,resource,code}                counter
//	identityd_k8s_operations_duration_seconds{verb,resource,outcome} histogram
//	identityd_k8s_errors_total{verb,resource,reason}                counter
//	identityd_k8s_connected                                         gauge
//
// verb is the Kubernetes verb (get, list, watch, create, update, patch,
// delete, deletecollection), resource is "resource.group" with its
// "/subresource" (core resources without group), and, for requests outside
// /api and /apis, verb is the HTTP method in lower case and resource the
// first path element ("/readyz", "/version"); discovery is "/api" or
// "/apis". code is the HTTP status, "<error>" when no answer came. The
// duration runs until the answer's headers (a watch: until it is
// established); outcome is success below 400. reason is tls, refused,
// timeout, canceled or connection for requests without answer, and
// unauthorized (401), forbidden (403), throttled (429) or server_error
// (5xx). connected is 1 when the last request got an answer from a serving
// server. A scrape sends no request.
//
// # Flags
//
//	--k8s-kubeconfig-path  kubeconfig file (its current context)
//	--k8s-api-server       API server URL; replaces the kubeconfig's
//	--k8s-client-qps       requests per second from this node, 0 = no
//	                       client-side limit (default 0)
//	--k8s-client-burst     requests above the rate at once, 0 =
//	                       ceil(qps); needs --k8s-client-qps
//	--k8s-request-timeout  timeout of one request, watches excepted, and
//	                       of the start's check (default 30s)
//
// # Shell commands
//
//	k8s/status   server, settings source, connected, version, rate limit,
//	             request timeout, errors
package k8sclient
