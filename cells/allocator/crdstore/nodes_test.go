package crdstore

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/globalstore"
)

// TestRestartKeepsEarlierRecord: a restarted node keeps listing the
// identities its earlier process recorded until that record's lease would
// have ended, so that a restart does not end its claims sooner than its
// death would; then the record lists only what the new process holds.
func TestRestartKeepsEarlierRecord(t *testing.T) {
	srv := serialServer(t)
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
	t.Parallel()
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

// logMsgs are the messages a levelLog recorded, shared by the handlers
// WithAttrs and WithGroup derive.
type logMsgs struct {
	mu   sync.Mutex
	msgs []string
}

// TestDuplicateNodeName: a second agent with the node name of a live one
// refuses to start, naming the first; a write of the record by anyone else
// while the node runs shows as a conflict and is reported.
func TestDuplicateNodeName(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	logA := newLevelLog(slog.LevelError, testLogger(t).Handler())
	var healthA *cell.SimpleHealth
	a := startNode(t, srv.RESTConfig(), "node-a", func(o *nodeOpts) {
		o.log = slog.New(logA)
		o.cells = []cell.Cell{cell.SimpleHealthCell, cell.Invoke(func(h *cell.SimpleHealth) { healthA = h })}
	})
	x, _ := a.allocate(t, web(1))
	cli.nodeLists(t, "node-a", x)

	var err error
	startNode(t, srv.RESTConfig(), "node-a", func(o *nodeOpts) { o.startErr = &err })
	if !errors.Is(err, ErrNodeNameInUse) || !strings.Contains(err.Error(), a.store.claim.Instance) {
		t.Fatalf("second agent with node-a: start error %v, want ErrNodeNameInUse naming instance %s", err, a.store.claim.Instance)
	}
	cli.nodeLists(t, "node-a", x)

	// Someone else writes the record while node-a runs.
	patch := []byte(`{"spec":{"identities":[]}}`)
	if err := cli.nodes.Patch(types.MergePatchType).Resource("identitynodes").Name("node-a").Body(patch).Do(context.Background()).Error(); err != nil {
		t.Fatal(err)
	}
	y, _ := a.allocate(t, web(2))
	const want = "written by someone else"
	require(t, 30*time.Second, func() error {
		if logA.count(want) == 0 {
			return fmt.Errorf("node-a logged no error %q after another writer changed its record", want)
		}
		return nil
	})
	cli.nodeLists(t, "node-a", x, y)
	// The writer's health says so, for a lease, after the writes that
	// succeed again (it reports once the write that lists y returned,
	// a moment after the record shows it).
	require(t, 5*time.Second, func() error {
		writer := healthA.GetChild("job-identity-node-writer")
		if writer == nil {
			return errors.New("no health scope job-identity-node-writer")
		}
		writer.Lock()
		level, status := writer.Level, writer.Status
		writer.Unlock()
		if level != cell.StatusDegraded || !strings.Contains(status, "shared") {
			return fmt.Errorf("identity-node-writer health %s %q after another writer, want Degraded naming the shared record", level, status)
		}
		return nil
	})
}

// TestNodeNameHolders: whose record a starting node takes over. A live
// record of another host blocks the name until its lease ends; one of this
// host whose process has ended (a restart after SIGKILL) is taken over with
// its identities; an expired one protects nothing.
func TestNodeNameHolders(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	host, _ := os.Hostname()
	ended := exec.Command("true")
	if err := ended.Run(); err != nil {
		t.Fatal(err)
	}
	record := func(name string, holder globalstore.NodeClaim, renewed time.Time) {
		t.Helper()
		obj := &IdentityNode{
			TypeMeta:   metav1.TypeMeta{APIVersion: IdentityGroup + "/" + IdentityVersion, Kind: "IdentityNode"},
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: IdentityNodeSpec{
				Identities:           []uint32{70001},
				RenewTime:            metav1.NewMicroTime(renewed),
				LeaseDurationSeconds: 60,
				Holder:               &holder,
			},
		}
		if err := cli.nodes.Post().Resource("identitynodes").Body(obj).Do(context.Background()).Error(); err != nil {
			t.Fatal(err)
		}
	}
	record("remote", globalstore.NodeClaim{Instance: "feedface", Host: host + "-elsewhere", PID: os.Getpid()}, time.Now())
	record("remote-expired", globalstore.NodeClaim{Instance: "feedface", Host: host + "-elsewhere", PID: os.Getpid()}, time.Now().Add(-2*time.Minute))
	record("restarted", globalstore.NodeClaim{Instance: "deadbeef", Host: host, PID: ended.Process.Pid}, time.Now())

	var err error
	startNode(t, srv.RESTConfig(), "remote", func(o *nodeOpts) { o.startErr = &err })
	if !errors.Is(err, ErrNodeNameInUse) || !strings.Contains(err.Error(), "feedface") {
		t.Errorf("start on a live record of another host: %v, want ErrNodeNameInUse naming it", err)
	}
	startNode(t, srv.RESTConfig(), "remote-expired")
	cli.nodeLists(t, "remote-expired")
	r := startNode(t, srv.RESTConfig(), "restarted")
	cli.nodeLists(t, "restarted", 70001)
	// The writer job names the new holder at its first write, after the
	// start.
	require(t, 30*time.Second, func() error {
		if n, err := cli.node(t, "restarted"); err != nil || n.Spec.Holder == nil || n.Spec.Holder.Instance != r.store.claim.Instance {
			return fmt.Errorf("record after the take-over: %+v, %v; want holder %s", n.Spec, err, r.store.claim)
		}
		return nil
	})
}

// TestRecordTimesInAnyRFC3339Form: the CRD's date-time format admits
// renewTime with any number of fractional digits, or none, and such a
// record written by hand must neither break the collector's listing of
// every record nor be misread.
func TestRecordTimesInAnyRFC3339Form(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	now := time.Now().UTC()
	forms := map[string]string{
		"seconds": now.Format(time.RFC3339),
		"nanos":   now.Format(time.RFC3339Nano),
		// -07:00 is the layout's zone; a literal +02:00 would be read
		// as "+" and the day of the month.
		"offset": now.In(time.FixedZone("", 2*3600)).Format("2006-01-02T15:04:05.000-07:00"),
	}
	for name, ts := range forms {
		body := fmt.Appendf(nil, `{"apiVersion":"identityd.io/v1","kind":"IdentityNode","metadata":{"name":%q},"spec":{"identities":[70000],"renewTime":%q,"leaseDurationSeconds":60}}`, name, ts)
		if err := cli.nodes.Post().Resource("identitynodes").Body(body).SetHeader("Content-Type", "application/json").Do(context.Background()).Error(); err != nil {
			t.Fatalf("creating IdentityNode %s with renewTime %s: %v", name, ts, err)
		}
	}
	a := startNode(t, srv.RESTConfig(), "node-a")
	require(t, 30*time.Second, func() error {
		nodes, err := a.store.listGCNodes(context.Background())
		if err != nil {
			return err
		}
		seen := 0
		for i := range nodes {
			n := &nodes[i]
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
			return fmt.Errorf("the listing shows %d of the %d records", seen, len(forms))
		}
		return nil
	})
}

// patchLog records the PATCHes of IdentityNode objects a client sends: the
// request's body and the answer's.
type patchLog struct {
	mu      sync.Mutex
	patches []recordedPatch
}

type recordedPatch struct{ request, answer string }

func (l *patchLog) wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripFunc(func(req *http.Request) (*http.Response, error) {
		if req.Method != http.MethodPatch || !strings.Contains(req.URL.Path, "/identitynodes/") {
			return rt.RoundTrip(req)
		}
		var body []byte
		if req.Body != nil {
			b, err := io.ReadAll(req.Body)
			req.Body.Close()
			if err != nil {
				return nil, err
			}
			body = b
			req.Body = io.NopCloser(bytes.NewReader(b))
		}
		resp, err := rt.RoundTrip(req)
		if err != nil {
			return resp, err
		}
		answer, rerr := io.ReadAll(resp.Body)
		resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(answer))
		l.mu.Lock()
		l.patches = append(l.patches, recordedPatch{string(body), string(answer)})
		l.mu.Unlock()
		return resp, rerr
	})
}

