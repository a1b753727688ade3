package kvstore

import (
	"context"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// statusTimeout bounds the status request to one endpoint, so that a hung
// member cannot hold up the status of the others.
const statusTimeout = 2 * time.Second

// Status describes the client's connection to etcd.
type Status struct {
	// Embedded is true when the client talks to the embedded etcd.
	Embedded bool
	// NodeName is this node's name in etcd keys.
	NodeName string
	// Endpoints holds the state of every endpoint.
	Endpoints []EndpointStatus
	// Leader is the leader's endpoint (or member ID when it is not one of
	// the endpoints); empty when no endpoint knows a leader.
	Leader string
	// Revision is the highest store revision an endpoint reported.
	Revision int64
	// LeaseID is the node's current lease, 0 when none is held.
	LeaseID clientv3.LeaseID
	// LeaseTTL is the lease TTL in use.
	LeaseTTL time.Duration
	// LastError is the last error a request returned, empty when none.
	LastError string
}

// EndpointStatus is the state of one etcd endpoint.
type EndpointStatus struct {
	Endpoint string
	// Connected is true when the endpoint answered the status request.
	Connected bool
	MemberID  uint64
	Version   string
	IsLeader  bool
	// LeaderID is the member ID of the leader the endpoint knows, 0 if none.
	LeaderID uint64
	Revision int64
	DBSize   int64
	// Error is why the endpoint did not answer.
	Error string
}

// Connected returns how many endpoints answered.
func (s Status) Connected() int {
	n := 0
	for _, ep := range s.Endpoints {
		if ep.Connected {
			n++
		}
	}
	return n
}

// Mode is "embedded" or "external".
func (s Status) Mode() string {
	if s.Embedded {
		return "embedded"
	}
	return "external"
}

// Status asks every endpoint for its state. It does not fail: unreachable
// endpoints are reported in the result.
func (c *Client) Status(ctx context.Context) Status {
	st := Status{
		Embedded: c.cfg.Embedded(),
		NodeName: c.cfg.NodeName,
		LeaseTTL: c.cfg.KVStoreLeaseTTL,
	}
	c.mu.Lock()
	cli := c.cli
	if c.lease != nil {
		st.LeaseID = c.lease.id
	}
	if c.lastErr != nil {
		st.LastError = flatError{c.lastErr}.Error()
	}
	c.mu.Unlock()

	eps := c.Endpoints()
	st.Endpoints = make([]EndpointStatus, len(eps))
	var wg sync.WaitGroup
	for i, ep := range eps {
		st.Endpoints[i].Endpoint = ep
		if cli == nil {
			st.Endpoints[i].Error = ErrNotStarted.Error()
			continue
		}
		wg.Go(func() {
			sctx, cancel := context.WithTimeout(ctx, statusTimeout)
			defer cancel()
			resp, err := cli.Status(sctx, ep)
			if err != nil {
				st.Endpoints[i].Error = flatError{err}.Error()
				return
			}
			st.Endpoints[i] = EndpointStatus{
				Endpoint:  ep,
				Connected: true,
				MemberID:  resp.Header.GetMemberId(),
				Version:   resp.Version,
				IsLeader:  resp.Leader != 0 && resp.Leader == resp.Header.GetMemberId(),
				LeaderID:  resp.Leader,
				Revision:  resp.Header.GetRevision(),
				DBSize:    resp.DbSize,
			}
		})
	}
	wg.Wait()
	// Every endpoint reports the leader's member ID; name it by endpoint
	// when the leader is one of ours.
	for _, ep := range st.Endpoints {
		st.Revision = max(st.Revision, ep.Revision)
		if ep.IsLeader {
			st.Leader = ep.Endpoint
		}
	}
	if st.Leader == "" {
		for _, ep := range st.Endpoints {
			if ep.LeaderID != 0 {
				st.Leader = fmt.Sprintf("member %x", ep.LeaderID)
				break
			}
		}
	}
	return st
}
