package crdstore

import (
	"hash/fnv"
	"sync/atomic"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Nodes that allocate the same new label sets at the same moment (the pods
// of one deployment starting on several nodes) all create its object, and
// all but one meet AlreadyExists: each set costs the API server one create
// per racing node. While this node keeps losing such races, it lets the
// live nodes that rank before it for the label set (rendezvous hashing over
// the IdentityNode records) create the object first, and waits for the
// watch to bring it instead of sending its own create. The wait only orders
// the creates: the placement alone keeps a label set to one object, so a
// node that waits in vain creates as before.
const (
	// contentionLoss is what a create lost to another node's create of
	// the same label set adds to the score, or an object another node
	// created while this node waited; each create won takes one off.
	contentionLoss = 8
	// contentionOn is the score from which the waits apply;
	// contentionMax caps it, so that the waits end after a few dozen
	// creates won once the races stop.
	contentionOn  = 16
	contentionMax = 64
	// maxCreateDelay caps the wait before a create.
	maxCreateDelay = 100 * time.Millisecond
)

// contention tracks how often this node's creates race with other nodes'.
type contention struct {
	score atomic.Int32
	// createNanos is a moving average of the time a successful create
	// took: the step between two ranks' turns.
	createNanos atomic.Int64
}

// lost records a race lost to, or an object created by, another node.
func (c *contention) lost() {
	for {
		v := c.score.Load()
		n := min(v+contentionLoss, contentionMax)
		if v == n || c.score.CompareAndSwap(v, n) {
			return
		}
	}
}

// won records a create that succeeded after d.
func (c *contention) won(d time.Duration) {
	for {
		v := c.score.Load()
		if v == 0 || c.score.CompareAndSwap(v, v-1) {
			break
		}
	}
	old := c.createNanos.Load()
	if old == 0 {
		old = int64(d)
	}
	c.createNanos.Store(old - old/8 + int64(d)/8)
}

// createDelay is how long this node waits for the nodes that rank before
// it to create the object of key: none unless it has been losing races.
func (s *Store) createDelay(key string) time.Duration {
	if s.contention.score.Load() < contentionOn {
		return 0
	}
	rank := s.createRank(key)
	if rank == 0 {
		return 0
	}
	step := time.Duration(s.contention.createNanos.Load())*2 + 5*time.Millisecond
	return min(time.Duration(rank)*step, maxCreateDelay)
}

// createRank is the number of live nodes that rank before this one for
// key: the nodes are ordered by a hash of the label set and the node name,
// so each label set has its own order and every node computes the same. It
// reads the node cache in place: it runs before every create while the
// races last.
func (s *Store) createRank(key string) int {
	now := metav1.Now()
	mine := rendezvous(key, s.node)
	rank := 0
	s.nodes.mu.RLock()
	defer s.nodes.mu.RUnlock()
	for _, n := range s.nodes.byName {
		if n.Name != s.node && !n.Expired(now) && rendezvous(key, n.Name) < mine {
			rank++
		}
	}
	return rank
}

func rendezvous(key, node string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(key))
	h.Write([]byte{0})
	h.Write([]byte(node))
	return h.Sum64()
}