func (l *patchLog) take() []recordedPatch {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.patches
	l.patches = nil
	return out
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// TestRenewalSendsOnlyItsTime: a renewal of the IdentityNode record, which
// every node sends every lease/3, patches the renewal time alone and gets
// the object's metadata back, not the record with all its identities; a
// change of the identities still writes them all.
func TestRenewalSendsOnlyItsTime(t *testing.T) {
	srv := serialServer(t)
	cli := newClient(t, srv.RESTConfig())
	var patches patchLog
	rc := rest.CopyConfig(srv.RESTConfig())
	rc.Wrap(patches.wrap)
	a := startNode(t, rc, "node-a")
	ids := a.allocateWeb(t, 20)
	cli.nodeLists(t, "node-a", ids...)
	before, err := cli.node(t, "node-a")
	if err != nil {
		t.Fatal(err)
	}
	patches.take()

	if err := a.store.renewTick(); err != nil {
		t.Fatal(err)
	}
	var renewals []recordedPatch
	require(t, 30*time.Second, func() error {
		renewals = append(renewals, patches.take()...)
		if len(renewals) == 0 {
			return errors.New("no renewal sent")
		}
		return nil
	})
	for _, p := range renewals {
		if strings.Contains(p.request, "identities") {
			t.Errorf("a renewal sent the identities: %s", p.request)
		}
		var answer map[string]json.RawMessage
		if err := json.Unmarshal([]byte(p.answer), &answer); err != nil {
			t.Fatalf("a renewal's answer: %v: %.300s", err, p.answer)
		}
		if _, ok := answer["spec"]; ok || string(answer["kind"]) != `"PartialObjectMetadata"` {
			t.Errorf("a renewal's answer is the whole record (%d bytes), not its metadata: %.300s", len(p.answer), p.answer)
		}
	}
	after, err := cli.node(t, "node-a")
	if err != nil {
		t.Fatal(err)
	}
	if !after.Spec.RenewTime.After(before.Spec.RenewTime.Time) {
		t.Errorf("renewal time %s not after %s", after.Spec.RenewTime.Time, before.Spec.RenewTime.Time)
	}
	cli.nodeLists(t, "node-a", ids...)

	// A release changes the identities: the write lists them all.
	a.release(t, ids[0])
	cli.nodeLists(t, "node-a", ids[1:]...)
	// The answer is logged after the server applied the write.
	require(t, 10*time.Second, func() error {
		for _, p := range patches.take() {
			if strings.Contains(p.request, "identities") {
				return nil
			}
		}
		return errors.New("the write after a release did not send the identities")
	})
}

// levelLog records the messages logged at or above a level, and passes
// every record on.
type levelLog struct {
	min  slog.Level
	msgs *logMsgs
	next slog.Handler
}

func newLevelLog(min slog.Level, next slog.Handler) levelLog {
	return levelLog{min: min, msgs: &logMsgs{}, next: next}
}

func (l levelLog) Enabled(ctx context.Context, lvl slog.Level) bool {
	return lvl >= l.min || l.next.Enabled(ctx, lvl)
}

func (l levelLog) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= l.min {
		l.msgs.mu.Lock()
		l.msgs.msgs = append(l.msgs.msgs, r.Message)
		l.msgs.mu.Unlock()
	}
	if l.next.Enabled(ctx, r.Level) {
		return l.next.Handle(ctx, r)
	}
	return nil
}

