package kvstore

import (
	"strings"
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
}

func newRequestMetrics() *requestMetrics {
	return &requestMetrics{
		duration: metrics.NewKVStoreOperationsDuration(),
		quorum:   metrics.NewKVStoreQuorumErrors(),
	}
}

type clientOut struct {
	cell.Out
	Client     *Client
	Collectors []prometheus.Collector `group:"identityd-metrics,flatten"`
}

func (m *requestMetrics) observe(method string, req any, err error, d time.Duration) {
	if m == nil {
		return
	}
	method = strings.TrimPrefix(method, "/etcdserverpb.")
	kind, action, _ := strings.Cut(method, "/")
	outcome := metrics.OutcomeSuccess
	if err != nil {
		outcome = metrics.OutcomeFailure
		if isQuorumError(err) {
			m.quorum.WithLabelValues(rpctypes.ErrorDesc(err)).Inc()
		}
	}
	m.duration.WithLabelValues(keyScope(req), kind, action, outcome).Observe(d.Seconds())
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
// its (first) key, so that the label has few values.
func keyScope(req any) string {
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
	if len(key) == 0 {
		return ""
	}
	parts := strings.SplitN(string(key), "/", 4)
	return strings.Join(parts[:min(3, len(parts))], "/")
}
