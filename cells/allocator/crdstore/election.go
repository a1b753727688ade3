package crdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/rest"
)

// One node per cluster runs the garbage collection: the holder of the
// coordination.k8s.io/v1 Lease identity-gc-<cluster ID> in the namespace of
// --identity-gc-lease-namespace (`kubectl get lease -n <namespace>` names
// it). Others read the lock once per retry period (a GET, no watch: a
// watch would bring every renewal to every node) and take it when its
// holder has not renewed it for its lease duration, or at once when the
// holder released it (a clean stop). The collection's correctness does not
// rest on there being one collector (collect's preconditions make two safe);
// the election only keeps the cluster's listings and marks from growing
// with the number of nodes.
//
// Earlier versions elected the collector on an IdentityLease of the same
// name (a CRD of identityd's own), and knew nothing of the Lease. So that
// a cluster upgraded node by node never has two collectors, a node takes
// and holds both locks, the IdentityLease first, and collects only while
// it holds both: a node of an earlier version holding the IdentityLease
// keeps every node of this one from the Lease, and a node of this one
// holding the IdentityLease keeps the earlier ones from collecting. Every
// node takes the locks in the same order, so no two nodes each hold one
// and wait for the other.
//
// The election follows client-go's leader election (tools/leaderelection):
// the same record, reads, writes and timings, except that a term ends
// before the lock is released rather than after. It is written here rather
// than imported because that package pulls in the whole generated
// clientset, its informers and listers (hundreds of packages) for one lock
// this store implements itself.

// electionTimings are the durations of the election, as client-go names
// them.
type electionTimings struct {
	// lease is how long the others wait after the holder's last renewal
	// before they take the lock (whole seconds: the lock states seconds).
	lease time.Duration
	// renewDeadline is how long the holder keeps trying to renew before
	// it stops collecting.
	renewDeadline time.Duration
	// retry is the period of the holder's renewals and of the others'
	// reads, which the others stretch by a random factor of up to 2.2
	// (client-go's jitter), so that they do not read in step.
	retry time.Duration
}

// gcElectionTimings derives the election's timings from the IdentityNode
// lease ttl, so that a node killed while it collects is replaced within
// one IdentityNode lease: the others notice its last renewal at most 2.2
// retry periods after it, and take the lock at most 2.2 retry periods
// after a lease has passed from then, so within lease + 4.4 × retry =
// 0.95 × ttl. As client-go requires: lease > renewDeadline > 1.2 × retry.
func gcElectionTimings(ttl time.Duration) electionTimings {
	return electionTimings{
		lease:         (ttl * 2 / 5).Truncate(time.Second),
		renewDeadline: ttl * 3 / 10,
		retry:         ttl / 8,
	}
}

// validate checks what client-go's elector requires of its timings: a
// holder must give up (renew deadline) before the others may take the
// lock (lease), and retry within the renew deadline even when stretched.
func (t electionTimings) validate() error {
	if t.retry <= 0 || t.lease <= t.renewDeadline || float64(t.renewDeadline) <= electionJitter*float64(t.retry) {
		return fmt.Errorf("election timings lease %s, renew deadline %s, retry %s: want lease > renew deadline > %.1f × retry > 0",
			t.lease, t.renewDeadline, t.retry, electionJitter)
	}
	return nil
}

// gcElection is this node's side of the election over its locks (the
// IdentityLease, then the Lease), each read with GET and written with POST
// and PUT, each PUT carrying the resourceVersion of the last read or write
// of that lock as precondition.
type gcElection struct {
	s *Store
	// name is the locks' name, id this process's holder identity.
	name, id string
	timings  electionTimings
	// locks are taken in this order and released in the reverse one;
	// err says why there are none (the Lease's client could not be built
	// from the settings the store's other clients were built from).
	locks []*electionLock
	err   error

	mu sync.Mutex
	// holder is the holder identity the locks name: the Lease's, or the
	// IdentityLease's while the Lease names none ("" when free or
	// unknown).
	holder string
	// term is the context of this node's term as collector, nil while
	// another node (or none) collects; endTerm ends it.
	term    context.Context
	endTerm context.CancelFunc
	// h is the election job's health; reported is what it last said.
	h        cell.Health
	reported string
}

