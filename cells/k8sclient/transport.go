package k8sclient

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// wrapTransport is the transport wrapper of RESTConfig: it bounds, counts
// and times every request.
func (c *Client) wrapTransport(rt http.RoundTripper) http.RoundTripper {
	return &instrumentedTransport{next: rt, client: c}
}

// instrumentedTransport records each request's verb, resource, code and
// duration (to the answer's headers: for a watch, until it is
// established) and gives every request but watches --k8s-request-timeout.
type instrumentedTransport struct {
	next   http.RoundTripper
	client *Client
}

// WrappedRoundTripper lets client-go reach the transport below, to close
// its idle connections.
func (t *instrumentedTransport) WrappedRoundTripper() http.RoundTripper { return t.next }

// RoundTrip implements http.RoundTripper.
func (t *instrumentedTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	c := t.client
	c.mu.Lock()
	prefix := c.prefix
	c.mu.Unlock()
	verb, resource := requestInfo(req.Method, strings.TrimPrefix(req.URL.Path, prefix), req.URL.RawQuery)
	var cancel context.CancelFunc
	if verb != "watch" {
		// A watch lasts until the server ends it (its timeoutSeconds); any
		// other request that outlives the timeout is stuck.
		var ctx context.Context
		ctx, cancel = context.WithTimeout(req.Context(), c.cfg.K8sRequestTimeout)
		req = req.WithContext(ctx)
	}
	start := time.Now()
	resp, err := t.next.RoundTrip(req)
	code := 0
	if err == nil {
		code = resp.StatusCode
	}
	c.metrics.observe(verb, resource, code, err, time.Since(start))
	c.record(code, err)
	if cancel != nil {
		if err != nil || resp.Body == nil {
			cancel()
		} else {
			// The timeout covers reading the body too, as
			// http.Client.Timeout does; its timer ends with the body.
			resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: cancel}
		}
	}
	return resp, err
}

type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (b *cancelOnClose) Close() error {
	err := b.ReadCloser.Close()
	b.cancel()
	return err
}

// requestInfo names a request as the API server's RequestInfo does: the
// Kubernetes verb (get, list, watch, create, update, patch, delete,
// deletecollection) and the resource as "resource.group" with
// "/subresource" (core resources have no group). Requests outside
// /api and /apis (/readyz, /version, /openapi/...) are named by their
// first path element and the HTTP method in lower case; discovery (/api,
// /apis, a group or version's document) is "/api" or "/apis". The names
// come from the client's own requests, so the label values stay few.
func requestInfo(method, path, rawQuery string) (verb, resource string) {
	parts := strings.Split(strings.Trim(path, "/"), "/")
	lower := strings.ToLower(method)
	var group string
	var rest []string
	switch {
	case parts[0] == "api" && len(parts) >= 2:
		rest = parts[2:]
	case parts[0] == "apis" && len(parts) >= 3:
		group, rest = parts[1], parts[3:]
	default:
		return lower, "/" + parts[0]
	}
	watch := false
	if len(rest) > 0 && rest[0] == "watch" {
		watch, rest = true, rest[1:]
	}
	if len(rest) == 0 {
		// The discovery document of a group version.
		return lower, "/" + parts[0]
	}
	// namespaces/<ns>/<resource>/...; namespaces/<ns>/status and
	// /finalize are subresources of the namespace itself.
	if rest[0] == "namespaces" && len(rest) > 2 && rest[2] != "status" && rest[2] != "finalize" {
		rest = rest[2:]
	}
	resource = rest[0]
	if group != "" {
		resource += "." + group
	}
	named := len(rest) > 1
	if len(rest) > 2 {
		resource += "/" + rest[2]
	}
	if !watch && method == http.MethodGet {
		for _, kv := range strings.Split(rawQuery, "&") {
			if k, v, _ := strings.Cut(kv, "="); k == "watch" {
				watch, _ = strconv.ParseBool(v)
			}
		}
	}
	switch {
	case watch:
		verb = "watch"
	case method == http.MethodGet && named:
		verb = "get"
	case method == http.MethodGet:
		verb = "list"
	case method == http.MethodPost:
		verb = "create"
	case method == http.MethodPut:
		verb = "update"
	case method == http.MethodPatch:
		verb = "patch"
	case method == http.MethodDelete && named:
		verb = "delete"
	case method == http.MethodDelete:
		verb = "deletecollection"
	default:
		verb = lower
	}
	return verb, resource
}
