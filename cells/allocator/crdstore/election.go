package crdstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/leaderelection"
	rl "k8s.io/client-go/tools/leaderelection/resourcelock"
)

// One node per cluster runs the garbage collection: the holder of the
// IdentityLease identity-gc-<cluster ID>, elected by client-go's leader
// election over that object. Others read the lock once per retry period
// (a GET, no watch: a watch would bring every renewal to every node) and
// take it when its holder has not renewed it for its lease duration, or at
// once when the holder released it (a clean stop). The collection's
// correctness does not rest on there being one collector (RunGC's
// preconditions make two safe); the election only keeps the cluster's
// listings and marks from growing with the number of nodes.

// electionTimings are the durations of client-go's leader election.
type electionTimings struct {
	// lease is how long the others wait after the holder's last renewal
	// before they take the lock (whole seconds: the lock states seconds).
	lease time.Duration
	// renewDeadline is how long the holder keeps trying to renew before
	// it stops collecting.
	renewDeadline time.Duration
	// retry is the period of the holder's renewals and of the others'
	// reads, which client-go stretches by a random factor of up to 2.2.
	retry time.Duration
}

// gcElectionTimings derives the election's timings from the IdentityNode
// lease ttl, so that a node killed while it collects is replaced within
// one IdentityNode lease: the others notice its last renewal at most 2.2
// retry periods after it, and take the lock at most 2.2 retry periods
// after a lease has passed from then, so within lease + 4.4 × retry =
// 0.95 × ttl. client-go requires lease > renewDeadline > 1.2 × retry.
func gcElectionTimings(ttl time.Duration) electionTimings {
	return electionTimings{
		lease:         (ttl * 2 / 5).Truncate(time.Second),
		renewDeadline: ttl * 3 / 10,
		retry:         ttl / 8,
	}
}

// gcElection is this node's side of the election, and the lock
// (resourcelock.Interface) client-go's elector drives: an IdentityLease
// read with GET and written with POST and PUT, each PUT carrying the
// resourceVersion of the last read or write as precondition.
type gcElection struct {
	s *Store
	// name is the lock object's, id this process's holder identity.
	name, id string
	timings  electionTimings

	mu sync.Mutex
	// cur is the lock as last read or written.
	cur *IdentityLease
	// holder is the holder identity cur names ("" when free or unknown).
	holder string
	// term is the context of this node's term as collector, nil while
	// another node (or none) collects; endTerm ends it.
	term    context.Context
	endTerm context.CancelFunc
	// h is the election job's health; reported is what it last said.
	h        cell.Health
	reported string
}

var _ rl.Interface = (*gcElection)(nil)

// holderSeparator separates the node name from the process instance in a
// holder identity; instances are hexadecimal.
const holderSeparator = "_"

func newGCElection(s *Store, timings electionTimings) *gcElection {
	return &gcElection{
		s:       s,
		name:    fmt.Sprintf("identity-gc-%d", s.cluster.ID),
		id:      s.node + holderSeparator + s.claim.Instance,
		timings: timings,
	}
}

// holderNode is the node name in a holder identity.
func holderNode(id string) string {
	if i := strings.LastIndex(id, holderSeparator); i > 0 {
		return id[:i]
	}
	return id
}

// run campaigns until ctx ends: client-go's elector acquires the lock,
// renews it while this node collects, and releases it when ctx ends.
func (e *gcElection) run(ctx context.Context, h cell.Health) {
	e.mu.Lock()
	e.h = h
	e.mu.Unlock()
	ctx = logr.NewContext(ctx, logr.FromSlogHandler(e.s.log.With("lock", e.name).Handler()))
	for ctx.Err() == nil {
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock:            e,
			Name:            e.name,
			LeaseDuration:   e.timings.lease,
			RenewDeadline:   e.timings.renewDeadline,
			RetryPeriod:     e.timings.retry,
			ReleaseOnCancel: true,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: e.startLeading,
				OnStoppedLeading: e.stopLeading,
			},
		})
		if err != nil {
			// The timings are derived from a validated lease.
			e.s.log.Error("Cannot run the garbage collection's election", "error", err)
			if h != nil {
				h.Degraded("Election of the collector", err)
			}
			return
		}
		// Run returns once this node's term ended (a lost renewal): it
		// campaigns again.
		le.Run(ctx)
	}
}

// startLeading is client-go's start of a term: unless a read showed
// another holder meanwhile, this node collects until its term ends.
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

// stopLeading ends this node's term: client-go's end of it (a renewal that
// failed for the renew deadline, or the store's stop), or a read or write
// of the lock that names another holder. An in-flight collection ends
// with it.
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