// electionLock is one lock of the election, an object with a Lease's
// spec, and the elector's view of it.
type electionLock struct {
	// kind names the lock in messages and in the objects it writes;
	// what is "<kind> <namespace>/<name>".
	apiVersion, kind, what string
	// resource and namespace ("" for a cluster-scoped kind) are where
	// client finds it.
	resource, namespace string
	client              *rest.RESTClient

	// cur is the lock as last read or written (nil: not read, or gone);
	// holder the holder identity it names. Guarded by gcElection.mu.
	cur    *IdentityLease
	holder string

	// The elector's own view, touched only by the run goroutine:
	// observed is the record as last read (when it changed) or written,
	// observedRaw the resourceVersion it was read at, observedTime when
	// this node saw it; a holder's lease counts from then, on this node's
	// clock, not from the time the holder wrote.
	observed     lockRecord
	observedRaw  string
	observedTime time.Time
}

// lockRecord is the election's record of the lock, client-go's
// LeaderElectionRecord.
type lockRecord struct {
	holder       string
	leaseSeconds int
	acquired     time.Time
	renewed      time.Time
	transitions  int
}

// holderSeparator separates the node name from the process instance in a
// holder identity; instances are hexadecimal.
const holderSeparator = "_"

// leaseGroupVersion is the group and version of the Lease.
var leaseGroupVersion = schema.GroupVersion{Group: "coordination.k8s.io", Version: "v1"}

func newGCElection(s *Store, timings electionTimings) *gcElection {
	e := &gcElection{
		s:       s,
		name:    fmt.Sprintf("identity-gc-%d", s.cluster.ID),
		id:      s.node + holderSeparator + s.claim.Instance,
		timings: timings,
	}
	e.locks, e.err = electionLocks(s.rest, s.nodeClient, s.cfg.leaseNamespace(), e.name)
	return e
}

// electionLocks are the election's locks named name, in the order they
// are taken: the IdentityLease, which own reads and writes, and the Lease
// in namespace ns on the API server of cfg.
func electionLocks(cfg *rest.Config, own *rest.RESTClient, ns, name string) ([]*electionLock, error) {
	// The client decodes the API server's errors (a Status) in the
	// Lease's group version; the lock itself is read as JSON.
	scheme := newScheme()
	metav1.AddToGroupVersion(scheme, leaseGroupVersion)
	leases, err := restClient(cfg, leaseGroupVersion, serializer.NewCodecFactory(scheme))
	if err != nil {
		return nil, err
	}
	return []*electionLock{
		{apiVersion: IdentityGroup + "/" + IdentityVersion, kind: "IdentityLease", what: "IdentityLease " + name,
			resource: "identityleases", client: own},
		{apiVersion: leaseGroupVersion.String(), kind: "Lease", what: "Lease " + ns + "/" + name,
			resource: "leases", namespace: ns, client: leases},
	}, nil
}

// holderNode is the node name in a holder identity.
func holderNode(id string) string {
	if i := strings.LastIndex(id, holderSeparator); i > 0 {
		return id[:i]
	}
	return id
}

// run campaigns until ctx ends: it acquires the lock, collects while it
// renews it, and releases it when ctx ends or a renewal failed for the
// renew deadline; then it campaigns again.
func (e *gcElection) run(ctx context.Context, h cell.Health) {
	e.mu.Lock()
	e.h = h
	e.mu.Unlock()
	err := e.err
	if err == nil {
		// The timings are derived from a validated lease.
		err = e.timings.validate()
	}
	if err != nil {
		e.s.log.Error("Cannot run the garbage collection's election", "error", err)
		if h != nil {
			h.Degraded("Election of the collector", err)
		}
		return
	}
	for ctx.Err() == nil {
		if !e.acquire(ctx) {
			return
		}
		e.debug("became leader")
		term, endTerm := context.WithCancel(ctx)
		e.startLeading(term)
		lost := e.renew(term)
		endTerm()
		e.stopLeading()
		if !lost {
			e.release()
		}
		e.debug("stopped leading")
	}
}

