package crdstore

import (
	"hash/fnv"
	"math"
	"sync/atomic"
	"time"
)

// Nodes that allocate the same new label sets at the same moment (the pods
// of one deployment starting on several nodes) all create its object, and
// all but one meet AlreadyExists: each set costs the API server one create
// per racing node. While this node keeps losing such races, it takes a
// rank for each label set among the nodes it races with, drawn from a hash
// of the label set and its own name, and waits its rank's turn for the
// watch to bring the object before it sends its own create. The number of
// racers is estimated from this node's own outcomes (the share of the
// contended creates it won), so the rank needs no knowledge of the other
// nodes: its cost does not grow with the cluster, and a node that stopped
// stops racing, and counting, at once. The wait only orders the creates:
// the placement alone keeps a label set to one object, so a node that
// waits in vain creates as before.
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
	// maxRacers caps the estimate of the racing nodes.
	maxRacers = 64
	// shareUnit is the fixed-point unit of the lost share; shareWeight
	// the inverse weight of one outcome in its moving average.
	shareUnit   = 1 << 20
	shareWeight = 32
)

// contention tracks how often this node's creates race with other nodes'.
type contention struct {
	score atomic.Int32
	// createNanos is a moving average of the time a successful create
	// took: the step between two ranks' turns.
	createNanos atomic.Int64
	// lostShare is a moving average, in shareUnit, of the share of this
	// node's creates that another node's object settled (1 - the share
	// it won). The zero value is a node that won every create.
	lostShare atomic.Int64
}

// lost records a race lost to, or an object created by, another node.
func (c *contention) lost() {
	for {
		v := c.score.Load()
		n := min(v+contentionLoss, contentionMax)
		if v == n || c.score.CompareAndSwap(v, n) {
			break
		}
	}
	c.outcome(shareUnit)
}

// won records a create that succeeded after d.
func (c *contention) won(d time.Duration) {
	for {
		v := c.score.Load()
		if v == 0 || c.score.CompareAndSwap(v, v-1) {
			break
		}
	}
	c.outcome(0)
	old := c.createNanos.Load()
	if old == 0 {
		old = int64(d)
	}
	c.createNanos.Store(old - old/8 + int64(d)/8)
}

// outcome moves the lost share's average towards x.
func (c *contention) outcome(x int64) {
	for {
		v := c.lostShare.Load()
		if c.lostShare.CompareAndSwap(v, v+(x-v)/shareWeight) {
			return
		}
	}
}

// racers estimates how many nodes race for the label sets this node
// creates: the inverse of the share of creates it won, as each of k nodes
// that race fairly wins one in k.
func (c *contention) racers() float64 {
	won := float64(shareUnit-c.lostShare.Load()) / shareUnit
	if won*maxRacers <= 1 {
		return maxRacers
	}
	return max(1, 1/won)
}

// createRank is this node's turn for key among k racing nodes: u·k rounded
// down, u = a hash of the label set and this node's name in [0, 1). Each
// node draws its own, so no node needs to know the others; with k about
// the number of racers, one of them has the lowest rank alone in most
// races (TestCreateRankOneFirst).
func (s *Store) createRank(key string, k float64) int {
	u := float64(rendezvous(key, s.node)>>11) / (1 << 53)
	return int(math.Floor(u * k))
}

// createDelay is how long this node waits, before it creates the object of
// key, for the racers of lower rank to create it: none unless it has been
// losing races.
func (s *Store) createDelay(key string) time.Duration {
	c := &s.contention
	if c.score.Load() < contentionOn {
		return 0
	}
	rank := s.createRank(key, c.racers())
	if rank == 0 {
		return 0
	}
	step := time.Duration(c.createNanos.Load())*2 + 5*time.Millisecond
	return min(time.Duration(rank)*step, maxCreateDelay)
}

// rendezvous hashes a label set with a node name: FNV-1a, whose high bits
// barely change with the last bytes of the input (node-1, node-2), then
// MurmurHash3's finalizer, so that every bit of the result depends on all
// of them.
func rendezvous(key, node string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(key))
	h.Write([]byte{0})
	h.Write([]byte(node))
	x := h.Sum64()
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}
