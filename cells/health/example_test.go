package health_test

import (
	"errors"
	"fmt"

	"github.com/identityd/identityd/cells/health"
)

// Readiness asks that every scope be OK; liveness forgives a scope
// Degraded for a cause outside the process, such as an unreachable etcd,
// which restarting the agent would not mend.
func ExampleProvider() {
	p := health.NewProvider()
	store := p.Root().NewScope("store")
	cache := p.Root().NewScope("cache")
	cache.OK("Synced")

	store.Degraded("Cannot reach etcd", health.External(errors.New("dial tcp 10.0.0.1:2379: connection refused")))
	ready, _ := p.Healthy()
	live, _ := p.Live()
	fmt.Println("etcd away: ready", ready, "live", live)

	store.Degraded("Lost its cache", errors.New("watch ended"))
	live, faults := p.Live()
	fmt.Println("own fault: live", live)
	for _, s := range faults {
		fmt.Println(s.Name, s.Level, s.Error)
	}

	store.OK("Connected")
	ready, _ = p.Healthy()
	fmt.Println("recovered: ready", ready)
	// Output:
	// etcd away: ready false live true
	// own fault: live false
	// store Degraded watch ended
	// recovered: ready true
}
