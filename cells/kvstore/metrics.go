package kvstore

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/prometheus/client_golang/prometheus"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/identityd/identityd/cells/metrics"
)

// requestMetrics records every etcd request the client makes:
// identityd_kvstore_operations_duration_seconds{scope,kind,action,outcome}
// with scope the key space (the first three elements of the key, e.g.
// "cilium/state/identities"), kind the gRPC service (KV, Lease, ...), action
// the call (Txn, Range, Put, ...); and identityd_kvstore_quorum_errors_total
// for requests etcd refused for lack of a leader or quorum.
type requestMetrics struct {
	duration *prometheus.HistogramVec
	quorum   *prometheus.CounterVec

	// observers caches the histogram's children by method, then scope,
	// then outcome: the label hashing and the child lookup of
	// WithLabelValues would otherwise run on every request.
	mu        sync.RWMutex
	observers map[string]map[string]*[2]prometheus.Observer
}

func newRequestMetrics() *requestMetrics {
	return &requestMetrics{
		duration:  metrics.NewKVStoreOperationsDuration(),
		quorum:    metrics.NewKVStoreQuorumErrors(),
		observers: map[string]map[string]*[2]prometheus.Observer{},
	}
}

func (m *requestMetrics) observe(method string, req any, err error, d time.Duration) {
	if m == nil {
		return
	}
	failed := 0
	if err != nil {
		failed = 1
		if isQuorumError(err) {
			m.quorum.WithLabelValues(rpctypes.ErrorDesc(err)).Inc()
		}
	}
	m.observer(method, keyScope(req))[failed].Observe(d.Seconds())
}