func (l levelLog) WithAttrs(as []slog.Attr) slog.Handler {
	return levelLog{min: l.min, msgs: l.msgs, next: l.next.WithAttrs(as)}
}

func (l levelLog) WithGroup(g string) slog.Handler {
	return levelLog{min: l.min, msgs: l.msgs, next: l.next.WithGroup(g)}
}

// count is the number of recorded messages that contain sub.
func (l levelLog) count(sub string) int {
	l.msgs.mu.Lock()
	defer l.msgs.mu.Unlock()
	n := 0
	for _, m := range l.msgs.msgs {
		if strings.Contains(m, sub) {
			n++
		}
	}
	return n
}

// TestDeletedRecordRecreated: this node's IdentityNode deleted under the
// running node (kubectl delete identitynode) is back within seconds,
// listing what the node holds, and the deletion is logged once, as a
// warning; twice deleted, twice written again. Before, it came back at the
// next renewal only, a third of the lease (5 minutes by default) later,
// with nothing logged.
func TestDeletedRecordRecreated(t *testing.T) {
	srv := serialServer(t)
	cli := newClient(t, srv.RESTConfig())
	log := newLevelLog(slog.LevelWarn, testLogger(t).Handler())
	// The Accept headers of the list and watch of the node's own record.
	var (
		acceptsMu sync.Mutex
		accepts   []string
	)
	rc := rest.CopyConfig(srv.RESTConfig())
	rc.Wrap(func(next http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(r *http.Request) (*http.Response, error) {
			if r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/identitynodes") && r.URL.Query().Has("fieldSelector") {
				acceptsMu.Lock()
				accepts = append(accepts, r.Header.Get("Accept"))
				acceptsMu.Unlock()
			}
			return next.RoundTrip(r)
		})
	})
	a := startNode(t, rc, "node-a", func(o *nodeOpts) { o.log = slog.New(log) })
	x, _ := a.allocate(t, web(1))
	y, _ := a.allocate(t, web(2))
	cli.nodeLists(t, "node-a", x, y)
	const gone = "IdentityNode was deleted"
	for round := 1; round <= 2; round++ {
		before, err := cli.node(t, "node-a")
		if err != nil {
			t.Fatal(err)
		}
		if err := cli.nodes.Delete().Resource("identitynodes").Name("node-a").Do(t.Context()).Error(); err != nil {
			t.Fatal(err)
		}
		deleted := time.Now()
		// Within seconds, not a renewal (DefaultConfig: 5 minutes)
		// later.
		require(t, 10*time.Second, func() error {
			n, err := cli.node(t, "node-a")
			if err != nil {
				return err
			}
			if n.UID == before.UID {
				return errors.New("the record is not deleted yet")
			}
			if want := []uint32{uint32(min(x, y)), uint32(max(x, y))}; !slices.Equal(n.Spec.Identities, want) {
				return fmt.Errorf("the re-created record lists %v, want %v", n.Spec.Identities, want)
			}
			return nil
		})
		t.Logf("round %d: the record is back %s after its deletion", round, time.Since(deleted).Round(time.Millisecond))
		// A moment for any further line about this deletion.
		time.Sleep(time.Second)
		if got := log.count(gone); got != round {
			t.Errorf("after %d deletions, %d lines say the record was deleted, want one per deletion", round, got)
		}
		expectSamples(t, samples(t, a.store), map[string]float64{"identityd_crd_identity_node_recreated_total": float64(round)})
	}
	// The watch asks for metadata only: its events do not carry the
	// record's identities.
	acceptsMu.Lock()
	defer acceptsMu.Unlock()
	if len(accepts) == 0 {
		t.Error("no list or watch request of the own record")
	}
	for _, a := range accepts {
		if !strings.Contains(a, "as=PartialObjectMetadata") {
			t.Errorf("the own record was listed or watched with Accept %q, want metadata only", a)
		}
	}
}

