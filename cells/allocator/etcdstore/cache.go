package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/identityd/identityd/internal/retry"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/logtext"
	"github.com/identityd/identityd/labels"
)

// cacheSource is what the master key cache needs of a kvstore client.
type cacheSource interface {
	Client() *clientv3.Client
	RequestTimeout() time.Duration
}

// cacheHooks let the owner of a masterCache react to its changes. Every
// hook is optional.
type cacheHooks struct {
	// validate rejects a parsed master key, which is then treated like an
	// unparsable one: skipped, logged and counted.
	validate func(id identity.NumericIdentity, lbls labels.Labels) error
	// stored and removed run under the cache's write lock, for state that
	// must change atomically with the cache (the ID pool).
	stored  func(id identity.NumericIdentity)
	removed func(id identity.NumericIdentity)
	// emit reports changes, in order, after the lock is released.
	emit func([]change)
	// listed runs after every complete listing; synced only after the
	// first.
	listed func()
	synced func()
	// failed runs when a listing or a watch fails.
	failed func(error)
}

// masterCache is a list+watch cache of the master keys in one etcd: the
// etcd backend's view of this cluster, and the read-only view of a remote
// cluster. A listing reads one consistent snapshot, the watch continues from
// the next revision, and a new listing (after a broken watch or a
// compaction) reports only what changed.
type masterCache struct {
	cacheLog *slog.Logger
	cacheKV  cacheSource
	// what names the cached identities in log messages.
	what  string
	hooks cacheHooks

	cacheMu sync.RWMutex
	byID    map[identity.NumericIdentity]*masterEntry
	byKey   map[string]identity.NumericIdentity
	// rev is the revision the cache reflects: that of the last listing
	// or of the last watch event applied. Entries this node created
	// (insertCreated) may be newer; the watch confirms them later.
	rev int64
	// rejected holds the value of every master key that is skipped, so
	// that a key is logged and counted once, not at every listing.
	rejected      map[string]string
	rejectedTotal atomic.Uint64

	synced chan struct{}
	once   sync.Once
	// relist ends the current watch so that the loop lists again.
	relist chan struct{}
}

type masterEntry struct {
	key    string
	lbls   labels.Labels
	modRev int64
}

type change struct {
	upsert bool
	id     identity.NumericIdentity
	lbls   labels.Labels
}

func newMasterCache(log *slog.Logger, kv cacheSource, what string, hooks cacheHooks) masterCache {
	return masterCache{
		cacheLog: log,
		cacheKV:  kv,
		what:     what,
		hooks:    hooks,
		byID:     map[identity.NumericIdentity]*masterEntry{},
		byKey:    map[string]identity.NumericIdentity{},
		rejected: map[string]string{},
		synced:   make(chan struct{}),
		relist:   make(chan struct{}, 1),
	}
}

// Synced reports whether the first listing of master keys completed.
func (c *masterCache) Synced() bool {
	select {
	case <-c.synced:
		return true
	default:
		return false
	}
}

func (c *masterCache) cacheRequestContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(clientv3.WithRequireLeader(ctx), c.cacheKV.RequestTimeout())
}

func (c *masterCache) lookupLabels(id identity.NumericIdentity) (labels.Labels, bool) {
	c.cacheMu.RLock()
	defer c.cacheMu.RUnlock()
	if e := c.byID[id]; e != nil {
		return e.lbls, true
	}
	return nil, false
}

func (c *masterCache) cachedID(key string) (identity.NumericIdentity, bool) {
	c.cacheMu.RLock()
	defer c.cacheMu.RUnlock()
	id, ok := c.byKey[key]
	return id, ok
}

// counts returns the number of cached and of rejected master keys.
func (c *masterCache) counts() (cached, rejected int) {
	c.cacheMu.RLock()
	defer c.cacheMu.RUnlock()
	return len(c.byID), len(c.rejected)
}

