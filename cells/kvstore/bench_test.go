package kvstore_test

import (
	"testing"

	"github.com/identityd/identityd/internal/etcdtest"
)

// BenchmarkRawTxn measures the etcd server's rate of the reference
// conditional transaction (compare CreateRevision == 0 on a new key, put
// two keys) with no identityd code involved: the ceiling other benchmarks
// of global identity allocation are compared with.
func BenchmarkRawTxn(b *testing.B) {
	etcd := etcdtest.StartSingle(b)
	cli := etcd.Client(b)
	b.Run("sequential", func(b *testing.B) {
		etcdtest.BenchRawTxn(b, cli, "bench/seq", 1)
	})
	b.Run("goroutines=8", func(b *testing.B) {
		etcdtest.BenchRawTxn(b, cli, "bench/par", 8)
	})
}

// BenchmarkEmbeddedRawTxn is BenchmarkRawTxn on the embedded etcd through
// the agent's client: what the TLS of its listeners costs a request.
func BenchmarkEmbeddedRawTxn(b *testing.B) {
	cli := startNode(b, nil, nil).client.Client()
	b.Run("sequential", func(b *testing.B) {
		etcdtest.BenchRawTxn(b, cli, "bench/seq", 1)
	})
	b.Run("goroutines=8", func(b *testing.B) {
		etcdtest.BenchRawTxn(b, cli, "bench/par", 8)
	})
}