// observer returns the histogram children of a method and key scope, for
// success and failure.
func (m *requestMetrics) observer(method string, scope []byte) *[2]prometheus.Observer {
	m.mu.RLock()
	// Indexing with string(scope) does not allocate.
	obs := m.observers[method][string(scope)]
	m.mu.RUnlock()
	if obs != nil {
		return obs
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	byScope := m.observers[method]
	if byScope == nil {
		byScope = map[string]*[2]prometheus.Observer{}
		m.observers[method] = byScope
	}
	if obs = byScope[string(scope)]; obs == nil {
		kind, action, _ := strings.Cut(strings.TrimPrefix(method, "/etcdserverpb."), "/")
		obs = &[2]prometheus.Observer{
			m.duration.WithLabelValues(string(scope), kind, action, metrics.OutcomeSuccess),
			m.duration.WithLabelValues(string(scope), kind, action, metrics.OutcomeFailure),
		}
		byScope[string(scope)] = obs
	}
	return obs
}

// quorumErrors are etcd's answers when it cannot reach agreement.
var quorumErrors = []error{
	rpctypes.ErrGRPCNoLeader,
	rpctypes.ErrGRPCTimeout,
	rpctypes.ErrGRPCTimeoutDueToLeaderFail,
	rpctypes.ErrGRPCTimeoutDueToConnectionLost,
	rpctypes.ErrGRPCLeaderChanged,
}

func isQuorumError(err error) bool {
	desc := rpctypes.ErrorDesc(err)
	for _, q := range quorumErrors {
		if desc == rpctypes.ErrorDesc(q) {
			return true
		}
	}
	return false
}

// keyScope names the key space of a request by the first three elements of
// its (first) key, so that the label has few values. It returns a part of
// the request's key.
func keyScope(req any) []byte {
	var key []byte
	switch r := req.(type) {
	case *pb.RangeRequest:
		key = r.Key
	case *pb.PutRequest:
		key = r.Key
	case *pb.DeleteRangeRequest:
		key = r.Key
	case *pb.TxnRequest:
		switch {
		case len(r.Compare) > 0:
			key = r.Compare[0].Key
		case len(r.Success) > 0:
			if p := r.Success[0].GetRequestPut(); p != nil {
				key = p.Key
			} else if d := r.Success[0].GetRequestDeleteRange(); d != nil {
				key = d.Key
			}
		}
	}
	end, slashes := len(key), 0
	for i, c := range key {
		if c == '/' {
			if slashes++; slashes == 3 {
				end = i
				break
			}
		}
	}
	return key[:end]
}

// newClientMetrics contributes the client's collector: the request
// histogram and quorum errors it records as requests happen, and the
// request counts and connectivity it reads at scrape time.
func newClientMetrics(lc cell.Lifecycle, c *Client) metrics.CollectorOut {
	if c == nil {
		// crd mode without endpoints: there is no client to report on.
		return metrics.CollectorOut{}
	}
	col := newClientCollector(c)
	// Appended after the client's hook (this needs the client), so the
	// scrapes' status requests begin once the client runs.
	lc.Append(col)
	return metrics.NewCollector(col)
}

// statusScrapeTimeout bounds the status requests of one scrape, so that an
// unreachable etcd makes the scrape slow, not stuck.
const statusScrapeTimeout = 5 * time.Second

// clientCollector reports the client's request metrics, its request counts
// and its connectivity. Each scrape sends one Status request per endpoint,
// which shows in the Status method's request count.
type clientCollector struct {
	*metrics.ScrapeCollector
	client *Client

	// run is the context of the client's run that the scrapes' status
	// requests derive from: from the start until the client's stop path
	// ends. nil before the start, when there is no connection to ask.
	run atomic.Pointer[runContext]
}

func newClientCollector(client *Client) *clientCollector {
	var (
		requests = metrics.NewDesc("kvstore_requests_total",
			"Number of etcd requests this node sent, by gRPC method (streams count once when opened; LeaseGrant counts lease creations and re-creations)",
			"method")
		connected = metrics.NewDesc("kvstore_connected",
			"1 when at least one etcd endpoint answered a status request during this scrape, else 0")
		endpoints = metrics.NewDesc("kvstore_endpoints",
			"Number of configured etcd endpoints, by whether they answered during this scrape",
			"state")
		lease = metrics.NewDesc("kvstore_lease_held",
			"1 when this node holds an etcd lease for its keys, else 0")
	)
	c := &clientCollector{client: client}
	c.ScrapeCollector = metrics.NewScrapeCollector(func(m metrics.Scrape) {
		st := c.status()
		up := st.Connected()
		m.Gauge(connected, metrics.BoolValue(up > 0))
		m.Gauge(endpoints, float64(up), "connected")
		m.Gauge(endpoints, float64(len(st.Endpoints)-up), "unreachable")
		m.Gauge(lease, metrics.BoolValue(st.LeaseID != 0))
		// Counts are read after the status requests so that those are in;
		// from the counters themselves, without RequestCounts' copy.
		client.counts.Range(func(method, n any) bool {
			m.Counter(requests, float64(n.(*atomic.Uint64).Load()), method.(string))
			return true
		})
	}, requests, connected, endpoints, lease).Include(client.metrics.duration, client.metrics.quorum)
	return c
}

// status asks every endpoint for its status within the scrape's bound.
func (c *clientCollector) status() Status {
	run := c.run.Load()
	if run == nil {
		// Before the start: no connection, every endpoint unreachable.
		return Status{Endpoints: make([]EndpointStatus, len(c.client.Endpoints()))}
	}
	ctx, cancel := context.WithTimeout(run.ctx, statusScrapeTimeout)
	defer cancel()
	return c.client.Status(ctx)
}

// runContext is one run of the client, as the scrapes see it.
type runContext struct {
	ctx    context.Context
	cancel context.CancelFunc
}

// Start begins the run whose context bounds the scrapes' status requests.
// The start context ends when the start is over, so the run keeps only
// its values.
func (c *clientCollector) Start(ctx cell.HookContext) error {
	run, cancel := context.WithCancel(context.WithoutCancel(ctx))
	c.run.Store(&runContext{run, cancel})
	return nil
}

// Stop ends the run with the client's stop path (its StopBudget), not at
// once: this hook stops before the client's, and until the client has
// stopped a scrape still reports what etcd answers, as the metrics
// endpoint serves while the other cells stop.
func (c *clientCollector) Stop(cell.HookContext) error {
	if run := c.run.Load(); run != nil {
		context.AfterFunc(c.client.stop.Load().expired, run.cancel)
	}
	return nil
}
