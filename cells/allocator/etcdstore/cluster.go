package etcdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
)

// ClusterConfigPrefix precedes a cluster name: Cilium's clustermesh writes
// the cluster's configuration there ({"id": <cluster ID>, ...}).
const ClusterConfigPrefix = "cilium/cluster-config/"

// ErrClusterMismatch: the etcd holds another cluster's identities, so this
// node's --cluster-id or --cluster-name is not the etcd's.
var ErrClusterMismatch = errors.New("this node's cluster does not match the etcd's")

// checkCluster compares this node's cluster ID and name with what the etcd
// holds, once the master keys are listed. Master keys are found by label
// set alone, so a node of another cluster ID on this etcd would adopt the
// etcd cluster's numbers, whose range says they belong to another cluster:
// other clusters of a mesh would then attribute them to that cluster.
//
// It refuses when Cilium's cluster configuration for this cluster name
// gives another ID, when the etcd holds global identities but none in this
// cluster's range, or when those in this cluster's range name another
// cluster in their cluster label and none names this one.
func (b *Store) checkCluster(ctx context.Context) error {
	if err := b.checkClusterConfig(ctx); err != nil {
		return err
	}
	maxc := b.cluster.MaxConnectedClusters
	var own int
	others := map[uint32]int{}
	names := map[string]int{}
	b.cacheMu.RLock()
	for id, e := range b.byID {
		if id >= b.cluster.MinID() && id <= b.cluster.MaxID() {
			own++
			if l, ok := e.lbls.Get(identity.ClusterLabelKey); ok {
				names[l.Value]++
			}
			continue
		}
		if id >= identity.MinAllocatorIdentity && id.Scope() == identity.ScopeGlobal {
			others[identity.ClusterID(id, maxc)]++
		}
	}
	b.cacheMu.RUnlock()
	if own == 0 && len(others) > 0 {
		ids := slices.Sorted(maps.Keys(others))
		return fmt.Errorf("%w: the etcd holds global identities of cluster ID %s and none of this node's --cluster-id %d; a node belongs on its own cluster's etcd",
			ErrClusterMismatch, joinIDs(ids), b.cluster.ID)
	}
	if len(names) > 0 && names[b.cluster.Name] == 0 {
		return fmt.Errorf("%w: the global identities of cluster ID %d in the etcd belong to cluster %s, not to this node's --cluster-name %q",
			ErrClusterMismatch, b.cluster.ID, quoteNames(slices.Sorted(maps.Keys(names))), b.cluster.Name)
	}
	return nil
}

// checkClusterConfig reads Cilium's configuration of this cluster name,
// where a clustermesh wrote one; a role without access to it is no error.
func (b *Store) checkClusterConfig(ctx context.Context) error {
	cli := b.kv.Client()
	if cli == nil {
		return globalstore.ErrUnavailable
	}
	rctx, cancel := b.requestContext(ctx)
	defer cancel()
	resp, err := cli.Get(rctx, ClusterConfigPrefix+b.cluster.Name)
	if err != nil {
		b.log.Debug("Cluster configuration not readable; not compared", "key", ClusterConfigPrefix+b.cluster.Name, "error", err)
		return nil
	}
	if len(resp.Kvs) == 0 {
		return nil
	}
	var cfg struct {
		ID *uint32 `json:"id"`
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, &cfg); err != nil || cfg.ID == nil {
		b.log.Warn("Cluster configuration in etcd is not Cilium's; not compared", "key", string(resp.Kvs[0].Key))
		return nil
	}
	if *cfg.ID != b.cluster.ID {
		return fmt.Errorf("%w: %s gives cluster %q the ID %d, this node has --cluster-id %d",
			ErrClusterMismatch, resp.Kvs[0].Key, b.cluster.Name, *cfg.ID, b.cluster.ID)
	}
	return nil
}

func joinIDs(ids []uint32) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = fmt.Sprint(id)
	}
	return strings.Join(s, ", ")
}

func quoteNames(names []string) string {
	s := make([]string, len(names))
	for i, n := range names {
		s[i] = fmt.Sprintf("%q", n)
	}
	return strings.Join(s, ", ")
}