// requestRelist makes the loop list again, reporting the differences.
func (c *masterCache) requestRelist() {
	select {
	case c.relist <- struct{}{}:
	default:
	}
}

// cacheLoop keeps the cache: list at one revision, watch from the next,
// and list again when the watch breaks or falls behind a compaction,
// reporting only what changed.
func (c *masterCache) cacheLoop(ctx context.Context) {
	failures := 0
	for ctx.Err() == nil {
		rev, err := c.list(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			failures++
			c.fail(err)
			c.cacheLog.Warn("Listing "+c.what+" failed; retrying", "error", err, "attempt", failures)
			retry.Sleep(ctx, retry.Backoff(failures))
			continue
		}
		failures = 0
		err = c.watch(ctx, rev+1)
		if ctx.Err() != nil {
			return
		}
		switch {
		case errors.Is(err, errRelist):
			c.cacheLog.Info("Listing "+c.what+" again", "revision", rev)
		case errors.Is(err, rpctypes.ErrCompacted):
			c.cacheLog.Info("Watch of "+c.what+" fell behind a compaction; listing again", "revision", rev)
		default:
			c.fail(err)
			c.cacheLog.Warn("Watch of "+c.what+" ended; listing again", "error", err)
			retry.Sleep(ctx, retry.Backoff(1))
		}
	}
}

var errRelist = errors.New("listing requested")

func (c *masterCache) fail(err error) {
	if c.hooks.failed != nil {
		c.hooks.failed(err)
	}
}