// acquire tries to take the lock until it holds it (true) or ctx ends
// (false), waiting between tries a retry period stretched by up to 2.2.
func (e *gcElection) acquire(ctx context.Context) bool {
	for {
		if e.tryAcquireOrRenew(ctx) {
			return true
		}
		if !sleepCtx(ctx, e.timings.retry+time.Duration(rand.Float64()*electionJitter*float64(e.timings.retry))) {
			return false
		}
	}
}

// electionJitter is client-go's JitterFactor.
const electionJitter = 1.2

// renew renews the lock once per retry period until ctx ends, no try
// succeeded for the renew deadline (retrying every retry period), or the
// term was lost: a read or write of the lock showed another holder, none,
// or no lock at all (deleted or rewritten by hand). A lost term returns
// true at once, even when the try that found it re-created or re-took the
// lock: the term then starts again through acquire and startLeading, as
// the first one did, rather than renewing a lock that no term collects
// under, and the lock is not released, since this node may hold it again.
func (e *gcElection) renew(ctx context.Context) (lost bool) {
	for {
		deadline := time.Now().Add(e.timings.renewDeadline)
		for !e.tryAcquireOrRenew(ctx) {
			if ctx.Err() != nil {
				return false
			}
			if e.leading() == nil {
				return true
			}
			if time.Until(deadline) < e.timings.retry {
				e.s.log.Info("Failed to renew the collector lock", "lock", e.name, "renewDeadline", e.timings.renewDeadline)
				return false
			}
			if !sleepCtx(ctx, e.timings.retry) {
				return false
			}
		}
		if e.leading() == nil {
			if ctx.Err() != nil {
				return false
			}
			e.s.log.Info("The collector lock changed under this node's term; campaigning again", "lock", e.name)
			return true
		}
		if !sleepCtx(ctx, e.timings.retry) {
			return false
		}
	}
}

// release gives the locks up that this node holds, the Lease first, so
// that another node takes them at once instead of after the lease: a
// record without a holder and with a lease of one second. It runs after
// the store's stop too, so its requests have their own deadline.
func (e *gcElection) release() {
	for i := len(e.locks) - 1; i >= 0; i-- {
		l := e.locks[i]
		if l.observed.holder != e.id {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), e.timings.renewDeadline)
		if err := e.releaseLock(ctx, l); err != nil {
			e.s.log.Info("Failed to release the collector lock", "lock", l.what, "error", err)
		}
		cancel()
	}
}

// releaseTries bounds the writes of one release that the lock's
// precondition refuses.
const releaseTries = 3

// releaseLock writes lock l without a holder. The write's precondition is
// the resourceVersion this node last saw, which is stale when the lock
// was written behind it: a renewal that the stop cancelled after the
// server had applied it, or an edit of the lock's metadata. Such a
// Conflict is followed by a read, and the write is tried again as long as
// the read shows this node holding the lock; otherwise the lock is not
// this node's to release.
func (e *gcElection) releaseLock(ctx context.Context, l *electionLock) error {
	var err error
	for range releaseTries {
		now := time.Now()
		rec := lockRecord{leaseSeconds: 1, acquired: now, renewed: now, transitions: l.observed.transitions}
		if err = e.update(ctx, l, rec); err == nil {
			l.setObserved(rec)
			return nil
		}
		if !apierrors.IsConflict(err) {
			return err
		}
		cur, _, err := e.get(ctx, l)
		if err != nil {
			return err
		}
		if cur.holder != e.id {
			return nil
		}
		l.observed.transitions = cur.transitions
	}
	return err
}

// tryAcquireOrRenew takes or renews every lock, in order, and reports
// whether this node holds them all: a lock held by another node ends the
// try, leaving the ones after it alone.
//
// A holder writes the locks in order and stops at the first it cannot
// write, and ends its term when it could not renew them for the renew
// deadline, which is shorter than the lease. So once the first lock shows
// its holder's lease passed, that holder collects no more, and a later
// lock that still names it is taken at once: each lock's lease counted
// from when this node first read it would put a takeover after a
// killed holder at one lease per lock.
func (e *gcElection) tryAcquireOrRenew(ctx context.Context) bool {
	gone := ""
	for _, l := range e.locks {
		ok, from := e.tryLock(ctx, l, gone)
		if !ok {
			return false
		}
		if from != "" {
			gone = from
		}
	}
	return true
}