// TestRecordMissingFromListing: the watch of the node's own record lists
// again (after a broken watch) without the record: a record this node
// wrote before was deleted meanwhile, and is written again at once, as on
// a delete event; before the first write, a missing record is the start's
// and asks nothing more.
func TestRecordMissingFromListing(t *testing.T) {
	log := newLevelLog(slog.LevelWarn, testLogger(t).Handler())
	s := &Store{log: slog.New(log), node: "node-a", writer: newNodeWriter()}
	w := &ownRecordWatch{s: s}
	woken := func() bool {
		select {
		case <-s.writer.wake:
			return true
		default:
			return false
		}
	}
	if err := w.Replace(nil, "1"); err != nil {
		t.Fatal(err)
	}
	if woken() || s.writer.recreated.Load() != 0 {
		t.Error("a listing without the record before the first write asked for a write")
	}
	// The first write completed while a listing ran: that listing may
	// lack the record.
	s.writer.lastOK.Store(time.Now().UnixNano())
	if err := w.Replace(nil, "1"); err != nil {
		t.Fatal(err)
	}
	if woken() || s.writer.recreated.Load() != 0 {
		t.Error("a listing begun before the first write asked for a write")
	}
	// Listings begun after a write.
	w.writtenBeforeList.Store(true)
	if err := w.Replace([]any{&IdentityNode{}}, "2"); err != nil {
		t.Fatal(err)
	}
	if woken() {
		t.Error("a listing with the record asked for a write")
	}
	if err := w.Replace(nil, "3"); err != nil {
		t.Fatal(err)
	}
	if !woken() || !s.writer.renew.Load() || s.writer.recreated.Load() != 1 || log.count("IdentityNode was deleted") != 1 {
		t.Errorf("a listing without the record after a write: woken/renew %v, count %d, lines %d; want a renewal asked, 1, 1",
			s.writer.renew.Load(), s.writer.recreated.Load(), log.count("IdentityNode was deleted"))
	}
}
