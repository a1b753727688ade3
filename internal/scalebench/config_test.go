package scalebench

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/kvstore"
)

// config is one sweep's settings.
type config struct {
	nodes []int
	modes []string
	// identities is the number of global identities each node holds,
	// shared of which are label sets every node holds.
	identities, shared int
	window             time.Duration
	// churn is the rate of changes per node in the churn window: a
	// change releases the node's oldest own label set and allocates a
	// new one.
	churn      float64
	gcInterval time.Duration
	// warmup, when set, replaces the mode's own churn warm-up.
	warmup time.Duration
	// settle, when set, replaces the wait between the setup and the
	// steady window (a collection interval and 5s).
	settle time.Duration
}

// The nodes' timers. Both leases get the shortest TTL their stores accept;
// the periodic sync of the etcd store runs once per lease renewal (every
// third of the TTL), as at the defaults (5m with a 15m lease), and the
// collection interval is by default the lease TTL, as at the defaults (15m
// and 15m): every timer runs faster than at the defaults by one factor,
// timeScale (36). The heartbeat timeout of the CRD store's collector gets
// its minimum where only identityd nodes allocate (no Cilium agents run
// in the benchmark).
var (
	leaseTTL     = max(kvstore.MinLeaseTTL, crdstore.MinIdentityNodeLeaseTTL)
	syncInterval = leaseTTL / 3
	heartbeat    = crdstore.MinHeartbeatTimeout
)

// The defaults the extrapolation is made at.
var (
	defaultGCInterval = globalstore.DefaultConfig.IdentityGCInterval
	defaultLeaseTTL   = kvstore.DefaultConfig.KVStoreLeaseTTL
	defaultNodeLease  = crdstore.DefaultConfig.IdentityNodeLeaseTTL
	defaultSync       = etcdstore.DefaultConfig.KVStorePeriodicSync
)

const (
	defaultIdentities = 100
	defaultChurn      = 0.1
	// The extrapolation's cluster sizes.
	targetSmall, targetLarge = 1000, 5000
)

// loadConfig reads the SCALE_* variables over the sweep's defaults.
func loadConfig() (config, error) {
	c := config{
		nodes:      []int{8, 16, 32, 64, 128},
		modes:      []string{modeEtcd, modeCRD},
		identities: defaultIdentities,
		shared:     -1,
		window:     125 * time.Second,
		churn:      defaultChurn,
		gcInterval: time.Duration(float64(defaultGCInterval) / timeScale()),
	}
	var err error
	if v := os.Getenv("SCALE_NODES"); v != "" {
		c.nodes = nil
		for f := range strings.SplitSeq(v, ",") {
			n, perr := strconv.Atoi(strings.TrimSpace(f))
			if perr != nil || n < 1 {
				return c, fmt.Errorf("SCALE_NODES: %q is not a node count", f)
			}
			c.nodes = append(c.nodes, n)
		}
	}
	if v := os.Getenv("SCALE_MODES"); v != "" {
		c.modes = nil
		for f := range strings.SplitSeq(v, ",") {
			f = strings.TrimSpace(f)
			if f != modeEtcd && f != modeCRD {
				return c, fmt.Errorf("SCALE_MODES: %q is neither %s nor %s", f, modeEtcd, modeCRD)
			}
			c.modes = append(c.modes, f)
		}
	}
	if c.identities, err = envInt("SCALE_IDENTITIES", c.identities); err != nil {
		return c, err
	}
	if c.shared, err = envInt("SCALE_SHARED", c.shared); err != nil {
		return c, err
	}
	if c.shared < 0 {
		c.shared = c.identities / 10
	}
	if c.identities < 1 || c.shared > c.identities-1 {
		return c, fmt.Errorf("SCALE_IDENTITIES %d and SCALE_SHARED %d: a node needs at least one label set of its own", c.identities, c.shared)
	}
	if c.window, err = envDuration("SCALE_WINDOW", c.window); err != nil {
		return c, err
	}
	if c.gcInterval, err = envDuration("SCALE_GC_INTERVAL", c.gcInterval); err != nil {
		return c, err
	}
	if c.warmup, err = envDuration("SCALE_WARMUP", 0); err != nil {
		return c, err
	}
	if v := os.Getenv("SCALE_CHURN"); v != "" {
		if c.churn, err = strconv.ParseFloat(v, 64); err != nil || c.churn <= 0 {
			return c, fmt.Errorf("SCALE_CHURN: %q is not a positive rate", v)
		}
	}
	if c.window <= 0 || c.gcInterval <= 0 {
		return c, fmt.Errorf("SCALE_WINDOW and SCALE_GC_INTERVAL must be positive")
	}
	return c, nil
}

func envInt(name string, def int) (int, error) {
	v := os.Getenv(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, fmt.Errorf("%s: %q is not a number", name, v)
	}
	return n, nil
}

func envDuration(name string, def time.Duration) (time.Duration, error) {
	v := os.Getenv(name)
	if v == "" {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", name, err)
	}
	return d, nil
}

// warmupFor is how long churn runs before the churn window is measured:
// long enough that the collection deletes released identities at the rate
// they are released. The etcd store deletes an unreferenced master key at
// its next run; the CRD store marks it at one run and deletes it at the
// first run a heartbeat timeout later.
func (c config) warmupFor(mode string) time.Duration {
	if c.warmup > 0 {
		return c.warmup
	}
	if mode == modeCRD {
		return heartbeat + 2*c.gcInterval
	}
	return 2 * c.gcInterval
}

// settleFor is the wait between the setup and the steady window: a full
// collection interval, so that every node's timers run as they do from then
// on.
func (c config) settleFor() time.Duration {
	if c.settle > 0 {
		return c.settle
	}
	return c.gcInterval + 5*time.Second
}

// timeScale is how much faster the nodes' per-node timers run here than at
// the defaults: the lease renewals, and the etcd store's periodic sync.
func timeScale() float64 {
	return float64(defaultLeaseTTL) / float64(leaseTTL)
}