// tryLock is one try on lock l, as client-go's tryAcquireOrRenew: a
// holder whose lease has not passed (on this node's clock) renews with a
// PUT alone; otherwise the lock is read, created when missing, left alone
// when another holder's lease has not passed, and written (taken or
// renewed) with the read's resourceVersion as precondition. A lock held
// by gone, whose term an earlier lock showed over, is taken whatever its
// lease. from is the other holder this try took the lock from.
func (e *gcElection) tryLock(ctx context.Context, l *electionLock, gone string) (ok bool, from string) {
	now := time.Now()
	rec := lockRecord{
		holder:       e.id,
		leaseSeconds: int(e.timings.lease / time.Second),
		acquired:     now,
		renewed:      now,
	}
	if l.observed.holder == e.id && l.leaseValid(now) {
		rec.acquired, rec.transitions = l.observed.acquired, l.observed.transitions
		if err := e.update(ctx, l, rec); err == nil {
			l.setObserved(rec)
			return true, ""
		}
		// Read the lock and try again below.
	}

	old, raw, err := e.get(ctx, l)
	switch {
	case apierrors.IsNotFound(err):
		if err := e.create(ctx, l, rec); err != nil {
			return false, ""
		}
		l.setObserved(rec)
		return true, ""
	case err != nil:
		return false, ""
	}
	if raw != l.observedRaw {
		l.setObserved(*old)
		l.observedRaw = raw
	}
	if old.holder != "" && old.holder != e.id && old.holder != gone && l.leaseValid(now) {
		return false, ""
	}
	if old.holder == e.id {
		rec.acquired, rec.transitions = old.acquired, old.transitions
	} else {
		rec.transitions = old.transitions + 1
	}
	if err := e.update(ctx, l, rec); err != nil {
		return false, ""
	}
	l.setObserved(rec)
	if old.holder != e.id {
		from = old.holder
	}
	return true, from
}

// leaseValid: the observed holder's lease, counted from when this node saw
// the record, has not passed.
func (l *electionLock) leaseValid(now time.Time) bool {
	return l.observedTime.Add(time.Duration(l.observed.leaseSeconds) * time.Second).After(now)
}

func (l *electionLock) setObserved(r lockRecord) {
	l.observed, l.observedTime = r, time.Now()
}

// sleepCtx waits d; false when ctx ended first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func (e *gcElection) debug(what string) {
	e.s.log.Debug("Garbage collection election", "lock", e.name, "event", what)
}

// startLeading starts a term: unless a read showed another holder
// meanwhile, this node collects until its term ends.
func (e *gcElection) startLeading(ctx context.Context) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if ctx.Err() != nil || e.holder != e.id || e.term != nil {
		return
	}
	e.term, e.endTerm = context.WithCancel(ctx)
	e.s.log.Info("This node collects the cluster's unused global identities", "lock", e.name)
	e.reportLocked("This node collects", nil)
}

// stopLeading ends this node's term: at the end of the renewals (one that
// failed for the renew deadline, or the store's stop), or at a read or
// write of the lock that names another holder. An in-flight collection
// ends with it.
func (e *gcElection) stopLeading() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.stopLeadingLocked()
}

func (e *gcElection) stopLeadingLocked() {
	if e.endTerm == nil {
		return
	}
	e.endTerm()
	e.term, e.endTerm = nil, nil
	e.s.log.Info("This node no longer collects the cluster's unused global identities", "lock", e.name)
}

// leading returns the context of this node's term, nil when it does not
// collect.
func (e *gcElection) leading() context.Context {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.term
}

// leader returns the node that the lock last showed holding it ("" when
// none), and whether this node collects.
func (e *gcElection) leader() (string, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return holderNode(e.holder), e.term != nil
}

