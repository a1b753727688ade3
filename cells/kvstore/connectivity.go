package kvstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"

	"github.com/identityd/identityd/cells/health"
)

// How often and how patiently the connectivity job checks that etcd
// answers: an etcd lost at every endpoint shows in health within about
// connectivityInterval + connectivityTimeout, not when the lease expires
// minutes later.
const (
	connectivityInterval = 2 * time.Second
	connectivityTimeout  = 2 * time.Second
)

// watchConnectivity is the job that keeps the kvstore's health in step
// with etcd: Degraded, marked health.External, while no endpoint answers
// (or the one that answers knows no leader, so that no request can
// succeed), OK again once one does. A KV or lease request that succeeded
// within the last interval already proves etcd answers, so a busy node
// sends no extra request; an idle one sends one Status request every
// interval.
func (c *Client) watchConnectivity(ctx context.Context, h cell.Health) error {
	t := time.NewTicker(connectivityInterval)
	defer t.Stop()
	down := false
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		var err error
		if time.Since(time.Unix(0, c.lastAnswer.Load())) >= connectivityInterval {
			err = c.ping(ctx)
		}
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			if !down {
				c.log.Warn("etcd does not answer; global identities cannot be allocated or released until it does",
					"endpoints", c.Endpoints(), "error", err)
			}
			down = true
			msg := fmt.Sprintf("No etcd endpoint answered within %s", connectivityTimeout)
			if errors.Is(err, errNoLeader) {
				msg = "etcd has no leader"
			}
			h.Degraded(msg, health.External(flatError{err}))
			// gRPC waits longer and longer between reconnection attempts
			// (up to 2 minutes); without this, etcd's return could go
			// unnoticed for that long.
			if cli := c.Client(); cli != nil {
				cli.ActiveConnection().ResetConnectBackoff()
			}
			continue
		}
		if down {
			down = false
			c.log.Info("etcd answers again", "endpoints", c.Endpoints())
		}
		h.OK("etcd answers at " + strings.Join(c.Endpoints(), ","))
		c.regrantLease(ctx)
	}
}

// regrantLease grants a new lease after the node's lease was lost, once
// etcd answers. Whoever wrote keys with the old one writes them again with
// it; without it a node that writes nothing for a while would show the
// lost lease in health (and be not ready) until its next write.
func (c *Client) regrantLease(ctx context.Context) {
	c.mu.Lock()
	lost := c.lostLease != 0
	c.mu.Unlock()
	if !lost {
		return
	}
	if _, err := c.Lease(ctx); err != nil && ctx.Err() == nil {
		c.log.Warn("Granting a new etcd lease after the lost one failed; retrying", "error", err)
	}
}

// errNoLeader is ping's error when etcd answers but cannot serve a write.
var errNoLeader = errors.New("the etcd member that answered knows no leader")

// ping asks whichever endpoint the client's connection reaches for its
// status: it needs no permission beyond authentication and counts as a
// Status request.
func (c *Client) ping(ctx context.Context) error {
	cli := c.Client()
	if cli == nil {
		return ErrStopped
	}
	ctx, cancel := context.WithTimeout(ctx, connectivityTimeout)
	defer cancel()
	resp, err := pb.NewMaintenanceClient(cli.ActiveConnection()).Status(ctx, &pb.StatusRequest{}, grpc.WaitForReady(true))
	if err != nil {
		return err
	}
	if resp.Leader == 0 {
		return errNoLeader
	}
	return nil
}