// observe records the lock as read or written: a holder other than this
// node ends its term.
func (e *gcElection) observe(l *IdentityLease) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.cur, e.holder = l, ""
	if l != nil && l.Spec.HolderIdentity != nil {
		e.holder = *l.Spec.HolderIdentity
	}
	if e.holder != e.id {
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

// failed reports a request on the lock that failed.
func (e *gcElection) failed(what string, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.reportLocked(what+" IdentityLease "+e.name+" failed", err)
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

// Get implements resourcelock.Interface: one GET of the lock. The raw
// record client-go compares to notice a renewal is the resourceVersion,
// which every write changes.
func (e *gcElection) Get(ctx context.Context) (*rl.LeaderElectionRecord, []byte, error) {
	ctx, cancel := context.WithTimeout(ctx, e.requestTimeout())
	defer cancel()
	var l IdentityLease
	err := e.s.nodeClient.Get().Resource("identityleases").Name(e.name).Do(ctx).Into(&l)
	switch {
	case apierrors.IsNotFound(err):
		e.observe(nil)
		return nil, nil, err
	case err != nil:
		if ctx.Err() == nil {
			e.failed("Reading", err)
		}
		return nil, nil, err
	}
	e.observe(&l)
	r := leaseRecord(&l.Spec)
	if p := e.s.predecessor.Load(); p != nil && r.HolderIdentity == *p {
		// The gone agent of this node name (killed: it released
		// nothing) holds the lock. Waiting for its lease to run out
		// would leave the cluster without a collector, and in the
		// double-write modes without a convergence report, for most of
		// an IdentityNode lease: client-go takes a lock shown without a
		// holder at once, and the PUT's precondition still refuses it
		// if anyone wrote the lock since this read.
		e.s.log.Info("Taking over the collector lock from the gone agent of this node name", "lock", e.name, "previous", *p)
		r.HolderIdentity = ""
	}
	return r, []byte(l.ResourceVersion), nil
}

// Create implements resourcelock.Interface: the first holder creates the
// lock.
func (e *gcElection) Create(ctx context.Context, r rl.LeaderElectionRecord) error {
	ctx, cancel := context.WithTimeout(ctx, e.requestTimeout())
	defer cancel()
	obj := &IdentityLease{
		TypeMeta:   metav1.TypeMeta{APIVersion: IdentityGroup + "/" + IdentityVersion, Kind: "IdentityLease"},
		ObjectMeta: metav1.ObjectMeta{Name: e.name},
		Spec:       leaseSpec(r),
	}
	var got IdentityLease
	if err := e.s.nodeClient.Post().Resource("identityleases").Body(obj).Do(ctx).Into(&got); err != nil {
		if !apierrors.IsAlreadyExists(err) && ctx.Err() == nil {
			e.failed("Creating", err)
		}
		return err
	}
	e.observe(&got)
	return nil
}

// errLockNotRead: an update needs the lock's resourceVersion.
var errLockNotRead = errors.New("the IdentityLease was not read yet")

// Update implements resourcelock.Interface: a PUT with the resourceVersion
// of the last read or write, which the API server refuses (Conflict) when
// another node wrote the lock since.
func (e *gcElection) Update(ctx context.Context, r rl.LeaderElectionRecord) error {
	e.mu.Lock()
	cur := e.cur
	e.mu.Unlock()
	if cur == nil {
		return errLockNotRead
	}
	ctx, cancel := context.WithTimeout(ctx, e.requestTimeout())
	defer cancel()
	obj := cur.DeepCopy()
	obj.Spec = leaseSpec(r)
	var got IdentityLease
	if err := e.s.nodeClient.Put().Resource("identityleases").Name(e.name).Body(obj).Do(ctx).Into(&got); err != nil {
		if !apierrors.IsConflict(err) && ctx.Err() == nil {
			e.failed("Writing", err)
		}
		return err
	}
	e.observe(&got)
	return nil
}

// RecordEvent implements resourcelock.Interface: no Kubernetes events, a
// debug log.
func (e *gcElection) RecordEvent(what string) {
	e.s.log.Debug("Garbage collection election", "lock", e.name, "event", what)
}

// Identity implements resourcelock.Interface.
func (e *gcElection) Identity() string { return e.id }

// Describe implements resourcelock.Interface.
func (e *gcElection) Describe() string { return "identityleases/" + e.name }

// leaseRecord is client-go's view of a lock's spec.
func leaseRecord(spec *IdentityLeaseSpec) *rl.LeaderElectionRecord {
	r := &rl.LeaderElectionRecord{}
	if spec.HolderIdentity != nil {
		r.HolderIdentity = *spec.HolderIdentity
	}
	if spec.LeaseDurationSeconds != nil {
		r.LeaseDurationSeconds = int(*spec.LeaseDurationSeconds)
	}
	if spec.AcquireTime != nil {
		r.AcquireTime = metav1.NewTime(spec.AcquireTime.Time)
	}
	if spec.RenewTime != nil {
		r.RenewTime = metav1.NewTime(spec.RenewTime.Time)
	}
	if spec.LeaseTransitions != nil {
		r.LeaderTransitions = int(*spec.LeaseTransitions)
	}
	return r
}

// leaseSpec is the spec of client-go's record.
func leaseSpec(r rl.LeaderElectionRecord) IdentityLeaseSpec {
	duration := int32(r.LeaseDurationSeconds)
	transitions := int32(r.LeaderTransitions)
	acquired := metav1.NewMicroTime(r.AcquireTime.Time)
	renewed := metav1.NewMicroTime(r.RenewTime.Time)
	return IdentityLeaseSpec{
		HolderIdentity:       &r.HolderIdentity,
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
