package k8sclient

import (
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
)

// Label names of the client's metrics.
const (
	labelVerb     = "verb"
	labelResource = "resource"
	labelCode     = "code"
	labelReason   = "reason"
)

// codeNoAnswer is the code label of a request that got no HTTP answer,
// as client-go's own metrics name it.
const codeNoAnswer = "<error>"

// requestMetrics records every request made through RESTConfig's
// transport and the client's own:
//
//   - identityd_k8s_requests_total{verb,resource,code}
//   - identityd_k8s_operations_duration_seconds{verb,resource,outcome}
//   - identityd_k8s_errors_total{verb,resource,reason}: requests that got
//     no answer, or one that says the server or the credentials failed
//     (401, 403, 429, 5xx); not the answers a caller handles (404, 409,
//     410, 422).
//
// These are the counterparts of the kvstore's requests, operations
// duration and quorum errors.
type requestMetrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
	errors   *prometheus.CounterVec
}

func newRequestMetrics() *requestMetrics {
	ns := metrics.Namespace
	return &requestMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns,
			Name:      "k8s_requests_total",
			Help:      "Number of Kubernetes API requests this node sent, by verb, resource and HTTP status code (<error> when no answer came)",
		}, []string{labelVerb, labelResource, labelCode}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns,
			Name:      "k8s_operations_duration_seconds",
			Help:      "Duration of Kubernetes API requests until the answer's headers, by verb, resource and outcome",
			// 0.5ms to about 16s: a create on an idle server to one
			// waiting out the API server's flow control.
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}, []string{labelVerb, labelResource, metrics.LabelOutcome}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns,
			Name:      "k8s_errors_total",
			Help:      "Number of Kubernetes API requests that got no answer or one that the server or the credentials failed (401, 403, 429, 5xx), by verb, resource and reason",
		}, []string{labelVerb, labelResource, labelReason}),
	}
}

func (m *requestMetrics) observe(verb, resource string, code int, err error, d time.Duration) {
	codeLabel, outcome, reason := codeNoAnswer, metrics.OutcomeFailure, ""
	if err != nil {
		reason = errorReason(err)
	} else {
		codeLabel = strconv.Itoa(code)
		switch {
		case code == http.StatusUnauthorized:
			reason = reasonUnauthorized
		case code == http.StatusForbidden:
			reason = reasonForbidden
		case code == http.StatusTooManyRequests:
			reason = reasonThrottled
		case code >= 500:
			reason = reasonServerError
		}
		// A 404 or a 409 is an answer the caller expects to handle; the
		// outcome says whether the request did what was asked.
		if code < 400 {
			outcome = metrics.OutcomeSuccess
		}
	}
	m.requests.WithLabelValues(verb, resource, codeLabel).Inc()
	m.duration.WithLabelValues(verb, resource, outcome).Observe(d.Seconds())
	if reason != "" {
		m.errors.WithLabelValues(verb, resource, reason).Inc()
	}
}

// newClientMetrics contributes the client's collector: the request metrics
// and whether the API server answered the last request; nothing when the
// client is not needed (nil). A scrape sends no request.
func newClientMetrics(c *Client) metrics.CollectorOut {
	if c == nil {
		return metrics.CollectorOut{}
	}
	connected := metrics.NewDesc("k8s_connected",
		"1 when the last Kubernetes API request got an answer from a serving API server (not 401 or 5xx), else 0")
	return metrics.NewCollector(metrics.NewScrapeCollector(func(m metrics.Scrape) {
		m.Gauge(connected, metrics.BoolValue(serverState(c.stateNow.Load()) == stateAnswering))
	}, connected).Include(c.metrics.requests, c.metrics.duration, c.metrics.errors))
}
