package migrate

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// listPage is the number of keys or objects read per request.
const listPage = 500

// maxTxnOps stays below etcd's default --max-txn-ops (128).
const maxTxnOps = 100

// etcdEnd is the etcd store in Cilium's key layout (docs/formats.md, "etcd
// layout"). As a target it writes a master key only where none exists, with
// the hold's reference key on the hold's lease in the same transaction.
type etcdEnd struct {
	cli   *clientv3.Client
	node  string
	ttl   int64
	lease clientv3.LeaseID
	// prefixes maps the cleaned reference prefix of each label set the
	// target holds or will hold to its canonical string: two label sets
	// with one prefix cannot be told apart in this layout.
	prefixes map[string]string
}

func newEtcdEnd(o Options) *etcdEnd {
	return &etcdEnd{cli: o.Etcd, node: o.HoldNode, ttl: int64(o.Hold.Seconds()), prefixes: map[string]string{}}
}

func (e *etcdEnd) list(ctx context.Context) (map[identity.NumericIdentity]*item, []Skipped, error) {
	items := map[identity.NumericIdentity]*item{}
	var skipped []Skipped
	from, end := etcdstore.MasterKeyPrefix, clientv3.GetPrefixRangeEnd(etcdstore.MasterKeyPrefix)
	var rev int64
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(listPage)}
		if rev != 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		resp, err := e.cli.Get(ctx, from, opts...)
		if err != nil {
			return nil, nil, err
		}
		rev = resp.Header.Revision
		for _, kv := range resp.Kvs {
			id, err := etcdstore.ParseMasterKey(string(kv.Key))
			if err != nil {
				name := strings.TrimPrefix(string(kv.Key), etcdstore.MasterKeyPrefix)
				skipped = append(skipped, Skipped{Name: name, Value: string(kv.Value), Reason: "master key name: " + err.Error()})
				continue
			}
			it := &item{id: id, raw: string(kv.Value)}
			if it.lbls, it.err = labels.ParseCanonical(string(kv.Value)); it.err == nil {
				it.key = it.lbls.Canonical()
				e.prefixes[etcdstore.ReferencePrefix(it.key)] = it.key
			} else {
				it.err = fmt.Errorf("labels: %w", it.err)
			}
			items[id] = it
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	if err := e.readReferences(ctx, items, rev); err != nil {
		return nil, nil, err
	}
	return items, skipped, nil
}

// readReferences marks, of each label set held at several master keys,
// the IDs other nodes' reference keys name at revision rev: a node adopts
// the ID they name (etcdstore.ReferencedIDs), so choose must take it. The
// hold's own reference is left out: this run writes it again.
func (e *etcdEnd) readReferences(ctx context.Context, items map[identity.NumericIdentity]*item, rev int64) error {
	byKey := map[string][]*item{}
	for _, it := range items {
		if it.err == nil {
			byKey[it.key] = append(byKey[it.key], it)
		}
	}
	for key, its := range byKey {
		if len(its) < 2 {
			continue
		}
		prefix := etcdstore.ReferencePrefix(key)
		resp, err := e.cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(rev))
		if err != nil {
			return fmt.Errorf("reading the reference keys of %q: %w", key, err)
		}
		kvs := slices.DeleteFunc(resp.Kvs, func(kv *mvccpb.KeyValue) bool { return string(kv.Key) == prefix+e.node })
		named, err := etcdstore.ReferencedIDs(prefix, kvs)
		if err != nil {
			return err
		}
		for _, it := range its {
			it.referenced = named[it.id] > 0
		}
	}
	return nil
}

// prepare grants the hold's lease. It is never revoked: it ends with its
// TTL, when the nodes that switched to this store reference the
// identities themselves.
func (e *etcdEnd) prepare(ctx context.Context) error {
	resp, err := e.cli.Grant(ctx, e.ttl)
	if err != nil {
		return fmt.Errorf("granting the hold's lease: %w", err)
	}
	e.lease = resp.ID
	return nil
}

func (e *etcdEnd) create(ctx context.Context, id identity.NumericIdentity, lbls labels.Labels) (*item, error) {
	key := lbls.Canonical()
	master := etcdstore.MasterKey(id)
	resp, err := e.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(master), "=", 0),
			// A Cilium agent that holds the label set's lock is allocating
			// it: the label set may get an ID of its own meanwhile.
			clientv3.Compare(clientv3.CreateRevision(etcdstore.LockPrefix(key)), "=", 0).WithPrefix()).
		Then(clientv3.OpPut(master, key),
			clientv3.OpPut(etcdstore.ReferencePrefix(key)+e.node, id.String(), clientv3.WithLease(e.lease))).
		Else(clientv3.OpGet(master)).
		Commit()
	if err != nil {
		return nil, err
	}
	if resp.Succeeded {
		return nil, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return nil, fmt.Errorf("a Cilium agent holds the allocation lock of %q (%s); run again once it is done", key, etcdstore.LockPrefix(key))
	}
	it := &item{id: id, raw: string(kvs[0].Value)}
	if it.lbls, it.err = labels.ParseCanonical(it.raw); it.err == nil {
		it.key = it.lbls.Canonical()
	}
	return it, nil
}

func (e *etcdEnd) unmark(context.Context, *item) error { return nil }

// hold writes one reference key of the hold's node for every label set,
// on the hold's lease, naming the ID the plan gives the label set: the
// garbage collection (identityd's and Cilium's) keeps every master key of
// a label set while a reference key of it exists, and a node adopts the
// ID its references name.
func (e *etcdEnd) hold(ctx context.Context, h holding) error {
	ops := make([]clientv3.Op, 0, maxTxnOps)
	flush := func() error {
		if len(ops) == 0 {
			return nil
		}
		_, err := e.cli.Txn(ctx).Then(ops...).Commit()
		ops = ops[:0]
		return err
	}
	for _, key := range slices.Sorted(maps.Keys(h.named)) {
		ops = append(ops, clientv3.OpPut(etcdstore.ReferencePrefix(key)+e.node, h.named[key].String(), clientv3.WithLease(e.lease)))
		if len(ops) == maxTxnOps {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

// skip refuses what the etcd store refuses (etcdstore.ErrKeyLayout): a
// label set whose cleaned keys leave their prefix, or are those of another
// label set.
func (e *etcdEnd) skip(lbls labels.Labels, key string) string {
	if err := etcdstore.CheckKeyLayout(key); err != nil {
		return err.Error()
	}
	ref := etcdstore.ReferencePrefix(key)
	if other, ok := e.prefixes[ref]; ok && other != key {
		return fmt.Sprintf("%s: its reference keys, cleaned as Cilium cleans keys, are those of %q", etcdstore.ErrKeyLayout, other)
	}
	e.prefixes[ref] = key
	return ""
}

// choose takes the ID a node adopts: the one other nodes' references name
// (etcdstore.ReferencedIDs); when they name none, or several, which nodes
// wait to agree, the smallest of those IDs, so that the plan does not
// depend on the listing's order.
func (e *etcdEnd) choose(its []*item) identity.NumericIdentity {
	named := slices.DeleteFunc(slices.Clone(its), func(it *item) bool { return !it.referenced })
	if len(named) > 0 {
		its = named
	}
	return slices.MinFunc(its, func(a, b *item) int { return cmp.Compare(a.id, b.id) }).id
}
