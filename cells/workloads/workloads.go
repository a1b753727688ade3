package workloads

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// Pod is what the node holds for one of its pods, as workloads/list shows
// it.
type Pod struct {
	// Name is namespace/name.
	Name string `json:"pod"`
	// IPs are the pod's addresses in the ipcache.
	IPs []netip.Prefix `json:"ips"`
	// Identity is the pod's identity, 0 while it has none.
	Identity identity.NumericIdentity `json:"identity"`
	// Labels are the identity labels of the pod's current labels.
	Labels labels.Labels `json:"labels"`
	// State says why the pod has no identity, or "ready".
	State string `json:"state"`
}

// TableHeader implements the shell's table output.
func (Pod) TableHeader() []string { return []string{"Pod", "IPs", "Identity", "State", "Labels"} }

// TableRow implements the shell's table output.
func (p Pod) TableRow() []string {
	ips := make([]string, len(p.IPs))
	for i, ip := range p.IPs {
		ips[i] = ip.String()
	}
	id := "-"
	if p.Identity != 0 {
		id = p.Identity.String()
	}
	return []string{p.Name, strings.Join(ips, ","), id, p.State, strings.Join(p.Labels.Strings(), ",")}
}

// stateReady is the state of a pod that holds the identity of its labels.
const stateReady = "ready"

// podState is what the node holds for one pod.
type podState struct {
	want want
	// held is the identity the pod holds (one allocator reference), for
	// heldLabels; nil when none.
	held       *identity.Identity
	heldLabels labels.Labels
	// prefixes are the pod's rows in the ipcache, with held's number.
	prefixes []netip.Prefix
	// waitingSince is when the pod began to wait for the identity of its
	// current labels; zero when it holds it or needs none.
	waitingSince time.Time
	// failures counts the failed attempts since the last success;
	// retryAt is when the next one is due.
	failures int
	retryAt  time.Time
	// awaiting: in operator mode, the last attempt found no identity for
	// the pod's labels in the store (the manager has not created it);
	// overdue: that has lasted longer than the allocation timeout.
	awaiting, overdue bool
}

// pendingRelease is an identity a pod no longer uses, held until at.
type pendingRelease struct {
	id *identity.Identity
	at time.Time
}

// sources are the node's pods and the cluster's namespaces, as the
// informers keep them.
type sources struct {
	pods       cache.Indexer
	namespaces cache.Store
}

func (s sources) pod(key string) *corev1.Pod {
	obj, ok, err := s.pods.GetByKey(key)
	if err != nil || !ok {
		return nil
	}
	p, _ := obj.(*corev1.Pod)
	return p
}

func (s sources) namespace(name string) *corev1.Namespace {
	obj, ok, err := s.namespaces.GetByKey(name)
	if err != nil || !ok {
		return nil
	}
	ns, _ := obj.(*corev1.Namespace)
	return ns
}

// Workloads gives the node's pods their identities: it reads the node's
// pods and the namespaces, holds one identity per pod and puts the pods'
// IPs into the ipcache with it. List shows what it holds.
type Workloads struct {
	log     *slog.Logger
	grace   time.Duration
	filter  *LabelFilter
	node    string
	cluster string
	alloc   allocator.Allocator
	ipc     *ipcache.IPCache
	metrics *workloadMetrics
	now     func() time.Time
	// adoptOnly: operator mode, the pods' identities are adopted, never
	// created; createTimeout is how long a pod waits for the manager to
	// create one before it is reported (--identity-allocation-timeout).
	adoptOnly     bool
	createTimeout time.Duration
	// health is the serving job's; overdueReported the number of overdue
	// pods it last said.
	health          cell.Health
	overdueReported int

	// mu guards pods; the serving loop is its only writer, List reads.
	mu   sync.Mutex
	pods map[string]*podState

	dirtyMu sync.Mutex
	dirty   map[string]struct{}
	kick    chan struct{}

	// Owned by the serving loop.
	src      sources
	releases []pendingRelease
	// initDone marks the ipcache initializer done: until the pods of the
	// first listing hold their identities, the ipcache prunes nothing of
	// the datapath map, so that a restart keeps every pod's entry.
	initDone     func()
	initDeadline time.Time
}

// initialHoldBound bounds how long the ipcache's pruning waits for the
// pods of the first listing: a store that is away must not keep stale
// map entries forever.
const initialHoldBound = 2 * time.Minute

// allocationTimeout bounds one batch of allocations, so that a hung store
// does not hold up the releases that fall due meanwhile.
const allocationTimeout = time.Minute

// awaitCreation is how often a pod whose identity the manager has not
// created yet tries again: an adoption that finds nothing costs no
// request, and the pod gets its identity within a second of the store's
// cache showing it.
const awaitCreation = time.Second

