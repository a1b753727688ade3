package crdstore

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// TestRestartKeepsEarlierRecord: a restarted node keeps listing the
// identities its earlier process recorded until that record's lease would
// have ended, so that a restart does not end its claims sooner than its
// death would; then the record lists only what the new process holds.
func TestRestartKeepsEarlierRecord(t *testing.T) {
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	a := startNode(t, srv.RESTConfig(), "node-a")
	x, _ := a.allocate(t, web(1))
	y, _ := a.allocate(t, web(2))
	cli.nodeLists(t, "node-a", x, y)
	a.stop()

	// The earlier record's lease ends a few seconds from now.
	const left = 6 * time.Second
	renew := time.Now().Add(left - DefaultConfig.IdentityNodeLeaseTTL).UTC().Format(time.RFC3339Nano)
	patch := fmt.Appendf(nil, `{"spec":{"renewTime":%q}}`, renew)
	if err := cli.nodes.Patch(types.MergePatchType).Resource("identitynodes").Name("node-a").Body(patch).Do(context.Background()).Error(); err != nil {
		t.Fatal(err)
	}
	restarted := time.Now()

	a2 := startNode(t, srv.RESTConfig(), "node-a")
	z, _ := a2.allocate(t, web(3))
	cli.nodeLists(t, "node-a", x, y, z)
	if time.Since(restarted) > left {
		t.Fatalf("the check took %s, longer than the earlier lease's rest (%s): make it longer", time.Since(restarted), left)
	}
	// Once the earlier lease has ended, only what the new process
	// holds.
	cli.nodeLists(t, "node-a", z)
	if took := time.Since(restarted); took < left-time.Second {
		t.Errorf("the earlier identities left the record after %s, before the earlier lease ended (%s)", took, left)
	}
}

// TestRestartAfterExpiredRecord: a record whose lease has ended protects
// nothing, and the restarted node does not bring its identities back.
func TestRestartAfterExpiredRecord(t *testing.T) {
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	a := startNode(t, srv.RESTConfig(), "node-a")
	x, _ := a.allocate(t, web(1))
	cli.nodeLists(t, "node-a", x)
	a.stop()
	renew := time.Now().Add(-2 * DefaultConfig.IdentityNodeLeaseTTL).UTC().Format(time.RFC3339Nano)
	patch := fmt.Appendf(nil, `{"spec":{"renewTime":%q}}`, renew)
	if err := cli.nodes.Patch(types.MergePatchType).Resource("identitynodes").Name("node-a").Body(patch).Do(context.Background()).Error(); err != nil {
		t.Fatal(err)
	}
	a2 := startNode(t, srv.RESTConfig(), "node-a")
	z, _ := a2.allocate(t, web(3))
	cli.nodeLists(t, "node-a", z)
}

// errorLog passes records on to next and keeps the messages of error
// records in msgs, shared by the handlers WithAttrs and WithGroup derive.
type errorLog struct {
	msgs *errorMsgs
	next slog.Handler
}

type errorMsgs struct {
	mu   sync.Mutex
	msgs []string
}

func newErrorLog(next slog.Handler) errorLog { return errorLog{msgs: &errorMsgs{}, next: next} }

func (l errorLog) Enabled(ctx context.Context, lvl slog.Level) bool {
	return lvl >= slog.LevelError || l.next.Enabled(ctx, lvl)
}

func (l errorLog) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError {
		l.msgs.mu.Lock()
		l.msgs.msgs = append(l.msgs.msgs, r.Message)
		l.msgs.mu.Unlock()
	}
	if l.next.Enabled(ctx, r.Level) {
		return l.next.Handle(ctx, r)
	}
	return nil
}

func (l errorLog) WithAttrs(as []slog.Attr) slog.Handler {
	return errorLog{msgs: l.msgs, next: l.next.WithAttrs(as)}
}

func (l errorLog) WithGroup(g string) slog.Handler {
	return errorLog{msgs: l.msgs, next: l.next.WithGroup(g)}
}

func (l errorLog) has(sub string) bool {
	l.msgs.mu.Lock()
	defer l.msgs.mu.Unlock()
	for _, m := range l.msgs.msgs {
		if strings.Contains(m, sub) {
			return true
		}
	}
	return false
}

// TestDuplicateNodeName: two processes with the same --node-name write one
// IdentityNode; each write carries the resourceVersion of the writer's
// last one, so the second writer's write shows as a conflict and both
// report it, instead of erasing each other's uses unnoticed.
func TestDuplicateNodeName(t *testing.T) {
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	logA := newErrorLog(testLogger(t).Handler())
	logB := newErrorLog(testLogger(t).Handler())
	a := startNode(t, srv.RESTConfig(), "node-a", func(o *nodeOpts) { o.log = slog.New(logA) })
	x, _ := a.allocate(t, web(1))
	cli.nodeLists(t, "node-a", x)
	b := startNode(t, srv.RESTConfig(), "node-a", func(o *nodeOpts) { o.log = slog.New(logB) })
	y, _ := b.allocate(t, web(2))
	cli.nodeLists(t, "node-a", x, y) // b carries a's live record
	a.allocate(t, web(3))
	const want = "written by someone else"
	require(t, 30*time.Second, func() error {
		if !logA.has(want) {
			return fmt.Errorf("node-a logged no error %q after node-b wrote its record", want)
		}
		return nil
	})
	b.allocate(t, web(4))
	require(t, 30*time.Second, func() error {
		if !logB.has(want) {
			return fmt.Errorf("node-b logged no error %q after node-a wrote its record", want)
		}
		return nil
	})
}

// TestRecordTimesInAnyRFC3339Form: the CRD's date-time format admits
// renewTime with any number of fractional digits, or none, and such a
// record written by hand must neither break the watch of every record nor
// be misread.
func TestRecordTimesInAnyRFC3339Form(t *testing.T) {
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	now := time.Now().UTC()
	forms := map[string]string{
		"seconds": now.Format(time.RFC3339),
		"nanos":   now.Format(time.RFC3339Nano),
		"offset":  now.In(time.FixedZone("", 2*3600)).Format("2006-01-02T15:04:05.000+02:00"),
	}
	for name, ts := range forms {
		body := fmt.Appendf(nil, `{"apiVersion":"identityd.io/v1","kind":"IdentityNode","metadata":{"name":%q},"spec":{"identities":[70000],"renewTime":%q,"leaseDurationSeconds":60}}`, name, ts)
		if err := cli.nodes.Post().Resource("identitynodes").Body(body).SetHeader("Content-Type", "application/json").Do(context.Background()).Error(); err != nil {
			t.Fatalf("creating IdentityNode %s with renewTime %s: %v", name, ts, err)
		}
	}
	a := startNode(t, srv.RESTConfig(), "node-a")
	require(t, 30*time.Second, func() error {
		nodes, _ := a.store.nodes.Nodes()
		seen := 0
		for _, n := range nodes {
			if _, ok := forms[n.Name]; !ok {
				continue
			}
			seen++
			if d := n.Spec.RenewTime.Sub(now); d > time.Second || d < -time.Second {
				return fmt.Errorf("IdentityNode %s: renewTime read as %s, written %s", n.Name, n.Spec.RenewTime.UTC(), forms[n.Name])
			}
			if n.Expired(metav1.Now()) {
				return fmt.Errorf("IdentityNode %s read as expired", n.Name)
			}
		}
		if seen != len(forms) {
			return fmt.Errorf("the watch shows %d of the %d records", seen, len(forms))
		}
		return nil
	})
}