// observe records lock l as read or written (nil: found missing): a
// holder other than this node, of either lock, ends its term.
func (e *gcElection) observe(l *electionLock, obj *IdentityLease) {
	e.mu.Lock()
	defer e.mu.Unlock()
	l.cur, l.holder = obj, ""
	if obj != nil && obj.Spec.HolderIdentity != nil {
		l.holder = *obj.Spec.HolderIdentity
	}
	e.holder = ""
	for i := len(e.locks) - 1; i >= 0 && e.holder == ""; i-- {
		e.holder = e.locks[i].holder
	}
	if l.holder != e.id {
		e.stopLeadingLocked()
	}
	switch {
	case e.term != nil:
		e.reportLocked("This node collects", nil)
	case e.holder == e.id:
		// Held, not yet started (or renewed after a lost term).
	case e.holder == "":
		e.reportLocked("No node collects", nil)
	default:
		e.reportLocked(fmt.Sprintf("Node %s collects", holderNode(e.holder)), nil)
	}
}

// failed reports a request on lock l that failed.
func (e *gcElection) failed(l *electionLock, what string, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.reportLocked(what+" "+l.what+" failed", err)
}

// reportLocked tells the election job's health, once per change.
func (e *gcElection) reportLocked(msg string, err error) {
	key := msg
	if err != nil {
		key += ": " + err.Error()
	}
	if e.h == nil || key == e.reported {
		return
	}
	e.reported = key
	if err != nil {
		// Not a readiness matter: the collection is the cluster's work,
		// not this node's, an unreachable API server is reported by the
		// Kubernetes client already, and the next read of the lock may be
		// an eighth of the IdentityNode lease away: a Degraded report
		// would hold readiness that long after the server is back.
		e.h.OK(fmt.Sprintf("%s, retrying: %v", msg, err))
		return
	}
	e.h.OK(msg)
}

// requestTimeout bounds each request on the lock, as client-go advises
// for its own locks: a hung request must not outlast the renew deadline.
func (e *gcElection) requestTimeout() time.Duration {
	return max(time.Second, e.timings.renewDeadline/2)
}

// request is r on the object name ("" for the collection) of lock l's
// kind, as JSON: both kinds have a Lease's metadata and spec, which
// IdentityLease decodes.
func (l *electionLock) request(r *rest.Request, name string) *rest.Request {
	r = r.Resource(l.resource).SetHeader("Content-Type", runtime.ContentTypeJSON)
	if l.namespace != "" {
		r = r.Namespace(l.namespace)
	}
	if name != "" {
		r = r.Name(name)
	}
	return r
}

// doRaw sends r and returns the answer's body, or the API server's error
// as its Status says it (Raw alone leaves an error "unknown").
func doRaw(ctx context.Context, r *rest.Request) ([]byte, error) {
	res := r.Do(ctx)
	body, err := res.Raw()
	if err != nil {
		return nil, res.Error()
	}
	return body, nil
}

// decodeLock decodes the answer of a request on a lock.
func decodeLock(body []byte, l *electionLock) (*IdentityLease, error) {
	var obj IdentityLease
	if err := json.Unmarshal(body, &obj); err != nil {
		return nil, fmt.Errorf("decoding %s: %w", l.what, err)
	}
	return &obj, nil
}

// get is one GET of lock l, and its resourceVersion, which every write
// changes.
func (e *gcElection) get(ctx context.Context, l *electionLock) (*lockRecord, string, error) {
	ctx, cancel := context.WithTimeout(ctx, e.requestTimeout())
	defer cancel()
	body, err := doRaw(ctx, l.request(l.client.Get(), e.name))
	var obj *IdentityLease
	if err == nil {
		obj, err = decodeLock(body, l)
	}
	switch {
	case apierrors.IsNotFound(err):
		e.observe(l, nil)
		return nil, "", err
	case err != nil:
		if ctx.Err() == nil {
			e.failed(l, "Reading", err)
		}
		return nil, "", err
	}
	e.observe(l, obj)
	r := leaseRecord(&obj.Spec)
	if p := e.s.predecessor.Load(); p != nil && r.holder == *p {
		// The gone agent of this node name (killed: it released
		// nothing) holds the lock. Waiting for its lease to run out
		// would leave the cluster without a collector, and in the
		// double-write modes without a convergence report, for most of
		// an IdentityNode lease: a lock shown without a holder is taken
		// at once, and the PUT's precondition still refuses it if anyone
		// wrote the lock since this read.
		e.s.log.Info("Taking over the collector lock from the gone agent of this node name", "lock", l.what, "previous", *p)
		r.holder = ""
	}
	return r, obj.ResourceVersion, nil
}