// newWorkloads serves the pods of node, or of the cluster for the manager
// (node ""): the manager creates identities in every mode it runs them in,
// a node in operator mode only adopts them.
func newWorkloads(log *slog.Logger, cfg Config, filter *LabelFilter, node, cluster string, alloc allocator.Allocator, ipc *ipcache.IPCache, m *workloadMetrics) *Workloads {
	return &Workloads{
		log: log, grace: cfg.IdentityChangeGracePeriod, filter: filter, node: node, cluster: cluster,
		alloc: alloc, ipc: ipc, metrics: m, now: time.Now,
		adoptOnly: node != "" && cfg.IdentityManagementMode == ManagementModeOperator,
		pods:      map[string]*podState{},
		dirty:     map[string]struct{}{},
		kick:      make(chan struct{}, 1),
	}
}

// List returns the node's pods, sorted by name.
func (w *Workloads) List() []Pod {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]Pod, 0, len(w.pods))
	for key, st := range w.pods {
		p := Pod{Name: key, IPs: slices.Clone(st.prefixes), Labels: st.want.labels, State: stateReady}
		if st.held != nil {
			p.Identity = st.held.ID
		}
		switch {
		case st.want.skip != reasonNone:
			p.State = string(st.want.skip)
		case st.held == nil || !st.heldLabels.Equal(st.want.labels):
			p.State = "allocating"
			if st.failures > 0 {
				p.State = fmt.Sprintf("allocation failed %d times", st.failures)
			}
			if st.awaiting {
				p.State = "waiting for the identity manager"
			}
		}
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b Pod) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// markDirty asks the loop to look at the pods of keys again.
func (w *Workloads) markDirty(keys ...string) {
	w.dirtyMu.Lock()
	for _, k := range keys {
		w.dirty[k] = struct{}{}
	}
	w.dirtyMu.Unlock()
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

func (w *Workloads) takeDirty() []string {
	w.dirtyMu.Lock()
	defer w.dirtyMu.Unlock()
	keys := make([]string, 0, len(w.dirty))
	for k := range w.dirty {
		keys = append(keys, k)
	}
	clear(w.dirty)
	slices.Sort(keys)
	return keys
}

// markNamespace marks the pods of namespace ns.
func (w *Workloads) markNamespace(ns string) {
	keys, err := w.src.pods.IndexKeys(cache.NamespaceIndex, ns)
	if err == nil && len(keys) > 0 {
		w.markDirty(keys...)
	}
}

// serve runs passes until ctx ends: at once, then whenever a pod or
// namespace changed, a retry or a release is due.
func (w *Workloads) serve(ctx context.Context) {
	for {
		next := w.pass(ctx)
		var (
			timer <-chan time.Time
			t     *time.Timer
		)
		if !next.IsZero() {
			t = time.NewTimer(max(next.Sub(w.now()), 0))
			timer = t.C
		}
		select {
		case <-ctx.Done():
		case <-w.kick:
		case <-timer:
		}
		if t != nil {
			t.Stop()
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// pass brings the dirty pods, and the pods whose retry is due, to what
// they should hold, releases the identities whose grace period ended, and
// returns when the next retry or release is due (zero: none).
func (w *Workloads) pass(ctx context.Context) time.Time {
	now := w.now()
	keys := w.takeDirty()
	w.mu.Lock()
	for key, st := range w.pods {
		if (st.failures > 0 || st.awaiting) && !st.retryAt.After(now) {
			keys = append(keys, key)
		}
	}
	w.mu.Unlock()
	slices.Sort(keys)
	keys = slices.Compact(keys)

	var (
		reqs    []allocator.Request
		reqKeys []string
	)
	for _, key := range keys {
		if w.decidePod(ctx, key, now) {
			w.mu.Lock()
			reqs = append(reqs, allocator.Request{Labels: w.pods[key].want.labels, AdoptOnly: w.adoptOnly})
			w.mu.Unlock()
			reqKeys = append(reqKeys, key)
		}
	}
	if len(reqs) > 0 {
		actx, cancel := context.WithTimeout(ctx, allocationTimeout)
		results := w.alloc.AllocateBatch(actx, reqs)
		cancel()
		done := w.now()
		for i, res := range results {
			w.allocated(ctx, reqKeys[i], reqs[i].Labels, res, done)
		}
	}
	w.releaseDue(ctx, w.now())
	return w.finishPass(w.now())
}

// decidePod applies what the pod of key should hold, except a new
// identity: it returns true when the pod needs one.
func (w *Workloads) decidePod(ctx context.Context, key string, now time.Time) bool {
	pod := w.src.pod(key)
	var ns *corev1.Namespace
	if pod != nil {
		ns = w.src.namespace(pod.Namespace)
	}
	wt := decide(pod, ns, w.node, w.cluster, w.filter)
	if wt.problem != nil {
		w.log.Warn("Pod input refused, the rest of the pod is used", "pod", key, "error", wt.problem)
	}

	w.mu.Lock()
	st := w.pods[key]
	if st == nil {
		if wt.skip == reasonGone {
			w.mu.Unlock()
			return false
		}
		st = &podState{}
		w.pods[key] = st
	}
	if wt.skip == reasonNoNamespace {
		// Keep what the pod holds until its namespace is known: a
		// namespace object is never missing for long.
		st.want.skip = reasonNoNamespace
		if st.held == nil && st.waitingSince.IsZero() {
			st.waitingSince = now
		}
		w.mu.Unlock()
		return false
	}
	if !wt.needsIdentity() {
		held, prefixes := st.held, st.prefixes
		st.want, st.held, st.heldLabels, st.prefixes = wt, nil, nil, nil
		st.waitingSince, st.failures, st.retryAt = time.Time{}, 0, time.Time{}
		if wt.skip == reasonGone {
			delete(w.pods, key)
		}
		w.mu.Unlock()
		w.removePrefixes(ctx, key, prefixes)
		w.releaseLater(held, now)
		return false
	}
	labelsChanged := !st.want.labels.Equal(wt.labels) || st.want.skip != reasonNone
	st.want = wt
	if st.held != nil && st.heldLabels.Equal(wt.labels) {
		id, cur := st.held, st.prefixes
		st.waitingSince, st.failures, st.retryAt = time.Time{}, 0, time.Time{}
		w.mu.Unlock()
		w.syncPrefixes(ctx, key, id, cur, wt.prefixes)
		return false
	}
	// A pod that waits already (for its namespace, or a failed
	// allocation) keeps waiting since then.
	if st.waitingSince.IsZero() {
		st.waitingSince = now
	}
	if labelsChanged {
		st.failures, st.retryAt = 0, time.Time{}
	}
	due := st.failures == 0 || !st.retryAt.After(now)
	w.mu.Unlock()
	return due
}

// allocated applies the outcome of the allocation of lbls for the pod of
// key.
func (w *Workloads) allocated(ctx context.Context, key string, lbls labels.Labels, res allocator.Result, now time.Time) {
	if res.Err != nil && ctx.Err() != nil {
		return // stopping: not a failure of the store
	}
	w.mu.Lock()
	st := w.pods[key]
	if res.Err != nil && w.adoptOnly && errors.Is(res.Err, globalstore.ErrNoIdentity) {
		// Not a failure: the manager has not created it yet.
		overdue := false
		if st != nil {
			st.awaiting, st.retryAt = true, now.Add(awaitCreation)
			if !st.overdue && !st.waitingSince.IsZero() && now.Sub(st.waitingSince) > w.createTimeout {
				st.overdue, overdue = true, true
			}
		}
		w.mu.Unlock()
		if overdue {
			w.metrics.notCreated.Inc()
			w.log.Error("The identity manager has not created the identity of the pod's labels within --identity-allocation-timeout; the pod waits for it",
				"pod", key, "labels", lbls, "timeout", w.createTimeout)
		}
		return
	}
	if res.Err != nil {
		w.metrics.failures.Inc()
		if st != nil {
			st.failures++
			st.retryAt = now.Add(retryDelay(st.failures))
		}
		w.mu.Unlock()
		w.log.Warn("Allocating the identity of a pod failed, retrying", "pod", key, "labels", lbls, "error", res.Err)
		return
	}
	if st == nil || !st.want.labels.Equal(lbls) || st.want.skip != reasonNone {
		// The pod changed during the allocation: the next pass
		// decides again, this reference is not needed.
		w.mu.Unlock()
		w.releaseLater(res.Identity, now)
		w.markDirty(key)
		return
	}
	old, cur, wantPrefixes := st.held, st.prefixes, st.want.prefixes
	if !st.waitingSince.IsZero() {
		w.metrics.wait.Observe(now.Sub(st.waitingSince).Seconds())
	}
	st.held, st.heldLabels = res.Identity, lbls
	st.waitingSince, st.failures, st.retryAt = time.Time{}, 0, time.Time{}
	st.awaiting, st.overdue = false, false
	w.mu.Unlock()
	if old != nil && old.ID != res.Identity.ID {
		// Every row gets the new number.
		cur = nil
	}
	w.syncPrefixes(ctx, key, res.Identity, cur, wantPrefixes)
	w.releaseLater(old, now)
}

// retryDelay is the wait after the n-th failure in a row: from about a
// second, doubling, to about a minute, jittered so that the nodes that
// failed together do not retry together.
func retryDelay(n int) time.Duration {
	d := min(time.Second<<min(n-1, 6), time.Minute)
	return d/2 + rand.N(d/2+1)
}

// owner is the pod's owner name in the ipcache.
func owner(key string) ipcache.ResourceID { return ipcache.ResourceID("pod/" + key) }

// whosePods names the pods served: this node's, or the cluster's (the
// manager's).
func (w *Workloads) whosePods() string {
	if w.node == "" {
		return "the cluster's pods"
	}
	return "this node's pods"
}

// syncPrefixes brings the pod's ipcache rows from cur to next, with id.
// The manager has no ipcache.
func (w *Workloads) syncPrefixes(ctx context.Context, key string, id *identity.Identity, cur, next []netip.Prefix) {
	if w.ipc == nil {
		return
	}
	add, remove := prefixDiff(cur, next)
	var errs []error
	if len(add) > 0 {
		updates := make([]ipcache.Update, len(add))
		for i, p := range add {
			updates[i] = ipcache.Update{Prefix: p, Info: ipcache.Info{Identity: id.ID}}
		}
		if err := w.ipc.UpsertBatch(ctx, owner(key), updates); err != nil {
			errs = append(errs, err)
		}
	}
	if len(remove) > 0 {
		if err := w.ipc.Remove(ctx, owner(key), remove...); err != nil {
			errs = append(errs, err)
		}
	}
	w.mu.Lock()
	if st := w.pods[key]; st != nil && st.held == id {
		if len(errs) == 0 {
			st.prefixes = next
		} else {
			// What the ipcache has is unknown: the retry writes every
			// row again.
			st.prefixes = nil
			st.failures++
			st.retryAt = w.now().Add(retryDelay(st.failures))
		}
	}
	w.mu.Unlock()
	if err := errors.Join(errs...); err != nil && ctx.Err() == nil {
		w.log.Warn("Writing a pod's IPs into the ipcache failed, retrying", "pod", key, "error", err)
	}
}

// removePrefixes drops the pod's ipcache rows.
func (w *Workloads) removePrefixes(ctx context.Context, key string, prefixes []netip.Prefix) {
	if len(prefixes) == 0 || w.ipc == nil {
		return
	}
	if err := w.ipc.Remove(ctx, owner(key), prefixes...); err != nil && ctx.Err() == nil {
		w.log.Warn("Removing a pod's IPs from the ipcache failed", "pod", key, "error", err)
	}
}

// releaseLater schedules the release of id after the grace period.
func (w *Workloads) releaseLater(id *identity.Identity, now time.Time) {
	if id != nil {
		w.releases = append(w.releases, pendingRelease{id: id, at: now.Add(w.grace)})
	}
}

// releaseDue releases the identities whose grace period ended.
func (w *Workloads) releaseDue(ctx context.Context, now time.Time) {
	kept := w.releases[:0]
	for _, r := range w.releases {
		if r.at.After(now) {
			kept = append(kept, r)
			continue
		}
		if _, err := w.alloc.Release(ctx, r.id); err != nil && ctx.Err() == nil {
			w.log.Warn("Releasing a pod's old identity failed", "identity", r.id.ID, "error", err)
		}
	}
	clear(w.releases[len(kept):])
	w.releases = kept
}

// finishPass updates the gauge, ends the hold on the ipcache's pruning
// once the first listing's pods hold their identities, and returns when
// the next retry or release is due.
func (w *Workloads) finishPass(now time.Time) time.Time {
	var next time.Time
	earlier := func(t time.Time) {
		if !t.IsZero() && (next.IsZero() || t.Before(next)) {
			next = t
		}
	}
	without, overdue := 0, 0
	w.mu.Lock()
	for _, st := range w.pods {
		if st.want.needsIdentity() && st.held == nil {
			without++
		}
		if st.failures > 0 || st.awaiting {
			earlier(st.retryAt)
		}
		if st.awaiting && st.overdue {
			overdue++
		}
	}
	w.mu.Unlock()
	if overdue != w.overdueReported && w.health != nil {
		w.overdueReported = overdue
		if overdue == 0 {
			w.health.OK("Serving " + w.whosePods())
		} else {
			w.health.OK(fmt.Sprintf("Serving %s; %d wait longer than --identity-allocation-timeout (%s) for identities the identity manager has not created", w.whosePods(), overdue, w.createTimeout))
		}
	}
	for _, r := range w.releases {
		earlier(r.at)
	}
	w.metrics.withoutIdentity.Set(float64(without))
	if w.initDone != nil {
		if without == 0 || !now.Before(w.initDeadline) {
			w.initDone()
			w.initDone = nil
		} else {
			earlier(w.initDeadline)
		}
	}
	return next
}