// listPrefix reads every key under prefix, listPageSize keys a request,
// all at the revision of the first request, which it returns: one
// consistent snapshot however many pages it takes. Each request is bounded
// by reqCtx; each key goes to fn.
func listPrefix(ctx context.Context, cli *clientv3.Client, prefix string, reqCtx func(context.Context) (context.Context, context.CancelFunc), fn func(*mvccpb.KeyValue), opts ...clientv3.OpOption) (int64, error) {
	end := clientv3.GetPrefixRangeEnd(prefix)
	from, rev := prefix, int64(0)
	for {
		page := append([]clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(listPageSize)}, opts...)
		if rev != 0 {
			page = append(page, clientv3.WithRev(rev))
		}
		rctx, cancel := reqCtx(ctx)
		resp, err := cli.Get(rctx, from, page...)
		cancel()
		if err != nil {
			return 0, err
		}
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for _, kv := range resp.Kvs {
			fn(kv)
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return rev, nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// list reads every master key at one revision, page by page, and replaces
// the cache with it. It returns the revision read.
func (c *masterCache) list(ctx context.Context) (int64, error) {
	cli := c.cacheKV.Client()
	if cli == nil {
		return 0, kvstore.ErrStopped
	}
	fresh := map[identity.NumericIdentity]*masterEntry{}
	rejected := map[string]string{}
	rev, err := listPrefix(ctx, cli, MasterKeyPrefix, c.cacheRequestContext, func(kv *mvccpb.KeyValue) {
		id, e, err := c.parseMaster(kv)
		if err != nil {
			rejected[string(kv.Key)] = string(kv.Value)
			c.reject(kv, err)
			return
		}
		fresh[id] = e
	})
	if err != nil {
		return 0, fmt.Errorf("listing %s: %w", MasterKeyPrefix, err)
	}
	c.replace(fresh, rejected, rev)
	if c.hooks.listed != nil {
		c.hooks.listed()
	}
	c.once.Do(func() {
		close(c.synced)
		if c.hooks.synced != nil {
			c.hooks.synced()
		}
	})
	return rev, nil
}

// reject logs and counts a skipped master key, unless it was skipped with
// the same value before.
func (c *masterCache) reject(kv *mvccpb.KeyValue, err error) {
	c.cacheMu.RLock()
	old, seen := c.rejected[string(kv.Key)]
	c.cacheMu.RUnlock()
	if seen && old == string(kv.Value) {
		return
	}
	c.rejectedTotal.Add(1)
	// The key and value are whatever another writer put in etcd: every
	// node logs them, so they are capped.
	c.cacheLog.Warn("Rejecting master key of "+c.what,
		"key", logtext.Cap(string(kv.Key)), "value", logtext.Cap(string(kv.Value)), "error", logtext.Error(err))
}

// parseMaster parses and validates a master key.
func (c *masterCache) parseMaster(kv *mvccpb.KeyValue) (identity.NumericIdentity, *masterEntry, error) {
	id, err := ParseMasterKey(string(kv.Key))
	if err != nil {
		return 0, nil, err
	}
	lbls, err := labels.ParseCanonical(string(kv.Value))
	if err != nil {
		return 0, nil, fmt.Errorf("unparsable label string: %w", err)
	}
	if c.hooks.validate != nil {
		if err := c.hooks.validate(id, lbls); err != nil {
			return 0, nil, err
		}
	}
	return id, &masterEntry{key: string(kv.Value), lbls: lbls, modRev: kv.ModRevision}, nil
}

// replace swaps the cache for a fresh listing read at revision rev and
// reports the differences. An entry this node created after rev is kept:
// the listing could not see it, and the watch that follows reports it.
func (c *masterCache) replace(fresh map[identity.NumericIdentity]*masterEntry, rejected map[string]string, rev int64) {
	var changes []change
	c.cacheMu.Lock()
	for id, old := range c.byID {
		e := fresh[id]
		if e == nil && old.modRev > rev {
			continue
		}
		if e == nil || e.key != old.key {
			changes = append(changes, c.removeLocked(id, old))
		}
	}
	for id, e := range fresh {
		if ch, ok := c.upsertLocked(id, e); ok {
			changes = append(changes, ch)
		}
	}
	c.rejected = rejected
	c.rev = rev
	c.cacheMu.Unlock()
	c.emit(changes)
}

// clear empties the cache, reporting a delete of every entry.
func (c *masterCache) clear() {
	c.replace(map[identity.NumericIdentity]*masterEntry{}, map[string]string{}, math.MaxInt64)
	c.cacheMu.Lock()
	c.rev = 0
	c.cacheMu.Unlock()
}

// insertCreated records a master key this node's transaction wrote at
// revision rev, without reporting it: the creator reports its identity
// itself. The watch event of the same write then finds the entry and
// costs neither a parse nor a report. Nothing is stored when the cache
// has already seen rev (the watch was faster) or knows another label set
// under id (an event it has not seen yet will settle that).
func (c *masterCache) insertCreated(id identity.NumericIdentity, key string, lbls labels.Labels, rev int64) {
	c.cacheMu.Lock()
	defer c.cacheMu.Unlock()
	if rev <= c.rev || c.byID[id] != nil {
		return
	}
	c.byID[id] = &masterEntry{key: key, lbls: lbls, modRev: rev}
	if _, dup := c.byKey[key]; !dup {
		c.byKey[key] = id
	}
	if c.hooks.stored != nil {
		c.hooks.stored(id)
	}
}

// upsertLocked stores e; it reports a change unless the cache had the same
// label set under id already.
func (c *masterCache) upsertLocked(id identity.NumericIdentity, e *masterEntry) (change, bool) {
	old := c.byID[id]
	c.byID[id] = e
	if c.hooks.stored != nil {
		c.hooks.stored(id)
	}
	if old != nil && old.key == e.key {
		return change{}, false
	}
	if _, dup := c.byKey[e.key]; !dup {
		c.byKey[e.key] = id
	}
	return change{upsert: true, id: id, lbls: e.lbls}, true
}

func (c *masterCache) removeLocked(id identity.NumericIdentity, old *masterEntry) change {
	delete(c.byID, id)
	if c.byKey[old.key] == id {
		delete(c.byKey, old.key)
	}
	if c.hooks.removed != nil {
		c.hooks.removed(id)
	}
	return change{id: id, lbls: old.lbls}
}

func (c *masterCache) emit(changes []change) {
	if len(changes) > 0 && c.hooks.emit != nil {
		c.hooks.emit(changes)
	}
}

// watch applies master key events from rev on, until the watch fails or a
// new listing is requested.
func (c *masterCache) watch(ctx context.Context, rev int64) error {
	cli := c.cacheKV.Client()
	if cli == nil {
		return kvstore.ErrStopped
	}
	// Requiring a leader makes a watch on a member cut off from the
	// others end, instead of silently serving nothing.
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	wch := cli.Watch(wctx, MasterKeyPrefix, clientv3.WithPrefix(), clientv3.WithRev(rev))
	for {
		var resp clientv3.WatchResponse
		select {
		case <-c.relist:
			return errRelist
		case r, ok := <-wch:
			if !ok {
				if err := ctx.Err(); err != nil {
					return err
				}
				return errors.New("watch channel closed")
			}
			resp = r
		}
		if err := resp.Err(); err != nil {
			return err
		}
		c.apply(resp.Events)
	}
}

func (c *masterCache) apply(events []*clientv3.Event) {
	var changes []change
	for _, ev := range events {
		if ev.Type == clientv3.EventTypePut && c.confirm(ev.Kv) {
			continue
		}
		key := string(ev.Kv.Key)
		switch ev.Type {
		case clientv3.EventTypePut:
			id, e, err := c.parseMaster(ev.Kv)
			if err != nil {
				c.reject(ev.Kv, err)
			}
			c.cacheMu.Lock()
			if err != nil {
				c.rejected[key] = string(ev.Kv.Value)
				// The key no longer holds the label set the cache
				// knows: withdraw that one.
				if id, perr := identity.ParseNumericIdentity(strings.TrimPrefix(key, MasterKeyPrefix)); perr == nil {
					if old := c.byID[id]; old != nil {
						changes = append(changes, c.removeLocked(id, old))
					}
				}
				c.advanceLocked(ev.Kv.ModRevision)
				c.cacheMu.Unlock()
				continue
			}
			delete(c.rejected, key)
			if old := c.byID[id]; old != nil && old.key != e.key {
				changes = append(changes, c.removeLocked(id, old))
			}
			if ch, ok := c.upsertLocked(id, e); ok {
				changes = append(changes, ch)
			}
			c.advanceLocked(ev.Kv.ModRevision)
			c.cacheMu.Unlock()
		case clientv3.EventTypeDelete:
			c.cacheMu.Lock()
			c.advanceLocked(ev.Kv.ModRevision)
			delete(c.rejected, key)
			if id, err := identity.ParseNumericIdentity(strings.TrimPrefix(key, MasterKeyPrefix)); err == nil {
				if old := c.byID[id]; old != nil {
					changes = append(changes, c.removeLocked(id, old))
				}
			}
			c.cacheMu.Unlock()
		}
	}
	c.emit(changes)
}

// confirm applies the put of a master key the cache already holds with the
// same label set (the watch event of this node's own creation, or a
// rewrite of the same value) without parsing its labels, and reports whether it
// did.
func (c *masterCache) confirm(kv *mvccpb.KeyValue) bool {
	suffix, ok := strings.CutPrefix(string(kv.Key), MasterKeyPrefix)
	if !ok {
		return false
	}
	id, err := identity.ParseNumericIdentity(suffix)
	if err != nil {
		return false
	}
	c.cacheMu.Lock()
	defer c.cacheMu.Unlock()
	e := c.byID[id]
	if e == nil || e.key != string(kv.Value) {
		return false
	}
	delete(c.rejected, string(kv.Key))
	e.modRev = kv.ModRevision
	c.advanceLocked(kv.ModRevision)
	return true
}

func (c *masterCache) advanceLocked(rev int64) {
	c.rev = max(c.rev, rev)
}