// create is the first holder's POST of lock l.
func (e *gcElection) create(ctx context.Context, l *electionLock, r lockRecord) error {
	ctx, cancel := context.WithTimeout(ctx, e.requestTimeout())
	defer cancel()
	obj := &IdentityLease{
		TypeMeta:   metav1.TypeMeta{APIVersion: l.apiVersion, Kind: l.kind},
		ObjectMeta: metav1.ObjectMeta{Name: e.name, Namespace: l.namespace},
		Spec:       leaseSpec(r),
	}
	body, err := json.Marshal(obj)
	if err != nil {
		return err
	}
	answer, err := doRaw(ctx, l.request(l.client.Post(), "").Body(body))
	var got *IdentityLease
	if err == nil {
		got, err = decodeLock(answer, l)
	}
	if err != nil {
		if !apierrors.IsAlreadyExists(err) && ctx.Err() == nil {
			e.failed(l, "Creating", err)
		}
		return err
	}
	e.observe(l, got)
	return nil
}

// errLockNotRead: an update needs the lock's resourceVersion.
var errLockNotRead = errors.New("the lock was not read yet")

// update is a PUT of lock l with the resourceVersion of its last read or
// write, which the API server refuses (Conflict) when another node wrote
// the lock since.
func (e *gcElection) update(ctx context.Context, l *electionLock, r lockRecord) error {
	e.mu.Lock()
	cur := l.cur
	e.mu.Unlock()
	if cur == nil {
		return errLockNotRead
	}
	ctx, cancel := context.WithTimeout(ctx, e.requestTimeout())
	defer cancel()
	obj := cur.DeepCopy()
	obj.APIVersion, obj.Kind = l.apiVersion, l.kind
	obj.Spec = leaseSpec(r)
	body, err := json.Marshal(obj)
	if err != nil {
		return err
	}
	answer, err := doRaw(ctx, l.request(l.client.Put(), e.name).Body(body))
	var got *IdentityLease
	if err == nil {
		got, err = decodeLock(answer, l)
	}
	if err != nil {
		if !apierrors.IsConflict(err) && ctx.Err() == nil {
			e.failed(l, "Writing", err)
		}
		return err
	}
	e.observe(l, got)
	return nil
}

// leaseRecord is the election's record of a lock's spec.
func leaseRecord(spec *IdentityLeaseSpec) *lockRecord {
	r := &lockRecord{}
	if spec.HolderIdentity != nil {
		r.holder = *spec.HolderIdentity
	}
	if spec.LeaseDurationSeconds != nil {
		r.leaseSeconds = int(*spec.LeaseDurationSeconds)
	}
	if spec.AcquireTime != nil {
		r.acquired = spec.AcquireTime.Time
	}
	if spec.RenewTime != nil {
		r.renewed = spec.RenewTime.Time
	}
	if spec.LeaseTransitions != nil {
		r.transitions = int(*spec.LeaseTransitions)
	}
	return r
}

// leaseSpec is the spec of an election record.
func leaseSpec(r lockRecord) IdentityLeaseSpec {
	duration := int32(r.leaseSeconds)
	transitions := int32(r.transitions)
	acquired := metav1.NewMicroTime(r.acquired)
	renewed := metav1.NewMicroTime(r.renewed)
	return IdentityLeaseSpec{
		HolderIdentity:       &r.holder,
		LeaseDurationSeconds: &duration,
		AcquireTime:          &acquired,
		RenewTime:            &renewed,
		LeaseTransitions:     &transitions,
	}
}

// GCLeader returns the node that collects, as this node last read the
// lock ("" when none does, or it was not read), and whether it is this
// one. A node whose --identity-gc-interval is 0 takes no part: "", false.
func (s *Store) GCLeader() (holder string, self bool) {
	el := s.election.Load()
	if el == nil {
		return "", false
	}
	return el.leader()
}
